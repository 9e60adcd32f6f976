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

A number that decides control flow or a shape cannot be lifted: the trace
meets a guard on it (`if lr > 0.1`, `range(n)`, `float(x)`) or makes a tensor
whose shape depends on it (`x[:n]`). Then the argument is traced once per value
from then on, the programs kept bounded (program_cache.py).
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols


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


def as_input(value) -> torch.Tensor:
    """A lifted number's input: float64 for a float, int64 for an int."""
    return torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64)


def read_number(value: torch.Tensor, name: str, symbols: dict) -> torch.SymFloat | torch.SymInt:
    """What the traced step gets for a lifted number: the input's value as a
    symbolic Python number. `symbols` learns its symbol's name (guarded_numbers)."""
    number = value.item()
    symbols[number.node.expr] = name
    return number


def guarded_numbers(exc: BaseException, symbols: dict) -> set[str]:
    """The lifted numbers a failed trace guarded on (control flow on their value)."""
    while exc is not None:
        cond = getattr(exc, "cond", None)   # GuardOnDataDependentSymNode's expression
        if cond is not None:
            return {symbols[s] for s in cond.free_symbols if s in symbols}
        exc = exc.__cause__ or exc.__context__
    return set()


def check_lifted(gm: fx.GraphModule, names: dict[fx.Node, str]) -> None:
    """Refuse a trace where a tensor's layout depends on a lifted number.
    `names`: each lifted number's placeholder -> the argument's name."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        for v in val if isinstance(val, (tuple, list)) else [val]:
            if isinstance(v, torch.Tensor) and \
                    free_unbacked_symbols((v.shape, v.stride(), v.storage_offset())):
                culprits = _numbers_behind(node, names) or set(names.values())
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
