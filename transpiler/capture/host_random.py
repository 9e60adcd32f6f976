"""Values the step draws on the host: Python's `random` (the module's functions
and any random.Random), numpy's (numpy.random's functions, and Generator or
RandomState objects the step reaches), and the clocks of `time`.

Eager draws a new value on every call; a trace would bake the first one in. So
while the step is traced, each draw made from the user's code is recorded (the
function, its arguments) and the value it returns (drawn for real: the
generator advances as eager's does) is given to the step as a program input: a
number becomes a symbolic Python number read from a 0-d float64 or int64 input
(as a lifted number is, numbers.py), so the program computes with it exactly as
Python does; an array becomes an array input (torch.from_numpy gives the traced
tensor, outside.py). Before every later run the runtime draws the same calls
again, in the same order, and feeds the values: each call's values, and the
generators' states after it, are eager's. A decision on a drawn number (`if
random.random() < p`, `max(lam, 1 - lam)`) is a number guard, as one on a
lifted number: the trace takes this call's branch, and a later call first draws
its values (Draws.peek, the generators put back after) to choose the program of
its outcome, tracing another where none holds; that program draws what its
branch draws. A decision the host cannot evaluate as Python does (a sum of
floats), or one on a drawn array, is refused, naming the draw and the line.
Draws made by torch's or numpy's own code are not the step's and pass through.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
import sys
import threading
import time
import types
from typing import Any, Callable

import torch

from ..errors import TranspileError
from .observed_arrays import observed
from .user_code import called_by_user, step_name, user_line

_RANDOM_METHODS = ("random", "uniform", "triangular", "randint", "randrange", "choice",
                   "gauss", "normalvariate", "lognormvariate", "expovariate", "vonmisesvariate",
                   "gammavariate", "betavariate", "paretovariate", "weibullvariate",
                   "getrandbits", "binomialvariate", "choices", "sample", "shuffle",
                   "randbytes")
_NUMPY_FUNCTIONS = ("random", "rand", "randn", "randint", "random_integers", "random_sample",
                    "ranf", "sample", "uniform", "normal", "standard_normal", "beta",
                    "binomial", "choice", "permutation", "shuffle", "poisson", "exponential",
                    "gamma", "dirichlet", "laplace", "lognormal", "multinomial",
                    "multivariate_normal", "geometric", "gumbel", "logistic", "pareto",
                    "power", "rayleigh", "standard_cauchy", "standard_exponential",
                    "standard_gamma", "standard_t", "triangular", "vonmises", "wald",
                    "weibull", "zipf", "chisquare", "f", "hypergeometric", "negative_binomial",
                    "noncentral_chisquare", "noncentral_f", "bytes", "integers")
_CLOCKS = ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic",
           "monotonic_ns", "process_time", "process_time_ns")


@dataclasses.dataclass
class Draw:
    call: Callable     # draws again: the function, bound to its generator
    args: tuple
    kwargs: dict
    what: str          # "random.uniform(0.5, 1.5) at train.py:12 (...)"
    clock: bool = False   # a clock of `time`: its value depends on when it is read


class Draws:
    """The host draws of one program, in the step's order. for_run() gives a
    run its values: the trace's for the run of the call that traced it, drawn
    again for every later one; DrawSlot reads each value."""

    def __init__(self):
        self.draws: list[Draw] = []
        self.values: list[Any] = []
        # each generator drawn from: (it, get its state, set it, its state before)
        self._sources: dict[int, tuple[Any, Callable, Callable, Any]] = {}
        self._traced = True   # the values are the trace's, for the run of its own call

    def __bool__(self) -> bool:
        return bool(self.draws)

    def for_run(self) -> list:
        """This run's values; returns the generators' states before they were
        drawn (verify has the eager step draw them again)."""
        if self._traced:
            self._traced = False
            return [(set_, before) for _, _, set_, before in self._sources.values()]
        before = self.states()
        self.values = [d.call(*d.args, **d.kwargs) for d in self.draws]
        return before

    def peek(self) -> None:
        """Draw this call's values for the program's number guards to read
        (a decision on a drawn value: a program per outcome, numbers.py), then
        put the generators back: the run draws the same values again
        (for_run). The call that traced the program reads the trace's."""
        if self._traced:
            return
        before = self.states()
        try:
            self.values = [d.call(*d.args, **d.kwargs) for d in self.draws]
        finally:
            self.restore(before)

    def note_state(self, generator, get: Callable, set_: Callable) -> None:
        """Remember a generator's state before its first draw of this trace."""
        if id(generator) not in self._sources:
            self._sources[id(generator)] = (generator, get, set_, get())

    def rewind(self) -> None:
        """Put every generator drawn from back where it was before this
        trace's draws (a trace that is thrown away must not have drawn)."""
        for _, _, set_, before in self._sources.values():
            set_(before)

    def states(self) -> list:
        """Every generator's state now, for restore() (verify draws twice)."""
        return [(set_, get()) for _, get, set_, _ in self._sources.values()]

    @staticmethod
    def restore(states: list) -> None:
        for set_, state in states:
            set_(state)


