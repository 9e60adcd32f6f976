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

from . import agreement, consistency, verify
from .backends import Executable, check_process_group, compile_program, device_of, resolve
from .capture import (Captured, HeldSlot, Returned, describe_change, flatten_args,
                      grad_signature, signature, trace_step)
from .errors import DivergenceError, TranspileError
from .modes import STARTUP_PASSES
from .pipeline import PassContext, record, run_passes
from .program import Program, format_collectives
from .rings import ring_names, world
from .startup import startup_program

log = logging.getLogger("transpiler")


@dataclasses.dataclass
class _Runnable:
    """A program with the slots its inputs are read from and its outputs written
    to (None: returned to the caller); compiled on its first run."""

    program: Program
    slots: list
    targets: list
    backend: str
    executable: Executable | None = None
    held: list[str] = dataclasses.field(init=False)       # held tensors it reads
    transient: list[str] = dataclasses.field(init=False)  # held values it only outputs

    def __post_init__(self):
        self.held = [spec.name for spec in self.program.inputs if spec.kind == "held"]
        self.transient = [spec.target for spec in self.program.outputs
                          if spec.kind == "held" and spec.target not in self.held]


@dataclasses.dataclass
class _Built:
    """Everything built for one signature of the arguments."""

    programs: dict[str, _Runnable]
    startup: _Runnable | None   # broadcast from rank 0, then initialize the held tensors
    refresh: _Runnable | None   # initialize the held tensors only
    returned: Returned
    state_key: tuple   # identity of the parameters and buffers it runs on
    backend: str       # the concrete backend its programs compile with
    schedulers: list   # LR schedulers stepped on the host after each call
    cleared: list      # (name, parameter) whose .grad each call leaves None
    reads_grads: bool  # whether which parameters have a .grad is part of the key
    averaged_after: int  # backward() calls before the first optimizer.step() (verify)


_LOADED = "loaded"   # held tensors restored by load_state_dict, for the next state set


