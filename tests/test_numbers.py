"""Python numbers among the step's arguments whose value changes between calls:
lifted to program inputs after their first change when they only enter
arithmetic, traced once per value when they decide control flow or a shape."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import transpile
from transpiler.program.program import InputKind


def weighted_step(model, opt, x, y, weight, k):
    """A loss weight (float) and a divisor (int) the training loop changes
    every call, mixed with the loss and in Python arithmetic between them."""
    opt.zero_grad()
    logits = model(x)
    loss = F.cross_entropy(logits, y) * (1 - weight) + weight * logits.pow(2).mean() / k
    loss = loss + 3 / (k + weight)
    loss.backward()
    opt.step()
    return loss


def branching_step(model, opt, x, y, weight, k):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    if weight > 0.25:   # the value decides control flow
        loss = loss * 2
    loss.backward()
    opt.step()
    return loss


def slicing_step(model, opt, x, y, weight, k):
    opt.zero_grad()
    loss = F.cross_entropy(model(x[:k]), y[:k])   # the value decides a shape
    loss.backward()
    opt.step()
    return loss


def _values(i: int) -> tuple[float, int]:
    return 0.1 * i + 0.013, 5 + i


def _run_against_eager(fn, calls: int, backend: str = "eager", optimizer: str = "adamw"):
    model = M.make("mlp")
    reference = copy.deepcopy(model)
    opts = [M.make_optimizer(optimizer, m) for m in (model, reference)]
    step = transpile(fn, backend=backend)
    worst = 0.0
    for i, (x, y) in enumerate(M.batches("mlp", calls, 8)):
        ours = step(model, opts[0], x, y, *_values(i))
        theirs = fn(reference, opts[1], x, y, *_values(i))
        worst = max(worst, (ours - theirs).abs().item(), M.max_rel_error(
            M.state_of(model, opts[0]), M.state_of(reference, opts[1])))
    return step, worst


def test_numbers_in_arithmetic_are_lifted_after_their_first_change(caplog):
    with caplog.at_level(logging.INFO, logger="transpiler"):
        step, worst = _run_against_eager(weighted_step, 6)
    assert worst == 0.0   # Python's arithmetic and promotion, bit for bit
    assert step._cache.builds == 2 and len(step._cache) == 2
    assert "lifting weight to a program input" in caplog.text
    assert "lifting k to a program input" in caplog.text
    lifted = {s.name: s for s in step.program.inputs if s.kind is InputKind.NUMBER}
    assert set(lifted) == {"weight", "k"}
    listing = str(step.program)
    assert "weight: f64[] = input(number 'weight')" in listing
    assert "k: i64[] = input(number 'k')" in listing


def test_a_lifted_number_deciding_control_flow_traces_per_outcome(caplog):
    with caplog.at_level(logging.INFO, logger="transpiler"):
        step, worst = _run_against_eager(branching_step, 5)
    assert worst == 0.0
    # weight 0.013 (traced with the value), 0.113 (lifted: weight <= 0.25),
    # 0.213 (the same program), 0.313 (weight > 0.25), 0.413 (the same)
    assert step._cache.builds == 3
    assert "(weight <= 0.25 at " in caplog.text
    assert "no longer holds (weight = 0.313" in caplog.text
    assert step._cache.lifted == {"weight", "k"} and not step._cache.per_value
    guards = [g.condition() for _, built in step._cache._order for g in built.number_guards]
    assert guards == ["weight <= 0.25", "0.25 < weight"]


def test_a_number_deciding_a_shape_traces_per_value(caplog):
    with caplog.at_level(logging.INFO, logger="transpiler"):
        step, worst = _run_against_eager(slicing_step, 4)
    assert worst == 0.0
    # One program per value of the deciding number; the other one stays lifted.
    assert step._cache.builds == 4
    assert "transpiler: k decides control flow or a shape" in caplog.text
    assert step._cache.per_value == {"k"} and step._cache.lifted == {"weight"}


def counting_step(model, opt, x, y, weight, k):
    """cleanrl's `if global_step > args.learning_starts`, ignite's gradient
    accumulation `if (iteration - 1) % accumulation_steps == 0: zero_grad()`."""
    if (k - 1) % 2 == 0:
        opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    if k > 7:
        loss = loss * weight
    loss.backward()
    if k % 2 == 0:
        opt.step()
    return loss


def test_integer_conditions_on_a_lifted_number_trace_per_outcome():
    step, worst = _run_against_eager(counting_step, 8, optimizer="sgd")
    assert worst == 0.0
    # k = 5 (traced with the value), then 6..12 lifted: one program per parity
    # and side of 7
    assert step._cache.builds == 5
    assert not step._cache.per_value


def test_a_warmup_factor_from_a_lifted_counter_traces_per_outcome():
    def warmup_step(model, opt, x, y, weight, k):
        """Lightning's KL annealing: min(1.0, self.global_step / warmup)."""
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y) * min(1.0, k / 8) + max(weight, k / 100.0)
        loss.backward()
        opt.step()
        return loss
    step, worst = _run_against_eager(warmup_step, 6)
    assert worst == 0.0
    # k = 5 (traced with the value), 6, 7 (k / 8 < 1.0), 8, 9, 10 (not); weight
    # against k / 100.0 goes one way from the second call
    assert step._cache.builds == 3 and not step._cache.per_value


