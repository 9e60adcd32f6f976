"""Modules, optimizers and GradScalers the step uses without taking them as
arguments: a trainer's `self.model` and `self.optimizer` (a bound-method step,
a callable step object), a partial's arguments, the step function's closure
cells and the globals its code names (a script whose step reads the globals
`model` and `optimizer`), and, through the user's functions it names, theirs.

They are found at the first call by walking those roots (plain objects,
lists, tuples and dicts, a few levels deep) and are then the step's own, as if
passed as arguments: their parameters, buffers and state are program inputs,
trained and reduced. Each later call reads them again along the path they
were found by; another object there is another signature (traces again).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any

import torch

from .scaler import GradScaler
from .argument_objects import instance_dict
from .reads import Cell, _global_names
from .user_code import is_library

_DEPTH = 3          # how deep into plain objects and containers the walk goes
_WIDTH = 256        # items of a container or attributes of an object it looks at
_STEP_OBJECTS = (torch.nn.Module, torch.optim.Optimizer, GradScaler)


@dataclasses.dataclass(frozen=True)
class FoundPath:
    """Where a step object was found: a root holder (dict or accessor) and
    key, or the call's argument leaf `argument` (an object held by an argument
    is found in each call's own argument), then attributes ("attr", name) or
    items ("item", key)."""

    name: str
    holder: Any
    key: Any
    steps: tuple = ()
    argument: int | None = None

    def read(self, leaves=None):
        value = self.holder.get(self.key, None) if self.argument is None or leaves is None \
            else leaves[self.argument]
        for kind, k in self.steps:
            if value is None:
                return None
            try:
                value = getattr(value, k) if kind == "attr" else value[k]
            except (AttributeError, KeyError, IndexError, TypeError):
                return None
        return value


def discover(step_fn, argument_leaves) -> list[FoundPath]:
    """The paths to the step objects the step reaches outside its arguments."""
    taken = {id(leaf) for leaf in argument_leaves}
    for leaf in argument_leaves:
        if isinstance(leaf, torch.nn.Module):
            taken |= {id(m) for m in leaf.modules()}
    found: dict[int, FoundPath] = {}
    walker = _Walker(taken, found)
    walker.step(step_fn, _step_name(step_fn))
    for i, leaf in enumerate(argument_leaves):
        # an optimizer wrapping another (SAM's), a module keeping its optimizers
        # (Lightning's self.optimizers()), a config holding a scaler
        if isinstance(leaf, (torch.optim.Optimizer, torch.nn.Module)) or _is_plain_object(leaf):
            walker.members(leaf, FoundPath(f"argument {i}", _Holder(leaf), None, argument=i), 0)
    modules = [p for p in found.values() if isinstance(p.read(), torch.nn.Module)]
    inner = {id(m) for p in modules for m in list(p.read().modules())[1:]}
    return [p for p in found.values() if id(p.read()) not in inner]


def _step_name(step_fn) -> str:
    return getattr(step_fn, "__qualname__", None) or type(step_fn).__name__


class _Walker:
    def __init__(self, taken: set[int], found: dict[int, FoundPath]):
        self.taken, self.found = taken, found
        self.seen: set[int] = set()

    def step(self, fn, name: str) -> None:
        if isinstance(fn, types.MethodType):
            self.value(fn.__self__, FoundPath("self", _Holder(fn.__self__), None), 0)
            self.function(fn.__func__)
        elif isinstance(fn, functools.partial):
            for i, arg in enumerate(fn.args):
                self.value(arg, FoundPath(f"{name} argument {i}", _Holder(fn.args), None,
                                          (("item", i),)), 0)
            for key, arg in fn.keywords.items():
                self.value(arg, FoundPath(key, fn.keywords, key), 0)
            self.step(fn.func, name)
        elif isinstance(fn, types.FunctionType):
            self.function(fn)
        elif callable(fn):
            self.value(fn, FoundPath("self", _Holder(fn), None), 0)
            self.function(getattr(type(fn), "__call__", None))

    def function(self, fn) -> None:
        """The closure cells and the globals its code names, and those of the
        user's functions among them."""
        if not isinstance(fn, types.FunctionType) or id(fn) in self.seen \
                or is_library(fn.__code__.co_filename):
            return
        self.seen.add(id(fn))
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            holder = Cell(cell)
            self.value(holder.get(var), FoundPath(var, holder, var), 0)
        for name in sorted(_global_names(fn.__code__)):
            if name in fn.__globals__:
                self.value(fn.__globals__[name], FoundPath(name, fn.__globals__, name), 0)

    def value(self, value, path: FoundPath, depth: int) -> None:
        if value is None or id(value) in self.taken:
            return
        if isinstance(value, _STEP_OBJECTS):
            if id(value) not in self.found:
                self.found[id(value)] = path
                if isinstance(value, torch.nn.Module) and depth < _DEPTH:
                    self.members(value, path, depth)   # a module keeping its optimizers
            return
        if isinstance(value, types.FunctionType):
            self.function(value)
            return
        if depth >= _DEPTH or id(value) in self.seen or isinstance(
                value, (str, bytes, int, float, bool, torch.Tensor, type, types.ModuleType)):
            return
        self.seen.add(id(value))
        if isinstance(value, (list, tuple)):
            items = list(enumerate(value))
        elif isinstance(value, dict):
            items = list(value.items())
        else:
            if is_library(_module_file(type(value))):
                return
            self.members(value, path, depth)
            return
        for k, v in items[:_WIDTH]:
            self.value(v, dataclasses.replace(
                path, name=f"{path.name}[{k!r}]", steps=path.steps + (("item", k),)), depth + 1)


    def members(self, obj, path: FoundPath, depth: int) -> None:
        """What an object holds in its attributes."""
        members = instance_dict(obj)
        for k, v in [(k, v) for k, v in (members or {}).items() if not k.startswith("__")][:_WIDTH]:
            self.value(v, dataclasses.replace(
                path, name=f"{path.name}.{k}", steps=path.steps + (("attr", k),)), depth + 1)


def _is_plain_object(value) -> bool:
    return instance_dict(value) is not None and not isinstance(
        value, (torch.nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType))


def _module_file(cls: type) -> str:
    import sys
    return getattr(sys.modules.get(cls.__module__), "__file__", None) or ""


class _Holder:
    """A root that is the value itself (a step's self, a partial's arguments)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def get(self, key, default=None):
        return self.value
