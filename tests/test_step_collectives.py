"""torch.distributed's collectives called in the step (transpiler/capture/traced_collectives.py):
a loss or a metric reduced over the ranks for logging, as training scripts do,
is a collective of the program, equal to torch DDP running the same step in the
same processes; the collectives a program cannot hold are refused at the first
call on every rank, nothing written. (Traced as they were, they issued
nothing: the step returned each rank's own loss where eager returns the
reduced one.) torch.distributed.nn's all_gather, which gradients flow back
through, is traced with a reduce-scatter of its gradient."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import TranspileError, transpile


def logged_step(model, opt, x, y):
    """The mean loss over the ranks (sync), the correct count of every rank
    (all_gather of a list, async with wait()), every rank's loss (a 0-d
    tensor gathered into a list), rank 0's first label (broadcast)."""
    opt.zero_grad()
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    opt.step()
    reduced = loss.detach().clone()
    dist.all_reduce(reduced)
    correct = (out.argmax(1) == y).sum().reshape(1)
    counts = [torch.zeros_like(correct) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, correct, async_op=True).wait()
    losses = [torch.zeros_like(loss) for _ in range(dist.get_world_size())]
    dist.all_gather(losses, loss.detach())
    first = y[:1].clone()
    dist.broadcast(first, src=0)
    return reduced / dist.get_world_size(), torch.stack(counts), torch.stack(losses), first


def rank_logged(mode: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    ours, theirs = M.make("mlp", seed=rank), M.make("mlp", seed=0)   # the startup aligns ours
    opts = [M.make_optimizer("sgd", m) for m in (ours, theirs)]
    step, ddp = transpile(logged_step, mode=mode), DDP(theirs)
    for batch in M.batches("mlp", 3, 16):
        x, y = M.shard(batch, rank, world)
        a, b = step(ours, opts[0], x, y), logged_step(ddp, opts[1], x, y)
        if not all(torch.equal(p, q) for p, q in zip(a, b)):
            return f"outputs differ: {a} != {b}"
    ops = sorted(n.meta["comm"].op for n in step.program.collectives() if not n.meta["comm"].params)
    if not all(torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters())):
        return "parameters differ"
    return ops


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce", "zero"])
def test_collectives_in_the_step_equal_ddp(mode, ranks2):
    for ops in ranks2.run(rank_logged, mode):
        assert ops == ["all_gather"] * 2 + ["all_reduce", "broadcast"], ops


def barrier_step(model, opt, x, y):
    loss = M.classify_step(model, opt, x, y)
    dist.barrier()
    return loss


def subgroup_step(model, opt, x, y):
    loss = M.classify_step(model, opt, x, y).detach().clone()
    dist.all_reduce(loss, group=SUBGROUP[0])
    return loss


SUBGROUP: list = []


def rank_refused(fn_name: str):
    if not SUBGROUP:
        SUBGROUP.append(dist.new_group([0, 1]))
    model = M.make("mlp")
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = transpile({"barrier": barrier_step, "subgroup": subgroup_step}[fn_name])
    with pytest.raises(TranspileError) as info:
        step(model, opt, *M.shard(M.batches("mlp", 1, 8)[0], dist.get_rank(), 2))
    untouched = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    return str(info.value), untouched


@pytest.mark.slow
@pytest.mark.parametrize("fn_name,match", [("barrier", "torch.distributed.barrier"),
                                           ("subgroup", "process group")])
def test_collectives_a_program_cannot_hold_are_refused(fn_name, match, ranks2):
    for message, untouched in ranks2.run(rank_refused, fn_name):
        assert match in message and untouched, message


def deciding_step(model, opt, x, y):
    """A decision on a tensor's value (traced on the call's values), then the
    loss reduced over the ranks."""
    if x.abs().max() > 3:   # an outlier batch: its inputs scaled down
        x = x / 2
    return logged_step(model, opt, x, y)[0]


def decided_on_the_sum(model, opt, x, y):
    loss = M.classify_step(model, opt, x, y).detach().clone()
    dist.all_reduce(loss)
    if loss > 100:
        loss = loss * 0
    return loss


def rank_deciding():
    rank, world = dist.get_rank(), dist.get_world_size()
    ours, theirs = M.make("mlp", seed=rank), M.make("mlp", seed=0)
    opts = [M.make_optimizer("sgd", m) for m in (ours, theirs)]
    step, ddp = transpile(deciding_step, mode="fuse_all_reduce"), DDP(theirs)
    g = torch.Generator().manual_seed(rank)
    for i in range(4):
        x, y = torch.randn(8, 16, generator=g) * (1 + i), torch.randint(0, 4, (8,), generator=g)
        if not torch.equal(step(ours, opts[0], x, y), deciding_step(ddp, opts[1], x, y)):
            return "outputs differ"
    if not all(torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters())):
        return "parameters differ"
    refused = transpile(decided_on_the_sum)
    try:
        refused(ours, opts[0], x, y)
    except TranspileError as e:
        return f"refused: {e}"
    return "not refused"


@pytest.mark.slow
def test_a_step_traced_on_its_values_issues_its_collectives_as_eager(ranks2):
    """The trace on the call's values issues no collective (a rank may trace
    alone); a decision on a reduced value is refused on every rank."""
    for answer in ranks2.run(rank_deciding):
        assert answer.startswith("refused") and "(if loss > 100:)" in answer, answer


class TwoTowers(nn.Module):
    """CLIP's shape: two encoders of normalized features, a learned temperature."""

    def __init__(self):
        super().__init__()
        self.image, self.text = nn.Linear(16, 8), nn.Linear(16, 8)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x, z):
        return (F.normalize(self.image(x), dim=-1), F.normalize(self.text(z), dim=-1),
                self.logit_scale.exp())


def clip_step(model, opt, x, z):
    """open_clip's ClipLoss with gather_with_grad: every rank's features,
    gathered with torch.distributed.nn.all_gather (gradients flow back through
    it), against this rank's."""
    a, b, scale = model(x, z)
    all_a = torch.cat(torch.distributed.nn.all_gather(a))
    all_b = torch.cat(torch.distributed.nn.all_gather(b))
    labels = torch.arange(a.shape[0]) + dist.get_rank() * a.shape[0]
    loss = (F.cross_entropy(scale * a @ all_b.t(), labels)
            + F.cross_entropy(scale * b @ all_a.t(), labels)) / 2
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def rank_clip(mode: str):
    ours, theirs, opts, step = M.against_ddp(TwoTowers, clip_step, mode)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        x, z = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
        a, b = step(ours, opts[0], x, z), clip_step(theirs, opts[1], x, z)
        if not torch.equal(a, b):
            return f"losses differ: {a} != {b}"
    if not all(torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters())):
        return "parameters differ"
    return sorted(n.meta["comm"].op for n in step.program.collectives() if not n.meta["comm"].params)


@pytest.mark.slow
def test_a_gather_gradients_flow_through_equals_ddp(ranks2):
    # forward: the gathers (the program may coalesce them); backward: their
    # gradients, reduce-scattered
    for ops in ranks2.run(rank_clip, "fuse_all_reduce"):
        assert set(ops) == {"all_gather", "reduce_scatter"}, ops
