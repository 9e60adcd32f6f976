"""Python numbers among the step's arguments whose value changes between calls.

A float or int argument (or numpy's float64, a float: `2. / (1. + np.exp(-10 *
p)) - 1`) is part of the signature: a trace bakes its value in.
When a call brings a new value, the argument is lifted: the step is traced
again with the number read from a 0-d tensor input (float64 for a float, int64
for an int: Python's own widths) through .item(). The trace then holds it as a
symbolic Python number (an unbacked SymFloat or SymInt), so the program
computes exactly what the step computes with a Python number: the arithmetic
between numbers in Python's precision, and the same type promotion and rounding
where it meets a tensor (a SymFloat is a scalar operand, not a tensor). Every
later value runs that program.

A number the step reads outside its arguments (a module's attribute, a
config's field, a global, a closure cell: reads.py guards it by value) is
lifted the same way after its value changes between calls: the trace reads it
from a 0-d input filled through the same host path on every call, and its guard
becomes one on its type.

A lifted number may decide control flow (`if step > warmup`, `(it - 1) %
accum == 0`): the trace takes the branch this call's value takes and the
program assumes it, a number guard (the condition as torch's shape environment
states it, over the numbers' symbols) checked on the host before every run: a
later value that decides otherwise traces again, a program per outcome
(NumberGuard). Integer arithmetic, divisions, and a number compared with a
constant or another number (`min(1.0, step / warmup)`) are evaluated as torch
states them, which Python evaluates alike; a sum or product in floating point
(`1 - (1 + s / g) ** -p > 0.9999`, which torch restates as another
computation that may round otherwise) replays the step's own operations
(ReplayedGuard, host_arithmetic.py). A function of math or numpy on a lifted
number is an input computed on the host (MathSlot).

A number converted (`float(w)`, `range(n)`) or that decides a shape cannot be
lifted: the trace takes one value of it, or makes a tensor whose shape depends
on it (`x[:n]`). Then the number is traced once per value from then on, the programs
kept bounded (program_cache.py).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable
from unittest import mock

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols
from torch.utils._sympy import functions as sympy_functions
from torch.utils._sympy.interp import sympy_interp
from torch.utils._sympy.reference import PythonReferenceAnalysis
from torch.utils._sympy.symbol import SymT, symbol_is_type

from .host_arithmetic import Decision, Decisions, Replay


class NotLiftable(Exception):
    """The lifted trace depends on the value of the numbers `names` beyond arithmetic."""

    def __init__(self, names: set[str], reason: str):
        super().__init__(reason)
        self.names = names


def is_number(value) -> bool:
    """A Python float or int, or numpy's float64, which computes as a Python
    float (a bool decides control flow: never lifted). numpy is not imported
    for it: a step given a numpy number has imported it."""
    if type(value) in (int, float):
        return True
    numpy = sys.modules.get("numpy")
    return numpy is not None and type(value) is numpy.float64


@dataclasses.dataclass(frozen=True)
class NumberSlot:
    """A lifted number among the step's arguments, fed as a 0-d CPU tensor of
    Python's width (a CPU scalar, as a Python number is to every kernel)."""

    leaf: int

    def number(self, leaves):
        return leaves[self.leaf]

    def read(self, leaves):
        return as_input(self.number(leaves))


@dataclasses.dataclass(frozen=True)
class ReachedNumberSlot:
    """A lifted number the step reads outside its arguments: read through its
    host path (reads.Place) on every call."""

    place: object

    def number(self, leaves):
        return self.place.read()

    def read(self, leaves):
        return as_input(self.number(leaves))


@dataclasses.dataclass(frozen=True)
class OptimizerValueSlot(ReachedNumberSlot):
    """A value of an optimizer's param group that the step's own Python may
    read (group_reads.py): made for every such value, kept as an input only
    where the program reads it."""


@dataclasses.dataclass(frozen=True)
class MathSlot:
    """A function of math (or numpy's) on numbers the program's inputs hold:
    computed on the host for each call, each argument replayed from its
    inputs' values (`sources`: symbol -> the slot that reads it;
    host_arithmetic.py)."""

    fn: Callable
    arguments: tuple   # a Replay, or a plain number
    sources: tuple     # ((symbol, slot), ...)

    def number(self, leaves):
        return self.of({symbol: slot.number(leaves) for symbol, slot in self.sources})

    def of(self, env: dict):
        """The number, from each source's value (symbol -> a Python number)."""
        return self.fn(*[a.evaluate(env) if isinstance(a, Replay) else a
                         for a in self.arguments])

    def read(self, leaves):
        return as_input(self.number(leaves))