class TranspiledStep:
    def __init__(self, step_fn: Callable, schedule, settings: PassContext, *, backend: str,
                 check_every: int | None = None, verify: int = 0,
                 verify_tolerance: float = 1e-3):
        self.step_fn = step_fn
        self.verify_steps, self.verify_tolerance = verify, verify_tolerance
        self.check_every = check_every
        self._check_due = False
        self._settings_agreed = False
        self.schedule = schedule
        self.settings = settings  # the world fields are filled in when a program is built
        self.backend = backend
        self._built: dict[tuple, _Built] = {}
        # Signatures whose programs read the .grad the step starts with: their
        # key also says which parameters have one (capture.grad_signature).
        self._reads_grads: set[tuple] = set()
        self._last_traced: tuple | None = None   # signature of the last trace
        self._last: _Built | None = None
        self._last_run: str | None = None
        self._synced: set[tuple] = set()          # state sets broadcast from rank 0
        self._restored = False                    # trust the next state set as loaded
        self._held: dict[str, torch.Tensor] = {}  # snapshots and the like, by name
        # The state set the held tensors are current for: None once a program
        # that does not carry them has run (or before the first startup).
        self._held_for: tuple | str | None = None
        self.startup_program: Program | None = None
        # One-time costs so far: traces, passes, and the first run of each program
        # (which is when compiled backends compile).
        self.build_seconds = 0.0

    @property
    def program(self) -> Program:
        """The program last run."""
        return self._last_built().programs[self._last_run].program

    @property
    def programs(self) -> dict[str, Program]:
        """Every program of the schedule, built for the arguments of the last call,
        by name ("main"; local_sgd: "warmup", "local", "sync")."""
        return {name: r.program for name, r in self._last_built().programs.items()}

    @property
    def skipped_steps(self) -> int:
        """Steps whose update skip_nonfinite skipped (non-finite summed gradients)."""
        return self.schedule.skipped

    @property
    def compiled_backend(self) -> str:
        """The backend the programs of the last call run with ("auto" resolved)."""
        return self._last_built().backend

    def _last_built(self) -> _Built:
        if self._last is None:
            raise TranspileError("the step has not been called yet: the programs are built "
                                 "on the first call, from the real arguments")
        return self._last

    def explain(self, name: str | None = None) -> str:
        """The collectives of a program (default: the one last run) as a table:
        one row per collective (a bucket in fuse_all_reduce), with its ring,
        dtype, size and parameters."""
        programs = self.programs
        if name is not None and name not in programs:
            raise TranspileError(f"no program {name!r}; this step has {', '.join(programs)}")
        return format_collectives(programs[name] if name else self.program)

    def check_consistency(self) -> list[str]:
        """Compare a checksum of every parameter across the ranks: one line per
        parameter that differs, naming the ranks (empty when they all agree). A
        collective: call it on every rank at the same step. (Under local SGD the
        ranks differ between syncs by design.)"""
        built = self._last_built()
        if world()[0] == 1:
            return []
        runnable = next(iter(built.programs.values()))
        named = [(spec.name, slot.read(None)) for spec, slot
                 in zip(runnable.program.inputs, runnable.slots) if spec.kind == "param"]
        return consistency.divergent(named)

    def _raise_if_divergent(self) -> None:
        lines = self.check_consistency()
        if lines:
            raise DivergenceError(
                f"the ranks' parameters differ after step {self.schedule.step}: "
                + "; ".join(lines[:5]) + (f"; and {len(lines) - 5} more" if len(lines) > 5 else "")
                + ". Something outside the transpiled step changed them on some ranks "
                "(a different seed, data-dependent code, an in-place edit).")

    def state_dict(self) -> dict:
        """The step's own state: its schedule (step counter; local_sgd: steps since
        the last sync, k) and its held tensors while they are current (local_sgd:
        the snapshots). With the model's and the optimizer's state_dict it resumes
        a run exactly."""
        current = self._held_for is not None
        return {"schedule": self.schedule.state_dict(),
                "held": {k: v.detach().clone() for k, v in self._held.items()} if current else {}}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict saved. The next call trusts each rank's model as
        loaded (no broadcast from rank 0): under local SGD the ranks' parameters
        legitimately differ between syncs."""
        self.schedule.load_state_dict(state["schedule"])
        self._held.clear()
        self._held.update({k: v.detach().clone() for k, v in state["held"].items()})
        self._held_for = _LOADED if self._held else None
        self._restored = True

    def __call__(self, *args, **kwargs):
        step_args = flatten_args(self.step_fn, args, kwargs)
        sig = signature(step_args)
        key = sig + grad_signature(step_args) if sig in self._reads_grads else sig
        built = self._built.get(key)
        if built is None:
            start = time.perf_counter()
            built = self._build(step_args, sig + grad_signature(step_args))
            if built.reads_grads:
                self._reads_grads.add(sig)
                key = sig + grad_signature(step_args)
            self._built[key] = built
            self.build_seconds += time.perf_counter() - start
        name = self.schedule.next_program()
        runnable = built.programs[name]
        if self._restored:
            self._synced.add(built.state_key)
            self._restored = False
        if built.startup is not None and built.state_key not in self._synced:
            self._run_startup(built, built.startup)
            self._synced.add(built.state_key)
        elif not self._held_current(runnable, built.state_key):
            self._run_startup(built, built.refresh)
        if self.schedule.step < self.verify_steps:
            outputs = self._run_verified(runnable, built, step_args)
        else:
            outputs = self._run(runnable, step_args.leaves)
        for _, param in built.cleared:
            param.grad = None
        for scheduler in built.schedulers:   # what the step did after optimizer.step()
            scheduler.step()
        if not runnable.held:
            self._held_for = None   # the parameters moved on without their snapshots
        self._last, self._last_run = built, name
        self.schedule.advance(name, self._held)
        for name in runnable.transient:   # read by the schedule; gone with the step
            self._held.pop(name, None)
        if self.check_every and self.schedule.step % self.check_every == 0:
            self._check_due = True
        if self._check_due and name != "local":   # local SGD's ranks differ until the sync
            self._check_due = False
            self._raise_if_divergent()
        return built.returned.rebuild(outputs[:built.returned.num_tensors])

    def _held_current(self, runnable: _Runnable, state_key: tuple) -> bool:
        if not runnable.held:
            return True
        if self._held_for == _LOADED and all(n in self._held for n in runnable.held):
            self._held_for = state_key
        return self._held_for == state_key

    def _build(self, step_args, sig) -> _Built:
        """Trace the step and run the passes of every program of the schedule and
        of the startup program; the ranks agree on all of them before any runs."""
        world_size, rank = world()
        if world_size > 1 and not self._settings_agreed:
            agreement.agree_on_settings(self._describe_settings())
            self._settings_agreed = True
        ctx = dataclasses.replace(self.settings, world_size=world_size, rank=rank,
                                  rings=ring_names(self.settings.nrings))
        error, built, to_agree = None, None, []
        try:
            captured = self._trace(step_args, sig)
            start = time.perf_counter()
            device = device_of(captured.program)
            backend = resolve(self.backend, device)
            if world_size > 1:
                check_process_group(device)
            programs = {}
            for name, passes in self.schedule.programs.items():
                program = captured.program.copy(name)
                run_passes(program, passes, ctx)
                programs[name] = _Runnable(program, *self._bind(program, captured), backend)
            held = list({spec.name: spec for r in programs.values() for spec in r.program.inputs
                         if spec.kind == "held"}.values())
            startup = refresh = None
            if world_size > 1:
                program = startup_program(captured, held)
                run_passes(program, STARTUP_PASSES, ctx)
                startup = _Runnable(program, *self._bind(program, captured), "eager")
            if held:
                program = startup_program(captured, held, name="refresh")
                refresh = _Runnable(program, *self._bind(program, captured), "eager")
            state_key = tuple(id(s.tensor) for s in captured.slots if hasattr(s, "tensor"))
            built = _Built(programs, startup, refresh, captured.returned, state_key, backend,
                           captured.schedulers, captured.cleared, captured.reads_grads,
                           captured.averaged_after)
            to_agree = [r.program for r in programs.values()] + ([startup.program] if startup else [])
            log.info("transpiler: passes for %s in %.2fs; collectives per program: %s",
                     ", ".join(programs), time.perf_counter() - start,
                     ", ".join(f"{n} {len(r.program.collectives())}" for n, r in programs.items()))
        except TranspileError as exc:
            error = exc
        if world_size > 1:
            agreement.agree(to_agree, error)
        elif error is not None:
            raise error
        return built

    def _describe_settings(self) -> dict[str, str]:
        options = {f.name: getattr(self.settings, f.name) for f in dataclasses.fields(self.settings)
                   if f.name not in ("world_size", "rank", "rings")}
        programs = {name: [getattr(p, "__name__", p) for p in passes]
                    for name, passes in self.schedule.programs.items()}
        return {"programs": str(programs), **{k: repr(v) for k, v in options.items()},
                "backend": repr(self.backend), "check_every": repr(self.check_every),
                "schedule": f"{type(self.schedule).__name__} "
                            f"{ {k: v for k, v in vars(self.schedule).items() if k != 'programs'} }"}

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
        return captured

    def _bind(self, program: Program, captured: Captured) -> tuple[list, list]:
        """The slot each input is read from and each output written to."""
        by_name = {spec.name: slot for spec, slot in zip(captured.program.inputs, captured.slots)}
        captured_targets = {(spec.kind, spec.target): target for spec, target
                            in zip(captured.program.outputs, captured.targets)
                            if spec.kind in ("state", "grad")}
        slots = [HeldSlot(self._held, spec.name) if spec.kind == "held" else by_name[spec.name]
                 for spec in program.inputs]
        by_name.update({spec.name: slot for spec, slot in zip(program.inputs, slots)})
        targets = [None if spec.kind == "user"
                   else captured_targets[(spec.kind, spec.target)] if spec.kind in ("state", "grad")
                   else HeldSlot(self._held, spec.target) if spec.kind == "held"
                   else by_name[spec.target] for spec in program.outputs]
        return slots, targets

    def _run(self, runnable: _Runnable, leaves) -> list:
        """Run a program on the live tensors; write the new state back only once
        the whole program has succeeded (outputs it wrote in place need none)."""
        first = runnable.executable is None
        if first:
            runnable.executable = compile_program(runnable.program, runnable.backend)
        start = time.perf_counter()
        executable = runnable.executable
        with torch.no_grad():
            outputs = executable.run([slot.read(leaves) for slot in runnable.slots])
            for target, value, written in zip(runnable.targets, outputs, executable.written):
                if target is not None and not written:
                    target.write(value)
        if first:   # compilers compile on the first run
            seconds = time.perf_counter() - start
            self.build_seconds += seconds
            log.info("transpiler: first run of program %r (%s) took %.2fs",
                     runnable.program.name, runnable.backend, seconds)
        return outputs

    def _run_verified(self, runnable: _Runnable, built: _Built, step_args) -> list:
        """Run the program functionally and compare everything it would write and
        return with the eager step under DDP's semantics (verify.py); write back
        only if every rank agrees."""
        cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=cuda):   # the program draws what the reference drew
            memo, expected = verify.reference_step(self.step_fn, step_args, built.averaged_after)
        with torch.no_grad():
            outputs = list(runnable.program.gm(*[slot.read(step_args.leaves)
                                                 for slot in runnable.slots]))
        n_user = built.returned.num_tensors
        names = [f"returned value {i}" for i in range(n_user)]
        ours, theirs = outputs[:n_user], expected
        for spec, target, value in zip(runnable.program.outputs[n_user:],
                                       runnable.targets[n_user:], outputs[n_user:]):
            mirrored = target.mirror(memo) if target is not None else None
            if mirrored is not None or spec.kind == "grad":
                names.append(f"{spec.kind} {spec.target}")
                ours.append(value)
                theirs.append(mirrored)
        names += [f"grad {name}" for name, _ in built.cleared]
        ours += [None] * len(built.cleared)
        theirs += [memo[id(p)].grad for _, p in built.cleared]
        verdict = verify.first_difference(names, ours, theirs, self.verify_tolerance)
        verify.agree_on_verdict(verdict, self.schedule.step)
        with torch.no_grad():
            for target, value in zip(runnable.targets, outputs):
                if target is not None:
                    target.write(value)
        return outputs

    def _run_startup(self, built: _Built, startup: _Runnable) -> None:
        """Run the startup program (or the refresh of the held tensors alone)."""
        if self._held_for not in (None, built.state_key):
            self._held.clear()   # they belonged to another model
        self._run(startup, None)
        self.startup_program = startup.program
        self._held_for = built.state_key


