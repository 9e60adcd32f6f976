"""The pass pipeline: settings, requirements, checks after every pass, history."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Sequence, Union

import torch

from .errors import PassError
from .program import HistoryEntry, Program
from .roles import ROLE, Role


@dataclasses.dataclass(frozen=True)
class PassContext:
    """Settings every pass reads. Passes take nothing from globals or the environment."""

    world_size: int = 1
    rank: int = 0
    nrings: int = 2
    rings: tuple[str, ...] = ()   # process-group name of each ring, len == nrings
    bucket_mb: float = 25.0       # coalesce_tensors: bucket cap
    first_bucket_mb: float = 1.0  # coalesce_tensors: cap of the first bucket per dtype
    fuse_dtype: torch.dtype | None = None  # coalesce_tensors: dtype on the wire
    adaptive_k: bool = False      # local_sgd: output the mean loss and lr for the schedule


Pass = Callable[[Program, PassContext], None]
PassLike = Union[str, Pass]


def requires(*names: str):
    """Declare the passes that must have run before this one. "a|b": either."""
    def mark(fn):
        fn.requires = names
        return fn
    return mark


def resolve(p: PassLike) -> Pass:
    if callable(p):
        return p
    if not isinstance(p, str) or not p.isidentifier():
        raise PassError(f"unknown pass {p!r}: give a pass name or a function")
    try:
        module = importlib.import_module(f"passes.{p}")
    except ModuleNotFoundError:
        raise PassError(f"unknown pass {p!r}; known passes: {', '.join(known_passes())}") from None
    return getattr(module, p)


def known_passes() -> list[str]:
    import pkgutil

    import passes
    return sorted(m.name for m in pkgutil.iter_modules(passes.__path__))


def check_roles(program: Program) -> None:
    missing = [n.name for n in program.graph.nodes
               if n.op == "call_function" and not isinstance(n.meta.get(ROLE), Role)]
    if missing:
        raise PassError(f"nodes without a role: {', '.join(missing[:5])}")


def record(program: Program, name: str, provenance: str) -> None:
    program.history.append(HistoryEntry(name, provenance, program.listing()))


def _check_requirements(fn: Pass, before: list[str]) -> None:
    for need in getattr(fn, "requires", ()):
        if not any(alt in before for alt in need.split("|")):
            raise PassError(
                f"pass {fn.__name__} requires {need.replace('|', ' or ')} to run before it; "
                f"passes run so far: {', '.join(before)}")


def check_order(passes: Sequence[PassLike]) -> None:
    """Raise now if a pass of the list would find its requirements unmet."""
    before = ["capture"]
    for p in passes:
        fn = resolve(p)
        _check_requirements(fn, before)
        before.append(fn.__name__)


def run_passes(program: Program, passes: Sequence[PassLike], ctx: PassContext) -> Program:
    """Run the passes in order on the program, in place. After each: the graph is
    linted, every node must have a role, the module is recompiled and the
    history gets a provenance line and a listing. Errors name the pass and the
    passes run before it."""
    for p in passes:
        fn = resolve(p)
        name = fn.__name__
        before = list(program.applied)
        _check_requirements(fn, before)
        n_before = len(program.graph.nodes)
        try:
            fn(program, ctx)
            program.graph.lint()
            check_roles(program)
            program.gm.recompile()
        except Exception as exc:
            raise PassError(f"pass {name} failed on program {program.name!r} "
                            f"(after {', '.join(before)}): {exc}") from exc
        n_comm = len(program.collectives())
        record(program, name, f"{name}: {n_before} -> {len(program.graph.nodes)} nodes, "
                              f"{n_comm} collectives")
    return program