def as_input(value) -> torch.Tensor:
    """A lifted number's input: float64 for a float, int64 for an int."""
    return torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64)


def read_number(value: torch.Tensor, name: str, symbols: dict, real) -> torch.SymFloat | torch.SymInt:
    """What the traced step gets for a lifted number: the input's value as a
    symbolic Python number. `symbols` learns its symbol's name (guarded_numbers);
    the shape environment learns its value `real`, which a condition on it
    takes (a number guard: take_number_guards)."""
    number = value.item()
    symbols[number.node.expr] = name
    number.node.shape_env.set_real_tensor_prop_unbacked_vals(number.node.expr, real)
    return number


def conditions_unlogged():
    """torch logs a warning for each condition it takes from a value it was
    given (read_number's): the log says what was traced instead."""
    return mock.patch.object(ShapeEnv, "_log_real_tensor_propagation", lambda *a: None)


@dataclasses.dataclass(frozen=True)
class NumberGuard:
    """What a program assumes of lifted numbers: `expr` over their symbols
    holds, as it did for the call it was traced on; `slots` reads each
    symbol's number for a call, `where` is the user's line that decided."""

    expr: sympy.Basic
    slots: tuple   # (symbol, its name, NumberSlot or ReachedNumberSlot)
    where: str

    def holds(self, leaves) -> bool:
        env = {symbol: slot.number(leaves) for symbol, _, slot in self.slots}
        return bool(sympy_interp(PythonReferenceAnalysis, env, self.expr))

    def condition(self) -> str:
        """The condition over the numbers' names."""
        return str(self.expr.xreplace({symbol: sympy.Symbol(name)
                                       for symbol, name, _ in self.slots}))

    def describe(self, leaves) -> str:
        values = ", ".join(f"{name} = {slot.number(leaves)!r}" for _, name, slot in self.slots)
        return f"{self.condition()}{self.where} no longer holds ({values})"


@dataclasses.dataclass(frozen=True)
class ReplayedGuard(NumberGuard):
    """A condition in floating point the step's Python took (`expr`, as
    sympy states it, is shown): checked by replaying the step's own operations
    on the call's numbers (host_arithmetic.Replay), which must give `taken`."""

    replay: Replay = None
    taken: bool = True

    def holds(self, leaves) -> bool:
        env = {symbol: slot.number(leaves) for symbol, _, slot in self.slots}
        return bool(self.replay.evaluate(env)) is self.taken


def take_number_guards(shape_env: ShapeEnv, symbols: dict, slots: dict, leaves,
                       where: Callable, decided_on_values: bool,
                       decisions: Decisions | None = None) -> list[NumberGuard]:
    """The conditions a trace assumed of its lifted numbers (`symbols`: each
    one's symbol -> its input's name; `slots`: name -> its slot), taken out of
    the shape environment's deferred runtime asserts (where read_number's
    values make torch put them) as number guards, each checked to hold for
    `leaves`, the call traced. A condition that also reads a tensor's value
    stays, a decision (decisions.py) where the trace `decided_on_values`. One
    that sympy cannot evaluate exactly on the host is replayed as the step's
    Python computed it, where `decisions` recorded it (a ReplayedGuard); else
    it raises NotLiftable."""
    guards = []
    for ras in shape_env.deferred_runtime_asserts.values():
        kept = []
        for ra in ras:
            mine = sorted(ra.expr.free_symbols & symbols.keys(), key=str)
            if not mine:
                kept.append(ra)
                continue
            names = {symbols[symbol] for symbol in mine}
            line = where(ra)
            if ra.expr.free_symbols - symbols.keys():
                if decided_on_values:
                    kept.append(ra)
                    continue
                raise NotLiftable(names, f"the step decides on {ra.expr}{line}, which reads "
                                         "other values than the lifted numbers")
            guard = NumberGuard(ra.expr, tuple((s, symbols[s], slots[symbols[s]]) for s in mine),
                                line)
            if not _exact(ra.expr):
                guard = _replayed(decisions and decisions.of(ra), symbols, slots, line)
            if guard is None or not guard.holds(leaves):
                raise NotLiftable(names, f"the step decides on {ra.expr}{line}, a condition "
                                         "computed in floating point")
            guards.append(guard)
        ras[:] = kept
    for decision in decisions.unasserted if decisions else ():   # decided by sympy alone
        guard = _replayed(decision, symbols, slots, where(decision))
        if guard is not None:
            guards.append(guard)
    return guards


