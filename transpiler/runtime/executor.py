"""Running a program on the live tensors and committing what it writes (the
new parameters and buffers, optimizer state, .grad, held tensors) only once the
whole program has succeeded: a step that raises leaves everything as it was.
Programs run, and compile, as traced (capture/ambient.py): without the
caller's autocast, grad mode or torch function modes. The write-back is all or
nothing: every value is checked against its target before the first is
written, and nothing that can fail runs after that."""

from __future__ import annotations

import functools
import logging
import time

import torch

from . import rebuild
from ..backends.compile import compile_program, inductor_cache_on
from ..capture.ambient import as_traced
from .compile_once import Plan, compiled_on_every_rank, digest
from ..errors import TranspileError
from .node_first import node_first_rank
from .runnable import Runnable
from ..world import world

log = logging.getLogger("transpiler")


class Executor:
    """Runs programs and commits their writes; counts the seconds compilers
    took (they compile on a program's first run)."""

    def __init__(self):
        self.compile_seconds = 0.0

    def run(self, runnable: Runnable, leaves, release_grads: bool = False) -> list:
        """Run the compiled program and write back the outputs it did not write
        in place; its outputs (None where written in place). `release_grads`:
        the .grad it replaces without reading them are set to None just before
        it runs, as the step's zero_grad() drops them in eager, so that their
        memory is free for the new ones (eager made to hold two sets of
        gradients takes 7 % longer on the bench's wide model); a program that
        then fails leaves them None. Only for a program that cannot fail over
        to another one on this call (one with no decision on tensor values),
        and not before a compiled program on CPU (_keeps_old_grads), which
        drops them when it fails."""
        if runnable.loop is not None:
            return runnable.loop.run(self.run, leaves, runnable.compile_alone)
        first = runnable.executable is None
        start = time.perf_counter()
        with as_traced():
            inputs = [slot.read(leaves) for slot in runnable.slots]
            if first:
                executable = compile_program(runnable.program, runnable.backend)
                if executable.prepare is not None:
                    # Compiled on every rank before any issues the program's
                    # collectives; kept only then (a failed compile is tried,
                    # and agreed on, again at the next call).
                    compile = functools.partial(_compile, executable.prepare, inputs,
                                                runnable.program.name, runnable.backend)
                    if runnable.compile_alone:
                        _compiled_alone(compile, runnable.program.name)
                    else:   # once per node: the node's other ranks load it
                        plan = Plan(node_first_rank(), digest(runnable.program, inputs)
                                    if inductor_cache_on() else None)
                        compiled_on_every_rank(compile, runnable.program.name, plan)
                runnable.executable = executable
            executable = runnable.executable
            if release_grads and not _keeps_old_grads(runnable):
                _release(runnable.replaced_grads)
            try:
                outputs = executable.run(inputs)
            except Exception as exc:
                if release_grads:   # as the step's zero_grad() left them
                    _release(runnable.replaced_grads)
                rebuild.raise_if_abandoned(exc)   # a rank gave up: its reason
                raise
        self.commit(runnable, outputs, executable.written)
        if first:
            seconds = time.perf_counter() - start
            self.compile_seconds += seconds
            log.info("transpiler: first run of program %r (%s) took %.2fs",
                     runnable.program.name, runnable.backend, seconds)
        return outputs

    def run_uncommitted(self, runnable: Runnable, leaves) -> list:
        """Run the program op by op and write nothing: every output, for the
        caller to check before it commits them."""
        if runnable.loop is not None:
            return runnable.loop.run(self.run_uncommitted, leaves, runnable.compile_alone)
        with as_traced():
            inputs = [slot.read(leaves) for slot in runnable.slots]
            try:
                return list(runnable.program.gm(*inputs))
            except Exception as exc:
                rebuild.raise_if_abandoned(exc)   # a rank gave up: its reason
                raise

    def commit(self, runnable: Runnable, outputs: list, written: list[bool] | None = None) -> None:
        """Write the outputs to their targets (but those `written` in place by
        the program), all or none: a value that does not fit its target (its
        shape, dtype or device) raises before any is written."""
        writes = [(spec, target, value) for spec, target, value, done
                  in zip(runnable.program.outputs, runnable.targets, outputs,
                         written or [False] * len(outputs)) if target is not None and not done]
        for spec, target, value in writes:
            why = target.misfit(value)
            if why is not None:
                raise TranspileError(
                    f"program {runnable.program.name!r} computed {why} as the new "
                    f"{spec.kind.value} {spec.target}, so nothing was written back: a target "
                    "changed in a way the step's signature does not record (a parameter given "
                    "a grad_dtype of its own), or the transpiler has a bug (report it, with "
                    "the step)")
        with torch.no_grad():
            for _, target, value in writes:
                target.write(value)


def _release(params) -> None:
    for param in params:
        param.grad = None


def _keeps_old_grads(runnable: Runnable) -> bool:
    """Whether the .grad a compiled CPU program replaces stay until it has
    written the new ones. Its new gradients are the last buffers it allocates,
    so they end on top of the heap; dropped before the next run, that top is
    handed back to the system (glibc trims a free top larger than twice its
    mmap threshold, some 20 MB) and the run faults it in again page by page:
    resnet18 under bf16 autocast (45 MB of gradients) took 13,800 page faults
    a step and 1.24x the eager step's time, against about 1,400 and 0.91x
    with the old gradients kept. Op by op (backend "eager") the early release costs
    no faults (none a step on that model), and an accelerator's caching
    allocator reuses what is freed."""
    return (runnable.backend != "eager" and bool(runnable.replaced_grads)
            and runnable.replaced_grads[0].device.type == "cpu")


def _compiled_alone(compile, program: str) -> None:
    """Compile a program built on this rank alone. The others may be waiting
    in its collectives: a failure abandons the job (rebuild.abandon)."""
    try:
        compile()
    except Exception as exc:  # noqa: BLE001 - posted for the others, then raised
        rebuild.abandon(f"rank {world()[1]} traced the step again but could not compile program "
                        f"{program!r} ({type(exc).__name__}: {exc}) while the others ran on "
                        "with the previous one; the communicators were shut down so that no "
                        "rank waits for the process group's timeout: this job cannot go on; "
                        "restart it.", exc)


def _compile(prepare, inputs: list, program: str, backend: str) -> bool:
    """prepare(inputs); a compiler's own failure as a TranspileError that says
    what to do (the traceback keeps the compiler's)."""
    try:
        return prepare(inputs)
    except TranspileError:
        raise
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [""])[0]
        raise TranspileError(
            f"backend {backend!r} could not compile program {program!r}: "
            f"{type(exc).__name__}: {first_line}. The program did not run; with "
            f"backend='eager' the step runs op by op") from exc
