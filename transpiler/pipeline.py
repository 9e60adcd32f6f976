"""The pass manager: passes found by name in the pass library (passes/), their
contracts (lowering/context.py) checked, the program checked after every
pass, its history recorded."""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Sequence

from .errors import PassError
from .lowering.context import Mark, Pass, PassContext, PassLike
from .program.program import HistoryEntry, Program, draws_random
from .program.roles import REDUCE, ROLE, Role

log = logging.getLogger("transpiler")


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


def _unwrapped(fn: Pass) -> Pass:
    """The function behind a functools.partial of a pass."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def pass_name(fn: Pass) -> str:
    """A pass's name: its function's, or a callable object's class."""
    fn = _unwrapped(fn)
    return getattr(fn, "__name__", type(fn).__name__)


def known_passes() -> list[str]:
    import pkgutil

    import passes
    return sorted(m.name for m in pkgutil.iter_modules(passes.__path__))


def check_roles(program: Program) -> None:
    missing = [n.name for n in program.graph.nodes
               if n.op == "call_function" and not isinstance(n.meta.get(ROLE), Role)]
    if missing:
        raise PassError(f"nodes without a role: {', '.join(missing[:5])}")


def record(program: Program, name: str, provenance: str, fn: Pass | None = None) -> None:
    """Add a history entry, of the pass `fn` (None: capture); with its listing
    when the "transpiler" logger is at DEBUG (listing a large program after
    every pass takes a good part of its passes' time)."""
    listing = program.listing() if log.isEnabledFor(logging.DEBUG) else None
    program.history.append(HistoryEntry(name, provenance, listing, fn))


def _check_requirements(fn: Pass, before: list[str]) -> None:
    for need in getattr(_unwrapped(fn), "requires", ()):
        if not any(alt in before for alt in need.split("|")):
            raise PassError(
                f"pass {pass_name(fn)} requires {need.replace('|', ' or ')} to run before it; "
                f"passes run so far: {', '.join(before)}")


def check_order(passes: Sequence[PassLike]) -> None:
    """Raise now if a pass of the list would find its requirements unmet, would
    act on a mark no pass left (a second reduction of values already reduced),
    or if a mark is left that no pass acts on (values never reduced)."""
    before = ["capture"]
    fns = [resolve(p) for p in passes]
    for fn in fns:
        _check_requirements(fn, before)
        before.append(pass_name(fn))
    _check_marks(fns, complete=True)


def _check_marks(fns: Sequence[Pass], complete: bool) -> None:
    """Each pass that consumes a mark needs a pass before it that leaves it, with
    no other consumer in between; `complete`: no mark may be left at the end."""
    pending: dict[Mark, str] = {}    # mark -> the pass that left it
    done: dict[Mark, str] = {}       # mark -> the pass that consumed it last
    names = ", ".join(pass_name(fn) for fn in fns)
    for fn in fns:
        mark = getattr(_unwrapped(fn), "consumes", None)
        if mark is not None:
            if mark not in pending:
                why = (f"{done[mark]} already acted on them" if mark in done
                       else "no pass before it leaves them")
                raise PassError(f"pass {pass_name(fn)} acts on the {mark.value}, but {why}; "
                                f"passes: {names}")
            done[mark] = pass_name(fn)
            del pending[mark]
        produces = getattr(_unwrapped(fn), "produces", None)
        if produces is not None:
            pending[produces] = pass_name(fn)
    for mark, by in pending.items() if complete else ():
        raise PassError(f"pass {by} leaves {mark.value} but no pass after it acts on them; "
                        f"add one (for reductions: insert_allreduce or coalesce_tensors); "
                        f"passes: {names}")


def _applied(program: Program) -> list[Pass]:
    """The passes the program went through, as they were given (by the
    function, not by its name: a pass of one's own may share a name)."""
    return [h.fn for h in program.history if h.fn is not None]


def _draws(program: Program) -> list[str]:
    return [n.name for n in program.graph.nodes if draws_random(n)]


def _check_draws(program: Program, before: list[str]) -> None:
    """A pass keeps the program's random ops, in their order: they draw from
    torch's generator the numbers the eager step draws, in its order."""
    after = _draws(program)
    if after != before:
        raise PassError(f"it changed the program's random ops or their order ({', '.join(before)} "
                        f"-> {', '.join(after)}): they would draw other numbers than the eager "
                        "step's; a pass must keep them, in their order")


def run_passes(program: Program, passes: Sequence[PassLike], ctx: PassContext) -> Program:
    """Run the passes in order on the program, in place. After each: the graph is
    linted, every node must have a role, the random ops are the same in the
    same order, the module's code is marked stale
    (program.graph_module: generated when it first runs) and the history gets
    a provenance line (and, at DEBUG, a listing). Errors name the pass and the
    passes run before it."""
    for p in passes:
        fn = resolve(p)
        name = pass_name(fn)
        before = list(program.applied)
        _check_requirements(fn, before)
        _check_marks(_applied(program) + [fn], complete=False)
        n_before = len(program.graph.nodes)
        draws = _draws(program)
        try:
            fn(program, ctx)
            program.graph.lint()
            check_roles(program)
            _check_draws(program, draws)
            program.gm.recompile()
        except Exception as exc:
            raise PassError(f"pass {name} failed on program {program.name!r} "
                            f"(after {', '.join(before)}): {exc}") from exc
        n_comm = len(program.collectives())
        if getattr(_unwrapped(fn), "consumes", None) is Mark.TO_REDUCE and any(
                REDUCE in n.meta for n in program.graph.nodes):
            raise PassError(f"pass {name} left values marked to reduce on program "
                            f"{program.name!r}: a pass that reduces must lower every mark")
        record(program, name, f"{name}: {n_before} -> {len(program.graph.nodes)} nodes, "
                              f"{n_comm} collectives", fn)
    return program

