"""`math.isfinite(loss.item())` and its kin, decided as tensor ops.

A test of a symbolic float (a tensor's value read with .item()) by
math.isfinite, math.isnan, math.isinf or numpy's ufuncs of those names would
convert the symbol to a Python float: a decision on its exact value, so every
call with another loss would trace again (and a nan keeps no check of its own:
decisions.py pins it). While the step is traced, each of them, given a symbolic
float, is computed by torch's op of the same name on the value: a decision on
a boolean only, which every finite loss takes alike (MAE's, DeiT's and DINO's
`if not math.isfinite(loss_value): sys.exit(1)`)."""

from __future__ import annotations

import contextlib
import math
import sys

import torch

_TESTS = ("isfinite", "isnan", "isinf")


def _as_tensor_op(original, name: str):
    op = getattr(torch, name)

    def test(x, *args, **kwargs):
        if isinstance(x, torch.SymFloat) and not args and not kwargs:
            return bool(op(torch.scalar_tensor(x, dtype=torch.float64)))
        return original(x, *args, **kwargs)
    return test


@contextlib.contextmanager
def finite_tests_as_tensor_ops():
    """math's (and numpy's, where loaded) isfinite, isnan and isinf decide on
    a symbolic float with torch's ops while the step is traced."""
    modules = [math] + [m for m in (sys.modules.get("numpy"),) if m is not None]
    saved = [(m, name, getattr(m, name)) for m in modules for name in _TESTS]
    for module, name, original in saved:
        setattr(module, name, _as_tensor_op(original, name))
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
