"""Join for uneven inputs (transpiler/join.py): `with step.join():` against torch
DDP under `Join([ddp])` running the same step in the same processes, the ranks'
loaders of different lengths: every rank's parameters and optimizer state (a
joined rank's where its last step left it) and each step's loss. Bit for bit on
2 ranks; on 3, within 1e-6 (gloo's ring sums 3 ranks' buffers in an order set
by the buffer's layout, which follows DDP's bucket layout only on 2). What a
joined rank cannot shadow is refused on every rank, never a hang."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import TranspileError, transpile

BATCH = 4


def _batches(model_name: str, counts: list[int]):
    rank = dist.get_rank()
    everyone = M.batches(model_name, max(counts) * len(counts), BATCH)
    return everyone[rank::len(counts)][:counts[rank]]


def rank_join_vs_ddp(mode: str, counts: list[int], model_name: str = "mlp",
                     optimizer: str = "sgd"):
    batches = _batches(model_name, counts)
    model = M.make(model_name, seed=dist.get_rank())
    opt = M.make_optimizer(optimizer, model)
    step = transpile(M.classify_step, mode=mode)
    with step.join():
        losses = [step(model, opt, *b).detach() for b in batches]

    reference = M.make(model_name, seed=0)
    ref_opt = M.make_optimizer(optimizer, reference)
    ddp = DDP(reference)
    with Join([ddp]):
        ref_losses = [M.classify_step(ddp, ref_opt, *b).detach() for b in batches]
    return (M.state_of(model, opt), M.state_of(reference, ref_opt), torch.stack(losses),
            torch.stack(ref_losses))


def _check(results, tolerance: float):
    for ours, theirs, losses, ref_losses in results:
        assert ours.keys() == theirs.keys()
        for k in ours:
            assert torch.allclose(ours[k], theirs[k], rtol=0, atol=tolerance), \
                (k, (ours[k] - theirs[k]).abs().max())
        assert torch.allclose(losses, ref_losses, rtol=0, atol=tolerance)
    # the final broadcast: every rank's parameters are the same
    first = {k: v for k, v in results[0][0].items() if k.startswith("model.")}
    for ours, *_ in results[1:]:
        assert all(torch.equal(first[k], ours[k]) for k in first)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce"])
def test_join_equals_ddp_join_on_2_ranks(mode, ranks2):
    _check(ranks2.run(rank_join_vs_ddp, mode, [4, 2], "mlp", "adamw"), 0.0)


@pytest.mark.slow
def test_join_on_3_ranks_of_3_lengths(ranks3):
    _check(ranks3.run(rank_join_vs_ddp, "fuse_all_reduce", [2, 5, 3]), 1e-6)


@pytest.mark.slow
def test_join_with_equal_loaders_equals_ddp(ranks2):
    _check(ranks2.run(rank_join_vs_ddp, "fuse_all_reduce", [3, 3]), 0.0)


def rank_join_refused(case: str):
    """Every rank raises the same TranspileError, none waits."""
    rank = dist.get_rank()
    model_name = "bn" if case == "buffers" else "mlp"
    batches = _batches(model_name, [3, 1])
    if case == "shapes" and rank == 0:   # rank 0's last batch is a short one
        x, y = batches[-1]
        batches[-1] = (x[:2], y[:2])
    model = M.make(model_name, seed=0)
    opt = M.make_optimizer("sgd", model)
    step = transpile(M.classify_step, mode="fuse_all_reduce")
    with pytest.raises(TranspileError) as info:
        with step.join():
            for b in batches:
                step(model, opt, *b)
    return str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("case,match", [("shapes", "needs a new program"),
                                        ("buffers", "broadcast")])
def test_what_a_joined_rank_cannot_shadow_is_refused_on_every_rank(case, match, ranks2):
    messages = ranks2.run(rank_join_refused, case)
    assert all(match in m for m in messages), messages
    assert messages[0] == messages[1]


@pytest.mark.parametrize("mode,options,match", [
    ("zero", {}, "modes grad_allreduce and fuse_all_reduce"),
    ("fuse_all_reduce", {"backend": "inductor"}, "backend='eager'"),
    ("fuse_all_reduce", {"find_unused_parameters": True}, "find_unused_parameters"),
])
def test_join_refuses_what_it_cannot_shadow_at_once(mode, options, match):
    step = transpile(M.classify_step, mode=mode, **options)
    with pytest.raises(TranspileError, match=match):
        step.join()


def test_join_divides_by_the_initial_world_size_only():
    step = transpile(M.classify_step, mode="fuse_all_reduce")
    with pytest.raises(TranspileError, match="divide_by_initial_world_size"):
        step.join(divide_by_initial_world_size=False)