@dataclasses.dataclass(frozen=True)
class DrawSlot:
    """A drawn value, read from the draws replayed for this run."""

    draws: Draws
    index: int

    def number(self, leaves):
        """The value a number guard reads (Draws.peek drew it for this call)."""
        return self.draws.values[self.index]

    def read(self, leaves):
        value = self.draws.values[self.index]
        if isinstance(value, (float, int)):
            return torch.tensor(value, dtype=torch.float64 if isinstance(value, float)
                                else torch.int64)
        return _FROM_NUMPY(value)


# torch.from_numpy itself: outside.py converts arrays through it while tracing.
_FROM_NUMPY = torch.from_numpy


class _Recording:
    """Patches the host's generators for one trace; each draw from the user's
    code goes through draw()."""

    def __init__(self, step_fn, draws: Draws, new_input: Callable):
        self.step_fn, self.draws, self.new_input = step_fn, draws, new_input
        self.depth = 0   # inside a recorded draw: the generator's own calls pass through
        # the patches are the process's: another thread's draws (a loader's) are its own
        self.thread = threading.get_ident()

    def wrap(self, original: Callable, name: str, bound: Callable, state,
             clock: bool = False) -> Callable:
        """A recording version of a drawing function; `bound(*args)` draws the
        same value again later; `state` is (generator, get, set) or None."""
        recording = self

        @functools.wraps(original)
        def draw(*args, **kwargs):
            if recording.depth or threading.get_ident() != recording.thread \
                    or not _from_user_code():
                return original(*args, **kwargs)
            recording.depth += 1
            try:
                if state is not None:
                    recording.draws.note_state(*state)
                value = original(*args, **kwargs)
            finally:
                recording.depth -= 1
            return recording.record(name, bound, args, kwargs, value, clock)
        return draw

    def record(self, name: str, bound: Callable, args: tuple, kwargs: dict, value,
               clock: bool = False):
        where = user_line(self.step_fn)
        shown = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
        what = f"{name}({shown}){where}"
        if any(isinstance(a, (torch.SymInt, torch.SymFloat, torch.Tensor))
               for a in (*args, *kwargs.values())):
            raise TranspileError(
                f"{step_name(self.step_fn)} draws {what} with an argument computed in the "
                "step: a host draw is replayed before the program runs, so its arguments must "
                "be known then; draw on the host outside the step and pass the value as an "
                "argument, or draw with torch (torch.rand, torch.distributions)")
        if not _replayable(value):
            raise TranspileError(
                f"{step_name(self.step_fn)} draws {what}, which gives a "
                f"{type(value).__name__}: only numbers and arrays drawn on the host are "
                "replayed on every call; draw it outside the step and pass it as an argument")
        self.draws.draws.append(Draw(bound, args, kwargs, what, clock))
        self.draws.values.append(value)
        if not isinstance(value, (float, int)):   # an array: usable only through torch
            value = observed(value, functools.partial(_refuse_host_computation,
                                                      step_name(self.step_fn), what))
        return self.new_input(value, f"draw{len(self.draws.draws) - 1}", what,
                              DrawSlot(self.draws, len(self.draws.draws) - 1))


