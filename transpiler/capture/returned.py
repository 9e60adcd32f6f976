"""What the step returns: a pytree whose leaves are tensors, None, Python
numbers and plain constants.

A tensor is an output of the program. A Python number the step computed from
tensors (`loss.item()`, `correct.sum().item()`, `losses.tolist()`) is a
symbolic number in the trace: the program outputs it as a 0-d tensor of a
dtype that holds it exactly (float64, int64, bool), or where it is a tensor's
value as read (`loss.item()`) that tensor, and the call reads it back with
`.item()`, the host read eager's `.item()` made. A plain value the trace
saw as a constant (a string, None, a size of a fixed shape, a number read from
a guarded host value) is returned as traced: the program is only chosen while
what it was computed from is as the trace read it. A value an LR scheduler
stepped in the step sets (group_reads.AfterTheCall) is read after the call.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..errors import TranspileError
from .group_reads import AfterTheCall


class LeafKind(enum.Enum):
    TENSOR = "tensor"
    NUMBER = "number"       # a symbolic number: an output, read back as a Python number
    CONSTANT = "constant"   # a plain value (None included), returned as traced
    AFTER = "after"         # a value an LR scheduler of the step sets: read after the call


# The dtype each kind of Python number is output in: every value of it exactly.
_NUMBER_DTYPES = {torch.SymFloat: torch.float64, torch.SymInt: torch.int64,
                  torch.SymBool: torch.bool}
_CONSTANTS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


@dataclasses.dataclass(frozen=True)
class ReturnedLeaf:
    kind: LeafKind
    dtype: torch.dtype | None = None   # NUMBER: the output's dtype
    value: Any = None                  # CONSTANT: the value; AFTER: what reads it


@dataclasses.dataclass(frozen=True)
class Returned:
    """The structure of what the step returns and how each leaf is made."""

    spec: pytree.TreeSpec
    leaves: tuple[ReturnedLeaf, ...]

    @classmethod
    def of(cls, result, step_name: str) -> "Returned":
        """The structure of a traced step's result; a leaf that is neither a
        tensor, a number nor a plain constant is refused."""
        values, spec = pytree.tree_flatten(result)
        leaves = []
        for value in values:
            if isinstance(value, torch.Tensor):
                leaves.append(ReturnedLeaf(LeafKind.TENSOR))
            elif type(value) in _NUMBER_DTYPES:
                leaves.append(ReturnedLeaf(LeafKind.NUMBER, _NUMBER_DTYPES[type(value)]))
            elif isinstance(value, AfterTheCall):
                leaves.append(ReturnedLeaf(LeafKind.AFTER, value=value.read))
            elif isinstance(value, _CONSTANTS):
                leaves.append(ReturnedLeaf(LeafKind.CONSTANT, value=value))
            else:
                raise TranspileError(
                    f"{step_name} returned a {type(value).__name__}; a transpiled step may "
                    "return tensors, Python numbers and strings (any pytree of them): return "
                    "the tensors it is computed from and build it outside the step")
        return cls(spec, tuple(leaves))

    @property
    def num_outputs(self) -> int:
        """How many of the program's first outputs are the step's."""
        return sum(leaf.kind in (LeafKind.TENSOR, LeafKind.NUMBER) for leaf in self.leaves)

    def outputs(self, result) -> list[torch.Tensor]:
        """The program's outputs for a result of this structure: its tensors, and
        its numbers as 0-d tensors (in the trace: ops on symbolic numbers; in an
        eager run that is compared with the program: its plain numbers)."""
        outs = []
        for leaf, value in zip(self.leaves, pytree.tree_leaves(result)):
            if leaf.kind is LeafKind.TENSOR:
                outs.append(value)
            elif leaf.kind is LeafKind.NUMBER:
                outs.append(torch.scalar_tensor(value, dtype=leaf.dtype, device="cpu"))
        return outs

    def rebuild(self, outputs) -> Any:
        """The step's result from the program's outputs (after the call's LR
        schedulers stepped)."""
        outs = iter(outputs)
        values = []
        for leaf in self.leaves:
            if leaf.kind is LeafKind.TENSOR:
                values.append(next(outs))
            elif leaf.kind is LeafKind.NUMBER:
                values.append(next(outs).item())
            elif leaf.kind is LeafKind.AFTER:
                values.append(leaf.value())
            else:
                values.append(leaf.value)
        return pytree.tree_unflatten(values, self.spec)


def returned_as_read(graph: fx.Graph, returned: Returned) -> None:
    """A number the step returns that is a tensor's value as read (`loss.item()`,
    an optimizer's value read from its input): the program returns that tensor
    and the call reads it with .item(). Exact under every backend (a compiled
    kernel takes a symbolic float as a float32), and no host read inside the
    program."""
    out = graph.output_node()
    results = list(out.args[0])
    for k, leaf in enumerate(leaf for leaf in returned.leaves
                             if leaf.kind in (LeafKind.TENSOR, LeafKind.NUMBER)):
        node = results[k]
        if leaf.kind is LeafKind.NUMBER and node.target is torch.ops.aten.scalar_tensor.default \
                and isinstance(node.args[0], fx.Node) \
                and node.args[0].target is torch.ops.aten._local_scalar_dense.default:
            results[k] = node.args[0].args[0]
    out.args = (type(out.args[0])(results),) + tuple(out.args[1:])
