"""Numbers the step changes on the host every call: meters updated with
`loss.item()`, counters advanced (`self.global_step += 1`), a flag computed
from a counter that decides accumulation. The program reads each such number
from an input and computes what the step leaves there, an output put back
after every run; a counter that pins the program to one of its values is
refused at the first call, nothing changed. Against the eager step in one
process (also under inductor, whose kernels would take a float as a float32)
and against torch DDP with its defaults on 2 ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests import models as M
from transpiler import TranspileError, transpile


class AverageMeter:
    """pytorch/examples imagenet/main.py's meter."""

    def __init__(self):
        self.val, self.avg, self.sum, self.count = 0, 0, 0, 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


class TrainState:
    """A trainer's state (transformers' TrainerState): counters and the last loss."""

    def __init__(self):
        self.global_step = 0
        self.epoch = 0.0
        self.best = float("inf")


def metered_step(model, optimizer, x, y, losses, top1, state):
    optimizer.zero_grad()
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    optimizer.step()
    losses.update(loss.item(), x.size(0))
    top1.update((out.argmax(1) == y).float().mean().item() * 100.0, x.size(0))
    state.global_step += 1
    state.epoch = state.global_step / 10
    state.best = min(state.best, loss.item())
    return loss


def _plain(obj) -> dict:
    return {k: v for k, v in vars(obj).items() if type(v) in (int, float, bool)}


def _host_objects():
    return AverageMeter(), AverageMeter(), TrainState()


def _twins():
    """The model twice from the same start, each with its SGD with momentum."""
    torch.manual_seed(0)
    ours = M.make("mlp")
    theirs = copy.deepcopy(ours)
    return ours, theirs, [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
                          for m in (ours, theirs)]


def test_meters_and_counters_equal_eager_from_one_program():
    ours, theirs, opts = _twins()
    held = [_host_objects(), _host_objects()]
    step = transpile(metered_step)
    for i, (x, y) in enumerate(M.batches("mlp", 5, 8)):
        a = step(ours, opts[0], x, y, *held[0])
        b = metered_step(theirs, opts[1], x, y, *held[1])
        assert torch.equal(a, b), i
        for mine, eager in zip(*held):
            assert _plain(mine) == _plain(eager), (i, _plain(mine), _plain(eager))
            assert [type(v) for v in _plain(mine).values()] == \
                [type(v) for v in _plain(eager).values()]
    M.assert_states_equal(M.state_of(ours, opts[0]), M.state_of(theirs, opts[1]))
    assert held[0][2].global_step == 5
    # one program per outcome of the best-loss comparison, not one per value
    assert step._cache.builds <= 3


@pytest.mark.compiles
def test_under_inductor_the_sums_are_python_floats_of_the_returned_losses():
    """A compiled kernel takes a symbolic float as a float32: the numbers the
    step leaves are computed in double, as Python's floats are."""
    torch.manual_seed(0)
    model = M.make("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, top1, state = _host_objects()
    step = transpile(metered_step, backend="inductor")
    total, count = 0, 0
    for x, y in M.batches("mlp", 5, 8):
        loss = step(model, opt, x, y, losses, top1, state).item()
        total += loss * 8
        count += 8
        assert losses.val == loss and losses.sum == total and losses.avg == total / count
    assert state.global_step == 5 and step.compiles <= 2   # the two outcomes of min()


def accumulating_step(model, optimizer, x, y, state):
    """accelerate's accumulate(): a counter, a flag computed from it, the
    update only when the flag is set."""
    loss = F.cross_entropy(model(x), y) / 2
    loss.backward()
    state.global_step += 1
    state.sync = state.global_step % 2 == 0
    if state.sync:
        optimizer.step()
        optimizer.zero_grad()
    return loss


def test_a_counter_that_decides_accumulation_equals_eager():
    ours, theirs, opts = _twins()
    states = [TrainState(), TrainState()]
    step = transpile(accumulating_step)
    for i, (x, y) in enumerate(M.batches("mlp", 6, 8)):
        assert torch.equal(step(ours, opts[0], x, y, states[0]),
                           accumulating_step(theirs, opts[1], x, y, states[1])), i
        assert _plain(states[0]) == _plain(states[1]), i
        M.assert_states_equal(M.state_of(ours, opts[0]), M.state_of(theirs, opts[1]))
    # the two outcomes of the flag, and the program without .grad at the start
    assert step._cache.builds <= 3


class Window:
    def __init__(self):
        self.n = 2


def sliced_step(model, optimizer, x, y, window):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x[:window.n]), y[:window.n])
    loss.backward()
    optimizer.step()
    window.n = window.n % 7 + 1
    return loss


