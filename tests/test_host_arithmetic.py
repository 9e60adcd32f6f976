"""Python arithmetic on lifted numbers, counters and draws, evaluated as the
step's Python evaluates it (transpiler/capture/host_arithmetic.py): a decision
in floating point replayed from the step's own operations, and a function of
math computed on the host before every run."""

from __future__ import annotations

import copy
import math
import random
from math import cos, pi

import numpy as np

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests import models as M
from transpiler import transpile
from transpiler.program.program import InputKind


def _against_eager(step_fn, arguments: list, tolerance: float = 0.0, **options):
    """The step transpiled (with `options`) and eager on twin models, call by
    call, with each call's extra arguments (ours, eager's): what both return
    and the parameters they leave are equal (bit for bit, or within
    `tolerance` of eager's, relative)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    reference = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    step = transpile(step_fn, **options)
    for i, extra in enumerate(arguments):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)
        ours, theirs = step(model, opts[0], x, y, *extra[0]), step_fn(reference, opts[1], x, y,
                                                                       *extra[1])
        for a, b in zip(ours, theirs):
            if isinstance(a, torch.Tensor):
                assert torch.allclose(a, b, rtol=tolerance, atol=0) if tolerance \
                    else torch.equal(a, b), (i, a, b)
            else:
                assert a == b and type(a) is type(b), (i, a, b)
        assert M.max_rel_error(M.state_of(model, opts[0]),
                               M.state_of(reference, opts[1])) <= tolerance, i
    return step


def scaled_update(model, opt, x, y, factor):
    """The update of each step below: the loss scaled by the factor it computes."""
    opt.zero_grad()
    loss = F.mse_loss(model(x), y) * factor
    loss.backward()
    opt.step()
    return loss


def folded_step(model, opt, x, y, s):
    # sympy folds the condition to 1.0*s > s; Python's rounding decides
    return (scaled_update(model, opt, x, y, 2.0 if s * 0.1 * 10 > s else 1.0),)


def test_a_condition_sympy_folds_is_decided_as_python_decides():
    values = [1.0, 2.0, 3.0, 5.0, 3.0, 7.0]
    assert [s * 0.1 * 10 > s for s in values] == [False, False, True, False, True, True]
    step = _against_eager(folded_step, [((s,), (s,)) for s in values])
    # the first value traced, then s lifted: a program per outcome
    assert step._cache.builds == 3 and not step._cache.per_value


class Counter:
    def __init__(self):
        self.it = 0


def cosine_step(model, opt, x, y, schedule):
    """A warm-up then cosine factor from a host counter the step advances
    (nanoGPT's get_lr), floored with max()."""
    schedule.it += 1
    if schedule.it < 3:
        factor = schedule.it / 3
    else:
        factor = 0.5 * (1 + math.cos(math.pi * (schedule.it - 3) / 10))
    factor = max(factor, 0.1)
    return scaled_update(model, opt, x, y, factor), factor


def test_a_cosine_factor_from_a_host_counter_trains_as_eager():
    ours, theirs = Counter(), Counter()
    step = _against_eager(cosine_step, [((ours,), (theirs,))] * 14)
    assert ours.it == theirs.it == 14
    # the counter lifted; a program for the warm-up, one for the cosine above
    # the floor and one for the floor (calls 12 to 14)
    assert step._cache.builds <= 4 and not step._cache.per_value
    computed = [spec.name for spec in step.program.inputs
                if spec.kind is InputKind.NUMBER and spec.name.startswith("math_")]
    assert computed == ["math_cos"]


def math_step(model, opt, x, y, step):
    decay = max(min(1 - (1 + step / 10) ** -0.75, 0.9), 0.05)
    shift = math.exp(-step * 0.3) + math.log1p(step) + math.sqrt(step)
    opt.zero_grad()
    loss = F.mse_loss(model(x) * decay + shift, y)
    loss.backward()
    opt.step()
    return loss, decay, shift


def test_math_on_an_argument_number_is_computed_on_the_host():
    for values in ([i + 1 for i in range(6)], [0.7 * i + 0.1 for i in range(6)]):
        step = _against_eager(math_step, [((v,), (v,)) for v in values])
        assert step._cache.builds == 2 and not step._cache.per_value
        names = {spec.name for spec in step.program.inputs if spec.kind is InputKind.NUMBER}
        assert {"math_exp", "math_log1p", "math_sqrt"} <= names


@pytest.mark.compiles
def test_under_inductor_the_math_inputs_and_replayed_guards_compile():
    """Under inductor (whose kernels round otherwise than eager's: within
    1e-5), the counter, its math_cos input and the replayed floor decision
    compile into programs that follow eager's branches and values."""
    ours, theirs = Counter(), Counter()
    step = _against_eager(cosine_step, [((ours,), (theirs,))] * 14, tolerance=1e-5,
                          backend="inductor")
    assert ours.it == theirs.it == 14
    assert step._cache.builds <= 4 and not step._cache.per_value


def numpy_step(model, opt, x, y, it):
    """yolo's warm-up (np.interp), an exponential decay and a cosine in numpy."""
    warm = np.interp(it, [0, 4], [0.1, 1.0])
    factor = warm * np.exp(-it * 0.1) + 0.5 * (1 + np.cos(np.pi * it / 10))
    return scaled_update(model, opt, x, y, factor), factor


def test_numpy_on_an_argument_number_is_computed_on_the_host():
    step = _against_eager(numpy_step, [((i,), (i,)) for i in range(1, 7)])
    assert step._cache.builds == 2 and not step._cache.per_value
    names = {spec.name for spec in step.program.inputs if spec.kind is InputKind.NUMBER}
    assert {"np_interp", "np_exp", "np_cos"} <= names


def test_while_traced_numpy_functions_keep_their_keywords_and_attributes():
    """math_on_numbers only takes calls on a symbolic number: a ufunc called
    with out= on an array, and its own attributes, are numpy's."""
    from transpiler.capture.host_arithmetic import math_on_numbers
    out = np.empty(2)
    with math_on_numbers(lambda fn, args: None):
        assert np.exp(np.zeros(2), out=out) is out and (out == 1.0).all()
        assert np.exp.nin == 1 and np.add.reduce([1, 2]) == 3
        assert math.exp(0.0) == 1.0
    assert isinstance(np.exp, np.ufunc) and math.exp.__module__ == "math"


def imported_step(model, opt, x, y, it):
    """`from math import cos, pi`: the module's own name for math.cos."""
    factor = 0.5 * (1 + cos(pi * it / 10))
    return scaled_update(model, opt, x, y, factor), factor


def test_a_math_function_imported_by_name_is_computed_on_the_host():
    step = _against_eager(imported_step, [((i,), (i,)) for i in range(1, 7)])
    assert step._cache.builds == 2 and not step._cache.per_value
    assert cos is math.cos   # put back after each trace


def drawn_step(model, opt, x, y):
    """A weight drawn on the host and passed through math, by a branch on it."""
    lam = random.random()
    weight = math.exp(-lam) if lam < 0.5 else math.sqrt(lam)
    return scaled_update(model, opt, x, y, weight), weight


def test_math_on_a_host_draw_is_drawn_and_computed_again_on_every_call():
    random.seed(0)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    reference = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    step = transpile(drawn_step)
    for i in range(8):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)
        before = random.getstate()
        ours = step(model, opts[0], x, y)
        after = random.getstate()
        random.setstate(before)
        theirs = drawn_step(reference, opts[1], x, y)
        assert torch.equal(ours[0], theirs[0]) and ours[1] == theirs[1], i
        assert random.getstate() == after, i
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert step.traces == 2   # a program per branch


