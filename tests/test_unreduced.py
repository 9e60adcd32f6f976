"""A step that runs backward() but leaves optimizer.step() to the loop: its
calls accumulate each rank's own gradients for a call that steps, so a step
of the optimizer outside the transpiled step would update every rank with its
own gradients (silently apart from DDP, and from each other). Refused at the
loop's optimizer.step(), before it writes (runtime/unreduced.py)."""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from transpiler import TranspileError, transpile


def backward_only(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach()


def steps_every_second_call(model, opt, x, y, update):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if update:
        opt.step()
        opt.zero_grad()
    return loss.detach()


def rank_steps_outside():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    transpile(backward_only)(model, opt, torch.randn(5, 4, generator=g),
                             torch.randint(0, 3, (5,), generator=g))
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step()
    except TranspileError as exc:
        return str(exc), all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    return None, False


def rank_steps_inside():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = transpile(steps_every_second_call)
    g = torch.Generator().manual_seed(dist.get_rank())
    for i in range(4):
        step(model, opt, torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g),
             i % 2 == 1)
    opt.step()   # after a call that stepped: its gradients were reduced (zeroed here)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
def test_a_step_of_the_optimizer_outside_the_step_is_refused_before_it_writes(ranks2):
    for error, unchanged in ranks2.run(rank_steps_outside):
        assert error is not None and unchanged
        assert re.search(rf"SGD.step\(\) is called at {re.escape(__file__)}.* outside the "
                         r"transpiled step backward_only", error)


@pytest.mark.slow
def test_accumulating_calls_that_step_inside_are_not_refused(ranks2):
    ours, theirs = ranks2.run(rank_steps_inside)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))   # the ranks agree


def test_one_process_has_nothing_to_reduce():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    transpile(backward_only)(model, opt, torch.randn(5, 4), torch.randint(0, 3, (5,)))
    opt.step()   # as eager's
