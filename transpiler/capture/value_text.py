"""A tensor's value turned into text while the step is traced, as eager does.

`.item()` on a traced tensor gives a symbolic number (zuf0). Printed, logged or
formatted by the user's code (`print(loss.item())`, `logging.info("%s", ...)`,
`f"{acc:.3f}"`, `round(x, 3)`), it would be the symbol's name, once: the step's
Python does not run again for later calls of the same program. While a step
is traced, a symbolic number that holds a tensor's value, turned into text by
code outside torch and this package, is turned into text as its value: the
conversion to a Python number is a decision on that value (decisions.py), as
Tensor.__format__ of a 0-d tensor is (trace.py), so the step is traced on this
call's values and again for a call whose value differs. A trace on fake
values stops there, even where the stop is caught (logging prints the error
and goes on). A logging call's arguments are such values as the record is
made, since a handler may format it later (a queue's, pytest's caplog), after
the trace. Sizes (backed symbols) and torch's own texts of symbols (its
graphs, messages, logs) are left as they are.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import torch
from torch.fx.experimental.symbolic_shapes import (GuardOnDataDependentSymNode,
                                                   free_unbacked_symbols)

# a symbolic number's Python type
KINDS = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}
_METHODS = ("__str__", "__repr__", "__format__")
# torch's and this package's code, whose texts of a symbol stay symbolic
_OWN = tuple(os.path.dirname(p) + os.sep for p in
             (torch.__file__, os.path.dirname(os.path.abspath(__file__))))


def _as_value(cls, name: str, original, stops: list):
    kind = KINDS[cls]

    def text(self, *args):
        caller = sys._getframe(1).f_code.co_filename
        if not free_unbacked_symbols(self) or caller.startswith(_OWN):
            return original(self, *args)
        try:
            value = kind(self)
        except GuardOnDataDependentSymNode as exc:   # fake values: the trace stops here
            stops.append(exc)
            raise
        return getattr(value, name)(*args)
    return text


_MAKE_RECORD = logging.Logger.makeRecord


def _value(x):
    if type(x) in KINDS and free_unbacked_symbols(x):
        return KINDS[type(x)](x)
    return x


def _make_record(self, name, level, fn, lno, msg, args, *rest, **kwargs):
    if isinstance(args, dict):
        args = {k: _value(v) for k, v in args.items()}
    elif isinstance(args, tuple):
        args = tuple(map(_value, args))
    return _MAKE_RECORD(self, name, level, fn, lno, _value(msg), args, *rest, **kwargs)


@contextlib.contextmanager
def values_as_text():
    """While tracing: a tensor's value as text is its value (module docstring)."""
    stops: list = []
    saved = [(cls, name, cls.__dict__.get(name)) for cls in KINDS for name in _METHODS]
    for cls, name, own in saved:
        setattr(cls, name, _as_value(cls, name, getattr(cls, name), stops))
    logging.Logger.makeRecord = _make_record
    try:
        yield
    finally:
        logging.Logger.makeRecord = _MAKE_RECORD
        for cls, name, own in saved:
            if own is None:
                delattr(cls, name)
            else:
                setattr(cls, name, own)
    if stops:   # caught on its way out (by logging, or the user's try)
        raise stops[0]