def test_a_counter_that_decides_a_shape_is_refused_with_nothing_changed():
    model = M.make("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = copy.deepcopy(model.state_dict())
    window = Window()
    with pytest.raises(TranspileError, match=r"changes host-side state on every call: "
                                             r"window.n 2 -> 3, then 3 -> 4"):
        transpile(sliced_step)(model, opt, *M.batches("mlp", 1, 8)[0], window)
    assert window.n == 2 and not opt.state
    M.assert_states_equal(model.state_dict(), before)


def meters_vs_ddp(mode: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    ours, theirs, opts, step = M.against_ddp(lambda: M.make("mlp"), metered_step, mode)
    held = [_host_objects(), _host_objects()]
    for x, y in M.batches("mlp", 4, 16):
        x, y = M.shard((x, y), rank, world)
        a = step(ours, opts[0], x, y, *held[0])
        b = metered_step(theirs, opts[1], x, y, *held[1])
        assert torch.equal(a, b)
        for mine, eager in zip(*held):
            assert _plain(mine) == _plain(eager), (_plain(mine), _plain(eager))
    mine, eager = M.states_compared(zip((ours, theirs.module), opts), sharded=mode == "zero")
    M.assert_states_equal(mine, eager)
    return held[0][0].sum, step._cache.builds


@pytest.mark.parametrize("mode", ["fuse_all_reduce", "zero"])
def test_meters_and_counters_equal_ddp_on_each_rank(mode, ranks2):
    (sum0, builds0), (sum1, builds1) = ranks2.run(meters_vs_ddp, mode)
    assert sum0 != sum1   # each rank's own losses
    assert builds0 <= 3 and builds1 <= 3


def counted_step(model, optimizer, x, y, losses, state):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    losses.update(loss.item(), x.size(0))
    state.global_step += 1
    state.epoch = state.global_step / 10
    return loss


def rank_meters(mode: str, backend: str, options: dict):
    """Each rank's meter holds the Python sums of the losses its step returned
    (in modes without a DDP reference, and under inductor, whose losses round
    otherwise than DDP's)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = M.make("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, state = AverageMeter(), TrainState()
    step = transpile(counted_step, mode=mode, backend=backend, **options)
    total = 0
    for x, y in M.batches("mlp", 4, 16):
        x, y = M.shard((x, y), rank, world)
        loss = step(model, opt, x, y, losses, state).item()
        total += loss * x.size(0)
        assert losses.val == loss and losses.sum == total and losses.avg == total / losses.count
    assert state.global_step == 4 and state.epoch == 0.4 and losses.count == 4 * 16 // world
    return losses.sum


@pytest.mark.parametrize("mode, options", [("local_sgd", {"k_steps": 2}), ("fsdp", {}),
                                           ("all_gather", {}),
                                           ("decentralized", {"topology": "ring"})])
def test_in_every_mode_each_ranks_meters_are_the_sums_of_its_losses(mode, options, ranks2):
    sums = ranks2.run(rank_meters, mode, "eager", options)
    assert sums[0] != sums[1]


@pytest.mark.compiles
def test_under_inductor_each_ranks_meters_are_the_sums_of_its_losses(ranks2):
    sums = ranks2.run(rank_meters, "fuse_all_reduce", "inductor", {})
    assert sums[0] != sums[1]


class LoopState:
    def __init__(self):
        self.iter_num = 0
        self.running = 0.0


def logging_step(model, optimizer, x, y, s):
    """nanoGPT's log line every other iteration, from counters kept on the host."""
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    s.iter_num += 1
    s.running = 0.9 * s.running + 0.1 * loss.item()
    if s.iter_num % 2 == 0:
        print(f"iter {s.iter_num}: loss {loss.item():.4f} running {s.running:.5f}")
    return loss


def test_a_counter_and_a_running_loss_printed_every_other_call_as_eager(capsys):
    ours, theirs, opts = _twins()
    states, printed = [LoopState(), LoopState()], []
    step = transpile(logging_step)
    for fn, model, opt, state in [(step, ours, opts[0], states[0]),
                                  (logging_step, theirs, opts[1], states[1])]:
        for x, y in M.batches("mlp", 6, 8):
            fn(model, opt, x, y, state)
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1] and printed[0].count("\n") == 3
    assert vars(states[0]) == vars(states[1])
    assert step._cache.builds == 2   # the two outcomes of iter_num % 2


class History:
    def __init__(self):
        self.losses = []


HISTORY = History()


def appending_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    HISTORY.losses.append(loss.item())
    return loss


def test_a_tensor_value_appended_to_a_host_list_is_appended_after_every_run():
    """A list the step only appends to (traced again with a stand-in that
    refuses reads, capture/appended.py): each call's value is appended to it,
    one program for every call."""
    HISTORY.losses.clear()
    step = M.against_eager(appending_step, calls=4)
    ours, eager = HISTORY.losses[0::2], HISTORY.losses[1::2]
    assert ours == eager and len(ours) == 4 and all(type(v) is float for v in ours)
    assert step.traces == 1


@pytest.mark.compiles
def test_under_inductor_a_meter_over_batches_of_changing_size_is_exact():
    """Once the batch size changes it is a symbol of the program: the meter's
    `sum += loss.item() * n` is still computed in double."""
    torch.manual_seed(0)
    model = M.make("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, state = AverageMeter(), TrainState()
    step = transpile(counted_step, backend="inductor")
    total, count = 0, 0
    for i, n in enumerate([8, 6, 4, 8, 6, 5]):
        x, y = M.batches("mlp", 1, n, seed=i)[0]
        loss = step(model, opt, x, y, losses, state).item()
        total += loss * n
        count += n
        assert losses.sum == total and losses.count == count and losses.avg == total / count, i
    assert step._cache.builds == 2 and step.compiles == 1   # static, then symbolic sizes
