"""Python arithmetic on symbolic numbers, evaluated on the host as the step's
own Python evaluates it.

A lifted number (numbers.py), a host draw (host_random.py) and what the step
computes from them are symbolic Python numbers in the trace. torch records
each operation on one in the graph being traced, in the step's order and
unchanged (`1 - (1 + s / g) ** -p` is operator.sub(1.0, operator.pow(...))),
but states a decision on one in sympy, which reorders and folds floating point
(`w * 2 - 0.1 > 0` becomes `0.1 < 2.0*w`): another computation, rounded
otherwise. Two things are taken from the recorded operations instead:

- a decision on such a number (`if decay < 0.9999`, `min(decay, max_decay)`,
  torch's own check of a float power's base) whose condition sympy cannot
  evaluate exactly: recorded while the step is traced (decisions_recorded),
  it becomes a number guard that replays those operations on Python numbers
  (numbers.take_number_guards), so a later call takes a program exactly where
  the step's Python would have taken the same branch;
- a function of `math` that torch has no symbolic form of, called on such a
  number (ultralytics' EMA: `decay * (1 - math.exp(-updates / tau))`, a cosine
  schedule's `math.cos(math.pi * step / total)`): computed on the host before
  every run, the argument's operations replayed and then the function, and
  given to the program as an input (numbers.MathSlot), as a host draw is.

A computation that reads anything else (a tensor's value, a shape) is not
replayed: it is traced as before.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import functools
import math
import sys
import threading
import types
from typing import Any, Callable

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from torch.fx.experimental.sym_node import SymNode
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._traceback import CapturedTraceback
import torch.fx as fx

from .user_code import called_by_user, is_user_file, library_dirs

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)

# Python's number functions a replay may call: operator's and math's, and
# torch's symbolic forms of Python's own conversions (which Python numbers pass
# through as Python computes them).
_TORCH_NUMBER_FUNCTIONS = frozenset({torch.sym_float, torch.sym_int, torch.sym_not,
                                     torch.sym_max, torch.sym_min, torch.sym_ite})


def _number_function(target) -> bool:
    module = getattr(target, "__module__", None)
    return module in ("_operator", "operator", "math") or target in _TORCH_NUMBER_FUNCTIONS \
        or (module == "torch" and getattr(target, "__name__", "").startswith("_sym_"))


class NotReplayable(Exception):
    """The number is computed from more than Python arithmetic on inputs."""


@dataclasses.dataclass(frozen=True)
class _Leaf:
    symbol: Any   # a number input's symbol


@dataclasses.dataclass(frozen=True)
class _Ref:
    index: int    # an earlier operation's result


@dataclasses.dataclass(frozen=True)
class Replay:
    """The operations that computed a symbolic number, as the trace recorded
    them: each (function, arguments), an argument a constant, an input's
    symbol (_Leaf) or an earlier result (_Ref); the last one's result is the
    number."""

    operations: tuple[tuple[Callable, tuple], ...]

    @staticmethod
    def of(node: fx.Node, leaf_symbol: Callable[[fx.Node], Any]) -> "Replay":
        """The operations behind `node`; leaf_symbol(node) is the symbol of a
        number input the node reads (its .item()), or None."""
        order: list[fx.Node] = []
        index: dict[fx.Node, int] = {}

        def visit(n: fx.Node):
            if n in index or leaf_symbol(n) is not None:
                return
            if n.op != "call_function" or not _number_function(n.target) or n.kwargs \
                    or not isinstance(n.meta.get("val"), _SYMBOLIC + (int, float, bool)):
                raise NotReplayable(f"{n.name} ({n.target}) is not Python arithmetic")
            for a in n.all_input_nodes:
                visit(a)
            index[n] = len(order)
            order.append(n)

        visit(node)
        if not order:   # the input itself
            return Replay(((_identity, (_Leaf(leaf_symbol(node)),)),))

        def arg(a):
            if isinstance(a, fx.Node):
                symbol = leaf_symbol(a)
                return _Leaf(symbol) if symbol is not None else _Ref(index[a])
            if isinstance(a, (int, float, bool)):
                return a
            raise NotReplayable(f"an argument {a!r} is not a number")
        return Replay(tuple((n.target, tuple(arg(a) for a in n.args)) for n in order))

    @property
    def symbols(self) -> set:
        return {a.symbol for _, args in self.operations for a in args if isinstance(a, _Leaf)}

    def evaluate(self, env: dict) -> Any:
        """The number, from each input's value (`env`: symbol -> a Python number)."""
        results: list = []
        for fn, args in self.operations:
            results.append(fn(*[env[a.symbol] if isinstance(a, _Leaf) else
                                results[a.index] if isinstance(a, _Ref) else a for a in args]))
        return results[-1]


