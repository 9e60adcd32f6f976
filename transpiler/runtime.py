"""The runtime: the callable `transpile` returns.

On each call it asks the schedule which program runs this step, computes the
signature of the arguments, builds what is missing (traces once per signature,
then runs that program's passes on a copy, compiles, checks rank agreement and
runs the startup program where needed), feeds the live tensors in, and writes
the new state back into the model, the optimizer and the step's held tensors
only after the whole program has succeeded.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

import torch
import torch.utils._pytree as pytree

from . import agreement
from .backends import Executable, compile_program
from .capture import Captured, HeldSlot, describe_change, flatten_args, signature, trace_step
from .errors import TranspileError
from .modes import STARTUP_PASSES
from .pipeline import PassContext, record, run_passes
from .program import Program, format_collectives
from .rings import ring_names, world
from .startup import startup_program

log = logging.getLogger("transpiler")


@dataclasses.dataclass
class _Built:
    program: Program
    executable: Executable
    slots: list      # where each input is read from
    targets: list    # where each output is written to (None: returned to the caller)
    out_spec: pytree.TreeSpec
    state_key: tuple


class TranspiledStep:
    def __init__(self, step_fn: Callable, schedule, settings: PassContext, *, backend: str):
        self.step_fn = step_fn
        self.schedule = schedule
        self.settings = settings  # the world fields are filled in when a program is built
        self.backend = backend
        self._captured: dict[tuple, Captured] = {}
        self._built: dict[tuple[tuple, str], _Built] = {}
        self._last_traced: tuple | None = None   # signature of the last trace
        self._last: _Built | None = None
        self._last_signature: tuple | None = None
        self._synced: set[tuple] = set()          # state sets broadcast from rank 0
        self._held: dict[str, torch.Tensor] = {}  # snapshots and the like, by name
        self._held_key: tuple | None = None       # state set they belong to (None: any)
        self._restored = False
        self.startup_program: Program | None = None
        self.build_seconds = 0.0  # one-time costs so far: trace, passes, compile, startup

    @property
    def program(self) -> Program:
        """The program last run (or built)."""
        if self._last is None:
            raise TranspileError("the step has not been called yet: the program is built "
                                 "on the first call, from the real arguments")
        return self._last.program

    @property
    def programs(self) -> dict[str, Program]:
        """The programs built so far for the arguments of the last call, by name
        ("main"; local_sgd: "warmup", "local", "sync")."""
        return {name: b.program for (sig, name), b in self._built.items()
                if sig == self._last_signature}

    def explain(self, name: str | None = None) -> str:
        """The collectives of a program (default: the one last run) as a table:
        one row per collective (a bucket in fuse_all_reduce), with its ring,
        dtype, size and parameters."""
        if name is None:
            return format_collectives(self.program)
        if name not in self.programs:
            raise TranspileError(f"no program {name!r} has been built yet; built: "
                                 f"{', '.join(self.programs)}")
        return format_collectives(self.programs[name])

    def state_dict(self) -> dict:
        """The step's own state: its schedule (step counter; local_sgd: steps since
        the last sync, k) and its held tensors (local_sgd: the snapshots).
        Together with the model's and the optimizer's state_dict it resumes a run."""
        return {"schedule": self.schedule.state_dict(),
                "held": {k: v.detach().clone() for k, v in self._held.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict saved. The next call trusts each rank's model as
        loaded (no broadcast from rank 0): under local SGD the ranks' parameters
        legitimately differ between syncs."""
        self.schedule.load_state_dict(state["schedule"])
        self._held.clear()
        self._held.update({k: v.detach().clone() for k, v in state["held"].items()})
        self._held_key = None
        self._restored = True

    def __call__(self, *args, **kwargs):
        step_args = flatten_args(self.step_fn, args, kwargs)
        sig = signature(step_args)
        name = self.schedule.next_program()
        built = self._built.get((sig, name))
        if built is None:
            start = time.perf_counter()
            built = self._build(step_args, sig, name)
            self._built[(sig, name)] = built
            self.build_seconds += time.perf_counter() - start
        self._last, self._last_signature = built, sig
        outputs = _execute(built.executable, built.slots, built.targets, step_args.leaves)
        self.schedule.advance(name, self._held)
        n_user = built.out_spec.num_leaves
        return pytree.tree_unflatten(list(outputs[:n_user]), built.out_spec)

    def _build(self, step_args, sig, name: str) -> _Built:
        world_size, rank = world()
        ctx = dataclasses.replace(self.settings, world_size=world_size, rank=rank,
                                  rings=ring_names(self.settings.nrings))
        error, programs, built, startup = None, [], None, None
        try:
            captured = self._captured.get(sig) or self._trace(step_args, sig)
            start = time.perf_counter()
            program = captured.program.copy(name)
            run_passes(program, self.schedule.programs[name], ctx)
            slots, targets = self._bind(program, captured)
            state_key = tuple(id(s.tensor) for s in captured.slots if hasattr(s, "tensor"))
            built = _Built(program, compile_program(program, self.backend), slots, targets,
                           captured.out_spec, state_key)
            programs = [program]
            if self._restored:
                self._synced.add(state_key)
            fresh = self._held_key in (None, state_key)
            missing = [s for s in program.inputs
                       if s.kind == "held" and not (fresh and s.name in self._held)]
            if (world_size > 1 and state_key not in self._synced) or missing:
                startup, _ = startup_program(captured, missing)
                run_passes(startup, STARTUP_PASSES, ctx)
                programs.append(startup)
            log.info("transpiler: built program %r in %.2fs; %d collectives", name,
                     time.perf_counter() - start, len(program.collectives()))
        except TranspileError as exc:
            error = exc
        if world_size > 1:
            agreement.agree(programs, error)
        elif error is not None:
            raise error
        self._restored = False
        if startup is not None:
            self._run_startup(startup, captured, built.state_key)
        return built

    def _trace(self, step_args, sig) -> Captured:
        fn_name = getattr(self.step_fn, "__name__", "step")
        why = ("first call" if self._last_traced is None
               else describe_change(self._last_traced, sig))
        self._last_traced = sig
        start = time.perf_counter()
        captured = trace_step(self.step_fn, step_args)
        record(captured.program, "capture", f"capture: {len(captured.program.graph.nodes)} "
                                            f"nodes from {fn_name} ({why})")
        log.info("transpiler: traced %s (%s) in %.2fs", fn_name, why, time.perf_counter() - start)
        self._captured[sig] = captured
        return captured

    def _bind(self, program: Program, captured: Captured) -> tuple[list, list]:
        """The slot each input is read from and each output written to."""
        by_name = {spec.name: slot for spec, slot in zip(captured.program.inputs, captured.slots)}
        created = {spec.target: target for spec, target
                   in zip(captured.program.outputs, captured.targets) if spec.kind == "state"}
        slots = [HeldSlot(self._held, spec.name) if spec.kind == "held" else by_name[spec.name]
                 for spec in program.inputs]
        by_name.update({spec.name: slot for spec, slot in zip(program.inputs, slots)})
        targets = [None if spec.kind == "user"
                   else created[spec.target] if spec.kind == "state"
                   else HeldSlot(self._held, spec.target) if spec.kind == "held"
                   else by_name[spec.target] for spec in program.outputs]
        return slots, targets

    def _run_startup(self, startup: Program, captured: Captured, state_key: tuple) -> None:
        if self._held_key not in (None, state_key):
            self._held.clear()   # they belonged to another model
        slots, targets = self._bind(startup, captured)
        _execute(compile_program(startup, "eager"), slots, targets, None)
        self.startup_program = startup
        self._synced.add(state_key)
        self._held_key = state_key


def _execute(executable: Executable, slots: list, targets: list, leaves) -> list:
    """Run a program on the live tensors; write the new state back only once the
    whole program has succeeded (outputs it wrote in place need no write-back)."""
    with torch.no_grad():
        outputs = executable.run([slot.read(leaves) for slot in slots])
        for target, value, written in zip(targets, outputs, executable.written):
            if target is not None and not written:
                target.write(value)
    return outputs
