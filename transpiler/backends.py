"""Backends: turn a Program into a callable from a list of input tensors to the
list of output tensors. One place where compilers plug in."""

from __future__ import annotations

from typing import Callable

from .errors import TranspileError
from .program import Program

BACKENDS = ("eager",)

Compiled = Callable[[list], list]


def compile_program(program: Program, backend: str) -> Compiled:
    if backend == "eager":
        gm = program.gm
        return lambda inputs: gm(*inputs)
    raise TranspileError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
