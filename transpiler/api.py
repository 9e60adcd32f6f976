"""The public entry point."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .backends import BACKENDS
from .errors import TranspileError
from .modes import MODES
from .pipeline import PassContext, PassLike, resolve
from .runtime import TranspiledStep

MAX_RINGS = 16


def transpile(step_fn: Callable, mode: str | None = None, *,
              passes: Sequence[PassLike] | None = None, nrings: int = 2,
              bucket_mb: float = 25.0, first_bucket_mb: float = 1.0,
              fuse_dtype: torch.dtype | None = None,
              backend: str = "eager") -> TranspiledStep:
    """Return a callable with the signature of `step_fn` that runs the whole
    training step (forward, backward, optimizer update) as one transpiled
    program on every rank.

    mode: a named preset of passes (see MODES; default "grad_allreduce"); or give
    `passes=[...]` instead,
    pass names or functions `(program, ctx) -> None`, run in order.
    nrings: how many communicators the collectives are spread over.
    bucket_mb, first_bucket_mb: fused-bucket caps (fuse_all_reduce), in MiB.
    fuse_dtype: dtype gradients are all-reduced in (fuse_all_reduce), e.g.
    torch.bfloat16; None keeps each gradient's own dtype.
    backend: how the program runs ("eager").
    """
    if not callable(step_fn):
        raise TranspileError(f"transpile needs the training step function, got {step_fn!r}")
    if passes is None:
        mode = mode or "grad_allreduce"
        if mode not in MODES:
            raise TranspileError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)} "
                                 "or give passes=[...]")
        passes = MODES[mode]
    elif mode is not None:
        raise TranspileError("give either mode or passes, not both")
    for p in passes:
        resolve(p)
    if not isinstance(nrings, int) or isinstance(nrings, bool) or not 1 <= nrings <= MAX_RINGS:
        raise TranspileError(f"nrings must be an integer from 1 to {MAX_RINGS}, got {nrings!r}")
    for name, value in (("bucket_mb", bucket_mb), ("first_bucket_mb", first_bucket_mb)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise TranspileError(f"{name} must be a positive number of MiB, got {value!r}")
    if fuse_dtype is not None and (not isinstance(fuse_dtype, torch.dtype)
                                   or not fuse_dtype.is_floating_point):
        raise TranspileError(f"fuse_dtype must be a floating-point torch.dtype or None, "
                             f"got {fuse_dtype!r}")
    if backend not in BACKENDS:
        raise TranspileError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
    settings = PassContext(nrings=nrings, bucket_mb=float(bucket_mb),
                           first_bucket_mb=float(first_bucket_mb), fuse_dtype=fuse_dtype)
    return TranspiledStep(step_fn, tuple(passes), settings, backend=backend)
