"""Backends: turn a Program into an Executable. One place where compilers plug in."""

from __future__ import annotations

import dataclasses
from typing import Callable

from .errors import TranspileError
from .program import Program
from .reinplace import reinplace

BACKENDS = ("eager",)


@dataclasses.dataclass
class Executable:
    """run: input tensors -> output tensors. written[i]: output i is a state
    update the program already wrote into its input (no write-back needed)."""

    run: Callable[[list], list]
    written: list[bool]


def compile_program(program: Program, backend: str) -> Executable:
    if backend == "eager":
        gm, written = reinplace(program)
        return Executable(lambda inputs: gm(*inputs), written)
    raise TranspileError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
