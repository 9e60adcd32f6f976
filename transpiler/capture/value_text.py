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
the trace. A symbolic size turned into text by the user's own code
(`print(x.shape)`) is its value too: reading it as a number specializes the
size (a guard: the program is for that size, as for `range(n)`). Sizes in
libraries' texts and torch's own texts of symbols (its graphs, messages,
logs) are left as they are. What the trace printed is shown again after each
later run of its program (printed.py). Where the step's own code turns such
a value into text, the text holds a marker instead and the value is an output
of the program, filled in after each run (text_values.py); the decisions
above are what is left where that does not hold.
"""

from __future__ import annotations

import collections.abc
import contextlib
import logging
import math
import os
import re
import sys

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import (GuardOnDataDependentSymNode,
                                                   free_unbacked_symbols)
from torch.utils._python_dispatch import _disable_current_modes

from .text_values import TextValues
from .user_code import is_user_file

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
        if caller.startswith(_OWN):
            return original(self, *args)
        if not self.node.expr.free_symbols:   # a decision took it to its value
            return getattr(kind(self), name)(*args)
        if not (free_unbacked_symbols(self) or is_user_file(caller)):
            return original(self, *args)
        marking = _marking(caller)
        if marking is not None and free_unbacked_symbols(self) and marking.markable(self):
            return marking.mark(self, lambda value: getattr(kind(value), name)(*args))
        try:
            value = kind(self)
        except GuardOnDataDependentSymNode as exc:   # fake values: the trace stops here
            stops.append(exc)
            raise
        return getattr(value, name)(*args)
    return text


def eager_repr(t: torch.Tensor) -> str:
    """repr(t) as eager shows it: each value it shows read (a decision on
    that value, as `.item()` is), formatted by torch from a real tensor of t's
    shape, dtype and device that holds them, with t's autograd suffix (a
    summarized tensor's formatting reads the values it shows only)."""
    opts = torch._tensor_str.PRINT_OPTS
    real = _shown_values(t, opts.threshold, opts.edgeitems)
    with _disable_current_modes():
        return _autograd_suffix(t)(repr(real))


def _autograd_suffix(t: torch.Tensor):
    """What eager's repr of t adds to that of a tensor of its values: its
    grad_fn, or requires_grad."""
    grad_fn = t.grad_fn
    if grad_fn is None and not t.requires_grad:
        return lambda text: text
    name = "requires_grad=True" if grad_fn is None else (
        f"grad_fn=<{grad_fn.name().rsplit('::', 1)[-1]}>" if type(grad_fn).__name__ == "CppFunction"
        else f"grad_fn=<{type(grad_fn).__name__}>")
    return lambda text: torch._tensor_str._add_suffixes(text[:-1], [name], len("tensor("), False)


def tensor_text(t: torch.Tensor, caller: str, spec: str | None = None) -> str:
    """A traced tensor turned into text by code in `caller`: repr(t) (spec
    None), or a 0-d tensor's value formatted by spec, as eager's. A marker
    where the user's code prints it (text_values.py); else each value it
    shows a decision."""
    marking = _marking(caller)
    if spec is not None:
        if marking is not None:
            return marking.mark_tensor(t, lambda real: real.item().__format__(spec))
        return as_numbers(t.detach().item()).__format__(spec)
    if marking is not None:
        suffix = _autograd_suffix(t)
        return marking.mark_tensor(t, lambda real: suffix(repr(real)))
    return eager_repr(t)


def eager_array_text(t: torch.Tensor, show) -> str:
    """show(t.numpy()) (str, repr, a format) as eager's: each value numpy's
    printout shows read, as eager_repr's."""
    opts = np.get_printoptions()
    real = _shown_values(t, opts["threshold"], opts["edgeitems"])
    with _disable_current_modes():
        return show(real.numpy())


def _shown_values(t: torch.Tensor, threshold: int, edgeitems: int) -> torch.Tensor:
    """A real tensor of t's shape, dtype and device holding the values of t a
    printout summarized at (threshold, edgeitems) shows, each read (a
    decision), zeros elsewhere."""
    shape = [int(n) for n in t.shape]   # a symbolic size: specialized
    summarized = math.prod(shape) > threshold
    shown = [list(range(n)) if not summarized or n <= 2 * edgeitems
             else [*range(edgeitems), *range(n - edgeitems, n)] for n in shape]
    values = t.detach()
    for dim, rows in enumerate(shown):
        if len(rows) < shape[dim]:
            values = values.index_select(dim, torch.tensor(rows, device=t.device))
    empty = math.prod(shape) == 0   # (shows no values)
    read = [] if empty else as_numbers(values.tolist())
    with _disable_current_modes():
        real = torch.zeros(shape, dtype=t.dtype, device=t.device)
        if not empty:
            index = torch.meshgrid(*(torch.tensor(rows, dtype=torch.long) for rows in shown),
                                   indexing="ij") if shape else ()
            real[index] = torch.tensor(read, dtype=t.dtype, device=t.device)
    return real


def as_numbers(values):
    """A traced tensor's values (.item(), .tolist()) as Python numbers: each a
    decision on its value."""
    if isinstance(values, list):
        return [as_numbers(v) for v in values]
    return KINDS[type(values)](values) if type(values) in KINDS else values


def shows_values(t) -> bool:
    """A traced tensor whose repr eager_repr gives (a plain dense one)."""
    return isinstance(t, FakeTensor) and t.layout is torch.strided \
        and not t.is_complex() and not t.is_quantized


