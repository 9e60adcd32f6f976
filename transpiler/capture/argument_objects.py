"""Objects among the step's arguments, read again in each call's own argument.

A batch that is an object holding tensors as attributes (PyG's `Data`, a
script's `Batch` class, an `argparse.Namespace` of settings) is often a new
object every call. What the step reads through it (reads.py) is recorded as a
path from its place among the arguments, not from the object: a guard reads
`batch.n` in the call's own `batch`, a tensor at `batch.x` is a program input
read from each call's `batch.x`, an attribute the step sets is set on each
call's object, and an object held by it (`data._store`) is followed the same
way. So the signature holds such an argument's type, not its identity
(signature.py), and a new object of the same type, whose reads find what the
trace found, runs the same program.

Which objects (read_in_place): instances of a Python class with a `__dict__`,
compared and hashed by identity, other than the step's modules, optimizers and
scalers, and namespaces (a SimpleNamespace, whose reads are not observed, is
guarded whole). An object with an `__eq__` or `__hash__` of its own, or an enum
member, is compared by value in the signature as before (code can compare it
without reading its attributes), unless it is unhashable (PyG's `Data`). Where
a trace keeps something of the object itself (reads.py's `_pin`: a write into
a container it holds, a host write keeping it, the object reached another way
or given twice, a scheduler), the argument is guarded by identity after all
(ArgumentLeaves).
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import enum
import types
from typing import Iterator

import torch

from .guards import MISSING

_HEAPTYPE = 1 << 9   # Py_TPFLAGS_HEAPTYPE: a class defined in Python
# Records compared by their attributes, which in-place guards compare.
_NAMESPACES = (types.SimpleNamespace, argparse.Namespace)
_STEP_OBJECTS = (torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler, torch.Tensor,
                 enum.Enum)


def instance_dict(obj) -> dict | None:
    """obj's own __dict__, read past any __getattribute__; None without one."""
    try:
        return object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return None


def stores(obj, key) -> bool:
    """Whether obj stores attribute key itself (its __dict__ or a slot), rather
    than its __getattr__ computing it: set on the instance, a value in place
    of a computed attribute shadows it until deleted."""
    members = instance_dict(obj)
    return (members is not None and key in members) \
        or hasattr(type(getattr(type(obj), key, None)), "__set__")


def read_in_place(value) -> bool:
    """Whether an argument (or an object held by one) is read again in each
    call's argument at its place: an instance of a Python class with a
    __dict__, hashed by identity or unhashable (not of a builtin's subclass,
    such as a list's, whose items are not attributes), or a namespace."""
    cls = type(value)
    if cls in _NAMESPACES:
        return True
    return (all(c is object or c.__flags__ & _HEAPTYPE for c in cls.__mro__)
            and instance_dict(value) is not None
            and not isinstance(value, _STEP_OBJECTS)
            and (cls.__hash__ is None   # unhashable: its __eq__ is no signature's
                 or (cls.__eq__ is object.__eq__ and cls.__hash__ is object.__hash__)))


class CallArguments:
    """The argument leaves of the call a step's programs are looked up and run
    for (set by the program cache before it reads any guard)."""

    __slots__ = ("leaves", "_holders")

    def __init__(self):
        self.leaves: list = []
        self._holders: dict[tuple, InPlace] = {}

    def holder(self, leaf: int, path: tuple, computed: bool, name: str) -> InPlace:
        """The accessor of an object at this place (one per place, whichever
        trace reads it)."""
        found = self._holders.get((leaf, path, computed))
        if found is None:
            found = self._holders[(leaf, path, computed)] = InPlace(self, leaf, path, computed,
                                                                     name)
        return found


_TRACED: contextvars.ContextVar = contextvars.ContextVar("the arguments of the traced call",
                                                        default=None)


@contextlib.contextmanager
def tracing_for(arguments: CallArguments) -> Iterator[None]:
    """While a step is traced: the arguments its in-place reads resolve in."""
    token = _TRACED.set(arguments)
    try:
        yield
    finally:
        _TRACED.reset(token)


def traced_arguments() -> CallArguments | None:
    return _TRACED.get()


# InPlace's key for the whole __dict__ (a copy), of an object whose reads are
# not observed (a SimpleNamespace: guarded whole)
EVERY_ATTRIBUTE = "every attribute"


class InPlace:
    """The attributes of the object at an argument's place: argument leaf
    `leaf`, then the instance attributes `path` (each read from the object's
    __dict__), in the arguments of the running call. `computed`: read and set
    with getattr and setattr (a custom __getattr__, a slot), else through the
    object's __dict__."""

    __slots__ = ("arguments", "leaf", "path", "computed", "name")

    def __init__(self, arguments: CallArguments, leaf: int, path: tuple, computed: bool,
                 name: str):
        self.arguments, self.leaf, self.path = arguments, leaf, path
        self.computed, self.name = computed, name

    def obj(self):
        obj = self.arguments.leaves[self.leaf]
        for attr in self.path:
            obj = instance_dict(obj)[attr]
        return obj

    def get(self, key, default=None):
        try:
            obj = self.obj()
        except (IndexError, KeyError, TypeError):   # the object is not there
            return default
        if self.computed:
            try:
                return getattr(obj, key)
            except AttributeError:
                return default
        members = instance_dict(obj)
        if members is None:
            return default
        return dict(members) if key is EVERY_ATTRIBUTE else members.get(key, default)

    def __contains__(self, key) -> bool:
        return self.get(key, MISSING) is not MISSING

    def shadows(self, key) -> bool:
        """Whether put(key, value) would shadow a computed attribute (stores())."""
        return self.computed and not stores(self.obj(), key)

    def put(self, key, value) -> None:
        obj = self.obj()
        if self.computed:
            if value is MISSING:
                object.__delattr__(obj, key)
            else:
                object.__setattr__(obj, key, value)
        elif key is EVERY_ATTRIBUTE:
            instance_dict(obj).clear()
            instance_dict(obj).update(value)
        elif value is MISSING:
            instance_dict(obj).pop(key, None)
        else:
            instance_dict(obj)[key] = value

    def __repr__(self) -> str:
        return f"InPlace({self.name})"


class ArgumentLeaves:
    """The running call's argument leaves by index: a guard on the identity
    of an argument that cannot be read in place after all (the trace wrote
    into a container it holds)."""

    __slots__ = ("arguments",)

    def __init__(self, arguments: CallArguments):
        self.arguments = arguments

    def get(self, key, default=None):
        leaves = self.arguments.leaves
        return leaves[key] if 0 <= key < len(leaves) else default

