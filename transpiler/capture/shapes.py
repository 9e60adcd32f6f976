"""Symbolic dimensions of the batch: one program for every size of a dimension.

A step is first traced with the batch's shapes as they are. When a call
brings a batch tensor of another shape (program_cache.py), or where the user
declared dimensions dynamic (transpile(dynamic=...)), the step is traced again
with the batch's dimensions as symbols (make_fx's symbolic tracing on fake
tensors of a ShapeEnv). What the program assumes of them (`s0 % 2 == 0` for a
view that halves one, `s0 == s1` where two must match, `2 <= s0`: sizes 0
and 1 are traced as constants, as torch.compile does) the ShapeEnv records as
guards; a call whose shapes satisfy them runs the program, any other traces
again. Dimensions the model fixes (a feature dimension a Linear reads) become
constants with a guard, not symbols.

Parameters, buffers, gradients and optimizer state keep their static shapes, so
buckets, shards and every collective are the same whatever the batch's size:
ranks holding batches of different sizes run the same collectives, as under
DDP. Code that reads a symbolic size as a Python int (a pass, a compiler)
specializes it: that adds a guard, never a wrong program.
"""

from __future__ import annotations

import dataclasses

import torch
from torch._dynamo.source import LocalSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from ..program.program import InputKind, same_layout
from .slots import ArraySlot, DataSlot


def symbolic_inputs(inputs, dynamic: dict[int, frozenset[int]]) -> list:
    """What a symbolic trace sees of each input: a fake tensor of one
    ShapeEnv, the dims `dynamic` names of each batch leaf (by leaf index) as
    symbols, every other dimension (and every other input) static. A symbol
    is named after its input (its source), so listings are deterministic."""
    # duck_shape=False: two dimensions of equal size at the trace are not
    # assumed equal (a batch of 16 sequences of 16 tokens).
    mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=False), allow_non_fake_inputs=True)
    fakes = []
    for spec, slot, value in zip(inputs.specs, inputs.slots, inputs.values):
        dims = dynamic.get(slot.leaf, ()) if isinstance(slot, (DataSlot, ArraySlot)) else ()
        if dims and isinstance(value, torch.Tensor) and value.dim():
            context = StatelessSymbolicContext(dynamic_sizes=[
                DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC
                for d in range(value.dim())])
            # A stand-in of the batch's layout at offset 0: a batch that is a
            # view (a rank's chunk of a global batch) would otherwise give each
            # rank a program of its own (inductor's cache key differs).
            fakes.append(mode.from_tensor(same_layout(value), symbolic_context=context,
                                          source=LocalSource(spec.name)))
        elif isinstance(value, torch.Tensor):
            fakes.append(mode.from_tensor(value, static_shapes=True))
        else:
            fakes.append(value)
    return fakes


def is_symbolic(value) -> bool:
    """A fake tensor with a symbolic dimension."""
    return isinstance(value, torch.Tensor) and any(
        isinstance(s, torch.SymInt) and not s.node.is_constant() and s.node.expr.free_symbols
        for s in value.shape)


def _traced_symbolic(value) -> bool:
    """A fake tensor traced with a symbolic dimension, even one the trace then
    specialized to a single size."""
    return isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt)
                                                   for s in value.shape)


@dataclasses.dataclass
class ShapeGuards:
    """What a program traced with symbolic dimensions assumes of the batch's
    shapes: the ShapeEnv's guards over the symbolic batch inputs. Guards
    added after the trace (a pass or a compiler specializing a size) count
    too: the check is rebuilt when the ShapeEnv has more guards."""

    names: list[str]        # the batch inputs with a symbolic dimension
    slots: list             # the DataSlot or ArraySlot each is read from
    values: list            # their fake tensors in the trace
    shape_env: ShapeEnv
    _code: object = None
    _count: int = -1
    _fixed: list = dataclasses.field(default_factory=list)   # per input: _fixed_sizes

    @classmethod
    def of(cls, program, slots) -> ShapeGuards | None:
        """The guards of a captured program; None when no input is symbolic."""
        found = [(spec.name, slot, node.meta["val"])
                 for spec, slot, node in zip(program.inputs, slots, program.placeholders)
                 if spec.kind is InputKind.DATA and _traced_symbolic(node.meta["val"])]
        if not found:
            return None
        names, slots, values = map(list, zip(*found))
        return cls(names, slots, values, values[0].fake_mode.shape_env)

    def holds(self, leaves) -> bool:
        """Whether the batch tensors among `leaves` satisfy the guards."""
        if self._count != len(self.shape_env.guards):
            self._count = len(self.shape_env.guards)
            source = self.shape_env.produce_guards_expression(self.values)
            self._code = compile(source, "<shape guards>", "eval") if source else None
            self._fixed = [self._fixed_sizes(v) for v in self.values]
        args = [slot.read(leaves) for slot in self.slots]
        if self._unfit(args):
            return False
        return self._code is None or self.shape_env.evaluate_guards_expression(self._code, args)

    def _fixed_sizes(self, value) -> list[tuple[int, int]]:
        """(dimension, size) of each dimension the program holds at one size: a
        symbol the trace specialized (it read the size as a number: `range(n)`,
        `x.shape[0] == 4`), which the ShapeEnv's guards do not check, as a
        static dimension is not theirs to check."""
        fixed = []
        for d, size in enumerate(value.shape):
            expr = self.shape_env.replace(size.node.expr) if isinstance(size, torch.SymInt) \
                else size
            if not isinstance(size, torch.SymInt) or expr.is_number:
                fixed.append((d, int(expr)))
        return fixed

    def _unfit(self, args) -> list[str]:
        """The fixed sizes the arguments do not have, as guards read."""
        return [f"{name}.size()[{d}] == {n}"
                for name, a, fixed in zip(self.names, args, self._fixed)
                for d, n in fixed if a.shape[d] != n]

    def describe(self, leaves) -> str:
        """Why a call's shapes fail the guards, in one line."""
        shapes = ", ".join(f"{name} {list(slot.read(leaves).shape)}"
                           for name, slot in zip(self.names, self.slots))
        traced = ", ".join(f"{name} {list(v.shape)}" for name, v in zip(self.names, self.values))
        args = [slot.read(leaves) for slot in self.slots]
        failed = self._unfit(args) + [
            guard for guard in self.shape_env.produce_guards(
                self.values, [LocalSource(f"t{i}") for i in range(len(self.values))])
            if not self.shape_env.evaluate_guards_expression(guard, args)]
        text = " and ".join(failed) or "none"
        for i, name in enumerate(self.names):   # the guards name input i L['t<i>']
            text = text.replace(f"L['t{i}']", name)
        return (f"the batch's shapes ({shapes}) are outside what the program traced for "
                f"({traced}) assumes: {text}")
