"""Values the step appends to a list or a deque on the host
(transpiler/capture/appended.py): each call's values appended to the same
container after every run, one program for every call; a step that also reads
what it appends to is refused with nothing changed, and one that appends once
(a lazy initialization) is as before."""

from __future__ import annotations

import collections
import copy

import pytest
import torch

from tests import models as M
from transpiler import transpile


class Trainer:
    def __init__(self):
        self.losses = []
        self.outputs = []
        self.recent = collections.deque(maxlen=3)
        self.history = []


class SmoothedValue:
    """torchvision references/classification/utils.py SmoothedValue."""

    def __init__(self, window_size=20):
        self.deque = collections.deque(maxlen=window_size)
        self.total = 0.0
        self.count = 0

    def update(self, value, n=1):
        self.deque.append(value)
        self.count += n
        self.total += value * n


LOSSES: list = []


def appends_values(model, opt, x, y, trainer):
    loss = M.classify_step(model, opt, x, y)
    trainer.losses.append(loss.item())
    trainer.losses.extend([opt.param_groups[0]["lr"], 2 * loss.item()])
    trainer.outputs.append(loss.detach())   # Lightning's training_step_outputs
    trainer.recent.append(int(x.shape[0]))
    LOSSES.append(loss.item())
    return loss


def meter_update(model, opt, x, y, meter):
    loss = M.classify_step(model, opt, x, y)
    assert isinstance(loss.item(), (float, int))   # torchvision's MetricLogger.update
    meter.update(loss.item(), n=x.shape[0])
    return loss


def _against_eager(step_fn, hosts, calls=5):
    """M.against_eager, and the host's lists and deques are the same objects."""
    containers = {k: id(v) for k, v in vars(hosts[0]).items()
                  if isinstance(v, (list, collections.deque))}
    step = M.against_eager(step_fn, calls=calls, hosts=hosts)
    assert containers == {k: id(v) for k, v in vars(hosts[0]).items()
                          if isinstance(v, (list, collections.deque))}
    return step


def _host(obj) -> dict:
    """Everything the host object holds, as comparable values."""
    return {k: [t.tolist() if isinstance(t, torch.Tensor) else (type(t), t) for t in v]
            if isinstance(v, (list, collections.deque)) else (type(v), v)
            for k, v in vars(obj).items()}


def test_values_appended_on_the_host_are_appended_after_every_run():
    LOSSES.clear()
    hosts = [Trainer(), Trainer()]
    step = _against_eager(appends_values, hosts)
    assert step.traces == 1
    assert _host(hosts[0]) == _host(hosts[1])
    assert len(hosts[0].losses) == 15 and len(hosts[0].recent) == 3
    assert LOSSES[0::2] == LOSSES[1::2]   # each call's value from ours, then eager's


def test_a_meter_s_deque_and_counters_are_eager_s():
    hosts = [SmoothedValue(window_size=3), SmoothedValue(window_size=3)]
    step = _against_eager(meter_update, hosts)
    assert step.traces == 1
    assert _host(hosts[0]) == _host(hosts[1])
    assert hosts[0].count == 40 and len(hosts[0].deque) == 3


def appends_and_reads(model, opt, x, y, trainer):
    loss = M.classify_step(model, opt, x, y)
    trainer.losses.append(loss.item())
    if len(trainer.losses) > 2:
        trainer.losses.pop(0)
    return loss


def test_a_list_the_step_appends_to_and_reads_is_refused_as_it_was():
    trainer = Trainer()
    trainer.losses.append(1.0)
    M.refused_as_it_was(appends_and_reads, trainer, r"appends values it computes from tensors "
                                                    r"to trainer.losses and also reads it \(len")
    assert trainer.losses == [1.0]


def first_call_starts_history(model, opt, x, y, trainer):
    loss = M.classify_step(model, opt, x, y)
    if not trainer.history:
        trainer.history.append(0.0)   # once: a lazy initialization
    return loss


def test_a_list_appended_to_once_is_a_lazy_initialization():
    hosts = [Trainer(), Trainer()]
    step = _against_eager(first_call_starts_history, hosts)
    assert hosts[0].history == hosts[1].history == [0.0]
    assert step.traces == 2   # the program of the empty list, then the other


@pytest.mark.compiles
def test_under_inductor_the_values_appended_are_the_program_s():
    """The items appended are outputs of the compiled program: the loss as
    Python's float of inductor's value (within its 1e-5 of eager's), the
    tensor, the constant and the batch size as given."""
    hosts = [Trainer(), Trainer()]
    torch.manual_seed(0)
    ours = M.make("mlp")
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    step = transpile(appends_values, backend="inductor")
    for x, y in M.batches("mlp", 4, 8):
        step(ours, opts[0], x, y, hosts[0])
        appends_values(theirs, opts[1], x, y, hosts[1])
    assert step.traces == 1 and step.compiles == 1
    assert len(hosts[0].losses) == len(hosts[1].losses) == 12
    assert all(type(a) is type(b) and abs(a - b) <= 1e-5 * abs(b)
               for a, b in zip(hosts[0].losses, hosts[1].losses))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=0)
               for a, b in zip(hosts[0].outputs, hosts[1].outputs))
    assert list(hosts[0].recent) == list(hosts[1].recent) == [8, 8, 8]
