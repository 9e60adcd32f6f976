"""The public entry point."""

from __future__ import annotations

from typing import Callable, Sequence

from .backends import BACKENDS
from .errors import TranspileError
from .modes import MODES
from .pipeline import PassLike, resolve
from .runtime import TranspiledStep

MAX_RINGS = 16


def transpile(step_fn: Callable, mode: str | None = None, *,
              passes: Sequence[PassLike] | None = None, nrings: int = 2,
              backend: str = "eager") -> TranspiledStep:
    """Return a callable with the signature of `step_fn` that runs the whole
    training step (forward, backward, optimizer update) as one transpiled
    program on every rank.

    mode: a named preset of passes (see MODES; default "grad_allreduce"); or give
    `passes=[...]` instead,
    pass names or functions `(program, ctx) -> None`, run in order.
    nrings: how many communicators the collectives are spread over.
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
    if backend not in BACKENDS:
        raise TranspileError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
    return TranspiledStep(step_fn, tuple(passes), nrings=nrings, backend=backend)
