"""Values the step draws on the host: Python's random, numpy's global
generator and Generator objects, the clock. Each call draws them again, as
eager does (same values, same generator states after). A decision on a drawn
number runs the program of its outcome (a program per outcome; a branch may
draw more); an integer drawn for a size, a program per value. A decision the
host cannot evaluate as Python does is refused at the first call, naming the
draw, with nothing changed. Against the eager step in one process and torch
DDP on 2 ranks, each rank its own draws and branches."""

import copy
import random
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import TranspileError, transpile


def mixup_step(model, opt, x, y):
    """mixup with a Beta(0.4, 0.4) weight from numpy (as in mixup's reference
    code), a random loss scale from Python's random."""
    lam = np.random.beta(0.4, 0.4)
    scale = random.uniform(0.5, 1.5)
    opt.zero_grad()
    mixed = lam * x + (1 - lam) * x.flip(0)
    out = model(mixed)
    loss = (lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y.flip(0))) * scale
    loss.backward()
    opt.step()
    return loss


class Jittered(nn.Module):
    """A module drawing from its own numpy Generator and random.Random."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.rng = np.random.default_rng(0)
        self.py_rng = random.Random(1)

    def forward(self, x):
        noise = torch.from_numpy(self.rng.standard_normal(tuple(x.shape), dtype=np.float32))
        return self.fc(x + 0.1 * noise) * self.py_rng.random()


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values()))


def _seed(i):
    random.seed(i)
    np.random.seed(i)


@pytest.mark.parametrize("make,step_fn", [
    (lambda: M.make("mlp"), mixup_step),
    (Jittered, M.classify_step),
], ids=["global generators", "a module's own generators"])
def test_draws_on_the_host_are_drawn_again_on_every_call(make, step_fn):
    torch.manual_seed(0)
    ours = make()
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    step = transpile(step_fn)
    for i, (x, y) in enumerate(M.batches("mlp", 4, 8)):
        _seed(i)
        a = step(ours, opts[0], x, y)
        after = (random.getstate(), np.random.get_state()[1].tolist())
        _seed(i)
        b = step_fn(theirs, opts[1], x, y)
        assert torch.equal(a, b), i
        assert _equal(ours, theirs), i
        assert after == (random.getstate(), np.random.get_state()[1].tolist())
    if isinstance(ours, Jittered):
        assert ours.rng.bit_generator.state == theirs.rng.bit_generator.state
        assert ours.py_rng.getstate() == theirs.py_rng.getstate()
    assert step.traces == 1


def clipped_when_the_draw_scales_it_out(model, opt, x, y):
    """Inputs scaled by a host draw, clipped only where they exceed a bound: a
    decision on tensor values that the draw scales."""
    x = x * random.uniform(0.5, 2.0)
    if x.abs().max() > 2.5:
        x = x.clamp(-2.5, 2.5)
    return M.classify_step(model, opt, x, y)


def test_a_decision_on_values_a_draw_computes_takes_the_draws_branch():
    # the trace on this call's values computes with the draw's value: it
    # computed with an empty tensor's (5e-315 for 0.84), took the other branch,
    # and the step was refused as deciding otherwise as it ran
    torch.manual_seed(0)
    ours = M.make("mlp")
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    step = transpile(clipped_when_the_draw_scales_it_out)
    branches = set()
    for i, (x, y) in enumerate(M.batches("mlp", 6, 8)):
        _seed(i)
        scaled = x * random.uniform(0.5, 2.0)
        branches.add(bool(scaled.abs().max() > 2.5))
        _seed(i)
        a = step(ours, opts[0], x, y)
        _seed(i)
        b = clipped_when_the_draw_scales_it_out(theirs, opts[1], x, y)
        assert torch.equal(a, b), i
        assert _equal(ours, theirs), i
    assert branches == {True, False}   # both branches taken


def decides_on_a_draw(model, opt, x, y):
    if random.random() < 0.5:   # a LayerDrop-style decision on the host
        x = x.flip(0)
    return M.classify_step(model, opt, x, y)


def cutmix_like(model, opt, x, y, p=0.5):
    """clovaai's CutMix: a draw decides whether to mix; only then is the
    weight drawn (a branch draws more)."""
    if np.random.rand() < p:
        lam = np.random.beta(1.0, 1.0)
        mixed = lam * x + (1 - lam) * x.flip(0)
        opt.zero_grad()
        out = model(mixed)
        loss = lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y.flip(0))
        loss.backward()
        opt.step()
        return loss
    return M.classify_step(model, opt, x, y)


def random_sub_batch(model, opt, x, y):
    """A sub-batch of a size drawn on the host: the integer is a constant of
    its program, a program per value drawn."""
    n = random.randrange(2, 8, 2)
    return M.classify_step(model, opt, x[:n].reshape(n, -1), y[:n])


def random_resolution(model, opt, x, y):
    """yolo's multi-scale training: the input resampled to a size drawn on
    the host: a program per value drawn."""
    size = random.randrange(4, 16, 4)
    x = F.interpolate(x.unsqueeze(1), size=size, mode="linear", align_corners=False)
    return M.classify_step(model, opt, F.interpolate(x, size=16).squeeze(1), y)


def decides_on_a_sum_of_a_draw(model, opt, x, y):
    # torch restates it (`0.6 < 2.0*u`), another computation: the step's own
    # operations are replayed on each call's draw (host_arithmetic.py)
    if random.random() * 2 - 0.1 > 0.5:
        x = x.flip(0)
    return M.classify_step(model, opt, x, y)


@pytest.mark.parametrize("step_fn,programs", [
    (decides_on_a_draw, 2), (cutmix_like, 2), (random_sub_batch, 3), (random_resolution, 3),
    (decides_on_a_sum_of_a_draw, 2)],
    ids=["a branch", "a branch that draws more", "a sub-batch size", "a resolution",
         "a branch on a sum in floating point"])
def test_a_decision_on_a_draw_runs_the_program_of_its_outcome(step_fn, programs):
    torch.manual_seed(0)
    ours = M.make("mlp")
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    step = transpile(step_fn)
    _seed(0)
    for i, (x, y) in enumerate(M.batches("mlp", 10, 8)):
        states = random.getstate(), np.random.get_state()
        a = step(ours, opts[0], x, y)
        after = (random.getstate(), np.random.get_state()[1].tolist())
        random.setstate(states[0])
        np.random.set_state(states[1])
        b = step_fn(theirs, opts[1], x, y)
        assert torch.equal(a, b), i
        assert _equal(ours, theirs), i
        assert after == (random.getstate(), np.random.get_state()[1].tolist()), i
    assert step.traces == programs


@pytest.mark.compiles
def test_the_programs_of_a_drawn_decision_under_inductor():
    torch.manual_seed(0)
    ours = M.make("mlp")
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    step = transpile(decides_on_a_draw, backend="inductor")
    _seed(0)
    for x, y in M.batches("mlp", 6, 8):
        state = random.getstate()
        step(ours, opts[0], x, y)
        after = random.getstate()
        random.setstate(state)
        decides_on_a_draw(theirs, opts[1], x, y)
        assert after == random.getstate()
    assert M.max_rel_error(M.state_of(ours, opts[0]), M.state_of(theirs, opts[1])) < 1e-5
    assert step.traces == 2


def timed_step(model, opt, x, y):
    start = time.perf_counter()
    loss = M.classify_step(model, opt, x, y)
    return loss, torch.tensor(start, dtype=torch.float64), \
        torch.tensor(time.perf_counter() - start)


def test_the_clock_is_read_on_every_call():
    """Each call reads the clock again (the start times increase); both reads
    are replayed before the program runs, so the elapsed time is not the step's."""
    model = M.make("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = transpile(timed_step)
    read = [step(model, opt, *batch)[1:] for batch in M.batches("mlp", 3, 8)]
    starts = [float(start) for start, _ in read]
    assert starts == sorted(starts) and len(set(starts)) == 3
    assert all(float(elapsed) >= 0 for _, elapsed in read)


def printing_step(model, opt, x, y):
    scale = random.uniform(0.5, 1.5)
    loss = M.classify_step(model, opt, x * scale, y)
    print(f"scale {scale:.4f} noise {np.random.rand():.3f}", scale)
    return loss


def test_a_drawn_value_printed_is_filled_in_with_each_calls_draw(capsys):
    """A drawn number printed is an output of the program (capture/text_values.py):
    each call prints its own draws, as eager, from one program."""
    printed = []
    for transpiled in (False, True):
        model = M.make("mlp")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = transpile(printing_step) if transpiled else printing_step
        random.seed(0)
        np.random.seed(0)
        capsys.readouterr()
        for batch in M.batches("mlp", 4, 8):
            step(model, opt, *batch)
        printed.append(capsys.readouterr().out)
    assert printed[1] == printed[0] and len(set(printed[0].splitlines())) == 4
    assert step.traces == 1


def printing_time_step(model, opt, x, y):
    start = time.perf_counter()
    loss = M.classify_step(model, opt, x, y)
    print(f"step took {time.perf_counter() - start:.6f} s")
    return loss


def test_a_time_measured_in_the_step_and_printed_is_refused_with_nothing_changed():
    """The clocks are read before the program runs: a time measured inside the
    step, printed, would not be the step's."""
    model = M.make("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TranspileError, match=r"turns a time it measures inside the step "
                                             r"\(time.perf_counter\(\) at .*test_host_random.py.*"
                                             r"time the call from outside the step"):
        transpile(printing_time_step)(model, opt, *M.batches("mlp", 1, 8)[0])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not opt.state


class Prefetcher(threading.Thread):
    """A loader thread drawing its augmentation from a random.Random of its own,
    making tensors of numpy arrays and reading the clock, as the step is traced
    on the main thread."""

    def __init__(self):
        super().__init__(daemon=True)
        self.rng, self.seen, self.done = random.Random(0), [], threading.Event()
        self.error = None

    def run(self):
        try:
            self.load()
        except Exception as exc:   # noqa: BLE001 - the test reports it
            self.error = exc

    def load(self):
        while not self.done.is_set():
            image = np.full((2, 2), self.rng.random(), dtype=np.float32)
            self.seen.append((torch.from_numpy(image), torch.as_tensor(image), time.perf_counter()))
            time.sleep(0.0005)


def test_another_threads_draws_are_its_own():
    """Only the tracing thread's draws and conversions are the step's: a loader
    thread drawing, converting arrays and reading the clock meanwhile gets its
    own numbers and tensors, and the step draws as eager does."""
    torch.manual_seed(0)
    ours = M.make("mlp")
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    step = transpile(mixup_step)
    thread = Prefetcher()
    thread.start()
    try:
        for batch in M.batches("mlp", 3, 8):
            _seed(1)
            a = step(ours, opts[0], *batch)
            _seed(1)
            assert torch.equal(a, mixup_step(theirs, opts[1], *batch))
    finally:
        thread.done.set()
        thread.join()
    assert _equal(ours, theirs)
    assert thread.seen and all(type(a) is torch.Tensor and type(b) is torch.Tensor
                               and type(t) is float for a, b, t in thread.seen)
    assert thread.error is None
    # lam and scale: the step's own draws, and no other
    assert [line.split(":")[0] for line in str(step.program).splitlines()
            if "= input(draw" in line] == ["d_draw0", "d_draw1"]


def rank_steps_vs_ddp(mode: str, step_fns: tuple, calls: int):
    """The steps in turn, transpiled and with the model in DDP; each rank its
    own draws (its own branches and sizes)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ours = M.make("mlp")
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    ddp = DDP(theirs)
    steps = {fn: transpile(fn, mode=mode) for fn in step_fns}
    for i, batch in enumerate(M.batches("mlp", calls, 16)):
        x, y = M.shard(batch, rank, world)
        for fn, step in steps.items():
            _seed(100 * rank + i)
            a = step(ours, opts[0], x, y)
            _seed(100 * rank + i)
            if not torch.equal(a, fn(ddp, opts[1], x, y)):
                return False
    return _equal(ours, theirs)


@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce", "zero"])
def test_host_draws_equal_ddp(mode, ranks2):
    assert ranks2.run(rank_steps_vs_ddp, mode, (mixup_step,), 4) == [True, True]


@pytest.mark.parametrize("mode", ["fuse_all_reduce", "zero"])
def test_decisions_on_draws_equal_ddp(mode, ranks2):
    assert ranks2.run(rank_steps_vs_ddp, mode, (cutmix_like, random_sub_batch, random_resolution),
                      6) == [True, True]
