"""The programs built for each signature of the step's arguments: a call with
a signature seen before runs what was built for it, a new one builds again."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from .capture import Returned, StepArgs, grad_signature, signature
from .executor import Runnable


@dataclasses.dataclass
class Built:
    """Everything built for one signature of the arguments."""

    programs: dict[str, Runnable]
    startup: Runnable | None   # broadcast from rank 0, then initialize the held tensors
    refresh: Runnable | None   # initialize the held tensors only
    returned: Returned
    state_key: tuple   # identity of the parameters and buffers it runs on
    backend: str       # the concrete backend its programs compile with
    schedulers: list   # LR schedulers stepped on the host after each call
    cleared: list      # (name, parameter) whose .grad each call leaves None
    reads_grads: bool  # whether which parameters have a .grad is part of the key
    averaged_at: tuple[int, ...]  # the backward() calls averaged where they end (verify)


class ProgramCache:
    """Built programs by signature (capture.signature). Where the programs read
    the .grad the step starts with, the key also says which parameters have one
    (capture.grad_signature); only those signatures pay for computing it."""

    def __init__(self):
        self._built: dict[tuple, Built] = {}
        self._reads_grads: set[tuple] = set()   # signatures keyed with their grads
        self.build_seconds = 0.0
        self.last_built: tuple | None = None   # the full signature last built for

    def __len__(self) -> int:
        return len(self._built)

    def get(self, step_args: StepArgs, build: Callable[[StepArgs, tuple], Built]) -> Built:
        """What was built for these arguments; build(step_args, signature with
        the grads) builds it when there is none."""
        sig = signature(step_args)
        key = sig + grad_signature(step_args) if sig in self._reads_grads else sig
        built = self._built.get(key)
        if built is None:
            start = time.perf_counter()
            built = build(step_args, sig + grad_signature(step_args))
            # Building made the optimizers' state the first step would make
            # (capture.trace_step): the key is the signature later calls have.
            sig = signature(step_args)
            self.last_built = full = sig + grad_signature(step_args)
            if built.reads_grads:
                self._reads_grads.add(sig)
            self._built[full if built.reads_grads else sig] = built
            self.build_seconds += time.perf_counter() - start
        return built