def _refuse_host_computation(step: str, what: str):
    """A drawn array is usable only through torch: any computation with it in
    numpy, on the host, would be done once, at the trace."""
    raise TranspileError(
        f"{step} computes on the host with an array it draws ({what}): that would be "
        "computed once, while the step is traced, and reused; convert it with "
        "torch.from_numpy and compute with torch, or draw outside the step and pass the "
        "result as an argument")


def _replayable(value) -> bool:
    numpy = sys.modules.get("numpy")
    return (type(value) in (float, int)) or (numpy is not None and isinstance(value, numpy.ndarray)
                                             and value.dtype != object)


# The standard library's random and this module: their frames call the
# generators on the user's behalf (numpy's too).
_GENERATOR_FILES: tuple[str, ...] = (random.__file__, __file__)


def _from_user_code() -> bool:
    return called_by_user(lambda f: f in _GENERATOR_FILES or _is_numpy(f))


def _is_numpy(filename: str) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and filename.startswith(numpy.__path__[0])


@contextlib.contextmanager
def host_draws_recorded(step_fn, draws: Draws, new_input: Callable):
    """While the step is traced: record its draws (new_input(value, name,
    what, slot) gives the traced value of each)."""
    rec = _Recording(step_fn, draws, new_input)
    undo: list[tuple[Any, str, Any]] = []

    def patch(owner, name, value):
        undo.append((owner, name, owner.__dict__.get(name, _ABSENT)
                     if isinstance(owner, type) else getattr(owner, name)))
        (type.__setattr__ if isinstance(owner, type) else setattr)(owner, name, value)

    instance = random._inst
    state = (instance, instance.getstate, instance.setstate)
    for name in _RANDOM_METHODS:
        original = getattr(random.Random, name, None)
        if original is None:
            continue
        patch(random.Random, name, _method(rec, original, f"random.{name}"))
        patch(random, name, getattr(instance, name))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        global_state = numpy.random.mtrand._rand
        state = (global_state, global_state.get_state, global_state.set_state)
        for name in _NUMPY_FUNCTIONS:
            original = getattr(numpy.random, name, None)
            if callable(original):
                patch(numpy.random, name, rec.wrap(original, f"np.random.{name}", original, state))
    for name in _CLOCKS:
        original = getattr(time, name)
        patch(time, name, rec.wrap(original, f"time.{name}", original, None, clock=True))
    try:
        yield rec
    finally:
        for owner, name, value in reversed(undo):
            if value is _ABSENT:
                type.__delattr__(owner, name)
            elif isinstance(owner, type):
                type.__setattr__(owner, name, value)
            else:
                setattr(owner, name, value)


_ABSENT = object()


def _method(rec: _Recording, original: Callable, name: str) -> Callable:
    """A recording method of random.Random: draws on its own instance."""
    def method(self, *args, **kwargs):
        bound = types.MethodType(original, self)
        state = (self, self.getstate, self.setstate)
        return rec.wrap(bound, name, bound, state)(*args, **kwargs)
    return method


def source_stand_in(rec: _Recording, value, _name: str) -> Any:
    """A recording stand-in for a numpy Generator or RandomState the step
    reaches (an attribute, a global): their methods cannot be patched. None
    for any other value."""
    numpy = sys.modules.get("numpy")
    if numpy is None or not isinstance(value, (numpy.random.Generator,
                                               numpy.random.RandomState)):
        return None
    return _GeneratorProxy(rec, value)


class _GeneratorProxy:
    def __init__(self, rec: _Recording, generator):
        self._rec, self._generator = rec, generator

    def __getattr__(self, name):
        attr = getattr(self._generator, name)
        if not callable(attr) or name.startswith("_"):
            return attr
        generator = self._generator
        bit = getattr(generator, "bit_generator", None)
        state = ((generator, lambda: bit.state, lambda s: setattr(bit, "state", s))
                 if bit is not None else (generator, generator.get_state, generator.set_state))
        return self._rec.wrap(attr, f"{type(generator).__name__}.{name}", attr, state)
