"""Errors that name the user's code: the step's name and the innermost frame in
the user's files."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

import torch

from ..errors import TranspileError


def step_name(step_fn) -> str:
    return getattr(step_fn, "__qualname__", None) or getattr(step_fn, "__name__", "train_step")


_LIBRARY_DIRS = tuple(os.path.dirname(p) + os.sep for p in
                      (torch.__file__, os.__file__, os.path.dirname(__file__)))


def library_dirs() -> tuple[str, ...]:
    """torch, the standard library, this package, and numpy and sympy where
    they are loaded (sympy works for torch's symbolic shapes): code that is
    not the user's."""
    found = [sys.modules.get(name) for name in ("numpy", "sympy")]
    return _LIBRARY_DIRS + tuple(os.path.dirname(m.__file__) + os.sep for m in found if m)


def is_library(filename: str) -> bool:
    return not filename or filename.startswith(library_dirs()) or filename.startswith("<frozen")


def called_by_user(passed: Callable[[str], bool]) -> bool:
    """Whether the innermost frame of the stack whose file `passed` does not
    accept (the caller's own module, the generators it wraps) is the user's
    code, not a library's."""
    frame = sys._getframe(1)
    while frame is not None and passed(frame.f_code.co_filename):
        frame = frame.f_back
    return frame is not None and not is_library(frame.f_code.co_filename)


def is_user_file(filename: str, libraries: tuple[str, ...] | None = None) -> bool:
    """Whether code of `filename` is the user's own: not a library's (as
    library_dirs, or `libraries` where the caller asks of many files), and not
    any installed package's."""
    return not filename.startswith(libraries or library_dirs() + ("<",)) \
        and "site-packages" not in filename and "dist-packages" not in filename


def user_line(step_fn, tb=None, frames=None) -> str:
    """' at file:line (code)' for the innermost frame in the user's code (of
    the traceback `tb`, the `frames` given, or the current stack)."""
    if frames is None:
        frames = traceback.extract_tb(tb) if tb is not None else traceback.extract_stack()
    libraries = library_dirs() + ("<",)
    for frame in reversed(frames):
        if not frame.filename.startswith(libraries):
            return f" at {frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    return ""


_DATA_DEPENDENT = (
    "data-dependent", "DataDependent", "_local_scalar_dense", "item()",
    "value out of a tracing tensor", "DynamicOutputShape", "Cannot call numel",
)


def trace_error(step_fn, exc: BaseException,
                stepping: torch.optim.Optimizer | None) -> TranspileError:
    """The error for a trace that raised `exc`; `stepping`: the optimizer whose
    step() was being traced, if any."""
    where = user_line(step_fn, exc.__traceback__)
    text = f"{type(exc).__name__}: {exc}"
    if stepping is not None:
        return TranspileError(
            f"{type(stepping).__name__}.step() cannot be captured{where}: "
            f"{text.splitlines()[0]}. SGD, Adam and AdamW are supported; other optimizers "
            "work when their step traces into tensor operations")
    if "DynamicOutputShape" in text:
        return TranspileError(
            f"{step_name(step_fn)} calls {exc}{where}, whose result's shape depends on tensor "
            "values and which torch cannot trace with a symbolic size (it has no meta function "
            "for one): call it outside the step, or with an op that torch can trace "
            f"({text.splitlines()[0]})")
    if "NestedTensor" in text:
        return TranspileError(
            f"{step_name(step_fn)} makes a nested tensor{where}, which a traced program cannot "
            "hold; nn.TransformerEncoder makes one on its inference fast path (eval mode, no "
            "grad, a padding mask). Evaluate outside the step, or turn the fast path off with "
            "torch.backends.mha.set_fastpath_enabled(False), with which eager computes as the "
            f"program does. ({text.splitlines()[0]})")
    if any(s in text for s in _DATA_DEPENDENT):
        return TranspileError(
            f"{step_name(step_fn)} depends on the value of a tensor{where}: Python control flow "
            "or .item()/.tolist() on tensor values cannot be captured in a static program. "
            "Compute it with tensor operations (torch.where, masking) or move it outside "
            f"the step. ({text.splitlines()[0]})")
    return TranspileError(f"tracing {step_name(step_fn)} failed{where}: {text.splitlines()[0]}")