class _Shown:
    """A traced tensor logged by the user's code: as eager's text, or as its
    value for a number format (`%.4f`)."""

    def __init__(self, tensor):
        self.text, self._tensor = eager_repr(tensor), tensor

    def __str__(self):
        return self.text

    __repr__ = __str__

    def __format__(self, spec):   # a number format of a 0-d tensor: its value's, as eager's
        return format(as_numbers(self._tensor.item()), spec) if spec else self.text

    def __float__(self):
        return float(self._tensor)

    def __int__(self):
        return int(self._tensor)

    __index__ = __int__


_MAKE_RECORD = logging.Logger.makeRecord


def _value(x, user: bool):
    if type(x) in KINDS and free_unbacked_symbols(x):
        return KINDS[type(x)](x)
    if user and shows_values(x):
        return _Shown(x)
    return x


# a conversion of printf-style formatting, as logging applies msg % args
_CONVERSION = re.compile(r"%(?:\((?P<key>[^)]*)\))?"
                         r"(?P<spec>[#0 +-]*\d*(?:\.\d+)?[hlL]?(?P<conv>[diouxXeEfFgGcrsa%]))")
_END = object()


def _markable(marking: TextValues, v) -> bool:
    return type(v) in KINDS and bool(free_unbacked_symbols(v)) and marking.markable(v)


def _marked_message(marking: TextValues, msg, args: tuple) -> str | None:
    """msg % args as a record's getMessage() formats it, each tensor value
    among args a marker rendering its own conversion (`%.4f` of loss.item());
    None where args hold none, or the format is one this does not read (a `*`
    width, arguments that do not match it)."""
    mapping = args[0] if len(args) == 1 and isinstance(args[0], collections.abc.Mapping) \
        and args[0] else None
    values = list(mapping.values()) if mapping is not None else list(args)
    if not isinstance(msg, str) or "*" in msg or not any(_markable(marking, v) or shows_values(v)
                                                         for v in values):
        return None
    positional = iter(args)

    def convert(match) -> str:
        conv, spec = match.group("conv"), "%" + match.group("spec")
        if conv == "%":
            return "%"
        v = mapping[match.group("key")] if match.group("key") is not None else next(positional)
        if _markable(marking, v):
            kind = KINDS[type(v)]
            return marking.mark(v, lambda value: spec % (kind(value),))
        if shows_values(v) and conv in "sra":   # str, repr and ascii of a tensor: its repr
            suffix, as_text = _autograd_suffix(v), spec[:-1] + "s"
            return marking.mark_tensor(v, lambda real: as_text % (suffix(repr(real)),))
        if shows_values(v):
            return marking.mark_tensor(v, lambda real: spec % (real.item(),))
        return spec % (v,)
    try:
        text = _CONVERSION.sub(convert, msg)
    except (KeyError, StopIteration, TypeError, ValueError):
        return None
    return text if mapping is not None or next(positional, _END) is _END else None


def _make_record(self, name, level, fn, lno, msg, args, *rest, **kwargs):
    user = is_user_file(fn)
    marking = _TEXT_VALUES[-1] if _TEXT_VALUES and user else None
    text = _marked_message(marking, msg, args) \
        if marking is not None and isinstance(args, tuple) and args else None
    if text is not None:   # the user's logging of tensor values: filled in after each run
        return _MAKE_RECORD(self, name, level, fn, lno, text, (), *rest, **kwargs)
    if isinstance(args, dict):
        args = {k: _value(v, user) for k, v in args.items()}
    elif isinstance(args, tuple):
        args = tuple(_value(v, user) for v in args)
    return _MAKE_RECORD(self, name, level, fn, lno, _value(msg, user), args, *rest, **kwargs)


_FAKE_REPR = FakeTensor.__repr__


def _repr_as_in_eager(self, *args, **kwargs):
    caller = sys._getframe(1).f_code.co_filename
    if shows_values(self) and is_user_file(caller):
        # a parameter's stand-in: as nn.Parameter's repr
        prefix = "Parameter containing:\n" if id(self) in _PARAMETERS else ""
        return prefix + tensor_text(self, caller)
    return _FAKE_REPR(self, *args, **kwargs)


# the trace's TextValues while values_as_text is given one
_TEXT_VALUES: list[TextValues] = []
# ids of the traced stand-ins of nn.Parameters, while values_as_text runs
_PARAMETERS: set[int] = set()


def _marking(caller: str) -> TextValues | None:
    """Where values turned into text by code in `caller` are marked: the
    user's own code, in a trace that marks them."""
    return _TEXT_VALUES[-1] if _TEXT_VALUES and is_user_file(caller) else None


@contextlib.contextmanager
def values_as_text(marked: TextValues | None, parameters: set[int]):
    """While tracing: a tensor's value as text is its value, or where `marked`
    is given and the user's code prints it, a marker (module docstring).
    `parameters`: ids of the stand-ins of nn.Parameters, shown as eager
    shows a Parameter."""
    stops: list = []
    _PARAMETERS.update(parameters)
    if marked is not None:
        _TEXT_VALUES.append(marked)
    saved = [(cls, name, cls.__dict__.get(name)) for cls in KINDS for name in _METHODS]
    for cls, name, own in saved:
        setattr(cls, name, _as_value(cls, name, getattr(cls, name), stops))
    logging.Logger.makeRecord = _make_record
    FakeTensor.__repr__ = _repr_as_in_eager
    try:
        yield
    finally:
        _PARAMETERS.difference_update(parameters)
        if marked is not None:
            _TEXT_VALUES.pop()
        FakeTensor.__repr__ = _FAKE_REPR
        logging.Logger.makeRecord = _MAKE_RECORD
        for cls, name, own in saved:
            if own is None:
                delattr(cls, name)
            else:
                setattr(cls, name, own)
    if stops:   # caught on its way out (by logging, or the user's try)
        raise stops[0]
