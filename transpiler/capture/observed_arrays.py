"""The numpy arrays a traced step is given (its arguments, its host draws) as it
sees them: every read of their values observed.

A numpy array is read on the host: whatever the step computes from its values
in Python or numpy (a schedule indexed by the step count, np.asarray(x) * 2,
idx.tolist()), or whatever torch reads from its buffer in C++ (indexing a
tensor with it, torch.Tensor(arr), x.new_tensor(arr)), is read once, when the
step is traced, and kept in the program. So the step gets a view of the array
of a subclass that observes those reads:

- torch's conversions (outside.py) and the C++ routes patched below give the
  array's program input: its values are read on every call, nothing is kept;
- a read on the host (an ndarray method, a ufunc, a numpy function, an item,
  iteration) calls `on_read`: for an argument, the program is kept only for
  calls with the same values (ValuesRead, checked on every call); a host draw
  refuses it (host_random.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from typing import Callable

import torch



def is_ndarray(value) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


# ndarray methods and protocols that read values (or write them).
_VALUE_READS = (
    "__bool__", "__float__", "__int__", "__index__", "__complex__", "__getitem__",
    "__setitem__", "__iter__", "__contains__", "item", "tolist", "astype", "copy", "tobytes",
    "fill", "sort", "argsort", "argmax", "argmin", "argpartition", "partition", "nonzero",
    "searchsorted", "take", "put", "compress", "choose", "clip", "round", "dot", "sum", "prod",
    "mean", "std", "var", "min", "max", "all", "any", "cumsum", "cumprod", "trace", "repeat",
    "flatten", "byteswap", "dump", "dumps", "tofile")
# numpy's functions that copy an array in C without asking the subclass.
_NUMPY_COPIES = ("asarray", "array", "asanyarray", "ascontiguousarray", "asfortranarray")
# Legacy constructors that read an array's buffer (torch.Tensor is patched apart).
_LEGACY = {"FloatTensor": torch.float32, "DoubleTensor": torch.float64,
           "HalfTensor": torch.float16, "BFloat16Tensor": torch.bfloat16,
           "LongTensor": torch.int64, "IntTensor": torch.int32, "ShortTensor": torch.int16,
           "CharTensor": torch.int8, "ByteTensor": torch.uint8, "BoolTensor": torch.bool}


def _plain(value):
    """An observed array as a plain ndarray view (its reads then unobserved)."""
    return value.view(sys.modules["numpy"].ndarray) if is_observed(value) else value


@functools.cache
def _observed_class() -> type:
    numpy = sys.modules["numpy"]

    def reading(name):
        method = getattr(numpy.ndarray, name)

        def read(self, *args, **kwargs):
            self._on_read()
            return method(_plain(self), *args, **kwargs)
        return read

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        for x in (*inputs, *kwargs.get("out", ())):
            if is_observed(x):
                x._on_read()
        if "out" in kwargs:
            kwargs["out"] = tuple(_plain(x) for x in kwargs["out"])
        return getattr(ufunc, method)(*map(_plain, inputs), **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        self._on_read()
        return func(*[_plain(a) for a in args], **{k: _plain(v) for k, v in kwargs.items()})

    def __array_finalize__(self, obj):
        self._on_read = getattr(obj, "_on_read", None)

    return type("ObservedArray", (numpy.ndarray,), {
        **{name: reading(name) for name in _VALUE_READS},
        "__array_ufunc__": __array_ufunc__, "__array_function__": __array_function__,
        "__array_finalize__": __array_finalize__,
    })


def observed(array, on_read: Callable[[], None]):
    """A view of `array` whose reads of values on the host call `on_read`."""
    view = array.view(_observed_class())
    view._on_read = on_read
    return view


def is_observed(value) -> bool:
    return "numpy" in sys.modules and isinstance(value, _observed_class())


@dataclasses.dataclass
class ValuesRead:
    """The numpy arguments whose values the traced step read on the host: the
    program keeps what it computed from them, so it serves a call only with
    the same values (their bytes, compared on every call)."""

    names: list[str]
    leaves: list[int]
    values: list[bytes]

    @classmethod
    def of(cls, read: dict[int, str], leaves) -> ValuesRead | None:
        if not read:
            return None
        at = sorted(read)
        return cls([read[i] for i in at], at, [leaves[i].tobytes() for i in at])

    def holds(self, leaves) -> bool:
        return all(leaves[i].tobytes() == v for i, v in zip(self.leaves, self.values))

    def describe(self, leaves) -> str:
        name = next(n for n, i, v in zip(self.names, self.leaves, self.values)
                    if leaves[i].tobytes() != v)
        return (f"numpy argument {name!r} has other values than those the step read on the "
                "host while traced")


@contextlib.contextmanager
def torch_reads(arrays: dict[int, torch.Tensor]):
    """While traced: the routes by which torch reads an array's values in C++
    give the array's program input (`arrays`: id -> it; an observed array, or
    one read through a host path) instead:
    indexing a tensor with it, x.new_tensor(it), torch.Tensor(it) and the
    legacy typed constructors; numpy's copies of it (np.asarray) are reads."""

    def traced(value):
        """The program input for an array torch is given; an observed array
        that is not one (a view of one) read as values; anything else as is."""
        t = arrays.get(id(value)) if is_ndarray(value) else None
        if t is None and is_observed(value):
            value._on_read()
            return _plain(value)
        return value if t is None else t

    def index(key):
        if isinstance(key, tuple):
            return tuple(traced(k) for k in key)
        return traced(key)

    getitem, setitem = torch.Tensor.__getitem__, torch.Tensor.__setitem__
    new_tensor = torch.Tensor.new_tensor
    own_new = vars(torch.Tensor).get("__new__")

    def constructor(original, dtype_of):
        """A constructor that makes a tensor of dtype_of(...) from one array."""
        def construct(*args, **kwargs):
            if len(args) == 1 and is_ndarray(args[0]):
                value = traced(args[0])
                if isinstance(value, torch.Tensor):
                    return value.to(dtype_of(*args, **kwargs)).clone()
                args = (value,)
            return original(*args, **kwargs)
        return construct

    def tensor_new(cls, *args, **kwargs):
        return constructor(lambda *a, **k: torch._C.TensorBase.__new__(cls, *a, **k),
                           lambda *_, **__: torch.get_default_dtype())(*args, **kwargs)

    numpy = sys.modules.get("numpy")
    copies = {name: getattr(numpy, name) for name in _NUMPY_COPIES} if numpy else {}

    def numpy_copy(original):
        def copy(value, *args, **kwargs):
            if is_observed(value):
                value._on_read()
            return original(_plain(value), *args, **kwargs)
        return copy

    saved = {name: getattr(torch, name) for name in _LEGACY}
    torch.Tensor.__getitem__ = lambda self, key: getitem(self, index(key))
    torch.Tensor.__setitem__ = lambda self, key, value: setitem(self, index(key), traced(value))
    torch.Tensor.new_tensor = lambda self, data, *args, **kwargs: constructor(
        functools.partial(new_tensor, self),
        lambda *_, **k: k.get("dtype") or self.dtype)(data, *args, **kwargs).to(
            kwargs.get("device") or self.device)
    torch.Tensor.__new__ = tensor_new
    for name, dtype in _LEGACY.items():
        setattr(torch, name, constructor(saved[name], lambda *_, dtype=dtype, **__: dtype))
    for name, original in copies.items():
        setattr(numpy, name, numpy_copy(original))
    try:
        yield
    finally:
        torch.Tensor.__getitem__, torch.Tensor.__setitem__ = getitem, setitem
        torch.Tensor.new_tensor = new_tensor
        if own_new is None:
            del torch.Tensor.__new__
        else:
            torch.Tensor.__new__ = own_new
        for name, original in saved.items():
            setattr(torch, name, original)
        for name, original in copies.items():
            setattr(numpy, name, original)
