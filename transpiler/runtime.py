"""The runtime: the callable `transpile` returns.

On each call it computes the signature of the arguments, builds (traces, runs
the passes, compiles, checks rank agreement) the programs for a new signature,
feeds the live tensors in, and writes the new state back into the model and the
optimizer only after the whole program has succeeded.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Sequence

import torch
import torch.utils._pytree as pytree

from . import agreement
from .backends import Executable, compile_program
from .capture import describe_change, flatten_args, signature, trace_step
from .errors import TranspileError
from .modes import STARTUP_PASSES
from .pipeline import PassContext, PassLike, record, run_passes
from .program import Program, format_collectives
from .rings import ring_names, world
from .startup import startup_program

log = logging.getLogger("transpiler")


@dataclasses.dataclass
class _Built:
    program: Program
    executable: Executable
    slots: list
    targets: list
    out_spec: pytree.TreeSpec
    n_user: int
    state_key: tuple


class TranspiledStep:
    def __init__(self, step_fn: Callable, passes: Sequence[PassLike], settings: PassContext, *,
                 backend: str):
        self.step_fn = step_fn
        self.passes = tuple(passes)
        self.settings = settings  # the world fields are filled in when a program is built
        self.backend = backend
        self._built: dict[tuple, _Built] = {}
        self._last_signature: tuple | None = None
        self._last: _Built | None = None
        self._synced: set[tuple] = set()
        self.startup_program: Program | None = None
        self.build_seconds = 0.0  # one-time costs so far: trace, passes, compile, startup

    @property
    def program(self) -> Program:
        """The main program last run (or built)."""
        if self._last is None:
            raise TranspileError("the step has not been called yet: the program is built "
                                 "on the first call, from the real arguments")
        return self._last.program

    def explain(self) -> str:
        """The collectives of the main program as a table: one row per all-reduce
        (a bucket in fuse_all_reduce), with its ring, dtype, size and parameters."""
        return format_collectives(self.program)

    def __call__(self, *args, **kwargs):
        step_args = flatten_args(self.step_fn, args, kwargs)
        sig = signature(step_args)
        built = self._built.get(sig)
        if built is None:
            start = time.perf_counter()
            built = self._build(step_args, sig)
            self._built[sig] = built
            self.build_seconds += time.perf_counter() - start
        self._last = built
        leaves = step_args.leaves
        with torch.no_grad():
            outputs = built.executable.run([slot.read(leaves) for slot in built.slots])
            # Write back only now that the whole program has succeeded.
            for target, value, written in zip(built.targets, outputs, built.executable.written):
                if target is not None and not written:
                    target.write(value)
        return pytree.tree_unflatten(list(outputs[:built.n_user]), built.out_spec)

    def _build(self, step_args, sig) -> _Built:
        name = getattr(self.step_fn, "__name__", "step")
        why = ("first call" if self._last_signature is None
               else describe_change(self._last_signature, sig))
        self._last_signature = sig
        world_size, rank = world()
        ctx = dataclasses.replace(self.settings, world_size=world_size, rank=rank,
                                  rings=ring_names(self.settings.nrings))
        start = time.perf_counter()
        error, programs, built, startup = None, [], None, None
        try:
            captured = trace_step(self.step_fn, step_args)
            traced = time.perf_counter()
            program = captured.program
            record(program, "capture", f"capture: {len(program.graph.nodes)} nodes from "
                                       f"{name} ({why})")
            run_passes(program, self.passes, ctx)
            state_key = tuple(id(s.tensor) for s in captured.slots if hasattr(s, "tensor"))
            built = _Built(program, compile_program(program, self.backend), captured.slots,
                           captured.targets, captured.out_spec,
                           captured.out_spec.num_leaves, state_key)
            programs = [program]
            if world_size > 1 and state_key not in self._synced:
                startup, startup_slots = startup_program(captured)
                run_passes(startup, STARTUP_PASSES, ctx)
                programs.append(startup)
            log.info("transpiler: traced %s (%s) in %.2fs, passes and compile %.2fs; "
                     "%d collectives", name, why, traced - start,
                     time.perf_counter() - traced, len(program.collectives()))
        except TranspileError as exc:
            error = exc
        if world_size > 1:
            agreement.agree(programs, error)
        elif error is not None:
            raise error
        if startup is not None:
            self._run_startup(startup, startup_slots)
            self._synced.add(built.state_key)
        return built

    def _run_startup(self, startup: Program, slots: list) -> None:
        self.startup_program = startup
        with torch.no_grad():
            values = compile_program(startup, "eager").run([slot.read(None) for slot in slots])
            for slot, value in zip(slots, values):
                slot.write(value)