class ShadowEMA:
    """An EMA kept in a dict of tensors with a host update count and a warm-up
    decay `min(decay, (1 + n) / (10 + n))` (TensorFlow's num_updates, as
    EfficientDet's and many detection repos' PyTorch EMAs do)."""

    def __init__(self, model, decay=0.999):
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.decay, self.num_updates = decay, 0

    @torch.no_grad()
    def update(self, model):
        self.num_updates += 1
        decay = min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))
        for k, v in model.state_dict().items():
            self.shadow[k].mul_(decay).add_(v.detach(), alpha=1 - decay)


def ema_step(model, opt, x, y, ema, trainer):
    trainer.it += 1
    torch.manual_seed(1000 + trainer.it)   # a seed from the host counter, then dropout
    opt.zero_grad()
    loss = F.mse_loss(F.dropout(model(x), 0.2), y)
    loss.backward()
    opt.step()
    ema.update(model)
    return loss


def test_an_ema_of_shadow_tensors_with_a_counted_warm_up_trains_as_eager():
    """The counters lifted, the decay's min() replayed, the shadow tensors (a
    dict outside the arguments) written back in place: one trace for every call."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    reference = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    emas = [ShadowEMA(m) for m in (model, reference)]
    trainers = [Counter(), Counter()]
    step = transpile(ema_step)
    for i in range(8):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)
        ours = step(model, opts[0], x, y, emas[0], trainers[0])
        generator = torch.random.get_rng_state()
        theirs = ema_step(reference, opts[1], x, y, emas[1], trainers[1])
        assert torch.equal(ours, theirs), i
        assert torch.equal(generator, torch.random.get_rng_state()), i   # seeded, then drawn
        assert all(torch.equal(emas[0].shadow[k], emas[1].shadow[k]) for k in emas[0].shadow), i
        assert emas[0].num_updates == emas[1].num_updates == trainers[0].it == i + 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert step.traces == 1
