"""What the step returns: a pytree whose leaves are tensors, None, Python
numbers and plain constants.

A tensor is an output of the program. A Python number the step computed from
tensors (`loss.item()`, `correct.sum().item()`, `losses.tolist()`) is a
symbolic number in the trace: the program outputs it as a 0-d tensor of a
dtype that holds it exactly (float64, int64, bool), or where it is a tensor's
value as read (`loss.item()`) that tensor, and the call reads it back with
`.item()`, the host read eager's `.item()` made. A tensor's `.numpy()` is
that tensor, output, and the call returns its `.numpy()` (ReturnedArray); the
step may only return it. A plain value the trace
saw as a constant (a string, None, a size of a fixed shape, a number read from
a guarded host value) is returned as traced: the program is only chosen while
what it was computed from is as the trace read it. A value an LR scheduler
stepped in the step sets (group_reads.AfterTheCall) is read after the call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import operator
import sys
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
import torch.utils._pytree as pytree

from ..errors import TranspileError
from .group_reads import AfterTheCall
from .user_code import is_user_file, step_name, user_line
from .value_text import eager_array_text


class LeafKind(enum.Enum):
    TENSOR = "tensor"
    NUMBER = "number"       # a symbolic number: an output, read back as a Python number
    ARRAY = "array"         # a tensor's .numpy(): the tensor, output, returned as .numpy()
    CONSTANT = "constant"   # a plain value (None included), returned as traced
    AFTER = "after"         # a value an LR scheduler of the step sets: read after the call


# The dtype each kind of Python number is output in: every value of it exactly.
_NUMBER_DTYPES = {torch.SymFloat: torch.float64, torch.SymInt: torch.int64,
                  torch.SymBool: torch.bool}
# ... and a plain number the step leaves on the host beside them (appended.py)
_WRITTEN_DTYPES = {**_NUMBER_DTYPES, float: torch.float64, int: torch.int64, bool: torch.bool}
_CONSTANTS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_OUTPUTS = (LeafKind.TENSOR, LeafKind.NUMBER, LeafKind.ARRAY)   # the leaves the program outputs


@dataclasses.dataclass(frozen=True)
class ReturnedLeaf:
    kind: LeafKind
    dtype: torch.dtype | None = None   # NUMBER: the output's dtype
    value: Any = None                  # CONSTANT: the value; AFTER: what reads it
    # NUMBER: numpy's scalar type where the step's Python computes it with numpy
    # (`warm * np.exp(-it)` is a numpy float64), else None (a Python number)
    numpy_type: Any = None

    def output(self, value) -> torch.Tensor:
        """The program's output for a value of this leaf (a TENSOR, ARRAY or NUMBER)."""
        if self.kind is LeafKind.ARRAY:
            return value.tensor if isinstance(value, ReturnedArray) else torch.from_numpy(value)
        if self.kind is LeafKind.NUMBER:
            return torch.scalar_tensor(value, dtype=self.dtype, device="cpu")
        return value

    def value_of(self, output: torch.Tensor):
        """The value this leaf stands for, from a run's output."""
        if self.kind is LeafKind.ARRAY:
            return output.numpy()
        if self.kind is LeafKind.NUMBER:
            return output.item() if self.numpy_type is None else self.numpy_type(output.item())
        return output


