"""What the executor runs: a program with where its inputs are read from and
its outputs written to (Runnable), and a program cut into a loop over
micro-batches (Loop, built by micro_loop.py), with the leaves each of its
runs reads (MicroLeaves)."""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..backends.compile import Executable
from ..capture.micro import CutArgs
from ..program.program import Held, InputKind, OutputKind, Program


@dataclasses.dataclass
class Runnable:
    """A program with the slots its inputs are read from and its outputs written
    to (None: returned to the caller); compiled on its first run."""

    program: Program
    slots: list
    targets: list
    backend: str
    executable: Executable | None = None
    sent_bytes: float = 0.0   # what this rank sends per run (collectives.sent_bytes)
    # built on this rank alone, its collectives agreed before (rebuild.py): the
    # others may be waiting in theirs, so its compile is not exchanged
    compile_alone: bool = False
    # a program traced over a cut list of micro-batches runs as a loop of
    # three programs (micro_loop.py); leaves are then a MicroLeaves
    loop: Loop | None = None
    # an eager program's first run, op by op and uncommitted (runtime._run), counts as its compile
    ran: bool = False
    held: list[str] = dataclasses.field(init=False)       # held tensors it reads
    transient: list[str] = dataclasses.field(init=False)  # held values it only outputs
    # parameters whose .grad it replaces without reading it (the step's
    # zero_grad() dropped it): released before the program runs (Executor.run)
    replaced_grads: list = dataclasses.field(init=False)

    def uncompiled(self) -> int:
        """How many of its programs (the loop's three) have not run yet."""
        pieces = (self.loop.first, self.loop.body, self.loop.last) if self.loop else (self,)
        return sum(piece.executable is None and not piece.ran for piece in pieces)

    def __post_init__(self):
        self.held = [spec.name for spec in self.program.inputs if spec.kind is InputKind.HELD]
        # (a sum in flight is kept from the program that issues it to the one
        # that waits on it, and gone with that one)
        self.transient = [spec.target for spec in self.program.outputs
                          if spec.kind is OutputKind.HELD and spec.target not in self.held
                          and spec.held is not Held.IN_FLIGHT] + \
            [spec.name for spec in self.program.inputs if spec.held is Held.IN_FLIGHT]
        read = {id(slot.param) for spec, slot in zip(self.program.inputs, self.slots)
                if spec.kind is InputKind.GRAD}
        self.replaced_grads = [   # (not one eager writes into: GradSlot.in_place)
            target.param for spec, target in zip(self.program.outputs, self.targets)
            if spec.kind is OutputKind.GRAD and target is not None
            and id(target.param) not in read and not target.in_place]


@dataclasses.dataclass
class MicroLeaves:
    """A call's leaves, and how each run of the loop reads them."""

    cut: CutArgs
    leaves: list

    def at(self, i: int) -> list:
        return self.cut.layout(self.leaves, i)


@dataclasses.dataclass
class Loop:
    first: Runnable
    body: Runnable
    last: Runnable
    store: dict            # LoopSlot values, by name; emptied after each run
    first_keys: list[list[str]]   # per output of first: the store names it sets
    body_keys: list[list[str]]    # ... of body (a carried value: its input's name)

    def run(self, run_piece: Callable, leaves: MicroLeaves, compile_alone: bool) -> list:
        for piece in (self.first, self.body, self.last):
            piece.compile_alone = compile_alone
        try:
            self._keep(run_piece(self.first, leaves.at(1)), self.first_keys)
            for i in range(1, leaves.cut.k):
                self._keep(run_piece(self.body, leaves.at(i)), self.body_keys)
            return run_piece(self.last, leaves.at(leaves.cut.k - 1))
        finally:
            self.store.clear()

    def _keep(self, outputs: list, keys: list[list[str]]) -> None:
        for value, names in zip(outputs, keys):
            for name in names:
                self.store[name] = value
