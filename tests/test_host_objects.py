"""Host objects whose state a trace cannot read: iterators the step pulls from
(transpiler/capture/host_iterators.py), files it writes (printed.py), deques
and sets it changes in place (guards.py, argument_writes.py). Each is eager's
on every call, or refused at the first call with nothing pulled, written or
changed."""

from __future__ import annotations

import collections
import io
import itertools

import pytest
import torch

from tests import models as M
from transpiler import transpile


class Trainer:
    """What a script's trainer keeps beside its model: a log file, a schedule."""

    def __init__(self, **values):
        vars(self).update(values)


# ----- files


def log_to_attribute(model, opt, x, y, trainer):
    loss = M.classify_step(model, opt, x, y)
    print(f"loss {loss.item():.6f}", file=trainer.log)
    trainer.log.write("step\n")
    return loss


def test_a_file_the_step_reaches_is_written_after_every_run():
    hosts = [Trainer(log=io.StringIO()) for _ in range(2)]
    step = M.against_eager(log_to_attribute, hosts=hosts, calls=5)
    assert step.traces == 1
    text = hosts[1].log.getvalue()
    assert text.count("step\n") == 5 and text.count("loss ") == 5
    assert hosts[0].log.getvalue() == text


def append_to_path(model, opt, x, y, trainer):
    loss = M.classify_step(model, opt, x, y)
    with open(trainer.path, "a") as f:
        f.write("x\n")
    with open(trainer.path, "a") as f:
        f.write(f"{loss.item():.4f}\n")
    with open(trainer.last, "w") as f:
        print(round(loss.item(), 3), file=f)
    return loss


def test_a_file_the_step_opens_is_opened_and_written_after_every_run(tmp_path):
    hosts = [Trainer(path=tmp_path / f"{k}.log", last=tmp_path / f"{k}.last") for k in "ab"]
    step = M.against_eager(append_to_path, hosts=hosts, calls=5)
    assert step.traces == 1
    ours, theirs = [(h.path.read_text(), h.last.read_text()) for h in hosts]
    assert ours == theirs and theirs[0].count("x\n") == 5


def stop_then_log(model, opt, x, y, trainer):
    loss = M.classify_step(model, opt, x, y)
    trainer.log.write(f"{loss.item():.6f}\n")
    if loss.item() > 10.0:   # a decision on the value: the trace is done again on it
        trainer.log.write("diverged\n")
    return loss


def test_a_trace_done_again_writes_the_file_once():
    hosts = [Trainer(log=io.StringIO()) for _ in range(2)]
    M.against_eager(stop_then_log, hosts=hosts, calls=5)
    assert hosts[0].log.getvalue() == hosts[1].log.getvalue()
    assert "\x00" not in hosts[0].log.getvalue()


@pytest.mark.parametrize("read", [lambda f: f.tell(), lambda f: f.getvalue(),
                                  lambda f: f.read()])
def test_reading_a_file_the_step_reaches_is_refused_with_nothing_written(read):
    def step_fn(model, opt, x, y, trainer):
        loss = M.classify_step(model, opt, x, y)
        trainer.log.write("step\n")
        read(trainer.log)
        return loss
    trainer = Trainer(log=io.StringIO("kept\n"))
    M.refused_as_it_was(step_fn, trainer, r"on trainer.log at .*test_host_objects.py")
    assert trainer.log.getvalue() == "kept\n"


# ----- iterators


def factor_from_schedule(model, opt, x, y, trainer):
    return M.classify_step(model, opt, x, y) * next(trainer.schedule)


SCHEDULE = iter([1.0, 0.5])


def factor_from_global(model, opt, x, y, trainer):
    return M.classify_step(model, opt, x, y) * next(SCHEDULE)


def factor_from_argument(model, opt, x, y, schedule):
    return M.classify_step(model, opt, x, y) * next(schedule)


def _halving():
    factor = 1.0
    while True:
        yield factor
        factor /= 2


@pytest.mark.parametrize("step_fn, make, name", [
    (factor_from_schedule, lambda: Trainer(schedule=_halving()), "trainer.schedule"),
    (factor_from_schedule, lambda: Trainer(schedule=itertools.cycle([1.0, 0.5])),
     "trainer.schedule"),
    (factor_from_global, lambda: Trainer(), "SCHEDULE"),
    (factor_from_argument, lambda: iter([1.0, 0.5]), "schedule"),
])
def test_an_iterator_the_step_pulls_from_is_refused_before_the_pull(step_fn, make, name):
    host = make()
    iterator = host.schedule if isinstance(host, Trainer) and hasattr(host, "schedule") \
        else SCHEDULE if step_fn is factor_from_global else host
    M.refused_as_it_was(step_fn, host, rf"pulls an item from {name} .*nothing was pulled")
    assert next(iterator) == 1.0   # the first item is still there


def loader_iterator_step(model, opt, x, y, trainer):
    x, y = next(trainer.batches)
    return M.classify_step(model, opt, x, y)


def test_a_dataloader_iterator_is_refused_before_a_batch_is_loaded():
    data = torch.utils.data.TensorDataset(*M.batches("mlp", 1, 8)[0])
    trainer = Trainer(batches=iter(torch.utils.data.DataLoader(data, batch_size=4)))
    M.refused_as_it_was(loader_iterator_step, trainer, "pulls an item from trainer.batches")
    assert len(list(trainer.batches)) == 2


def first_parameter_device(model, opt, x, y, trainer):
    device = next(iter(model.parameters())).device   # an iterator of its own
    weights = iter([1.0, 1.0])
    return M.classify_step(model, opt, x.to(device), y) * next(weights)


def test_an_iterator_the_step_makes_is_its_own():
    hosts = [Trainer(), Trainer()]
    assert M.against_eager(first_parameter_device, hosts=hosts).traces == 1


# ----- deques and sets changed in place (appended to on the host: test_appended.py)


def recent_argument(model, opt, x, y, recent):
    loss = M.classify_step(model, opt, x, y)
    recent.append(1)
    return loss


def seen_argument(model, opt, x, y, seen):
    loss = M.classify_step(model, opt, x, y)
    seen.add(len(seen))
    return loss


@pytest.mark.parametrize("step_fn, make, changed", [
    (recent_argument, lambda: collections.deque([0], maxlen=3), "a deque of 1 items, now 2"),
    (seen_argument, lambda: {0}, "a set of 1 items, now 2"),
])
def test_a_deque_or_a_set_changed_in_place_is_refused_as_it_was(step_fn, make, changed):
    host = make()
    before = repr(host)
    M.refused_as_it_was(step_fn, host, changed)
    assert repr(host) == before


def mean_of_recent(model, opt, x, y, trainer):
    return M.classify_step(model, opt, x, y) * (sum(trainer.recent) / len(trainer.recent))


def test_a_deque_the_step_reads_is_guarded_by_its_contents():
    hosts = [Trainer(recent=collections.deque([1.0], maxlen=2)) for _ in range(2)]
    values = iter([1.0, 1.0, 3.0, 3.0, 3.0, 3.0])

    def between(i, models):
        for h in hosts:
            h.recent.append(next(values))
    step = M.against_eager(mean_of_recent, between=between, calls=3, hosts=hosts)
    assert step.traces == 3   # (1, 1), (1, 3), (3, 3)
