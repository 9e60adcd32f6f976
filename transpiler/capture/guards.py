"""Guards: the host values a program was traced with, checked on every call.

Each guard names one place the traced step read (an entry of an object's
`__dict__`, of a class's namespace, of a function's globals, a closure cell, an
item of a container: a `holder` with `.get(key, default)`, reads.py) and what
was there: a plain value (compared by type and value), an object (by identity),
a container of objects or tensors (item by item), a tensor read as a program
input (by layout), or nothing (the read found no such attribute). The check of
a whole program's guards is one generated Python function, so a call pays
about a hundred nanoseconds per guard; only a failed check looks for the guard that
failed, to name it in the log.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import pathlib
import sys
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from .numbers import is_number

MISSING = object()

# Types whose values a guard compares; containers of them are compared by value.
_SCALARS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device,
            enum.Enum, range, slice, pathlib.PurePath)
CONTAINERS = (tuple, list, frozenset, set, dict, collections.deque)
# Those that change in place, with their items as a list (a deque's, in order).
MUTABLE_CONTAINERS = (list, dict, set, collections.deque)
# A container with more elements than this is guarded by identity and length.
LARGE = 1024


def _numpy_scalar(value) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.generic)


def snapshot(value, budget: list | None = None) -> Any:
    """A comparable copy of a plain value (scalars, numpy scalars, and tuples,
    lists, sets and dicts of them), or MISSING for anything else."""
    if isinstance(value, _SCALARS) or _numpy_scalar(value):
        return value
    if isinstance(value, CONTAINERS):
        budget = [LARGE] if budget is None else budget
        budget[0] -= len(value)
        if budget[0] < 0:
            return MISSING
        items = value.items() if isinstance(value, dict) else value
        if isinstance(value, dict):
            flat = tuple((snapshot(k, budget), snapshot(v, budget)) for k, v in items)
            ok = all(k is not MISSING and v is not MISSING for k, v in flat)
        else:
            flat = tuple(snapshot(v, budget) for v in items)
            ok = all(v is not MISSING for v in flat)
        return (type(value), flat) if ok else MISSING
    return MISSING


def saved(value) -> list:
    """The items of every list, dict and set in a value (nested ones
    included), as references: restore() puts them back after an in-place
    change, and they keep the objects a container held alive."""
    found, seen, todo = [], set(), [value]
    while todo and len(found) < LARGE:
        v = todo.pop()
        if id(v) in seen or not isinstance(v, CONTAINERS):
            continue
        seen.add(id(v))
        if isinstance(v, MUTABLE_CONTAINERS):
            found.append((v, list(v) if isinstance(v, (list, collections.deque)) else v.copy()))
        todo.extend(v.values() if isinstance(v, dict) else v)
    return found


def restore(found: list) -> None:
    """Put back what saved() found."""
    for container, items in found:
        if isinstance(container, list):
            container[:] = items
        elif isinstance(container, collections.deque):
            container.clear()
            container.extend(items)
        else:
            container.clear()
            container.update(items)


def copy_containers(value, budget: list | None = None):
    """A copy of the containers in a value, sharing everything else, or MISSING
    if it holds a tensor or an array (which `==` cannot compare) or is large.
    Comparing a container with its copy by `==` runs in C, element by element,
    each first by identity."""
    budget = [LARGE] if budget is None else budget
    if isinstance(value, torch.Tensor) or layout(value) is not MISSING:
        return MISSING
    if not isinstance(value, CONTAINERS):
        return value
    budget[0] -= len(value)
    if budget[0] < 0:
        return MISSING
    if isinstance(value, dict):
        items = [(k, copy_containers(v, budget)) for k, v in value.items()]
        if any(v is MISSING for _, v in items):
            return MISSING
        try:
            return type(value)(items)
        except TypeError:   # a dict subclass that takes other arguments
            return dict(items)
    items = [copy_containers(v, budget) for v in value]
    if any(v is MISSING for v in items):
        return MISSING
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*items)
    if isinstance(value, collections.deque):
        return collections.deque(items, value.maxlen)
    try:
        return type(value)(items)
    except TypeError:
        return list(items)


def mutable(value) -> bool:
    """Whether the value can change in place (so that identity says nothing)."""
    if isinstance(value, MUTABLE_CONTAINERS):
        return True
    return isinstance(value, (tuple, frozenset)) and any(mutable(v) for v in value)


def layout(value) -> Any:
    """What a program input read through a path depends on: its tensor layout."""
    if isinstance(value, torch.Tensor):
        return (type(value), tuple(value.shape), value.dtype, value.device, value.requires_grad)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        return (numpy.ndarray, value.shape, value.dtype.str)
    return MISSING


def contents(value, budget: list | None = None) -> Any:
    """A container item by item: plain values by value, tensors by layout,
    other objects by identity (the guard keeps them alive)."""
    budget = [LARGE] if budget is None else budget
    plain = snapshot(value, budget)
    if plain is not MISSING:
        return plain
    if isinstance(value, CONTAINERS):
        budget[0] -= len(value)
        if budget[0] < 0:
            return ("large", id(value), len(value))
        if isinstance(value, dict):
            return (type(value), tuple((contents(k, budget), contents(v, budget))
                                       for k, v in value.items()))
        return (type(value), tuple(contents(v, budget) for v in value))
    found = layout(value)
    return found if found is not MISSING else ("object", id(value))


class Check(enum.Enum):
    """How a guard compares what is at its place now with what was read."""

    VALUE = "value"          # a plain value: same type and value
    EQUAL = "equal"          # a container: equal to a copy of it (==, in C)
    ABSENT = "absent"        # nothing there (the read raised AttributeError)
    IDENTITY = "identity"    # the same object
    TYPE = "type"            # an object of this type (`original`), read in place (argument_objects.py)
    CONTENTS = "contents"    # a container: contents() equal
    LAYOUT = "layout"        # a tensor read as a program input: same layout


@dataclasses.dataclass(eq=False)
class Guard:
    name: str        # as the log shows it: "model.drop.p", "global 'LOSS_WEIGHT' of train"
    holder: Any      # a dict or an accessor with .get(key, default)
    key: Any
    check: Check
    original: Any    # the value read (kept alive: identity and contents compare with it)
    expected: Any = dataclasses.field(init=False)
    # the objects in a container guarded by identity, kept alive so that no
    # other object can take their ids
    kept: Any = dataclasses.field(init=False, default=None)

    def __post_init__(self):
        if self.check is Check.CONTENTS or (self.check is Check.VALUE and mutable(self.original)):
            self.kept = saved(self.original)
            copied = copy_containers(self.original)
            if copied is not MISSING:   # compared by == with a copy, in C
                self.check, self.expected = Check.EQUAL, copied
                return
        self.expected = {Check.VALUE: lambda v: v,
                         Check.ABSENT: lambda v: MISSING,
                         Check.IDENTITY: lambda v: v,
                         Check.TYPE: lambda v: v,
                         Check.CONTENTS: contents,
                         Check.LAYOUT: layout}[self.check](self.original)

    def current(self) -> Any:
        return self.holder.get(self.key, MISSING)

    def holds(self) -> bool:
        now = self.current()
        if _symbolic(now):   # a number the trace computed, left here: changed
            return False
        if self.check is Check.VALUE:
            return now is self.original or (type(now) is type(self.original)
                                            and now == self.original)
        if self.check is Check.EQUAL:
            return type(now) is type(self.original) and now == self.expected
        if self.check is Check.ABSENT:
            return now is MISSING
        if self.check is Check.IDENTITY:
            return now is self.original
        if self.check is Check.TYPE:
            return type(now) is self.original
        if self.check is Check.CONTENTS:
            return contents(now) == self.expected
        return layout(now) == self.expected

    def expression(self, i: int) -> str:
        """This guard's check as a Python expression over the names H{i}
        (holder), K{i} (key), O{i} (original) and E{i} (expected)."""
        get = f"H{i}.get(K{i}, MISSING)"
        if self.check is Check.VALUE:
            return f"((_v := {get}) is O{i} or (type(_v) is T{i} and _v == O{i}))"
        return {Check.EQUAL: f"(type(_v := {get}) is T{i} and _v == E{i})",
                Check.ABSENT: f"{get} is MISSING",
                Check.IDENTITY: f"{get} is O{i}",
                Check.TYPE: f"type({get}) is O{i}",
                Check.CONTENTS: f"contents({get}) == E{i}",
                Check.LAYOUT: f"layout({get}) == E{i}"}[self.check]

    def describe(self) -> str:
        now = self.current()
        if self.check is Check.IDENTITY or (self.check in (Check.CONTENTS, Check.EQUAL)
                                            and snapshot(self.original) is MISSING):
            what = "absent" if now is MISSING else f"another {type(now).__name__} object"
            if self.check is not Check.IDENTITY and now is self.original:
                what = "changed in place"
            return f"{self.name}: {what}"
        if self.check is Check.LAYOUT:
            return f"{self.name}: {_show_layout(self.original)} -> {_show_layout(now)}"
        if self.check is Check.TYPE:
            return f"{self.name}: a {self.original.__name__} -> {_show_layout(now)}"
        before = "absent" if self.check is Check.ABSENT else show(self.original)
        return f"{self.name}: {before} -> {'absent' if now is MISSING else show(now)}"


def _symbolic(value, depth: int = 0) -> bool:
    """Whether a value, or a container in it, holds a symbolic number (one a
    trace computed: comparing it would be a decision on it)."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if depth < 4 and isinstance(value, CONTAINERS):
        return any(_symbolic(v, depth + 1)
                   for v in (value.values() if isinstance(value, dict) else value))
    return False


