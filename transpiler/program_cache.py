"""The programs built for each signature of the step's arguments: a call with
a signature seen before, whose guarded host values (capture/guards.py) are as
they were at the trace, runs what was built for it; anything else builds again.
The programs kept are bounded, as torch.compile bounds its recompiles: past the
bound the least recently used is dropped, with a warning that names what keeps
changing."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from .capture import Returned, StepArgs, describe_change, grad_signature, signature
from .capture.guards import Guards
from .capture.numbers import is_number
from .executor import Runnable

log = logging.getLogger("transpiler")

# Programs kept per step (torch.compile's recompile limit is 8 too).
CACHE_LIMIT = 8


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
    guards: Guards     # host values its programs were traced with
    # (name, parameter) of those kept as shards between steps (mode fsdp)
    sharded_params: list = dataclasses.field(default_factory=list)


class ProgramCache:
    """Built programs by signature (capture.signature), each with its guards.
    Where the programs read the .grad the step starts with, the key also says
    which parameters have one (capture.grad_signature); only those signatures
    pay for computing it."""

    def __init__(self, limit: int = CACHE_LIMIT):
        self._built: dict[tuple, list[Built]] = {}
        self._order: list[tuple[tuple, Built]] = []   # least recently used first
        self._reads_grads: set[tuple] = set()   # signatures keyed with their grads
        self.limit = limit
        self.build_seconds = 0.0
        self.builds = 0
        self.last_built: tuple | None = None   # the full signature last built for
        # Names of number arguments fed as inputs, and of those that cannot be
        # (their value decides control flow or a shape): capture/numbers.py.
        self.lifted: set[str] = set()
        self.per_value: set[str] = set()

    def __len__(self) -> int:
        return len(self._order)

    def get(self, step_args: StepArgs, build: Callable[[StepArgs, str], Built]) -> Built:
        """What was built for these arguments; build(step_args, why) builds it
        when there is none, `why` saying in one line what is new."""
        step_args.lifted = frozenset(i for i, (name, leaf) in enumerate(zip(step_args.names,
                                                                            step_args.leaves))
                                     if name in self.lifted and is_number(leaf))
        sig = signature(step_args)
        key = sig + grad_signature(step_args) if sig in self._reads_grads else sig
        entries = self._built.get(key, [])
        for built in entries:
            if not built.guards.changed():
                if self._order[-1][1] is not built:
                    self._order.remove((key, built))
                    self._order.append((key, built))
                return built
        if entries:
            why = entries[-1].guards.changed()
        elif self.last_built is None:
            why = "first call"
        else:
            why = describe_change(self.last_built, sig + grad_signature(step_args)) \
                + self._lift_changed_numbers(step_args)
        start = time.perf_counter()
        requested = step_args.lifted
        built = build(step_args, why)
        dropped = {step_args.names[i] for i in requested - step_args.lifted}
        self.lifted -= dropped
        self.per_value |= dropped
        # Building made the optimizers' state the first step would make
        # (capture.trace_step): the key is the signature later calls have.
        sig = signature(step_args)
        self.last_built = full = sig + grad_signature(step_args)
        if built.reads_grads:
            self._reads_grads.add(sig)
        key = full if built.reads_grads else sig
        self._built.setdefault(key, []).append(built)
        self._order.append((key, built))
        self.builds += 1
        if len(self._order) > self.limit:
            old_key, old = self._order.pop(0)
            self._built[old_key].remove(old)
            log.warning("transpiler: the step has been traced %d times; %d programs are kept, "
                        "the least recently used was dropped. The last trace was for: %s. A "
                        "number argument used only in arithmetic is fed as an input after its "
                        "first change; one that decides shapes or control flow (%s) traces "
                        "once per value: keep it fixed, or compute with it in tensor ops; a "
                        "module attribute or a global that changes every call belongs in a "
                        "tensor (an argument, or a buffer of the model)", self.builds,
                        self.limit, why, ", ".join(sorted(self.per_value)) or "none here")
        self.build_seconds += time.perf_counter() - start
        return built

    def _lift_changed_numbers(self, step_args: StepArgs) -> str:
        """Lift the number arguments whose value is new since the last build
        (capture/numbers.py): the build traces them as inputs. Says so, for the log."""
        before = dict(self.last_built)
        lifting = frozenset(
            i for i, (name, leaf) in enumerate(zip(step_args.names, step_args.leaves))
            if is_number(leaf) and i not in step_args.lifted and name not in self.per_value
            and is_number(before.get(("input", name))) and before[("input", name)] != leaf)
        if lifting:
            step_args.lifted |= lifting
            self.lifted |= {step_args.names[i] for i in lifting}
        return "".join(f"; lifting {step_args.names[i]} to a program input" for i in sorted(lifting))
