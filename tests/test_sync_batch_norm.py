"""nn.SyncBatchNorm trains, on CPU and gloo too: its statistics are gathered over
the ranks by collectives of the program (transpiler/capture/sync_batch_norm.py).
Reference: one process with plain BatchNorm on the concatenated global batch,
within 1e-6 (outputs, gradients, running statistics, parameters), on 2 and 3
ranks, in every mode that reduces gradients, eager and under inductor."""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from transpiler import TranspileError, transpile

STEPS = 3
PER_RANK = 4


class _Block(nn.Module):
    """A ResNet block with a downsampling shortcut: the shortcut's BatchNorm
    and the block's first one normalize values that do not depend on each
    other (so do their gradients in the backward pass)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 6, 3, stride=2, padding=1), nn.BatchNorm2d(6)
        self.conv2, self.bn2 = nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.down = nn.Sequential(nn.Conv2d(3, 6, 1, stride=2), nn.BatchNorm2d(6))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.down(x))


def _model(seed: int = 0, kind: str = "chain") -> nn.Module:
    torch.manual_seed(seed)
    if kind == "block":
        return nn.Sequential(_Block(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 5))
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
        nn.Conv2d(6, 6, 3, stride=2), nn.BatchNorm2d(6, momentum=None), nn.ReLU(),
        nn.Flatten(), nn.Linear(6 * 3 * 3, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 5))


def _step(model, opt, x, y):
    opt.zero_grad()
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    opt.step()
    return loss, out


def _global_batches(world_size: int):
    g = torch.Generator().manual_seed(7)
    n = PER_RANK * world_size
    return [(torch.randn(n, 3, 8, 8, generator=g) * 3 + 1, torch.randint(0, 5, (n,), generator=g))
            for _ in range(STEPS)]


def _state(model, grads: bool) -> dict:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if grads:   # modes zero and fsdp leave .grad None (each rank keeps a shard of it)
        state.update({f"{k}.grad": p.grad.clone() for k, p in model.named_parameters()})
    return state


def rank_synced(mode: str, backend: str, kind: str = "chain"):
    """The transpiled step on this rank's shards with SyncBatchNorm; the
    reference (one process, plain BatchNorm, the global batch); the program's
    collectives."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = _global_batches(world)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(_model(seed=rank, kind=kind))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = transpile(_step, mode=mode, backend=backend)
    losses, outs = [], []
    for x, y in batches:
        loss, out = step(model, opt, x.chunk(world)[rank], y.chunk(world)[rank])
        losses.append(loss)
        outs.append(out)
    with step.unsharded() if mode == "fsdp" else contextlib.nullcontext():
        ours = _state(model, grads=mode in ("grad_allreduce", "fuse_all_reduce"))
    ops = [n.meta["comm"].op for n in step.program.collectives() if not n.meta["comm"].params]

    reference = _model(seed=0, kind=kind)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    ref_losses, ref_outs = [], []
    for x, y in batches:
        loss, out = _step(reference, opt, x, y)
        ref_losses.append(loss)
        ref_outs.append(out.detach().chunk(world)[rank])
    return (ours, _state(reference, grads=len(ours) > len(reference.state_dict())), torch.stack([l.detach() for l in losses]),
            torch.stack(ref_losses).detach(), torch.stack(outs), torch.stack(ref_outs), ops)


def _check(results, world: int):
    for ours, reference, losses, ref_losses, outs, ref_outs, ops in results:
        assert ours.keys() == reference.keys()
        for k in ours:
            assert torch.allclose(ours[k], reference[k], rtol=0, atol=1e-6), \
                (k, (ours[k].double() - reference[k]).abs().max())
        # each rank's loss is the mean over its shard: their mean is the global loss
        assert torch.allclose(outs, ref_outs, rtol=0, atol=1e-6)
    mean_loss = sum(r[2] for r in results) / world
    assert torch.allclose(mean_loss, results[0][3], rtol=0, atol=1e-6)
    return results[0][6]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce", "zero", "fsdp"])
def test_sync_batch_norm_equals_one_process_on_the_global_batch(mode, ranks2):
    ops = _check(ranks2.run(rank_synced, mode, "eager"), 2)
    # one gather of the statistics per layer in the forward, one all-reduce of
    # their gradients per layer in the backward
    assert ops.count("all_gather") >= 3


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fuse_all_reduce", "fsdp"])
def test_independent_layers_share_their_collectives(mode, ranks2):
    """The shortcut's BatchNorm is gathered with the block's first one, and
    their gradients' all-reduces with the second one's: 2 + 2 collectives for
    3 layers."""
    ops = _check(ranks2.run(rank_synced, mode, "eager", "block"), 2)
    assert ops.count("all_gather") == 2 and ops.count("all_reduce") == 2


@pytest.mark.slow
def test_sync_batch_norm_on_3_ranks(ranks3):
    _check(ranks3.run(rank_synced, "fuse_all_reduce", "eager"), 3)


@pytest.mark.slow
def test_sync_batch_norm_under_inductor(ranks2):
    _check(ranks2.run(rank_synced, "fuse_all_reduce", "inductor"), 2)


def rank_plain_batch_norm_differs():
    """Without SyncBatchNorm each rank normalizes with its own shard's
    statistics: the check above would fail (it is not vacuous)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _global_batches(world)[0]
    model = _model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = transpile(_step, mode="fuse_all_reduce")
    _, out = step(model, opt, x.chunk(world)[rank], y.chunk(world)[rank])
    reference = _model(seed=0)
    _, ref = _step(reference, torch.optim.SGD(reference.parameters(), lr=0.1), x, y)
    return (out - ref.detach().chunk(world)[rank]).abs().max().item()


@pytest.mark.slow
def test_plain_batch_norm_differs_from_the_global_batch(ranks2):
    assert min(ranks2.run(rank_plain_batch_norm_differs)) > 1e-3


def rank_own_group():
    group = dist.new_group([0, 1])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(_model(), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _global_batches(2)[0]
    step = transpile(_step, mode="fuse_all_reduce")
    with pytest.raises(TranspileError, match="process_group"):
        step(model, opt, x, y)
    return all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.slow
def test_a_process_group_of_its_own_is_refused_before_anything_changes(ranks2):
    assert all(ranks2.run(rank_own_group))


def test_one_process_runs_torchs_own_forward():
    """One process: no collective; SyncBatchNorm is BatchNorm (torch's own path)."""
    model = nn.SyncBatchNorm.convert_sync_batchnorm(_model())
    reference = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    step = transpile(_step, mode="fuse_all_reduce")
    for x, y in _global_batches(1):
        step(model, opt, x, y)
        _step(reference, ref_opt, x, y)
    assert not step.program.collectives()
    ours, theirs = _state(model, grads=True), _state(reference, grads=True)
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
