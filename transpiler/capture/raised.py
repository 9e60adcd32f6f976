"""An exception the step raises itself on this call's values: a validation
`raise` on a value (`if not torch.isfinite(loss): raise FloatingPointError`),
`sys.exit(1)` after a non-finite loss, clip_grad_norm_'s
`error_if_nonfinite=True`. Eager writes what the step did up to the raise
(zero_grad's None, a forward's batch-norm statistics, the generator's draws),
then raises.

A trace on the call's values (decisions.py) that meets such an exception
stops the step there: the program computes what the step did before it, and
the runtime writes that and raises the same exception, with the traceback of
the step's frames, on every call whose decisions take that branch. Only a
`raise` or `assert` statement (the step's or a library's) and sys.exit() count:
an op or a builtin that fails on what the trace gave it (`.numpy()` of a
traced tensor) is a failure of the trace, as is an exception raised inside
torch's tracing machinery (or this package), or while handling one."""

from __future__ import annotations

import dataclasses
import dis
import functools
import os
import types

import torch

from ..errors import TranspileError
from .user_code import library_dirs

_TORCH = os.path.dirname(torch.__file__) + os.sep
# Where torch traces (fake tensors, proxies, decompositions, symbolic shapes):
# an exception raised there is the trace's, not the step's.
_TRACING = tuple(_TORCH + p for p in (
    "_subclasses" + os.sep, "fx" + os.sep, "_dynamo" + os.sep, "_functorch" + os.sep,
    "_prims" + os.sep, "_prims_common" + os.sep, "_refs" + os.sep, "_decomp" + os.sep,
    "_library" + os.sep, "_higher_order_ops" + os.sep, "_inductor" + os.sep,
    "utils" + os.sep + "_sympy" + os.sep, "_ops.py", "_meta_registrations.py", "_guards.py",
    "utils" + os.sep + "_python_dispatch.py", "utils" + os.sep + "_stats.py", "_compile.py",
)) + (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)


def _innermost(exc: BaseException) -> types.TracebackType | None:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb


def _raised_in(exc: BaseException) -> str:
    """The file of the innermost frame the exception passed through."""
    tb = _innermost(exc)
    return "" if tb is None else tb.tb_frame.f_code.co_filename


def _by_a_raise_statement(exc: BaseException) -> bool:
    """Whether Python code raised it (`raise`, `assert`): not an op's kernel
    or a builtin failing on what the trace gave it (`.numpy()` of a traced
    tensor), which eager would not have met."""
    tb = _innermost(exc)
    if tb is None:
        return False
    return _opnames(tb.tb_frame.f_code).get(tb.tb_lasti) in ("RAISE_VARARGS", "RERAISE")


@functools.lru_cache(maxsize=256)
def _opnames(code: types.CodeType) -> dict[int, str]:
    return {ins.offset: ins.opname for ins in dis.get_instructions(code)}


def raised_by_the_step(exc: BaseException, handled: BaseException | None) -> bool:
    """Whether the step itself raised `exc` (its code or a library's check on
    the values it was given: a `raise` or `assert` statement, or sys.exit()),
    as eager would on the same values; `handled`: the exception being handled
    when the step was called (the context of everything raised in it)."""
    if isinstance(exc, TranspileError) or not (
            isinstance(exc, SystemExit)
            or isinstance(exc, Exception) and _by_a_raise_statement(exc)):
        return False
    seen: set[int] = {id(handled)}
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _raised_in(exc).startswith(_TRACING):
            return False
        exc = exc.__cause__ or exc.__context__
    return True


@dataclasses.dataclass
class Raised:
    """The exception a program ends in, raised after its writes on every run."""

    exception: BaseException
    traceback: types.TracebackType | None

    @classmethod
    def of(cls, exc: BaseException) -> Raised:
        """Its traceback from the first frame in the user's code (the step's
        frames, without the trace's)."""
        tb = exc.__traceback__
        libraries = library_dirs() + ("<",)
        while tb is not None and tb.tb_frame.f_code.co_filename.startswith(libraries):
            tb = tb.tb_next
        return cls(exc, tb or exc.__traceback__)

    def describe(self) -> str:
        text = str(self.exception).splitlines()
        return f"{type(self.exception).__name__}" + (f": {text[0]}" if text else "")

    def throw(self):
        raise self.exception.with_traceback(self.traceback)