@dataclasses.dataclass(frozen=True)
class Returned:
    """The structure of what the step returns and how each leaf is made."""

    spec: pytree.TreeSpec
    leaves: tuple[ReturnedLeaf, ...]
    # the values the step printed (text_values.py): outputs after the result's
    shown: tuple[ReturnedLeaf, ...] = ()
    # the symbolic numbers the step left on the host (host_state.py) and in its
    # arguments' containers (argument_writes.py), outputs after the printed
    # ones: each put where the step wrote it after every run
    written: tuple[ReturnedLeaf, ...] = ()
    writes: tuple = ()   # where each goes (its put_back), in the same order

    @classmethod
    def of(cls, result, step_name: str, shown: tuple = (), writes: tuple = (),
           numpy_type: Callable = lambda number: None) -> "Returned":
        """The structure of a traced step's result; a leaf that is neither a
        tensor, a number nor a plain constant is refused. `shown`: the
        tensors and symbolic numbers it printed; `writes`: the host writes of
        symbolic numbers it made; numpy_type(number): the numpy scalar type
        the step's Python gives a symbolic number, or None."""
        def number(value) -> ReturnedLeaf:
            return ReturnedLeaf(LeafKind.NUMBER, _WRITTEN_DTYPES[type(value)],
                                numpy_type=numpy_type(value))
        values, spec = pytree.tree_flatten(result)
        leaves = []
        for value in values:
            if isinstance(value, torch.Tensor):
                leaves.append(ReturnedLeaf(LeafKind.TENSOR))
            elif isinstance(value, ReturnedArray):
                leaves.append(ReturnedLeaf(LeafKind.ARRAY))
            elif type(value) in _NUMBER_DTYPES:
                leaves.append(number(value))
            elif isinstance(value, AfterTheCall):
                leaves.append(ReturnedLeaf(LeafKind.AFTER, value=value.read))
            elif isinstance(value, _CONSTANTS):
                leaves.append(ReturnedLeaf(LeafKind.CONSTANT, value=value))
            else:
                raise TranspileError(
                    f"{step_name} returned a {type(value).__name__}; a transpiled step may "
                    "return tensors, Python numbers and strings (any pytree of them): return "
                    "the tensors it is computed from and build it outside the step")
        return cls(spec, tuple(leaves), tuple(
            ReturnedLeaf(LeafKind.TENSOR) if isinstance(v, torch.Tensor) else number(v)
            for v in shown), tuple(ReturnedLeaf(LeafKind.TENSOR) if isinstance(w.after, torch.Tensor)
                                   else number(w.after) for w in writes), tuple(writes))

    @property
    def user_outputs(self) -> int:
        """How many of the program's first outputs are the step's result's."""
        return sum(leaf.kind in _OUTPUTS for leaf in self.leaves)

    @property
    def num_outputs(self) -> int:
        """How many of the program's first outputs are the step's: its result's,
        then the values it printed, then the numbers it left on the host."""
        return self.user_outputs + len(self.shown) + len(self.written)

    def outputs(self, result, shown: tuple = (), written: tuple = ()) -> list[torch.Tensor]:
        """The program's outputs for a result of this structure (and, in the
        trace, the values printed and the numbers written): its tensors, and
        its numbers as 0-d tensors (in the trace: ops on symbolic numbers; in
        an eager run that is compared with the program: its plain numbers)."""
        return [leaf.output(value) for leaf, value in
                [*zip(self.leaves, pytree.tree_leaves(result)), *zip(self.shown, shown),
                 *zip(self.written, written)]
                if leaf.kind in _OUTPUTS]

    def shown_values(self, outputs) -> list:
        """The values the step printed, from a run's outputs."""
        return [leaf.value_of(o) for leaf, o in
                zip(self.shown, outputs[self.user_outputs:self.user_outputs + len(self.shown)])]

    def write_back(self, outputs) -> None:
        """Put each number the step left on the host where it left it, from a
        run's outputs, as the step's Python would have."""
        start = self.user_outputs + len(self.shown)
        for leaf, w, o in zip(self.written, self.writes, outputs[start:self.num_outputs]):
            w.put_back(leaf.value_of(o))

    def rebuild(self, outputs) -> Any:
        """The step's result from the program's outputs (after the call's LR
        schedulers stepped)."""
        outs = iter(outputs)
        values = []
        for leaf in self.leaves:
            if leaf.kind in _OUTPUTS:
                values.append(leaf.value_of(next(outs)))
            elif leaf.kind is LeafKind.AFTER:
                values.append(leaf.value())
            else:
                values.append(leaf.value)
        return pytree.tree_unflatten(values, self.spec)


