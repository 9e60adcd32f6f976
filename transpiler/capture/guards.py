"""Guards: the plain Python values a step can read that are not program inputs.

A trace reads such values once and bakes them into the program: a module's
float attribute (a temperature, nn.Dropout's p), a config object a module holds,
a global or a closure cell the step function (or a function it calls, or a
module's forward) reads. Each is recorded when the step is traced and checked on
every call, as torch.compile's guards are: a change traces again, and the log
names the value. What is recorded is everything the step *can* read, found
without running it: every submodule's attributes (public and private) and those
of the plain objects they hold, and the globals and closure cells named by the
code of the step, of the functions it reaches through them and of each
submodule's forward. Values of torch's own code are left out (they do not
change), and so are tensors, which are inputs or refused (trace.py).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import operator
import os
import sys
import types
from typing import Any, Iterator

import torch

# Types whose values a guard compares; containers of them are compared by value.
_SCALARS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device,
            enum.Enum)
_CONTAINERS = (tuple, list, frozenset, set)
# Code under these directories is not the user's: torch's own and the standard library.
_LIBRARY_DIRS = tuple(os.path.dirname(p) + os.sep for p in (torch.__file__, os.__file__))
_MISSING = object()
# The attributes through which torch.nn.Module keeps its parameters, buffers,
# submodules and hooks: torch's bookkeeping, not values a forward reads (what
# they hold is compared by the signature), and mutated in place, never rebound.
MODULE_BOOKKEEPING = frozenset(vars(torch.nn.Module())) - {"training"}


def snapshot(value) -> Any:
    """A comparable copy of a plain value, or _MISSING for anything else."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, _CONTAINERS) and len(value) <= 64:
        items = tuple(snapshot(v) for v in value)
        if all(v is not _MISSING for v in items):
            return (type(value), items)
    return _MISSING


class _Cell:
    """A closure cell read like a dict of one entry."""

    __slots__ = ("cell",)

    def __init__(self, cell):
        self.cell = cell

    def get(self, key, default=None):
        try:
            return self.cell.cell_contents
        except ValueError:   # an empty cell
            return default


@dataclasses.dataclass(frozen=True)
class Guard:
    name: str          # as the log shows it: "model.drop.p", "global LOSS_WEIGHT"
    holder: Any        # a dict (an object's __dict__, a function's globals) or a _Cell
    key: str
    value: Any         # snapshot() of the value when the step was traced
    original: Any      # the value itself
    identity: bool = False   # value is an object that must stay the same one
    # a list or set (or a tuple holding one): compared with a copy taken now,
    # since the same object may have been changed in place
    copied: Any = dataclasses.field(init=False, default=_MISSING)

    def __post_init__(self):
        if not self.identity and _mutable(self.original):
            object.__setattr__(self, "copied", copy.deepcopy(self.original))

    def current(self):
        now = self.holder.get(self.key, _MISSING)
        return now if self.identity else snapshot(now)

    def unchanged(self) -> bool:
        now = self.holder.get(self.key, _MISSING)
        if self.copied is not _MISSING:
            return type(now) is type(self.copied) and now == self.copied
        if self.identity or now is self.original:
            return now is self.original
        return now is not _MISSING and snapshot(now) == self.value

    def describe(self) -> str:
        now = self.holder.get(self.key, _MISSING)
        if self.identity:
            return f"{self.name}: another {type(now).__name__} object"
        new = "deleted" if now is _MISSING else show(snapshot(now))
        return f"{self.name}: {show(self.value)} -> {new}"

    def restore(self) -> None:
        if self.copied is not _MISSING:   # changed in place: put back
            _refill(self.original, _unsnap(self.value))
        if isinstance(self.holder, _Cell):
            self.holder.cell.cell_contents = self.original
        elif isinstance(self.holder, dict):   # a class's namespace is read-only here
            self.holder[self.key] = self.original


class Guards:
    """The guards of one program. The check reads each holder's values with one
    itemgetter and compares them with the recorded objects as a tuple (which
    compares each element by identity first, then by value); values that can
    change in place (lists, sets) and objects guarded by identity are checked
    one by one."""

    def __init__(self, guards: list[Guard]):
        self.guards = guards
        by_holder: dict[int, list[Guard]] = {}
        self._each = []
        for g in guards:
            if g.identity or isinstance(g.holder, _Cell) or _mutable(g.original):
                self._each.append(g)
            else:
                by_holder.setdefault(id(g.holder), []).append(g)
        self._grouped = [(gs[0].holder, operator.itemgetter(*[g.key for g in gs]),
                          tuple(g.original for g in gs) if len(gs) > 1 else gs[0].original)
                         for gs in by_holder.values()]

    def changed(self) -> str | None:
        """None while every value is as recorded, else one line naming the first
        that is not."""
        for holder, get, expected in self._grouped:
            try:
                if get(holder) == expected:
                    continue
            except KeyError:
                pass
            return next(g.describe() for g in self.guards if not g.unchanged())
        for g in self._each:
            if not g.unchanged():
                return g.describe()
        return None

    def __len__(self) -> int:
        return len(self.guards)


