"""Values the step appends to a list or a deque on the host.

`self.losses.append(loss.item())`, Lightning's
`self.training_step_outputs.append(loss)`, torchvision's SmoothedValue
(`self.deque.append(value)`): eager adds one item per call, computed from that
call's tensors, and the program runs without the step's Python. A first trace
sees such a container changed in place, holding values the program computes
(host_state.py); where every such change is items added at the end of a list
or a deque read at a place (reads.place_key: an attribute, a global, a closure
cell, a dict's key), the step is traced again with, at each of those places, a
stand-in that takes appends (`append`, `extend`, `+=`) and refuses any read
(its items, its length, iterating it): what the program computes cannot
depend on what the host holds there. Each item appended is then an output of
the program (a tensor, or a number as the step's Python makes it,
returned.py), appended to the container itself after every run, in the step's
order; the program is guarded by the container's identity alone, so it serves
every call however long the list grows. A deque with a maxlen drops its oldest
items as eager's does.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from ..errors import TranspileError
from .user_code import step_name, user_line

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


class AppendsSeen(Exception):
    """The step appends to containers at `places`: trace again with those
    containers taking appends only."""

    def __init__(self, places: frozenset):
        super().__init__(f"{len(places)} containers appended to")
        self.places = places


class AppendedRead(TranspileError):
    """The step reads a container it appends to (at `place`): trace again with
    that container as any other (appends of the program's values there are
    refused with this error)."""

    def __init__(self, place, message: str):
        super().__init__(message)
        self.place = place


def appended_place(write, place) -> Any:
    """`place` where `write` (reads.Write, in place) is items added at the end
    of a list or a deque read there, and nothing else it holds changed; else
    None."""
    if not write.in_place or not write.before or not write.after:
        return None
    (container, before), (after_container, after) = write.before[0], write.after[0]
    if container is not after_container or not isinstance(container, (list, collections.deque)):
        return None
    if any(b[1] != a[1] for b, a in zip(write.before[1:], write.after[1:])):
        return None   # a container held inside changed too
    kept = len(after) - _added(container, before, after)
    return place if 0 < len(after) - kept and all(
        a is b for a, b in zip(after[:kept], before[len(before) - kept:])) and all(
        _appendable(item) for item in after[kept:]) else None


def _appendable(item) -> bool:
    """What the program can give: a tensor, a number (symbolic or plain)."""
    return isinstance(item, (torch.Tensor, *_SYMBOLIC)) or type(item) in (int, float, bool)


def _added(container, before: list, after: list) -> int:
    """How many items were added at the end (a full deque drops as many at its
    start)."""
    if getattr(container, "maxlen", None) is None or len(after) > len(before):
        return len(after) - len(before)
    return next((n for n in range(1, len(after) + 1)
                 if all(a is b for a, b in zip(after[:-n], before[n:]))), len(after))


class AppendOnly:
    """What the step sees at an appended container's place while traced: it
    keeps what is appended, in order, and refuses a read."""

    def __init__(self, container, name: str, place, step_fn):
        self._container, self._name, self._place, self._step_fn = container, name, place, step_fn
        self.items: list = []

    def append(self, item) -> None:
        self.items.append(item)

    def extend(self, items) -> None:
        self.items.extend(items)

    def __iadd__(self, items):
        self.extend(items)
        return self

    def __getattr__(self, name: str):
        if name.startswith("_"):   # a probe (hasattr, a protocol), not a method of the list
            raise AttributeError(name)
        raise self._refused(f".{name}")

    def _refused(self, what: str) -> AppendedRead:
        return AppendedRead(self._place, (
            f"{step_name(self._step_fn)} appends values it computes from tensors to "
            f"{self._name} and also reads it ({what}){user_line(self._step_fn)}: the program "
            "appends each call's values after it runs, so it cannot read what the host holds "
            "there; return the value from the step and keep it after the call"))

    def _read(name: str):
        def refused(self, *args, **kwargs):
            raise self._refused(name)
        return refused

    __len__ = _read("len()")
    __iter__ = _read("iterating it")
    __getitem__ = _read("an item")
    __contains__ = _read("`in`")
    __bool__ = _read("its truth")
    __reversed__ = _read("reversed()")
    __eq__ = _read("==")
    __hash__ = None
    del _read

    def appended(self) -> list[Appended]:
        """What the step appended, as outputs of the program; a TranspileError
        for an item the program cannot give (an object, a string)."""
        for item in self.items:
            if not _appendable(item):
                raise TranspileError(
                    f"{step_name(self._step_fn)} appends a {type(item).__name__} to "
                    f"{self._name}{user_line(self._step_fn)}, where it appends numbers or "
                    "tensors on other calls: the program appends tensors and numbers after "
                    "each run; append the rest outside the step")
        return [Appended(self._name, self._container, item) for item in self.items]


class Appended:
    """One item appended at a place: `after` the trace's value (an output of
    the program), put_back appends a run's value to the container."""

    def __init__(self, name: str, container, after):
        self.name, self.container, self.after = name, container, after

    def put_back(self, value) -> None:
        self.container.append(value)
