"""One compile per node: before a program first runs, the first rank of each
node compiles it, filling inductor's on-disk caches (AOTAutograd's and the FX
graph cache, in TORCHINDUCTOR_CACHE_DIR, which the processes of a host share
unless it is set apart); the node's other ranks wait for it, then compile the
same program, which inductor loads from those caches. A rank whose program
differs from its node's first rank's (mode zero's and fsdp's programs hold
each rank's shard offsets), or whose cache is off, compiles at once, beside the
first ranks. The ranks exchange over the control plane which program each
compiles, then whether each compile succeeded: the all-gather of the first
compiles' outcomes is the waiting ranks' starting signal. If a compile fails
on any rank, every rank raises before running the program, whose collectives
would leave the others waiting; a waiting rank then does not compile at all."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
import time
from typing import Callable

import torch

from .agreement import raise_first_failure
from ..capture.shapes import is_symbolic
from .control_plane import all_gather_values
from ..program.program import Program
from ..world import world

log = logging.getLogger("transpiler")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a rank shows the others before compiling."""

    node_first: int         # the first rank of its node
    digest: str | None      # of the program it compiles (None: it cannot load from a cache)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What a rank shows the others after compiling."""

    failed: str | None   # "Type: message" of its error
    loaded: bool         # read from inductor's cache, not compiled
    seconds: float       # the compile's (or load's) own, not the wait before it


def digest(program: Program, inputs: list) -> str:
    """What inductor's cache key reads of the program, short of its own
    (which needs the compile's first stages): the graph's code (with every
    offset and group name) and the inputs' shapes, strides and dtypes. Two
    ranks with equal digests compile the same program, so the one loads what
    the other compiled (a tensor constant differing would only make it
    compile again)."""
    # A batch input with symbolic dimensions is compiled for its symbols
    # (backends._examples), whatever this rank's batch: ranks holding batches
    # of different sizes compile the same code.
    values = [v if is_symbolic(v) else x
              for v, x in zip((n.meta.get("val") for n in program.placeholders), inputs)]
    tensors = [(x.dtype, tuple(map(str, x.shape)), tuple(map(str, x.stride())), x.device.type)
               if isinstance(x, torch.Tensor) else type(x).__name__ for x in values]
    text = program.graph.python_code("self").src + repr(tensors)
    return hashlib.sha256(text.encode()).hexdigest()


def compiled_on_every_rank(compile: Callable[[], bool], program: str, plan: Plan) -> None:
    """Run `compile` (which says whether it loaded the program from inductor's
    cache) on every rank, each node's other ranks after its first (see the
    module's docstring); raise on every rank if it failed on any."""
    world_size, rank = world()
    if world_size == 1:
        compile()
        return
    plans = all_gather_values(plan)
    waits = [r != p.node_first and p.digest is not None and p.digest == plans[p.node_first].digest
             for r, p in enumerate(plans)]
    doing = f"compile program {program!r}"
    error, mine = (None, None) if waits[rank] else _attempt(compile)
    outcomes = all_gather_values(mine)
    raise_first_failure([c and c.failed for c in outcomes], error, doing)
    if any(waits):
        if waits[rank]:
            error, mine = _attempt(compile)
        later = all_gather_values(mine if waits[rank] else None)
        raise_first_failure([c and c.failed for c in later], error, doing)
        outcomes = [a or b for a, b in zip(outcomes, later)]
    if rank == 0:
        log.info("transpiler: program %r %s", program, report(plans, waits, outcomes))


class How(enum.Enum):
    """How a rank came by the compiled program, as report() says it."""

    COMPILED = "compiled by {}"
    LOADED = "loaded from inductor's cache by {}"
    DIFFERS = ("compiled at the same time by {} (the program differs from the one of the first "
               "rank of the node)")
    NO_CACHE = "compiled at the same time by {} (inductor's cache is off there)"
    MISSED = ("compiled again by {}: not found in the cache that the first rank of the node "
              "filled (is TORCHINDUCTOR_CACHE_DIR set apart?)")


def how(rank: int, plan: Plan, waited: bool, outcome: Compiled) -> How:
    if outcome.loaded:
        return How.LOADED
    if waited:
        return How.MISSED
    if rank == plan.node_first:
        return How.COMPILED
    return How.DIFFERS if plan.digest is not None else How.NO_CACHE


def report(plans: list[Plan], waits: list[bool], outcomes: list[Compiled]) -> str:
    """Which ranks compiled the program, which loaded it (each the longest
    time it took them), and why any other than the first of its node compiled
    it too."""
    ranks: dict[How, list[int]] = {h: [] for h in How}
    for rank, args in enumerate(zip(plans, waits, outcomes)):
        ranks[how(rank, *args)].append(rank)
    return "; ".join(h.value.format(f"{_ranks(rs)} in {max(outcomes[r].seconds for r in rs):.2f}s")
                     for h, rs in ranks.items() if rs)


def _attempt(compile: Callable[[], bool]) -> tuple[Exception | None, Compiled]:
    start = time.perf_counter()
    try:
        loaded = compile()
    except Exception as exc:  # noqa: BLE001 - shown to every rank, then raised
        return exc, Compiled(f"{type(exc).__name__}: {exc}", False, time.perf_counter() - start)
    return None, Compiled(None, loaded, time.perf_counter() - start)


def _ranks(ranks: list[int]) -> str:
    """"rank 3", or "ranks 0-3, 8" (runs of consecutive ranks as ranges)."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][-1] == r - 1:
            runs[-1][-1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"
