"""Functions the model memoizes with functools (lru_cache, cache):
transformers caches BEiT's and Data2Vec's relative position index this way.
A cache is host state the step fills on its first call and reads afterwards.

A trace that fills one leaves it holding the trace's tensors, which the next
eager forward, or the next trace, would read: every cache filled while the
step is traced is emptied after the trace, so the program computes the value
on every call (its ops are in the graph) and eager computes it again where it
is next called, as the function is pure. A cache filled before the trace (a
forward outside the step) hands the trace a tensor that existed before it,
which outside.py refuses as a constant: the step is traced again with those
caches emptied (`read_before`).

The caches seen are those at the top level of a module, or in a class of one,
outside torch, the standard library and this package, and those a wrapper
there closes over (not one kept on an instance).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from typing import Iterator

from .user_code import library_dirs

_Cache = functools._lru_cache_wrapper


def _user_caches() -> list[_Cache]:
    libraries = library_dirs()
    found: dict[int, _Cache] = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or path.startswith(libraries) \
                or not isinstance(getattr(module, "__dict__", None), dict):
            continue   # a library's, or an object put in sys.modules that is not a module
        caches, classes = _SCANS.scanned(module, _scan_module)
        for cache in caches + [c for cls in classes for c in _SCANS.scanned(cls, _scan_class)]:
            found[id(cache)] = cache
    return list(found.values())


def _scan_module(module) -> tuple[list[_Cache], list[type]]:
    """The caches among a module's values, and its own classes (scanned apart:
    a class's namespace may change while its module's does not)."""
    caches, classes = [], []
    for value in list(vars(module).values()):
        if isinstance(value, type) and value.__module__ == module.__name__:
            classes.append(value)
        else:
            caches += _caches_in(value)
    return caches, classes


def _scan_class(cls) -> list[_Cache]:
    return [c for v in list(vars(cls).values()) for c in _caches_in(getattr(v, "__func__", v))]


class _Scans:
    """What a module's or a class's namespace held at its last scan, by the
    identity of each value: a trace scans the thousands of modules a script
    imports, and their namespaces rarely change between traces."""

    def __init__(self):
        self._last: dict[int, tuple[object, tuple[int, ...], object]] = {}

    def scanned(self, owner, scan):
        values = tuple(map(id, list(vars(owner).values())))
        last = self._last.get(id(owner))
        if last is not None and last[0] is owner and last[1] == values:
            return last[2]
        found = scan(owner)
        self._last[id(owner)] = (owner, values, found)
        return found


_SCANS = _Scans()


def _caches_in(value) -> list[_Cache]:
    """The cache itself, or the caches a decorator's wrapper closes over
    (transformers' compile_compatible_method_lru_cache)."""
    if type(value) is _Cache:
        return [value]
    if not isinstance(value, types.FunctionType):
        return []
    cells = value.__closure__ or ()
    return [c.cell_contents for c in cells
            if type(getattr(c, "cell_contents", None)) is _Cache]


class Caches:
    """The user's caches and what the trace did with them."""

    def __init__(self):
        self._before = [(c, c.cache_info()) for c in _user_caches()]
        self.read_before: list[_Cache] = []

    def settle(self) -> None:
        """After the trace: empty the caches it filled; note those it read
        entries of that were there before it."""
        for cache, before in self._before:
            now = cache.cache_info()
            if now.hits != before.hits and before.currsize:
                self.read_before.append(cache)
            if now.misses != before.misses:
                cache.cache_clear()

    def forget_read(self) -> None:
        for cache in self.read_before:
            cache.cache_clear()


@contextlib.contextmanager
def memoized_while_traced() -> Iterator[Caches]:
    caches = Caches()
    try:
        yield caches
    finally:
        caches.settle()
