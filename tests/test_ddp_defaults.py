"""DDP's defaults, exactly: torch DDP with its defaults running the same step
function in the same processes (2 gloo ranks, each on its own shard of the
batch) against the transpiled step. BatchNorm's buffers are broadcast from rank
0 before every step (broadcast_buffers=True); off with broadcast_buffers=False,
as DDP's option."""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import TranspileError, transpile
from transpiler.program import InputKind
from transpiler.roles import Role

STEPS = 4
BATCH = 12


def _state(model, opt, step=None) -> dict:
    """Parameters, buffers and the optimizer's full state (mode zero's
    gathered from its shards), by name."""
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    full = step.full_optimizer_state_dict(opt) if step is not None else opt.state_dict()
    for i, entry in full["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                state[f"opt.{i}.{key}"] = value.clone()
    return state


def _ddp(model, broadcast_buffers: bool):
    if broadcast_buffers:
        return DDP(model)
    with warnings.catch_warnings():   # deprecated in torch 2.13 for forward_sync_buffers
        warnings.simplefilter("ignore", FutureWarning)
        return DDP(model, broadcast_buffers=False)


def rank_bn_vs_ddp(mode, backend, broadcast_buffers, ddp_broadcasts):
    """BatchNorm model, SGD with momentum, 4 steps: the transpiled step (its
    model starts from another seed on each rank: the startup broadcast aligns
    them) and DDP, each ending with its state on this rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = [M.shard(b, rank, world_size) for b in M.batches("bn", STEPS, BATCH)]
    model = M.make("bn", seed=rank)
    opt = M.make_optimizer("sgd", model)
    options = {} if broadcast_buffers is None else {"broadcast_buffers": broadcast_buffers}
    step = transpile(M.classify_step, mode=mode, backend=backend, **options)
    for batch in batches:
        step(model, opt, *batch)
    ours = _state(model, opt, step)
    ops = [n.meta["comm"].op for n in step.program.collectives()]

    model = M.make("bn", seed=0)
    opt = M.make_optimizer("sgd", model)
    ddp = _ddp(model, ddp_broadcasts)
    for batch in batches:
        M.classify_step(ddp, opt, *batch)
    return ours, _state(model, opt), ops


def _assert_equal(ours: dict, theirs: dict):
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), (k, (ours[k] - theirs[k]).abs().max())


@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce", "zero"])
def test_batchnorm_equals_ddp_defaults_bit_for_bit(mode, ranks2):
    results = ranks2.run(rank_bn_vs_ddp, mode, "eager", None, True)
    for ours, ddp, ops in results:
        _assert_equal(ours, ddp)
        # the statistics (f32) and the batch count (i64): one broadcast each
        assert ops.count("broadcast") == 2
    # Rank 1's statistics are rank 0's, updated on rank 1's batch: they differ.
    assert not torch.equal(results[0][0]["model.bn.running_mean"],
                           results[1][0]["model.bn.running_mean"])


def test_batchnorm_under_inductor_equals_ddp_defaults(ranks2):
    """Inductor's kernels round differently from eager's (test_training_loops
    bounds that at 1e-5); without the broadcast rank 1's statistics would be
    0.09 off."""
    for ours, ddp, ops in ranks2.run(rank_bn_vs_ddp, "fuse_all_reduce", "inductor", None, True):
        assert M.max_rel_error(ours, ddp) <= 1e-5
        assert ops.count("broadcast") == 2


def test_broadcast_buffers_false_equals_ddp_without_it(ranks2):
    for ours, ddp, ops in ranks2.run(rank_bn_vs_ddp, "fuse_all_reduce", "eager", False, False):
        _assert_equal(ours, ddp)
        assert "broadcast" not in ops


def test_without_the_broadcast_rank_1_differs_from_ddp_defaults(ranks2):
    """What the broadcast fixes: the test above can fail."""
    (ours0, ddp0, _), (ours1, ddp1, _) = ranks2.run(rank_bn_vs_ddp, "grad_allreduce", "eager",
                                                    False, True)
    _assert_equal(ours0, ddp0)   # rank 0 broadcasts its own buffers: no difference
    assert not torch.equal(ours1["model.bn.running_mean"], ddp1["model.bn.running_mean"])


class Masked(torch.nn.Module):
    """A buffer only the forward reads (a mask), beside BatchNorm's."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)
        self.bn = torch.nn.BatchNorm1d(16)
        self.register_buffer("mask", torch.ones(4, 16).tril())

    def forward(self, x):
        return torch.nn.functional.linear(self.bn(x), self.fc.weight * self.mask, self.fc.bias)


def test_only_the_buffers_the_step_writes_are_broadcast():
    from passes.broadcast_buffers import broadcast_buffers
    from tests.test_passes import CTX
    from transpiler.capture import flatten_args, trace_step

    model = Masked()
    opt = M.make_optimizer("sgd", model)
    x, y = M.batches("bn", 1, 8)[0]
    program = trace_step(M.classify_step, flatten_args(M.classify_step, (model, opt, x, y), {})).program
    broadcast_buffers(program, CTX)
    sent = [n.meta["comm"].params for n in program.collectives()]
    assert sent == [("bn.running_mean", "bn.running_var"), ("bn.num_batches_tracked",)]
    # only the broadcast reads a broadcast buffer: the forward reads what it received
    for node in program.placeholders:
        spec = node.meta["input"]
        if spec.kind is InputKind.BUFFER:
            sent = {u.meta["role"] is Role.COMM for u in node.users}
            assert sent == {spec.name != "mask"}, spec.name


@pytest.mark.parametrize("value", [1, "yes", None])
def test_broadcast_buffers_must_be_a_bool(value):
    with pytest.raises(TranspileError, match="broadcast_buffers must be True or False"):
        transpile(M.classify_step, broadcast_buffers=value)


def test_broadcast_buffers_false_drops_the_pass():
    step = transpile(M.classify_step, mode="local_sgd", begin_step=2, broadcast_buffers=False)
    assert all("broadcast_buffers" not in p for p in step.schedule.programs.values())
    # local SGD's warm-up steps are DDP's; its local and sync steps are not
    step = transpile(M.classify_step, mode="local_sgd", begin_step=2)
    assert {name: "broadcast_buffers" in p for name, p in step.schedule.programs.items()} == \
        {"warmup": True, "local": False, "sync": False}