def _replayed(decision: Decision | None, symbols: dict, slots: dict,
              line: str) -> ReplayedGuard | None:
    """The guard of a condition the step took, replayed (None where it was not
    recorded, or reads more than numbers the program's inputs hold)."""
    if decision is None or decision.replay is None or not decision.replay.symbols <= symbols.keys():
        return None
    read = sorted(decision.replay.symbols, key=str)
    return ReplayedGuard(decision.expr, tuple((s, symbols[s], slots[symbols[s]]) for s in read),
                         line, decision.replay, decision.value)


# Integer functions whose results Python computes exactly (sympy_interp's
# reference analysis evaluates each as Python does).
_INTEGER_OPS = (sympy.Add, sympy.Mul, sympy.Max, sympy.Min, sympy.Abs, sympy.Mod,
                sympy_functions.Max, sympy_functions.Min, sympy_functions.Mod,
                sympy_functions.PythonMod, sympy_functions.FloorDiv)


def _exact(expr: sympy.Basic) -> bool:
    """Whether a condition evaluates on the host as the step's own Python did:
    relations between integer arithmetic, divisions as Python divides, lone
    numbers and constants. A sum or product of floats is not: sympy reorders
    and folds them, and torch restates a condition by moving its terms (`w * 2
    - 0.1 > 0` becomes `0.1 < 2.0*w`), another computation, rounded otherwise."""
    if isinstance(expr, (sympy.And, sympy.Or, sympy.Not)):
        return all(_exact(a) for a in expr.args)
    if isinstance(expr, sympy.core.relational.Relational):
        return all(_as_python(side) for side in expr.args)
    return False


def _as_python(expr: sympy.Basic) -> bool:
    """A number computed as Python computes it (`step / warmup`, `float(n) / 1000.0`)."""
    if expr.is_Number or expr.is_Symbol or _integral(expr):
        return True
    if isinstance(expr, (sympy_functions.IntTrueDiv, sympy_functions.ToFloat)):
        return all(_integral(a) for a in expr.args)
    return isinstance(expr, sympy_functions.FloatTrueDiv) and all(map(_as_python, expr.args))


def _integral(expr: sympy.Basic) -> bool:
    if expr.is_Integer:
        return True
    if expr.is_Symbol:
        return symbol_is_type(expr, SymT.UNBACKED_INT)
    if isinstance(expr, sympy.Pow):
        return _integral(expr.base) and expr.exp.is_Integer and expr.exp >= 0
    return isinstance(expr, _INTEGER_OPS) and all(_integral(a) for a in expr.args)


def guarded_numbers(exc: BaseException, symbols: dict) -> set[str]:
    """The lifted numbers a failed trace guarded on (control flow on their value)."""
    while exc is not None:
        cond = getattr(exc, "cond", None)   # GuardOnDataDependentSymNode's expression
        if cond is not None:
            return {symbols[s] for s in cond.free_symbols if s in symbols}
        exc = exc.__cause__ or exc.__context__
    return set()


def check_lifted(gm: fx.GraphModule, names: dict[fx.Node, str], suspects: set[str]) -> None:
    """Refuse a trace where a tensor's layout depends on a lifted number.
    `names`: each lifted number's placeholder -> the argument's name; where
    the numbers behind a layout cannot be told, the `suspects` are named."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        for v in val if isinstance(val, (tuple, list)) else [val]:
            if isinstance(v, torch.Tensor) and \
                    free_unbacked_symbols((v.shape, v.stride(), v.storage_offset())):
                culprits = _numbers_behind(node, names) or suspects
                raise NotLiftable(culprits, f"the shape of {node.name} ({node.target}) depends "
                                            f"on {' and '.join(sorted(culprits))}")


def _numbers_behind(node: fx.Node, names: dict[fx.Node, str]) -> set[str]:
    """The lifted numbers the symbolic (non-tensor) arguments of `node` are
    computed from."""
    found, todo, seen = set(), [a for a in node.all_input_nodes if _symbolic(a)], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.target is torch.ops.aten._local_scalar_dense.default and n.args[0] in names:
            found.add(names[n.args[0]])
        todo += [a for a in n.all_input_nodes if _symbolic(a)]
    return found


def _symbolic(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymFloat, torch.SymInt, torch.SymBool))
