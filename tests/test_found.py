"""Modules, optimizers and GradScalers the step uses without taking them as
arguments: a trainer object's (a bound-method step), a partial's, a script's
globals. They are the step's own, as if passed: trained, reduced, equal to
the eager step and to DDP; rebinding one traces again."""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import transpile


class Trainer:
    """As transformers' Trainer and Lightning keep them: on the object."""

    def __init__(self, model, optimizer, scaler=None):
        self.model, self.optimizer = model, optimizer
        self.state = {"scaler": scaler}
        self.label_smoothing = 0.0

    def training_step(self, x, y):
        self.model.train()
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(x), y, label_smoothing=self.label_smoothing)
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def _pair():
    torch.manual_seed(0)
    model = M.make("mlp")
    twin = copy.deepcopy(model)
    return [(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)) for m in (model, twin)]


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values()))


def test_a_trainers_model_and_optimizer_through_self():
    (m1, o1), (m2, o2) = _pair()
    ours, theirs = Trainer(m1, o1), Trainer(m2, o2)
    step = transpile(ours.training_step)
    for i, (x, y) in enumerate(M.batches("mlp", 4, 8)):
        if i == 2:
            ours.label_smoothing = theirs.label_smoothing = 0.1
        assert torch.equal(step(x, y), theirs.training_step(x, y)), i
        assert _equal(m1, m2) and all(
            torch.equal(o1.state[p]["momentum_buffer"], o2.state[q]["momentum_buffer"])
            for p, q in zip(m1.parameters(), m2.parameters()))
    assert step.traces == 2


MODEL, OPTIMIZER = None, None


def global_step(x, y):
    """A script whose step reads its model and optimizer from globals."""
    OPTIMIZER.zero_grad()
    loss = F.cross_entropy(MODEL(x), y)
    loss.backward()
    OPTIMIZER.step()
    return loss


def test_a_scripts_model_and_optimizer_in_globals():
    global MODEL, OPTIMIZER
    (m1, o1), (m2, o2) = _pair()
    step = transpile(global_step)
    try:
        for i, (x, y) in enumerate(M.batches("mlp", 4, 8)):
            if i == 2:   # another model in the global: traces for it
                m1, o1 = m2, o2 = _pair()[0]
                m2 = copy.deepcopy(m1)
                o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
            MODEL, OPTIMIZER = m1, o1
            a = step(x, y)
            MODEL, OPTIMIZER = m2, o2
            assert torch.equal(a, global_step(x, y)), i
            assert _equal(m1, m2), i
    finally:
        MODEL = OPTIMIZER = None
    assert step.traces == 2


def test_a_partial_holding_the_model_and_optimizer():
    (m1, o1), (m2, o2) = _pair()
    step = transpile(functools.partial(M.classify_step, m1, o1))
    for x, y in M.batches("mlp", 3, 8):
        assert torch.equal(step(x, y), M.classify_step(m2, o2, x, y))
        assert _equal(m1, m2)


def rank_trainer_vs_ddp(mode: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    (m1, o1), (m2, o2) = _pair()
    ours, theirs = Trainer(m1, o1), Trainer(DDP(m2), o2)
    step = transpile(ours.training_step, mode=mode)
    for batch in M.batches("mlp", 4, 16):
        x, y = M.shard(batch, rank, world)
        if not torch.equal(step(x, y), theirs.training_step(x, y)):
            return False
    return _equal(m1, m2)


@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce", "zero"])
def test_a_trainer_equals_ddp(mode, ranks2):
    assert ranks2.run(rank_trainer_vs_ddp, mode) == [True, True]


def manual_sgd(model, x, y, lr=0.1):
    """pytorch/examples word_language_model's update, written by hand: no optimizer."""
    model.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)
    return loss


def test_an_update_written_by_hand_without_an_optimizer():
    torch.manual_seed(0)
    ours = M.make("mlp")
    theirs = copy.deepcopy(ours)
    step = transpile(manual_sgd)
    for x, y in M.batches("mlp", 3, 8):
        assert torch.equal(step(ours, x, y), manual_sgd(theirs, x, y))
        assert _equal(ours, theirs)


def rank_manual_sgd_vs_ddp(mode: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ours = M.make("mlp")
    theirs = copy.deepcopy(ours)
    step, ddp = transpile(manual_sgd, mode=mode), DDP(theirs)
    for batch in M.batches("mlp", 3, 16):
        x, y = M.shard(batch, rank, world)
        if not torch.equal(step(ours, x, y), manual_sgd(ddp, x, y)):
            return False
    return _equal(ours, theirs)


@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce"])
def test_an_update_written_by_hand_equals_ddp(mode, ranks2):
    assert ranks2.run(rank_manual_sgd_vs_ddp, mode) == [True, True]