def _refill(container, items) -> None:
    """Give a list or set (or those inside a tuple) the recorded items again."""
    if isinstance(container, list):
        container[:] = items
    elif isinstance(container, set):
        container.clear()
        container.update(items)
    elif isinstance(container, (tuple, frozenset)):
        for inner, item in zip(container, items):
            _refill(inner, item)


def _mutable(value) -> bool:
    return isinstance(value, (list, set)) or (
        isinstance(value, (tuple, frozenset)) and any(_mutable(v) for v in value))


def show(value) -> str:
    if isinstance(value, tuple) and len(value) == 2 and value[0] in _CONTAINERS:
        return repr(value[0](_unsnap(v) for v in value[1]))
    return repr(value)


def _unsnap(value):
    if isinstance(value, tuple) and len(value) == 2 and value[0] in _CONTAINERS:
        return value[0](_unsnap(v) for v in value[1])
    return value


def record(step_fn, modules) -> Guards:
    """The guards of a step on these modules, with their values now."""
    guards: dict[tuple[int, str], Guard] = {}

    def add(name, holder, key, value):
        snap = snapshot(value)
        if snap is not _MISSING:
            guards.setdefault((id(holder), key), Guard(name, holder, key, snap, value))

    for mi, module in enumerate(modules):
        root = f"model{mi}" if len(modules) > 1 else "model"
        for prefix, sub in module.named_modules():
            for name, holder in _objects_of(f"{root}.{prefix}" if prefix else root, sub):
                for key, value in vars(holder).items():
                    if holder is sub and key in MODULE_BOOKKEEPING:
                        continue
                    add(f"{name}.{key}", vars(holder), key, value)
                    if _is_plain_object(value):   # the object held, and its class's values
                        guards.setdefault((id(vars(holder)), key),
                                          Guard(f"{name}.{key}", vars(holder), key, value, value,
                                                True))
                if holder is not sub and not _is_library_module(type(holder).__module__):
                    for key, value in vars(type(holder)).items():
                        if not key.startswith("__"):
                            add(f"{name}.{key} (class {type(holder).__name__})",
                                vars(type(holder)), key, value)
    for name, holder, key, value in _code_values(step_fn, modules):
        add(name, holder, key, value)
    return Guards(list(guards.values()))


def _objects_of(name: str, module: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """The module and the plain objects it holds in its attributes (a config)."""
    yield name, module
    for key, value in vars(module).items():
        if _is_plain_object(value):
            yield f"{name}.{key}", value


def _is_plain_object(value) -> bool:
    return (hasattr(value, "__dict__") and not isinstance(
        value, (torch.nn.Module, torch.Tensor, torch.optim.Optimizer, type, types.ModuleType,
                types.FunctionType, types.MethodType, types.BuiltinFunctionType))
            and not callable(getattr(type(value), "__get__", None)))


def _code_values(step_fn, modules) -> Iterator[tuple[str, Any, str, Any]]:
    """(name, holder, key, value) of each global, closure cell and attribute of
    an imported module that the code reachable from the step names."""
    todo = [_function_of(step_fn)]
    todo += [getattr(type(m), "forward", None) for module in modules for m in module.modules()]
    seen: set[int] = set()
    while todo:
        fn = todo.pop()
        if not isinstance(fn, types.FunctionType) or id(fn.__code__) in seen \
                or _is_library(fn.__code__.co_filename):
            continue
        seen.add(id(fn.__code__))
        names = _names(fn.__code__)
        if fn.__closure__:
            for var, cell in zip(fn.__code__.co_freevars, fn.__closure__):
                holder = _Cell(cell)
                value = holder.get(var, _MISSING)
                yield f"closure variable {var!r} of {fn.__qualname__}", holder, var, value
                todo.append(_function_of(value))
        for name in names:
            value = fn.__globals__.get(name, _MISSING)
            if value is _MISSING:
                continue
            where = f"global {name!r} of {fn.__module__}"
            if isinstance(value, types.ModuleType):
                attrs = vars(value)
                for attr in names & attrs.keys():
                    yield f"{name}.{attr} ({value.__name__})", attrs, attr, attrs[attr]
                continue
            yield where, fn.__globals__, name, value
            todo.append(_function_of(value))
            if _is_plain_object(value) and not _is_library_module(type(value).__module__):
                for attr, v in vars(value).items():
                    if attr in names:
                        yield f"{name}.{attr} ({where})", vars(value), attr, v


def _function_of(value):
    """The Python function behind a function, a bound method or a partial."""
    while True:
        if isinstance(value, types.MethodType):
            value = value.__func__
        elif isinstance(value, functools.partial):
            value = value.func
        else:
            return value


def _names(code: types.CodeType) -> set[str]:
    """Every global and attribute name the code and its nested code read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _is_library_module(name: str) -> bool:
    module = sys.modules.get(name)
    return module is not None and _is_library(getattr(module, "__file__", None) or "")


def _is_library(filename: str) -> bool:
    return not filename or filename.startswith(_LIBRARY_DIRS) or filename.startswith("<frozen")