def _show_layout(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {str(value.dtype).replace('torch.', '')}{list(value.shape)} on {value.device}"
    return "absent" if value is MISSING else f"a {type(value).__name__}"


@dataclasses.dataclass(eq=False)
class HookGuard:
    """The hooks the traced step ran: each hooks dict it read (a module's
    forward and backward hooks, torch's global module hooks, a parameter's
    tensor hooks) with the handles it held. Every registration anywhere bumps
    RemovableHandle.next_id, so while that is unchanged only a removal can
    have changed a dict, and only the dicts that held hooks are compared;
    after a registration, all of them are, once."""

    places: list = dataclasses.field(default_factory=list)   # (name, get the dict, handles)
    next_id: int = -1

    def add(self, name: str, get, hooks) -> None:
        self.places.append((name, get, _handles(hooks)))

    def seal(self) -> None:
        """Record the registration counter as the trace leaves it."""
        self.next_id = RemovableHandle.next_id
        self._held = [p for p in self.places if p[2]]

    def changed(self) -> str | None:
        places = self.places if RemovableHandle.next_id != self.next_id else self._held
        for name, get, handles in places:
            now = _handles(get())
            if now != handles:
                return f"{name}: {len(handles)} -> {len(now)} hooks"
        self.next_id = RemovableHandle.next_id
        return None

    def __len__(self) -> int:
        return len(self.places)


def _handles(hooks) -> tuple:
    return tuple(hooks) if hooks else ()


class Guards:
    """The guards of one program, checked with one generated function."""

    def __init__(self, guards: list[Guard], hooks: HookGuard | None = None):
        self.guards = guards
        self.hooks = hooks or HookGuard()
        if self.hooks.next_id < 0:
            self.hooks.seal()
        namespace = {"MISSING": MISSING, "snapshot": snapshot, "contents": contents,
                     "layout": layout}
        terms = []
        for i, g in enumerate(guards):
            # an accessor backed by a mapping is checked on the mapping (C's .get)
            namespace.update({f"H{i}": getattr(g.holder, "mapping", g.holder), f"K{i}": g.key, f"O{i}": g.original,
                              f"E{i}": g.expected, f"T{i}": type(g.original)})
            terms.append(g.expression(i))
        source = "def check():\n    return " + (" and ".join(terms) or "True") + "\n"
        exec(compile(source, "<guards>", "exec"), namespace)   # noqa: S102 - our own code
        self._check = namespace["check"]

    def changed(self) -> str | None:
        """None while every value is as recorded, else one line naming the first
        that is not."""
        if not self._check():
            return next((g.describe() for g in self.guards if not g.holds()), "a guarded value")
        return self.hooks.changed()

    def changed_numbers(self) -> list[Guard]:
        """The guards of numbers now of another value (of the same type):
        those a trace may read from an input instead (numbers.py)."""
        return [g for g in self.guards if g.check is Check.VALUE and is_number(g.original)
                and type(g.current()) is type(g.original) and not g.holds()]

    def __len__(self) -> int:
        return len(self.guards) + len(self.hooks)


def show(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