def test_a_condition_computed_in_floating_point_is_replayed_as_python_computes_it():
    def decaying_step(model, opt, x, y, weight, k):
        """timm's ModelEmaV3.get_decay: 1 - (1 + step / gamma) ** -power, clamped."""
        opt.zero_grad()
        decay = min(max(1 - (1 + k / 10) ** -0.75, 0.0), 0.9999)
        loss = F.cross_entropy(model(x), y) * decay
        loss.backward()
        opt.step()
        return loss
    step, worst = _run_against_eager(decaying_step, 4)
    assert worst == 0.0
    # traced with the first value, then once with k lifted: sympy restates the
    # clamps' conditions in floating point, so they are checked by replaying
    # the step's own operations on each call's k (host_arithmetic.py)
    assert step._cache.builds == 2 and not step._cache.per_value


def test_a_numpy_float64_is_lifted_as_a_float():
    # DANN's alpha = 2. / (1. + np.exp(-10 * p)) - 1 is numpy's float64: traced
    # per value, a new program every call
    import numpy as np

    def numpy_values(i: int) -> tuple:
        weight, k = _values(i)
        return 2. / (1. + np.exp(-10 * weight)) - 1, k

    model = M.make("mlp")
    reference = copy.deepcopy(model)
    opts = [M.make_optimizer("adamw", m) for m in (model, reference)]
    step = transpile(weighted_step)
    for i, (x, y) in enumerate(M.batches("mlp", 5, 8)):
        assert type(numpy_values(i)[0]) is np.float64
        ours = step(model, opts[0], x, y, *numpy_values(i))
        theirs = weighted_step(reference, opts[1], x, y, *numpy_values(i))
        assert ours.item() == theirs.item()
        M.assert_states_equal(M.state_of(model, opts[0]), M.state_of(reference, opts[1]))
    assert step._cache.builds == 2


def test_a_bool_is_never_lifted():
    def flagged_step(model, opt, x, y, flag):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y) * (2.0 if flag else 1.0)
        loss.backward()
        opt.step()
        return loss
    model = M.make("mlp")
    opt = M.make_optimizer("sgd", model)
    step = transpile(flagged_step)
    for i, (x, y) in enumerate(M.batches("mlp", 4, 8)):
        step(model, opt, x, y, i % 2 == 0)
    assert step._cache.builds == 2 and not step._cache.lifted