def _identity(x):
    return x


def replay_of(number, leaf_symbol: Callable[[fx.Node], Any]) -> Replay:
    """The Replay of a symbolic number of the trace in progress."""
    mode = get_proxy_mode()
    thunk = mode and get_proxy_slot(number, mode.tracer, None)
    if thunk is None:
        raise NotReplayable(f"{number} has no operations recorded")
    return Replay.of(thunk.force().node, leaf_symbol)


def traced_value(shape_env, symbol):
    """The value an input's symbol holds for the call traced (what
    numbers.read_number told the shape environment), as a Python number."""
    value = shape_env.real_tensor_prop_unbacked_vals[symbol]
    return int(value) if value.is_Integer else float(value)


def number_input_symbol(node: fx.Node):
    """The symbol of a number input's value (`.item()` of its placeholder)."""
    if node.target is not torch.ops.aten._local_scalar_dense.default \
            or node.args[0].op != "placeholder":
        return None
    val = node.meta.get("val")
    return val.node.expr if isinstance(val, _SYMBOLIC) else None


# ----- decisions -------------------------------------------------------------


@dataclasses.dataclass
class Decision:
    """A condition on symbolic numbers the trace took: its operations (None
    where they read more than number inputs), the value Python takes for the
    call traced, the condition as sympy states it and where it was taken."""

    replay: Replay | None
    value: bool
    expr: Any
    stack: Any


class Decisions:
    """The decisions of one trace: by the runtime asserts they put in the
    shape environment, and those sympy decided without one (`unasserted`)."""

    def __init__(self):
        self.by_assert: dict[int, Decision] = {}
        self.unasserted: list[Decision] = []

    def of(self, runtime_assert) -> Decision | None:
        return self.by_assert.get(id(runtime_assert))


@contextlib.contextmanager
def decisions_recorded(decisions: Decisions):
    """While the step is traced: each condition Python takes on symbolic
    numbers (SymNode.guard_bool: `bool()`, a comparison in `min`; expect_true:
    torch._check) is recorded with its operations, replayed on the call's
    values: the branch taken is the one Python takes. sympy may decide a
    condition in floating point otherwise (it folds `s * 0.1 * 10 > s` to
    `1.0*s > s`, false for every s), with no runtime assert: such a decision
    is kept among `unasserted`, a number guard of its own."""
    thread = threading.get_ident()

    def recording(original):
        def decide(self, file, line):
            shape_env = self.shape_env
            asserts = shape_env.deferred_runtime_asserts if shape_env else {}
            before = {k: len(v) for k, v in asserts.items()}
            value = original(self, file, line)
            if get_proxy_mode() is None or threading.get_ident() != thread \
                    or not free_unbacked_symbols(self.expr):
                return value
            new = [ra for k, ras in asserts.items() for ra in ras[before.get(k, 0):]]
            try:   # now: the trace drops the condition's nodes when it ends
                replay = replay_of(torch.SymBool(self), number_input_symbol)
                python = bool(replay.evaluate({symbol: traced_value(shape_env, symbol)
                                               for symbol in replay.symbols}))
            except (NotReplayable, KeyError):
                replay, python = None, bool(value)
            decision = Decision(replay, python, self.expr, CapturedTraceback.extract(skip=1))
            for ra in new:
                decisions.by_assert[id(ra)] = decision
            if replay is not None and (not new or python != bool(value)):
                decisions.unasserted.append(decision)
            return python
        return decide

    originals = {name: getattr(SymNode, name) for name in ("guard_bool", "expect_true")}
    for name, original in originals.items():
        setattr(SymNode, name, recording(original))
    try:
        yield decisions
    finally:
        for name, original in originals.items():
            setattr(SymNode, name, original)


# ----- math's functions on symbolic numbers -----------------------------------

# math's functions of numbers that torch traces only by taking one value of
# their argument (math.floor, ceil and trunc are symbolic already)
MATH_FUNCTIONS = ("exp", "expm1", "log", "log1p", "log2", "log10", "sqrt", "pow", "cos", "sin",
                  "tan", "acos", "asin", "atan", "atan2", "cosh", "sinh", "tanh", "acosh",
                  "asinh", "atanh", "erf", "erfc", "gamma", "lgamma", "hypot", "fabs",
                  "degrees", "radians", "copysign", "fmod")
