"""Iterators on the host that the step pulls from.

An iterator keeps its position where a trace cannot read it or put it back:
in C (a list's iterator, itertools.count, zip), in a suspended frame (a
generator), or in a DataLoader's worker state. A step that pulls from one it
did not create (an attribute, a global, a closure cell, an argument, an item
of a container it reads: `data = next(self._data_loader_iter)`, `lr =
next(self.lr_schedule)`) would pull once, while traced, and run every later
call on that item, leaving the iterator one item on where eager moves it one
item per call. So while the step is traced it sees a stand-in in that place,
which refuses the pull before it is made, naming the iterator and the user's
line: nothing is consumed. An iterator the step makes itself and leaves
(`next(iter(model.parameters()))`, `for x, y in zip(xs, ys)`) is its own and
pulled as eager pulls it.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

from torch.utils.data.dataloader import _BaseDataLoaderIter

from ..errors import TranspileError
from .user_code import step_name, user_line


def pulled_stand_in(step_fn, value, name: str) -> Any:
    """The stand-in for an iterator the step reaches at `name`, or None for
    anything else. A file is an iterator too, over its lines: printed.py
    stands in for it. An iterator of the user's own class keeps its position
    in its attributes, which the trace observes (reads.py)."""
    if not isinstance(value, Iterator) or isinstance(value, io.IOBase):
        return None
    if hasattr(value, "__dict__") and not isinstance(value, _BaseDataLoaderIter):
        return None
    return _Unpulled(step_fn, value, name)


class _Unpulled:
    """An iterator that refuses to be pulled from, for one trace."""

    def __init__(self, step_fn, iterator, name: str):
        self._step_fn, self._iterator, self._name = step_fn, iterator, name

    def __iter__(self):
        return self

    def __next__(self):
        raise TranspileError(
            f"{step_name(self._step_fn)} pulls an item from {self._name} (a "
            f"{type(self._iterator).__name__}){user_line(self._step_fn)}, an iterator it "
            "did not create: the program runs without the step's Python, so it would pull "
            "once, while the step is traced, and reuse that item on every call. Pull outside "
            "the step (x, y = next(it)) and pass the item as an argument; nothing was pulled")

    def send(self, _value):
        return self.__next__()

    def __getattr__(self, attribute: str):
        return getattr(self._iterator, attribute)