def numbers_vs_ddp(mode: str, fn=weighted_step):
    """The loss weight and divisor changed every call, transpiled and under DDP
    with its defaults, same processes, each rank its own batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = M.make("mlp")
    reference = copy.deepcopy(model)
    opts = [M.make_optimizer("adamw", m) for m in (model, reference)]
    step, ddp = transpile(fn, mode=mode), DDP(reference)
    for i, batch in enumerate(M.batches("mlp", 5, 16)):
        x, y = M.shard(batch, rank, world)
        step(model, opts[0], x, y, *_values(i))
        fn(ddp, opts[1], x, y, *_values(i))
    ours, theirs = M.states_compared(zip((model, reference), opts), sharded=mode == "zero")
    return step._cache.builds, M.max_rel_error(ours, theirs)


@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce", "zero"])
def test_lifted_numbers_equal_ddp(mode, ranks2):
    assert ranks2.run(numbers_vs_ddp, mode) == [(2, 0.0), (2, 0.0)]


@pytest.mark.parametrize("mode", ["fuse_all_reduce", "zero"])
def test_a_program_per_outcome_equals_ddp(mode, ranks2):
    # weight 0.013 (traced with the value), 0.113 (lifted), 0.213, 0.313 (the
    # other branch), 0.413: three programs, every rank alike
    assert ranks2.run(numbers_vs_ddp, mode, branching_step) == [(3, 0.0), (3, 0.0)]


# ----- numbers the step reads outside its arguments -----------------------------

LOSS_SCALE = 1.0   # a global the training loop anneals


class Tempered(torch.nn.Module):
    """The MLP with a softmax temperature kept as a plain float attribute
    (fairseq's GumbelVectorQuantizer.curr_temp, set by set_num_updates)."""

    def __init__(self):
        super().__init__()
        self.body = M.make("mlp")
        self.temperature = 1.0

    def forward(self, x):
        return self.body(x) / self.temperature


class Schedule:
    """A config object passed as an argument (read in place), its weight
    annealed by the loop; a class attribute changed at the end."""

    warmup = 3

    def __init__(self, weight: float):
        self.weight = weight


def annealed_step(model, opt, x, y, schedule):
    opt.zero_grad()
    logits = model(x)
    loss = F.cross_entropy(logits, y) * LOSS_SCALE * (1 - schedule.weight) \
        + schedule.weight * logits.pow(2).mean() / schedule.warmup
    loss.backward()
    opt.step()
    return loss


def deciding_step(model, opt, x, y, schedule):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    if schedule.weight > 0.25:   # the value decides control flow
        loss = loss * 2
    (loss * LOSS_SCALE).backward()
    opt.step()
    return loss


def seeded_step(model, opt, x, y, schedule):
    """fairseq's train_step: torch.manual_seed(args.seed + num_updates) in the step."""
    torch.manual_seed(1234 + model.num_updates)
    opt.zero_grad()
    loss = F.cross_entropy(F.dropout(model(x), 0.3), y)
    loss.backward()
    opt.step()
    return loss


def _anneal(model, i: int, calls: int) -> "Schedule":
    """What the loop sets before call i; the class attribute changes at the last call."""
    global LOSS_SCALE
    LOSS_SCALE = 1.0 + 0.25 * i
    model.temperature = 1.0 - 0.05 * i
    model.num_updates = 10 * i
    Schedule.warmup = 3 if i < calls - 1 else 5
    return Schedule(0.1 * i + 0.013)


def _run_read_against_eager(fn, calls: int, backend: str = "eager"):
    model = Tempered()
    reference = copy.deepcopy(model)
    opts = [M.make_optimizer("adamw", m) for m in (model, reference)]
    step = transpile(fn, backend=backend)
    worst = 0.0
    try:
        for i, (x, y) in enumerate(M.batches("mlp", calls, 8)):
            ours = step(model, opts[0], x, y, _anneal(model, i, calls))
            theirs = fn(reference, opts[1], x, y, _anneal(reference, i, calls))
            worst = max(worst, (ours - theirs).abs().item(), M.max_rel_error(
                M.state_of(model, opts[0]), M.state_of(reference, opts[1])))
            assert _plain_values(model) == _plain_values(reference)   # what the step left there
    finally:
        _anneal(model, 0, calls)
    return step, worst


def test_numbers_read_outside_the_arguments_are_lifted_after_their_first_change(caplog):
    with caplog.at_level(logging.INFO, logger="transpiler"):
        step, worst = _run_read_against_eager(annealed_step, 6)
    assert worst == 0.0
    # a module's attribute, a global, a field of an argument's object (a new
    # object every call) and, at the last call, a class attribute
    assert step._cache.builds == 3
    names = {"model.temperature", "global 'LOSS_SCALE' of tests.test_numbers",
             "schedule.weight", "schedule.warmup"}
    for name in names:
        assert f"lifting {name} to a program input" in caplog.text
    lifted = {s.name for s in step.program.inputs if s.kind is InputKind.NUMBER}
    assert lifted == names
    assert "model_temperature: f64[] = input(number 'model.temperature')" in str(step.program)
    assert "schedule_warmup: i64[] = input(number 'schedule.warmup')" in str(step.program)


def test_a_number_read_outside_the_arguments_that_decides_traces_per_outcome(caplog):
    with caplog.at_level(logging.INFO, logger="transpiler"):
        step, worst = _run_read_against_eager(deciding_step, 5)
    assert worst == 0.0
    # 0.013 (traced with the value), 0.113 (lifted), 0.213, 0.313 (the other
    # branch), 0.413
    assert step._cache.builds == 3 and not step._cache.per_value_places
    assert "(schedule.weight <= 0.25 at " in caplog.text
    lifted = {s.name for s in step.program.inputs if s.kind is InputKind.NUMBER}
    assert lifted == {"global 'LOSS_SCALE' of tests.test_numbers", "model.temperature",
                      "schedule.weight"}


def test_a_number_argument_and_an_attribute_changed_in_the_same_call_are_lifted_together():
    def tempered_step(model, opt, x, y, weight, k):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if k % 2 == 0:
            loss = loss * 2
        loss.backward()
        opt.step()
        return loss
    model = Tempered()
    reference = copy.deepcopy(model)
    opts = [M.make_optimizer("adamw", m) for m in (model, reference)]
    step = transpile(tempered_step)
    for i, (x, y) in enumerate(M.batches("mlp", 5, 8)):
        model.temperature = reference.temperature = 1.0 - 0.05 * i
        ours = step(model, opts[0], x, y, *_values(i))
        assert torch.equal(ours, tempered_step(reference, opts[1], x, y, *_values(i)))
    M.assert_states_equal(M.state_of(model, opts[0]), M.state_of(reference, opts[1]))
    # k = 5 (traced with the values), then k and the temperature lifted at
    # once: a program per parity
    assert step._cache.builds == 3


def test_a_seed_from_a_number_read_outside_the_arguments_is_computed_every_call():
    step, worst = _run_read_against_eager(seeded_step, 4)
    assert worst == 0.0
    assert step._cache.builds == 2


def _plain_values(obj) -> dict:
    return {k: v for k, v in vars(obj).items() if type(v) in (int, float, bool)}


def test_a_host_value_computed_from_a_lifted_number_is_written_back_after_each_run():
    """The lifted number the step leaves on the host is an output of the one
    program, put where the step put it after each run (as many programs as
    without it)."""
    def storing_step(model, opt, x, y, schedule):
        model.last_temperature = model.temperature   # the host keeps the value
        model.scaled = model.temperature * schedule.weight
        return annealed_step(model, opt, x, y, schedule)
    step, worst = _run_read_against_eager(storing_step, 4)
    assert worst == 0.0
    assert step._cache.builds == 3


def read_numbers_vs_ddp(mode: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Tempered()
    reference = copy.deepcopy(model)
    opts = [M.make_optimizer("adamw", m) for m in (model, reference)]
    step, ddp = transpile(annealed_step, mode=mode), DDP(reference)
    try:
        for i, batch in enumerate(M.batches("mlp", 5, 16)):
            x, y = M.shard(batch, rank, world)
            step(model, opts[0], x, y, _anneal(model, i, 5))
            annealed_step(ddp, opts[1], x, y, _anneal(reference, i, 5))
    finally:
        _anneal(model, 0, 5)
    ours, theirs = M.states_compared(zip((model, reference), opts), sharded=mode == "zero")
    return step._cache.builds, M.max_rel_error(ours, theirs)


@pytest.mark.parametrize("mode", ["fuse_all_reduce", "zero"])
def test_lifted_numbers_read_outside_the_arguments_equal_ddp(mode, ranks2):
    assert ranks2.run(read_numbers_vs_ddp, mode) == [(3, 0.0), (3, 0.0)]


@pytest.mark.compiles
@pytest.mark.parametrize("run,fn,builds", [(_run_against_eager, weighted_step, 2),
                                           (_run_against_eager, counting_step, 4),
                                           (_run_read_against_eager, annealed_step, 3)])
def test_lifted_numbers_under_inductor(run, fn, builds):
    step, worst = run(fn, 4, backend="inductor")
    assert worst < 1e-5
    assert step._cache.builds == builds
