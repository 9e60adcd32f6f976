"""The tensors a transpiled step keeps between calls (local SGD's snapshots,
InputKind.HELD), and which state set (the model's parameters and buffers, by
identity) they are current for. This decides what must run before a program:
the startup program (broadcast rank 0's parameters, then initialize the held
tensors) the first time a state set is seen, the refresh (initialize them
again) when they are stale, or nothing.

    EMPTY --startup or refresh--> CURRENT(state set)
    CURRENT --a program that does not carry them runs--> EMPTY
    CURRENT --startup or refresh for another state set--> CURRENT(that one)
    any --load--> LOADED --a program that reads them runs--> CURRENT(its state set)
"""

from __future__ import annotations

import enum

import torch

from ..program.collectives import WAIT


class Phase(enum.Enum):
    EMPTY = "empty"       # none current: before the first startup, or since the
                          # parameters moved on without them
    LOADED = "loaded"     # restored by load(), for the next state set that reads them
    CURRENT = "current"   # current for one state set


class Prelude(enum.Enum):
    """What runs before a program."""

    STARTUP = "startup"   # broadcast from rank 0, then initialize the held tensors
    REFRESH = "refresh"   # initialize the held tensors only


class HeldTensors:
    """The held tensors, their phase, and the state sets already broadcast."""

    def __init__(self):
        # By name (program.held_name); programs read and write this dict (HeldSlot).
        self.tensors: dict[str, torch.Tensor] = {}
        self.phase = Phase.EMPTY
        self._owner: tuple | None = None    # the state set they are current for (CURRENT)
        self._synced: set[tuple] = set()    # state sets broadcast from rank 0
        self._trust_next = False            # after load(): the next state set counts as synced

    def prelude(self, state_key: tuple, has_startup: bool, reads: list[str]) -> Prelude | None:
        """What must run before a program that reads the held tensors `reads` on
        the state set `state_key` (has_startup: whether its signature has a
        startup program, i.e. there is more than one rank)."""
        if self._trust_next:
            self._synced.add(state_key)
            self._trust_next = False
        if has_startup and state_key not in self._synced:
            return Prelude.STARTUP
        if not reads:
            return None
        if self.phase is Phase.LOADED and all(name in self.tensors for name in reads):
            self._become(Phase.CURRENT, state_key)
        if self.phase is Phase.CURRENT and self._owner == state_key:
            return None
        return Prelude.REFRESH

    def needs_startup(self, state_key: tuple) -> bool:
        """Whether a program on `state_key` (with a startup program) would run
        the startup program first: a broadcast from rank 0."""
        return state_key not in self._synced and not self._trust_next

    def initializing(self, state_key: tuple) -> None:
        """Before a startup or refresh on `state_key`: drop what belongs to another
        state set (or was loaded), since the program initializes only its own."""
        if self.phase is not Phase.EMPTY and self._owner != state_key:
            self.tensors.clear()
            self._become(Phase.EMPTY)

    def initialized(self, state_key: tuple, prelude: Prelude) -> None:
        """After a startup or refresh on `state_key` succeeded."""
        if prelude is Prelude.STARTUP:
            self._synced.add(state_key)
        self._become(Phase.CURRENT, state_key)

    def step_done(self, carried: bool, transient: list[str]) -> None:
        """After a step whose program carried the held tensors or not (the
        parameters then moved on without them); `transient` are values it only
        output for the schedule, gone with the step."""
        if not carried:
            self._become(Phase.EMPTY)
        for name in transient:
            self.tensors.pop(name, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the held tensors while they are current (or loaded), else {};
        each waited on first (a sum in flight, Held.IN_FLIGHT; for any other
        tensor the wait does nothing)."""
        if self.phase is Phase.EMPTY:
            return {}
        return {name: WAIT(t).detach().clone() for name, t in self.tensors.items()}

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what state_dict saved. The next state set is trusted as loaded
        (no broadcast from rank 0): under local SGD the ranks' parameters
        legitimately differ between syncs."""
        self.tensors.clear()
        self.tensors.update({name: t.detach().clone() for name, t in tensors.items()})
        self._become(Phase.LOADED if self.tensors else Phase.EMPTY)
        self._trust_next = True

    def _become(self, phase: Phase, owner: tuple | None = None) -> None:
        self.phase, self._owner = phase, owner
