"""Tensors from outside the step's arguments.

make_fx turns a real tensor that an op meets into a constant of the program:
read once, at the trace, and reused on every call. That is right for a tensor
the step makes itself from Python data (`torch.tensor(2.0)`: its values are
literals, or host values that guards.py watches), and wrong for every tensor
that already existed: a batch pulled from an iterator inside the step, a tensor
in a global or a closure, a plain tensor attribute of a module. Those are
refused, naming the user's line. numpy arrays among the step's arguments are
batch inputs: while the step is traced, torch.from_numpy, torch.as_tensor,
torch.asarray and torch.tensor give the traced input for such an array (the
step sees a stand-in that holds no values, observed_arrays.py: indexing a
tensor with it works too); a numpy array that is not among the arguments is
refused where it is converted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import PythonKeyTracer

from ..errors import TranspileError
from .observed_arrays import is_ndarray, torch_reads
from .user_code import step_name, user_line

# A constant used only by lift_fresh_copy was made inside the step from Python
# data (torch.tensor and friends lift it); any other constant already existed.
_LIFT_FRESH = torch.ops.aten.lift_fresh_copy.default
_CONVERTERS = ("from_numpy", "as_tensor", "asarray", "tensor")


@dataclasses.dataclass
class _Seen:
    line: str
    shape: tuple
    dtype: torch.dtype


@contextlib.contextmanager
def outside_tensors(step_fn, arrays: dict[int, torch.Tensor], guarded: set[int], hint: str):
    """While the step is traced: record where each real tensor became a
    constant, and convert the numpy arrays among the arguments (by id, to
    their traced input) and refuse the others. Yields a check of the traced
    graph that raises on a tensor from outside the arguments other than those
    in `guarded` (ids of tensors the signature compares by value)."""
    seen: dict[int, _Seen] = {}
    create_arg = PythonKeyTracer.create_arg

    def recording(self, a):
        if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) and id(a) not in seen:
            seen[id(a)] = _Seen(user_line(step_fn), tuple(a.shape), a.dtype)
        return create_arg(self, a)

    thread = threading.get_ident()   # another thread's conversions (a loader's) are its own

    def converting(name, original):
        def convert(data, *args, **kwargs):
            if threading.get_ident() != thread:
                return original(data, *args, **kwargs)
            if isinstance(data, (torch.SymFloat, torch.SymInt)) and name != "from_numpy":
                # a number the program computes (a lifted argument, a host draw)
                dtype = kwargs.get("dtype", args[0] if args else None) or (
                    torch.get_default_dtype() if isinstance(data, torch.SymFloat)
                    else torch.int64)
                return torch.full((), data, dtype=dtype, device=kwargs.get("device"))
            if not is_ndarray(data):
                return original(data, *args, **kwargs)
            traced = arrays.get(id(data))
            if traced is None:
                raise TranspileError(
                    f"{step_name(step_fn)} makes a tensor from a numpy array of shape "
                    f"{tuple(data.shape)} ({data.dtype}) that is not among its arguments"
                    f"{user_line(step_fn)}: it would be read once, when the step is traced, and "
                    f"reused on every call. {hint}")
            dtype = kwargs.get("dtype", args[0] if args and name != "from_numpy" else None)
            value = traced.to(dtype=dtype, device=kwargs.get("device"))
            return value.clone() if name == "tensor" and value is traced else value
        return convert

    saved = {name: getattr(torch, name) for name in _CONVERTERS}
    PythonKeyTracer.create_arg = recording
    for name, original in saved.items():
        setattr(torch, name, converting(name, original))
    try:
        with torch_reads(arrays):
            yield lambda gm: _check(step_fn, gm, seen, guarded, hint)
    finally:
        PythonKeyTracer.create_arg = create_arg
        for name, original in saved.items():
            setattr(torch, name, original)


def _check(step_fn, gm: fx.GraphModule, seen: dict[int, _Seen], guarded: set[int],
           hint: str) -> None:
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target, None)
        if not isinstance(value, torch.Tensor) or id(value) in guarded \
                or all(u.target is _LIFT_FRESH for u in node.users):
            continue
        where = seen.get(id(value))
        what = ("a parameter" if isinstance(value, torch.nn.Parameter) or value.requires_grad
                else "a tensor")
        raise TranspileError(
            f"{step_name(step_fn)} uses {what} of shape {tuple(value.shape)} "
            f"({str(value.dtype).replace('torch.', '')}) that is not among its arguments"
            f"{where.line if where else ''}: it would be read once, when the step is traced, and "
            f"reused on every call, never updated or reduced. {hint}")