def returned_as_read(graph: fx.Graph, returned: Returned) -> None:
    """A number the step returns, prints or leaves on the host that is a
    tensor's value as read (`loss.item()`, an optimizer's value read from its
    input): the program returns that tensor and the call reads it with .item();
    one computed from such values with + - * / (`sum + val * n`): computed on
    float64 tensors (_in_double). Exact under every backend (a compiled kernel
    takes a symbolic float as a float32), and no host read inside the program."""
    out = graph.output_node()
    results = list(out.args[0])
    doubles: dict = {}   # shared: `avg = sum / count` reuses what `sum` computed
    for k, leaf in enumerate([*(leaf for leaf in returned.leaves if leaf.kind in _OUTPUTS),
                              *returned.shown, *returned.written]):
        node = results[k]
        number = leaf.kind is LeafKind.NUMBER and node.target is torch.ops.aten.scalar_tensor.default
        if not number or not isinstance(node.args[0], fx.Node):
            continue
        if node.args[0].target is torch.ops.aten._local_scalar_dense.default:
            results[k] = node.args[0].args[0]
        elif leaf.dtype is torch.float64:
            with graph.inserting_before(out):
                results[k] = _in_double(node.args[0], doubles) or node
    out.args = (type(out.args[0])(results),) + tuple(out.args[1:])


# Python's arithmetic on floats, as ops on float64 tensors: each rounds as Python's
# does (inductor compiles without contracting a multiply and an add)
_DOUBLE_OPS = {operator.add: torch.ops.aten.add.Tensor, operator.sub: torch.ops.aten.sub.Tensor,
               operator.mul: torch.ops.aten.mul.Tensor, operator.truediv: torch.ops.aten.div.Tensor,
               operator.neg: torch.ops.aten.neg.default, torch.sym_float: None}


def _in_double(value, memo: dict) -> fx.Node | None:
    """A symbolic number the program computes with Python's arithmetic
    (`self.sum += loss.item() * n`), as a float64 0-d tensor computed from the
    tensors it is read from: a compiled kernel takes a symbolic float as a
    float32, where Python computes in double. None: an op outside + - * / (the
    symbolic number is output as it is)."""
    if not isinstance(value, fx.Node):   # a constant of the step's code
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if value in memo:
        return memo[value]
    graph, fake = value.graph, value.meta.get("val")
    if value.target is torch.ops.aten._local_scalar_dense.default:
        source = value.args[0]
        node = graph.call_function(torch.ops.aten._to_copy.default, (source,),
                                   {"dtype": torch.float64})
        node.meta["val"] = torch.ops.aten._to_copy.default(source.meta["val"], dtype=torch.float64)
    elif value.target in _DOUBLE_OPS and not value.kwargs \
            and isinstance(fake, (torch.SymInt, torch.SymFloat)):
        args = [_in_double(a, memo) for a in value.args]
        if any(a is None for a in args):
            return None
        if _DOUBLE_OPS[value.target] is None:   # sym_float: the int as a double
            return args[0]
        tensors = [a for a in args if isinstance(a, fx.Node)]
        if not tensors:
            return None
        args = [a if isinstance(a, fx.Node) else _double_constant(graph, a, tensors[0])
                for a in args]
        node = graph.call_function(_DOUBLE_OPS[value.target], tuple(args))
        node.meta["val"] = _DOUBLE_OPS[value.target](*[a.meta["val"] for a in args])
    elif isinstance(fake, torch.SymInt):   # a symbolic size (a batch's): its int as a double
        node = graph.call_function(torch.ops.aten.scalar_tensor.default, (value,),
                                   {"dtype": torch.float64})
        with _fake_mode(graph):
            node.meta["val"] = torch.ops.aten.scalar_tensor.default(fake, dtype=torch.float64)
    else:
        return None
    memo[value] = node
    return node


def _fake_mode(graph: fx.Graph):
    """The fake mode of the graph's traced tensors."""
    return next(n.meta["val"].fake_mode for n in graph.nodes
                if isinstance(n.meta.get("val"), FakeTensor))