# numpy's, on a number (each gives a numpy float64, as on a Python number)
NUMPY_FUNCTIONS = ("exp", "expm1", "log", "log1p", "log2", "log10", "sqrt", "cbrt", "sin", "cos",
                   "tan", "arcsin", "arccos", "arctan", "arctan2", "sinh", "cosh", "tanh",
                   "hypot", "power", "interp")


class NumberFunction:
    """A function of math or numpy while the step is traced: a call goes
    through `on_call(fn, args, kwargs)`; anything else (a ufunc's `.nin`,
    `.reduce`) is the function's own. A user's global bound to one is not
    guarded (reads.py): it is the function the module imported."""

    def __init__(self, fn: Callable, on_call: Callable):
        self._fn, self._on_call = fn, on_call
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return self._on_call(self._fn, args, kwargs)

    def __getattr__(self, name: str):
        return getattr(self._fn, name)


def _this_module(filename: str) -> bool:
    return filename == __file__


@contextlib.contextmanager
def math_on_numbers(computed: Callable):
    """While the step is traced: a function of math (or numpy's, on a number:
    `np.exp(-step)`, `np.interp(it, xp, fp)`) the user's code calls on a
    symbolic number gives computed(fn, arguments), a number the program reads
    from an input (numbers.MathSlot); None there (an argument that is not
    replayed) leaves the function to take one value of it, as before."""
    thread = threading.get_ident()
    numpy = sys.modules.get("numpy")
    patched = [(math, name, getattr(math, name)) for name in MATH_FUNCTIONS if hasattr(math, name)]
    if numpy is not None:
        patched += [(numpy, name, getattr(numpy, name)) for name in NUMPY_FUNCTIONS]

    def on_numbers(fn, args: tuple, kwargs: dict):
        if not kwargs and any(isinstance(a, _SYMBOLIC) for a in args) \
                and called_by_user(_this_module) and threading.get_ident() == thread:
            number = computed(fn, args)
            if number is not None:
                return number
        return fn(*args, **kwargs)

    wrapped = {id(fn): NumberFunction(fn, on_numbers) for _, _, fn in patched}
    # `from math import exp, cos`: the user's modules' own names for them too
    patched += [(module, name, value) for module in _user_modules()
                for name, value in list(vars(module).items()) if id(value) in wrapped]
    for module, name, fn in patched:
        setattr(module, name, wrapped[id(fn)])
    try:
        yield
    finally:
        for module, name, fn in patched:
            setattr(module, name, fn)


# The Python number each kind of symbolic number stands for, as isinstance sees it.
_STANDS_FOR = {torch.SymFloat: 0.5, torch.SymInt: 1, torch.SymBool: True}
_ISINSTANCE = builtins.isinstance


def traced_isinstance(obj, classes) -> bool:
    """isinstance for the user's code while traced: a symbolic number is an
    instance of what the Python number it stands for is one of."""
    kind = _STANDS_FOR.get(type(obj))
    return _ISINSTANCE(obj, classes) or (kind is not None and _ISINSTANCE(kind, classes))


@contextlib.contextmanager
def numbers_as_python_types():
    """While the step is traced: the user's code asks isinstance() of a symbolic
    number (a `.item()`, a lifted counter, a symbolic size) as of the Python
    number it stands for, so that `assert isinstance(v, (float, int))`
    (torchvision's MetricLogger) or `isinstance(n, numbers.Number)` holds as in
    eager. Each of the user's modules gets its own `isinstance` global for the
    trace; everyone else's stays the builtin."""
    modules = [m for m in _user_modules() if "isinstance" not in vars(m)]
    for module in modules:
        module.isinstance = traced_isinstance
    try:
        yield
    finally:
        for module in modules:
            vars(module).pop("isinstance", None)


def _user_modules() -> list:
    """The user's own imported modules: a script run as __main__, and those
    whose files are user_code.is_user_file's."""
    libraries = library_dirs() + ("<",)
    return [module for name, module in list(sys.modules.items())
            if isinstance(module, types.ModuleType) and (
                name == "__main__" or is_user_file(vars(module).get("__file__") or "<",
                                                   libraries))]
