"""What the host does to torch's random number generators around each run of
a program, so that the program draws the numbers the eager step draws and
leaves every generator where the eager step leaves it.

The program's random ops draw from torch's real generators at run time, in the
step's order. What the step's Python did to the generators while it was traced
(torch.manual_seed, set_rng_state, fork_rng: torch_rng.py records it,
rng_lanes.py lays it out) is redone here, on the host, on every call:

- each stream (a device's default generator: "cpu", "cuda:0", ...) has a main
  lane of draws, drawn from the real generator, and may have side lanes, drawn
  from generators of the plan's own (a seeded torch.random.fork_rng inside the
  step). Each lane starts at an origin: the state the call finds (`CALL`), a
  seed (`SEED`, a constant or an int computed from the step's lifted
  numbers), or a state tensor among the arguments (`STATE`);
- before the run each lane's generator is set to its origin; after it the real
  generator is set to where the eager step leaves it (an origin, or the end of
  a side lane), unless the main lane already left it there;
- if the run raises, every real generator the plan touched is restored to the
  state the call found.

Runs on the host in the runtime (`RngPlan.drawing`), around the program; a
plan without lanes or origins to set does nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Iterator
from typing import Callable

import sympy
import torch

from .numbers import NumberSlot, ReachedNumberSlot
from .slots import DataSlot

CPU = "cpu"


class OriginKind(enum.Enum):
    CALL = "the state the call finds"
    SEED = "a seed"
    STATE = "a state tensor among the arguments"


@dataclasses.dataclass(frozen=True)
class Seed:
    """A seed the step gives torch.manual_seed: a constant, or an int computed
    from lifted int numbers (numbers.py), evaluated on every call."""

    constant: int | None = None
    expr: sympy.Expr | None = None
    numbers: tuple[tuple[sympy.Symbol, NumberSlot | ReachedNumberSlot], ...] = ()

    def value(self, leaves) -> int:
        if self.expr is None:
            return self.constant
        return int(self.expr.xreplace({symbol: sympy.Integer(slot.number(leaves))
                                       for symbol, slot in self.numbers}))

    def describe(self) -> str:
        return str(self.constant if self.expr is None else self.expr)


@dataclasses.dataclass(frozen=True, eq=False)
class Origin:
    """Where a lane of draws starts (compared by identity: two seeds of the
    same value are two origins)."""

    kind: OriginKind
    seed: Seed | None = None
    state: DataSlot | None = None

    def set(self, generator: torch.Generator, found: torch.Tensor, leaves) -> None:
        """Put `generator` at this origin; `found`: the state the call found."""
        if self.kind is OriginKind.CALL:
            generator.set_state(found)
        elif self.kind is OriginKind.SEED:
            generator.manual_seed(self.seed.value(leaves))
        else:
            generator.set_state(self.state.read(leaves))


@dataclasses.dataclass(frozen=True)
class Lane:
    """A side lane: its draws take `generator=` this generator, set to `origin`
    before each run."""

    generator: torch.Generator
    origin: Origin


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """One real generator: where its main lane starts (None: as the call finds
    it), its side lanes, and where the eager step leaves it: an origin, a side
    lane's end, or None (where the program's main lane leaves it)."""

    stream: str
    start: Origin | None
    lanes: tuple[Lane, ...]
    end: Origin | Lane | None

    def real(self) -> torch.Generator:
        """The stream's real generator (a CUDA stream exists only where CUDA
        was initialized when the step was traced)."""
        if self.stream == CPU:
            return torch.default_generator
        return torch.cuda.default_generators[torch.device(self.stream).index]


@dataclasses.dataclass(frozen=True)
class RngPlan:
    """The host's part of the step's random draws (see the module docstring)."""

    streams: tuple[StreamPlan, ...] = ()
    # Seeds for CUDA where CUDA was not initialized when the step was traced
    # (torch.cuda.manual_seed(_all), and torch.manual_seed's CUDA part): torch
    # queues them for CUDA's initialization; replayed after each run.
    lazy: tuple[tuple[Callable[[int], None], Seed], ...] = ()

    def drawing(self, leaves) -> contextlib.AbstractContextManager:
        """Around one run of the program, `leaves` the call's arguments (a
        plan with nothing to do costs nothing)."""
        return self._drawing(leaves) if self.streams or self.lazy else contextlib.nullcontext()

    @contextlib.contextmanager
    def _drawing(self, leaves) -> Iterator[None]:
        found = [(plan, real, real.get_state())
                 for plan, real in ((plan, plan.real()) for plan in self.streams)]
        try:
            for plan, real, state in found:
                for lane in plan.lanes:
                    lane.origin.set(lane.generator, state, leaves)
                if plan.start is not None:
                    plan.start.set(real, state, leaves)
            yield
        except BaseException:
            for _, real, state in found:
                real.set_state(state)
            raise
        for plan, real, state in found:
            if isinstance(plan.end, Lane):
                real.set_state(plan.end.generator.get_state())
            elif plan.end is not None:
                plan.end.set(real, state, leaves)
        for seed_cuda, seed in self.lazy:
            seed_cuda(seed.value(leaves))
