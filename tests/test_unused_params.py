"""transpile(find_unused_parameters=True) against DDP(find_unused_parameters=True)
in the same processes: a mixture of experts whose experts a rank's batch may
not route to (a decision on the routing, as transformers' MoE layers take),
each rank routing otherwise at each call, one expert no rank ever uses, and a
call where an expert is used by no rank. DDP averages a gradient over every
rank, zeros where a rank gave none, and leaves a parameter no rank gave one
untouched (its .grad None, skipped by the optimizer)."""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import transpile
from transpiler.errors import TranspileError


class RoutedExperts(nn.Module):
    def __init__(self, experts: int = 4):
        super().__init__()
        self.gate = nn.Linear(4, experts)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(experts))
        self.out = nn.Linear(4, 1)

    def forward(self, x, route):
        h = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            hit = route == e
            if hit.any():   # an expert no token is routed to is not run
                h[hit] = expert(x[hit]) * self.gate(x[hit])[:, e:e + 1].sigmoid()
        return self.out(h + x)


def _step(model, opt, x, route, y):
    opt.zero_grad()
    loss = (model(x, route).squeeze(-1) - y).square().mean()
    loss.backward()
    opt.step()
    return loss.detach()


# ROUTES[call][rank]: expert 3 is never used; at call 2 expert 1 is used by no rank
ROUTES = [[[0, 0, 0, 0], [0, 1, 2, 1]],
          [[2, 1, 1, 0], [2, 2, 2, 2]],
          [[0, 0, 2, 2], [2, 0, 0, 2]],
          [[1, 1, 1, 1], [0, 2, 1, 0]]]


def _optimizer(name, model):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(step, model, opt, rank):
    g = torch.Generator().manual_seed(1 + rank)
    losses = []
    for routes in ROUTES:
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, generator=g)
        losses.append(step(model, opt, x, torch.tensor(routes[rank]), y))
    return losses


def _rank_vs_ddp(mode, opt_name):
    rank = dist.get_rank()
    torch.manual_seed(0)
    ours = RoutedExperts()
    theirs = copy.deepcopy(ours)
    opts = [_optimizer(opt_name, m) for m in (ours, theirs)]
    mine = _train(transpile(_step, mode=mode, find_unused_parameters=True), ours, opts[0], rank)
    reference = _train(_step, DDP(theirs, find_unused_parameters=True), opts[1], rank)
    a, b = M.state_of(ours, opts[0]), M.state_of(theirs, opts[1])
    # A parameter no rank ever gave a gradient has no optimizer state in DDP's
    # optimizer; here it has the state the optimizer starts from.
    extra = {k: v for k, v in a.items() if k not in b}
    assert extra and all(k.startswith("opt.experts.3.") and not v.any() for k, v in extra.items())
    a = {k: v for k, v in a.items() if k in b}
    return (M.max_rel_error(a, b), [torch.equal(x, y) for x, y in zip(mine, reference)],
            torch.equal(ours.experts[3].weight, theirs.experts[3].weight))


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce"])
def test_experts_a_rank_does_not_route_to_equal_ddp(mode, opt_name, ranks2):
    for error, losses, untouched in ranks2.run(_rank_vs_ddp, mode, opt_name):
        assert error == 0.0 and all(losses) and untouched


def _rank_without_the_option():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = RoutedExperts()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TranspileError, match="find_unused_parameters=True") as e:
        _train(transpile(_step, mode="fuse_all_reduce"), model, opt, rank)
    unchanged = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    return unchanged and "rank 1 built a different program" in str(e.value)


def test_without_the_option_every_rank_stops_naming_it(ranks2):
    assert ranks2.run(_rank_without_the_option) == [True, True]


def test_one_process_leaves_an_unused_expert_as_eager_does():
    torch.manual_seed(0)
    ours = RoutedExperts()
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    step = transpile(_step, find_unused_parameters=True)
    assert [torch.equal(a, b) for a, b in zip(_train(step, ours, opts[0], 0),
                                               _train(_step, theirs, opts[1], 0))] == [True] * 4
    assert all(torch.equal(p, q) for p, q in zip(ours.state_dict().values(),
                                                 theirs.state_dict().values()))


@pytest.mark.parametrize("mode", ["zero", "fsdp", "local_sgd", "decentralized", "all_gather"])
def test_modes_that_do_not_take_it_refuse_it(mode):
    with pytest.raises(TranspileError, match="find_unused_parameters"):
        transpile(_step, mode=mode, find_unused_parameters=True)


def _two_micro_batches(model, opt, x, route, y):
    """Gradient accumulation: the first micro-batch routes to no token of an
    expert the second does: that expert is used (its zeros, given where the
    first backward() ends, take the second's gradient). DDP reduces the last
    micro-batch's backward only (no_sync), as the transpiled step reduces once."""
    opt.zero_grad()
    for half, last in ((slice(0, 2), False), (slice(2, 4), True)):
        with model.no_sync() if isinstance(model, DDP) and not last else contextlib.nullcontext():
            loss = (model(x[half], route[half]).squeeze(-1) - y[half]).square().mean()
            loss.backward()
    opt.step()
    return loss.detach()


def _rank_micro_batches_vs_ddp():
    rank = dist.get_rank()
    torch.manual_seed(0)
    ours = RoutedExperts()
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    step = transpile(_two_micro_batches, mode="fuse_all_reduce", find_unused_parameters=True)
    ddp = DDP(theirs, find_unused_parameters=True)
    g = torch.Generator().manual_seed(1 + rank)
    # rank 0: expert 1 only in its second micro-batch; no rank routes to 2 or 3
    routes = [[0, 0, 1, 1], [0, 0, 0, 0]][rank]
    for _ in range(3):
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, generator=g)
        args = (x, torch.tensor(routes), y)
        a, b = step(ours, opts[0], *args), _two_micro_batches(ddp, opts[1], *args)
        assert torch.equal(a, b)
    return M.max_rel_error(dict(ours.state_dict()), dict(theirs.state_dict()))


def test_a_parameter_a_later_backward_uses_is_used(ranks2):
    assert ranks2.run(_rank_micro_batches_vs_ddp) == [0.0, 0.0]
