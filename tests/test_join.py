"""Join for uneven inputs (transpiler/runtime/join.py): `with step.join():` against torch
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
                     optimizer: str = "sgd", divide: bool = True):
    batches = _batches(model_name, counts)
    model = M.make(model_name, seed=dist.get_rank())
    opt = M.make_optimizer(optimizer, model)
    step = transpile(M.classify_step, mode=mode)
    with step.join(divide_by_initial_world_size=divide):
        losses = [step(model, opt, *b).detach() for b in batches]

    reference = M.make(model_name, seed=0)
    ref_opt = M.make_optimizer(optimizer, reference)
    ddp = DDP(reference)
    with Join([ddp], divide_by_initial_world_size=divide):
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
@pytest.mark.parametrize("divide", [True, False], ids=["initial", "stepping"])
def test_join_equals_ddp_join_on_2_ranks(mode, divide, ranks2):
    """divide_by_initial_world_size both ways: after rank 1 joins, rank 0's
    gradients divided by 2 or by 1, as DDP's."""
    _check(ranks2.run(rank_join_vs_ddp, mode, [4, 2], "mlp", "adamw", divide), 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("divide", [True, False], ids=["initial", "stepping"])
def test_join_on_3_ranks_of_3_lengths(divide, ranks3):
    _check(ranks3.run(rank_join_vs_ddp, "fuse_all_reduce", [2, 5, 3], "mlp", "sgd", divide),
           1e-6)


@pytest.mark.slow
def test_dividing_by_the_ranks_stepping_is_not_vacuous(ranks2):
    initial = ranks2.run(rank_join_vs_ddp, "fuse_all_reduce", [4, 2], "mlp", "sgd", True)
    stepping = ranks2.run(rank_join_vs_ddp, "fuse_all_reduce", [4, 2], "mlp", "sgd", False)
    assert not torch.equal(initial[0][0]["model.layers.0.weight"],
                           stepping[0][0]["model.layers.0.weight"])


def rank_sharded_join_vs_ddp(mode: str, counts: list[int], optimizer: str, divide: bool = True):
    """Modes zero and fsdp under join: every rank's parameters and the full
    optimizer state against DDP's under Join with the whole optimizer on
    each rank (its model, and the state of a rank that stepped last: a
    joined rank's shard still takes the others' updates)."""
    batches = _batches("mlp", counts)
    model = M.make("mlp", seed=dist.get_rank())
    opt = M.make_optimizer(optimizer, model)
    step = transpile(M.classify_step, mode=mode)
    with step.join(divide_by_initial_world_size=divide):
        losses = [step(model, opt, *b).detach() for b in batches]
    with step.unsharded():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    full = step.full_optimizer_state_dict(opt)["state"]
    state = {f"{i}.{k}": v for i, entry in full.items() for k, v in entry.items()}

    reference = M.make("mlp", seed=0)
    ref_opt = M.make_optimizer(optimizer, reference)
    ddp = DDP(reference)
    with Join([ddp], divide_by_initial_world_size=divide):
        ref_losses = [M.classify_step(ddp, ref_opt, *b).detach() for b in batches]
    ref_full = ref_opt.state_dict()["state"]
    ref_state = {f"{i}.{k}": v for i, entry in ref_full.items() for k, v in entry.items()}
    ref_params = dict(reference.named_parameters())
    return (params, {n: p.detach().clone() for n, p in ref_params.items()}, state, ref_state,
            torch.stack(losses), torch.stack(ref_losses))


@pytest.mark.slow
@pytest.mark.parametrize("mode,divide", [("zero", True), ("fsdp", True), ("zero", False)])
def test_sharded_join_equals_ddp_join(mode, divide, ranks2):
    """On 2 ranks bit for bit: the parameters on every rank, the optimizer
    state gathered (a rank that stepped last, under DDP), each step's loss."""
    _check_sharded(ranks2.run(rank_sharded_join_vs_ddp, mode, [2, 4], "adamw", divide), [2, 4],
                   0.0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_sharded_join_on_3_ranks_of_3_lengths(mode, ranks3):
    """Within 1e-6, as modes zero and fsdp themselves on 3 ranks (each
    parameter's shards are laid out otherwise than DDP's buckets,
    test_ddp_layout.py)."""
    counts = [2, 5, 3]
    _check_sharded(ranks3.run(rank_sharded_join_vs_ddp, mode, counts, "sgd"), counts, 1e-6)


def _check_sharded(results, counts: list[int], tolerance: float):
    def close(a, b):
        return torch.allclose(a, b, rtol=0, atol=tolerance)
    last = counts.index(max(counts))
    for params, ref_params, state, _, losses, ref_losses in results:
        assert params.keys() == ref_params.keys()
        for k in params:
            assert close(params[k], ref_params[k]), (k, (params[k] - ref_params[k]).abs().max())
        assert state.keys() == results[last][3].keys()
        for k in state:
            assert close(state[k], results[last][3][k]), k
        assert close(losses, ref_losses)
    # not vacuous: rank 0 joined first, and the others' steps moved the model
    assert not torch.allclose(results[0][0]["layers.0.weight"],
                              M.make("mlp", seed=0).layers[0].weight, atol=1e-3)


@pytest.mark.slow
def test_join_with_equal_loaders_equals_ddp(ranks2):
    _check(ranks2.run(rank_join_vs_ddp, "fuse_all_reduce", [3, 3]), 0.0)


def rank_join_refused(case: str, mode: str = "fuse_all_reduce"):
    """Every rank raises the same TranspileError, none waits."""
    rank = dist.get_rank()
    model_name = "bn" if case == "buffers" else "mlp"
    batches = _batches(model_name, [3, 1])
    if case == "shapes" and rank == 0:   # rank 0's last batch is a short one
        x, y = batches[-1]
        batches[-1] = (x[:2], y[:2])
    model = M.make(model_name, seed=0)
    opt = M.make_optimizer("sgd", model)
    step = transpile(M.classify_step, mode=mode)
    with pytest.raises(TranspileError) as info:
        with step.join():
            for b in batches:
                step(model, opt, *b)
    return str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("case,mode,match", [
    ("shapes", "fuse_all_reduce", "needs a new program"),
    ("buffers", "fuse_all_reduce", "broadcast"),
    ("buffers", "zero", "broadcast_buffers=False"),
    ("shapes", "fsdp", "needs a new program"),
])
def test_what_a_joined_rank_cannot_shadow_is_refused_on_every_rank(case, mode, match, ranks2):
    messages = ranks2.run(rank_join_refused, case, mode)
    assert all(match in m for m in messages), messages
    assert messages[0] == messages[1]


@pytest.mark.parametrize("mode,options,match", [
    ("local_sgd", {}, "modes grad_allreduce, fuse_all_reduce, zero and fsdp"),
    ("zero", {"hierarchical": True}, "without hierarchical"),
    ("fuse_all_reduce", {"backend": "inductor"}, "backend='eager'"),
    ("fuse_all_reduce", {"find_unused_parameters": True}, "find_unused_parameters"),
])
def test_join_refuses_what_it_cannot_shadow_at_once(mode, options, match):
    step = transpile(M.classify_step, mode=mode, **options)
    with pytest.raises(TranspileError, match=match):
        step.join()