def _double_constant(graph: fx.Graph, value, like: fx.Node) -> fx.Node:
    node = graph.call_function(torch.ops.aten.scalar_tensor.default, (float(value),),
                               {"dtype": torch.float64})
    with _fake_mode(graph):
        node.meta["val"] = torch.ops.aten.scalar_tensor.default(
            float(value), dtype=torch.float64, device=like.meta["val"].device)
    return node


class ReturnedArray:
    """A traced tensor's `.numpy()`: the program outputs the tensor and the call
    returns its `.numpy()`, which shares its memory as eager's does. Printed
    or formatted, it shows eager's text. Its values do not exist while the
    step is traced: any other use raises, naming the step's line."""

    __slots__ = ("tensor", "_step_fn")

    def __init__(self, tensor: torch.Tensor, step_fn):
        object.__setattr__(self, "tensor", tensor)
        object.__setattr__(self, "_step_fn", step_fn)

    def _refused(self, *args, **kwargs):
        raise TranspileError(
            f"{step_name(self._step_fn)} uses the values of a tensor's .numpy()"
            f"{user_line(self._step_fn)}: the program runs without the step's Python, so "
            "numpy cannot compute with them inside the step; a transpiled step may return "
            ".numpy() of a tensor as it is. Compute with tensor operations (the program's "
            "own), read numbers with .item() or .tolist(), or call numpy on what the step "
            "returns")

    def __getattr__(self, name):
        if name.startswith("__"):   # a probe of a protocol (hasattr): not a use
            raise AttributeError(name)
        self._refused()

    # its text, as eager's: the values it shows read (decisions, as .item())
    def __repr__(self) -> str:
        if is_user_file(sys._getframe(1).f_code.co_filename):
            return eager_array_text(self.tensor, repr)
        return f"ReturnedArray({self.tensor.dtype}, {tuple(self.tensor.shape)})"

    def __str__(self) -> str:
        return eager_array_text(self.tensor, str)

    def __format__(self, spec: str) -> str:
        return eager_array_text(self.tensor, lambda a: format(a, spec))


for _name in ("__bool__", "__len__", "__iter__", "__getitem__",
              "__setitem__", "__contains__", "__float__", "__int__", "__index__",
              "__complex__", "__array__", "__array_ufunc__", "__array_function__",
              "__setattr__", "__neg__", "__pos__", "__abs__", "__invert__",
              *(f"__{op}__" for base in ("add", "sub", "mul", "truediv", "floordiv", "mod",
                                          "pow", "matmul", "and", "or", "xor", "lshift",
                                          "rshift")
                for op in (base, "r" + base, "i" + base)),
              "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"):
    setattr(ReturnedArray, _name, ReturnedArray._refused)
ReturnedArray.__hash__ = None


_NUMPY = torch.Tensor.numpy


@contextlib.contextmanager
def arrays_returned(step_fn):
    """While tracing: `.numpy()` of a traced tensor is a ReturnedArray, after
    the checks eager's .numpy() makes (no grad, on the CPU, a dtype numpy has;
    `force=True` detaches and moves it first)."""
    def numpy(self, *, force: bool = False):
        if not isinstance(self, FakeTensor):
            return _NUMPY(self, force=force)
        if force:
            self = self.detach().cpu().resolve_conj().resolve_neg()
        elif self.requires_grad:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. "
                               "Use tensor.detach().numpy() instead.")
        elif self.device.type != "cpu":
            raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use "
                            "Tensor.cpu() to copy the tensor to host memory first.")
        if self.dtype not in _NUMPY_DTYPES:
            raise TypeError(f"Got unsupported ScalarType {str(self.dtype).split('.')[-1]}")
        return ReturnedArray(self, step_fn)

    torch.Tensor.numpy = numpy
    try:
        yield
    finally:
        torch.Tensor.numpy = _NUMPY


# the dtypes .numpy() converts (torch's tensor_numpy.cpp)
_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32,
                 torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
                 torch.complex128, torch.uint16, torch.uint32, torch.uint64}
