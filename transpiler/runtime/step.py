"""The runtime: the callable `transpile` returns.

On each call it asks the schedule which program runs this step, computes the
signature of the arguments, builds what is missing (traces once per signature,
then runs that program's passes on a copy, compiles, checks rank agreement and
runs the startup program where needed), feeds the live tensors in, and writes
the new state back into the model, the optimizer and the step's held tensors
only after the whole program has succeeded. What it keeps lives in three parts
with one job each: the programs built per signature (program_cache.py), the
held tensors and what must run before a program (held.py), and the running and
committing of a program (executor.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
from typing import Callable

import torch

from . import (agreement, divergence, micro_loop, rebuild, replica_average, sharded_params,
               unreduced, verify)
from ..lowering import powersgd, reduce_groups
from . import schedule as schedules
from ..backends.compile import check_process_group, device_of, resolve
from ..program.collectives import sent_bytes
from .control_plane import all_gather_values
from ..capture import Captured, HeldSlot, decisions, flatten_args, trace_step
from ..capture.ambient import refuse_untraceable, snapshot
from ..capture.arguments import signature_of
from ..capture.found import discover
from ..capture.argument_writes import arguments_of
from ..capture.ddp_wrapper import refuse_other_options
from ..capture.micro import NotRollable, cut_arguments
from ..capture.optimizer_state import forget_state
from ..capture.optimizers import numbers_where_needed
from ..capture.raised import raised_by_the_step
from ..capture.user_code import step_name
from ..errors import DivergenceError, TranspileError
from .executor import Executor
from .runnable import MicroLeaves, Runnable
from .held import HeldTensors, Prelude
from .join import Join
from ..modes import STARTUP_PASSES
from ..lowering.context import PassContext
from ..pipeline import pass_name, record, resolve as resolve_pass, run_passes
from ..program.program import Held, InputKind, OutputKind, Program, format_collectives, held_name
from ..program.roles import COMM, INPUT
from .program_cache import Built, ProgramCache
from .rebuild import AgreedPrograms
from ..program.mesh import Dim
from ..lowering.rings import build_mesh, reduce_scatter_native
from ..world import global_ranks, over, world
from ..lowering.shards import Sharding, ShardedState, StateGuard
from .startup import startup_program
from .verify import Reference

log = logging.getLogger("transpiler")


def _over_its_group(method):
    """A method of TranspiledStep run over the step's process group."""
    @functools.wraps(method)
    def over_its_group(self, *args, **kwargs):
        with over(self.process_group):
            return method(self, *args, **kwargs)
    return over_its_group


class TranspiledStep:
    """The step as transpiled: same signature and return value as the user's
    step function. It chooses the program (schedule), finds or builds it
    (ProgramCache, _build), runs what is due before it (HeldTensors), runs it
    (Executor) and checks the ranks' consistency when asked to."""

    def __init__(self, step_fn: Callable, schedule, settings: PassContext, *, backend: str,
                 check_every: int | None = None, verify: int = 0,
                 verify_tolerance: float = 1e-3,
                 groups: tuple[reduce_groups.ReduceGroup, ...] = (),
                 sharded_state: bool = False, dynamic: bool | dict | None = None,
                 micro_batches: str | None = None, process_group=None,
                 broadcast_buffers: bool = True):
        self.step_fn = step_fn
        self._parameters = signature_of(step_fn)
        self.broadcast_buffers = broadcast_buffers   # a DDP wrapper's must agree
        # The group the step is data parallel over (None: every rank): all it
        # does runs inside world.over(process_group) (_over_its_group).
        self.process_group = process_group
        # The argument holding the list of micro-batches (micro_loop.py), and
        # whether the step was found not to roll (then traced unrolled per k).
        self.micro_batches = micro_batches
        self._unrolled = False
        # Mode zero: the optimizers' state is kept as shards (shards.py).
        self._sharded = ShardedState(settings.hierarchical) if sharded_state else None
        self._guard = StateGuard(sharded_state)   # shards never pass for full state
        self.groups = groups   # parameters reduced over groups of their own
        self.verify_steps, self.verify_tolerance = verify, verify_tolerance
        self._reference = Reference()   # the eager step under torch DDP (verify=N)
        self.check_every = check_every
        self._check_due = False
        self._settings_agreed = False
        self._decides = False   # the step decides on tensor values (capture/decisions.py)
        self.schedule = schedule
        self.settings = settings  # the world fields are filled in when a program is built
        self.backend = backend
        self._cache = ProgramCache(dynamic=dynamic)
        self._agreed = AgreedPrograms()   # what every rank agreed on (rebuild.py)
        self._held = HeldTensors()
        self._executor = Executor()
        # One-time costs by phase (setup_split): every trace, pass and rank agreement.
        self._seconds = dict.fromkeys(("trace", "passes", "agreement"), 0.0)
        self._last: Built | None = None
        # Bytes this rank has sent in its steps' collectives (collectives.sent_bytes).
        self.bytes_sent = 0.0
        # The first build, run op by op until the second call decides whether
        # it compiles (_decide_pending); whether every rank builds again then.
        self._pending: Built | None = None
        self._everyone_rebuilds = False
        self._compiles = 0   # programs of the step compiled so far (their first run)
        self._last_run: str | None = None
        self.startup_program: Program | None = None
        self._found: list | None = None   # paths to the step objects it reaches (found.py)
        self._join: Join | None = None   # the join() context the step is called in
        # The parameters in the order the first trace's backward accumulated
        # their gradients: the buckets of every later build (DDP's rebuilt ones)
        self._ready_order: tuple[str, ...] = ()

    @property
    def build_seconds(self) -> float:
        """One-time costs so far: traces, passes, and the first run of each
        program (which is when compiled backends compile)."""
        return self._cache.build_seconds + self._executor.compile_seconds

    @property
    def traces(self) -> int:
        """How many times the step has been traced (a program set built)."""
        return self._cache.builds

    @property
    def compiles(self) -> int:
        """How many of the step's programs have been compiled for its backend
        (each on its first run; eager: made ready to run op by op); the
        startup program, always eager, is not counted."""
        return self._compiles

    @property
    def setup_split(self) -> dict[str, float]:
        """build_seconds by phase: tracing, passes (with the startup program),
        the ranks' agreement, compiling (the first run of each program), and
        the rest (creating communicators, computing signatures)."""
        split = dict(self._seconds, compile=self._executor.compile_seconds)
        split["other"] = max(0.0, self.build_seconds - sum(split.values()))
        return split

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

    @property
    def cuda_graphs(self) -> dict[str, str]:
        """backend="cudagraphs": per program of the last call that has run,
        "captured" or why it is not (transpiler/backends/cuda_graphs.py)."""
        return {name: r.executable.graph.status if r.executable.graph is not None
                else "not captured: " + (r.executable.why_not or "not a CUDA graph backend")
                for name, r in self._last_built().programs.items() if r.executable is not None}

    def _last_built(self) -> Built:
        if self._last is None:
            raise TranspileError("the step has not been called yet: the programs are built "
                                 "on the first call, from the real arguments")
        return self._last

    def explain(self, name: str | None = None) -> str:
        """The collectives of a program (default: the one last run) as a table:
        one row per collective (a bucket in fuse_all_reduce), with its ring,
        dtype, size and parameters, and the bytes this rank sends per step."""
        programs = self._last_built().programs
        if name is not None and name not in programs:
            raise TranspileError(f"no program {name!r}; this step has {', '.join(programs)}")
        runnable = programs[name or self._last_run]
        return format_collectives(runnable.program, runnable.sent_bytes)

    @_over_its_group
    def check_consistency(self) -> list[str]:
        """Compare a checksum of every parameter across the ranks: one line per
        parameter that differs, naming the ranks (empty when they all agree). A
        collective: call it on every rank at the same step. (Under local SGD the
        ranks differ between syncs by design.)"""
        built = self._last_built()
        if world()[0] == 1:
            return []
        runnable = next(iter(built.programs.values()))
        grouped = {id(p) for g in self.groups for p in g.params}  # differ across groups
        named = [(spec.name, slot.read(None)) for spec, slot
                 in zip(runnable.program.inputs, runnable.slots)
                 if spec.kind is InputKind.PARAM and id(slot.read(None)) not in grouped]
        return divergence.divergent(named)

    def _raise_if_divergent(self) -> None:
        lines = self.check_consistency()
        if lines:
            raise DivergenceError(
                f"the ranks' parameters differ after step {self.schedule.step}: "
                + "; ".join(lines[:5]) + (f"; and {len(lines) - 5} more" if len(lines) > 5 else "")
                + ". Something outside the transpiled step changed them on some ranks "
                "(a different seed, data-dependent code, an in-place edit).")

    def _state_tensors(self, buffers: bool) -> list[torch.Tensor]:
        """The parameters the step updates (with `buffers`, its floating-point
        buffers too), the live tensors, in program order."""
        runnable = next(iter(self._last_built().programs.values()))
        kinds = (InputKind.PARAM, InputKind.BUFFER) if buffers else (InputKind.PARAM,)
        updated = set(runnable.program.updated_inputs(*kinds))
        tensors = [slot.read(None) for node, slot in zip(runnable.program.placeholders,
                                                         runnable.slots) if node in updated]
        return [t for t in tensors if t.is_floating_point()]

    @_over_its_group
    def global_average(self, buffers: bool = False) -> None:
        """Set the parameters the step updates (with `buffers=True`, also its
        floating-point buffers, such as BatchNorm's statistics) to their mean
        over the ranks, in place: for evaluation, a checkpoint or the end of
        decentralized training, where the ranks' parameters differ by design. A
        collective: call it on every rank at the same step."""
        if world()[0] > 1:
            replica_average.global_average(self._state_tensors(buffers))

    @_over_its_group
    def consensus_distance(self) -> float:
        """The mean over the ranks of the distance (Euclidean, float64, all the
        updated parameters as one vector) of each rank's parameters to their
        average; 0.0 when they agree. A collective: call it on every rank."""
        if world()[0] == 1:
            return 0.0
        return replica_average.consensus_distance(self._state_tensors(False))

    def state_dict(self) -> dict:
        """The step's own state: its schedule (step counter; local_sgd: steps since
        the last sync, k) and its held tensors while they are current (local_sgd:
        the snapshots). With the model's and the optimizer's state_dict it resumes
        a run exactly."""
        return {"schedule": self.schedule.state_dict(), "held": self._held.state_dict()}

    @_over_its_group
    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """optimizer.state_dict() with mode zero's shards gathered into full
        entries: what torch's optimizer on one process holds, loadable into
        it, or back into this optimizer (the next step shards it again). A
        collective: call it on every rank. Without mode zero, the state_dict."""
        if self._sharded is None:
            return optimizer.state_dict()
        return self._sharded.full_state_dict(optimizer)

    @_over_its_group
    def sharded_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's state_dict for torch.distributed.checkpoint: under
        mode zero each shard is a DTensor (Shard(0) of the flattened
        parameter), so `dcp.save` writes each rank's part and `dcp.load` fills
        it from a checkpoint of any world size; then
        `load_sharded_optimizer_state_dict`. A parameter without state (all in
        a fresh process, an unused one later) is given the state its first
        step would make, to load into (kept only in a fresh optimizer; dropped
        at load when loaded as such). Without mode zero, the state_dict. A
        collective where it makes state: call it on every rank."""
        if self._sharded is None:
            return optimizer.state_dict()
        return self._sharded.dcp_state_dict(optimizer)

    @_over_its_group
    def load_sharded_optimizer_state_dict(self, optimizer: torch.optim.Optimizer,
                                          state: dict) -> None:
        """Load a state_dict from sharded_optimizer_state_dict that
        torch.distributed.checkpoint filled."""
        if self._sharded is None:
            optimizer.load_state_dict(state)
        else:
            self._sharded.load_dcp_state_dict(optimizer, state)

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict saved. The next call trusts each rank's model as
        loaded (no broadcast from rank 0): under local SGD the ranks' parameters
        legitimately differ between syncs."""
        self.schedule.load_state_dict(state["schedule"])
        self._held.load(state["held"])

    @_over_its_group
    def __call__(self, *args, **kwargs):
        # Mode fsdp: the released parameters are plain ones while the step is
        # called, and refuse to be read again after it (sharded_params.Released).
        if self._last is not None:
            sharded_params.restore(self._last.sharded_params)
        try:
            return self._call(*args, **kwargs)
        finally:
            if self._last is not None:
                sharded_params.free(self._last.sharded_params)

    def _call(self, *args, **kwargs):
        step_args = flatten_args(self.step_fn, args, kwargs, self._parameters)
        # arguments_of: where its programs set what the step sets there
        with arguments_of(step_args), unreduced.inside_a_step():
            return self._call_flat(step_args)

    def _call_flat(self, step_args):
        if self._found is None:   # what the step reaches outside its arguments (found.py)
            self._found = discover(self.step_fn, step_args.leaves)
            if self._found and self.verify_steps:
                raise TranspileError(
                    f"verify= runs the eager step on copies of the step's arguments, but the "
                    f"step uses {self._found[0].name} without taking it as an argument: pass "
                    "it as an argument to verify the step")
        step_args.found = [(path.name, path.read(step_args.leaves)) for path in self._found]
        cut = cut_arguments(self.step_fn, step_args, self.micro_batches) \
            if self.micro_batches is not None else None
        call_args = step_args if cut is None or self._unrolled else cut
        self._guard.admit(step_args.optimizers)
        if self._sharded is not None:   # a full state loaded since: its shards, before the signature
            self._sharded.shard(step_args.optimizers)
        if self._pending is not None:
            self._decide_pending(call_args)
        if self._join is not None:   # every rank says whether it steps, and what (join.py)
            self._join.before_step(self._cache.find(call_args), self.schedule.next_program(),
                                   step_args.modules, step_args.leaves)
        builds = self._cache.builds
        try:
            built = self._cache.get(call_args, self._build)
        except NotRollable as exc:
            log.info("transpiler: the micro-batch loop over %r is traced unrolled, once per "
                     "number of micro-batches: %s", self.micro_batches, exc)
            self._unrolled = True
            built = self._cache.get(step_args, self._build)
        traced_now = self._cache.builds > builds   # on this call's values
        name = self.schedule.next_program()
        tried: list[Built] = []   # those whose decisions on tensor values this call's differ from
        while True:
            runnable = built.programs[name]
            if self._join is not None:   # with a rank joined, maybe divided otherwise
                runnable = self._join.runnable(runnable)
            leaves = MicroLeaves(cut, step_args.leaves) if runnable.loop else step_args.leaves
            self._run_prelude(built, runnable)
            sharded_params.free(built.sharded_params)   # after the startup cut their shards
            fresh = runnable.uncompiled()
            if traced_now:   # the run starts from the host state the call found, as traced
                for write in reversed(built.host_writes):
                    write.undo()
            # what the step draws on the host, drawn for this run
            states = built.draws.for_run() if built.draws else None
            generators = decisions.torch_generators() if built.decisions else None
            try:
                outputs = self._run(runnable, built, step_args, leaves, states)
                break
            except BaseException as exc:
                # The first run failed: the state made for its trace goes too (the
                # next call's signature, without it, builds again).
                forget_state(built.made_state)
                built.made_state = []
                change = decisions.changed(exc, built.decisions)
                if change is None:
                    raise
                # the generators and draws as the call found them, refused or run again
                decisions.set_torch_generators(generators)
                if states:
                    built.draws.restore(states)
                if traced_now:
                    error = decisions.traced_otherwise(change)
                    if world()[0] > 1:   # the others wait in their first collective
                        rebuild.abandon(str(error), error)
                    raise error from exc
                # Nothing was written and no collective issued (decisions.py): run the
                # program of this call's decisions, from the same draws.
                tried.append(built)
                builds = self._cache.builds
                built = self._cache.redecide(
                    call_args, self._build, tried,
                    f"the decision {change.describe()} went the other way")
                traced_now = self._cache.builds > builds
        built.made_state = []
        self._compiles += fresh - runnable.uncompiled()
        for _, param in built.cleared:
            param.grad = None
        for write in built.host_writes:   # what the step's Python wrote on the host
            write.redo()
        built.returned.write_back(outputs)   # and the numbers it computed there
        # (a trace showed its own text, unless the values it prints fill it in)
        if built.printed is not None and (not traced_now or built.printed.renders is not None):
            built.printed.show_again(built.returned.shown_values(outputs))
        for edit in built.argument_edits:   # keys it popped, tensors made to require grad
            edit.apply()
        if world()[0] > 1:   # a step of its optimizers outside it is refused until one inside
            if built.steps:
                unreduced.reduced(step_args.optimizers)
            else:
                unreduced.leave_unreduced(step_name(self.step_fn), step_args.optimizers)
        for scheduler in built.schedulers:   # what the step did after optimizer.step()
            scheduler.step()
        self._last, self._last_run = built, name
        self.bytes_sent += runnable.sent_bytes
        self.schedule.advance(name, self._held.tensors)
        if self.schedule.updates_on_host:
            self.schedule.host_update(self._held.tensors, {
                spec.name: slot.tensor for spec, slot in zip(runnable.program.inputs, runnable.slots)
                if spec.kind is InputKind.PARAM})
        if self.settings.comm_hook is not None:   # its state's host part (PowerSGD's counter)
            self.settings.comm_hook.after_step(runnable.program)
        self._held.step_done(carried=bool(runnable.held), transient=runnable.transient)
        if self.check_every and self.schedule.step % self.check_every == 0:
            self._check_due = True
        if self._check_due and self.schedule.parameters_agree_after(name) \
                and (self._join is None or self._join.every_rank_steps):
            # (a rank that has joined keeps its model until the join ends)
            self._check_due = False
            self._raise_if_divergent()
        if built.raised is not None:   # what the step wrote before its raise is written
            built.raised.throw()
        return built.returned.rebuild(outputs[:built.returned.num_outputs])

    def _run(self, runnable: Runnable, built: Built, step_args, leaves, states):
        if self.schedule.step < self.verify_steps:
            return self._run_verified(runnable, built, step_args, leaves, states)
        if built is self._pending or (not runnable.ran and runnable.executable is None
                                      and runnable.backend == "eager" and runnable.loop is None):
            # An eager program's first run runs it as traced and writes nothing
            # in place: its outputs are checked against their targets first (an
            # op whose meta function got a shape wrong, a quantization
            # observer's resize_, raises with nothing written), then committed.
            # From the second run on, its reinplaced executable.
            with built.rng.drawing(step_args.leaves):
                outputs = self._executor.run_uncommitted(runnable, leaves)
            self._executor.commit(runnable, outputs)
            if built is not self._pending:   # an eager program: ran, as compiled
                runnable.ran = True
            return outputs
        with built.rng.drawing(step_args.leaves):
            return self._executor.run(runnable, leaves, release_grads=not built.decisions)

    def join(self, divide_by_initial_world_size: bool = True) -> Join:
        """DDP's Join for uneven inputs: `with step.join(): for batch in
        loader: step(...)`. A rank whose batches run out shadows the others'
        collectives until every rank is done; then every rank gets the model
        of the highest rank among those that stepped last (join.py). Every
        rank must enter it. Modes grad_allreduce, fuse_all_reduce, zero and fsdp
        (where a joined rank's shards still take the others' updates), backend
        eager."""
        if self.settings.comm_hook is not None and self.settings.comm_hook.stateful:
            raise TranspileError("step.join() with PowerSGD: not supported (DDP's joined rank "
                                 "runs the hook on zeros, which advances its state)")
        if not isinstance(self.schedule, schedules.EveryStep) or self.settings.hierarchical:
            raise TranspileError("step.join() shadows the collectives of one program: modes "
                                 "grad_allreduce, fuse_all_reduce, zero and fsdp, without "
                                 "hierarchical=")
        if self.backend != "eager" or self.verify_steps or self.micro_batches is not None:
            raise TranspileError("step.join() runs with backend='eager', without verify= and "
                                 "micro_batches= (a joined rank issues the program's collectives "
                                 "in its graph's order, which a compiler may change)")
        if self.settings.find_unused:
            raise TranspileError("step.join() with find_unused_parameters=True: not supported "
                                 "(DDP's joined rank contributes its last used map)")
        return Join(self, divide_by_initial_world_size)

    @property
    def parameter_shard_bytes(self) -> int:
        """Mode fsdp: bytes of the parameter shards this rank keeps between steps."""
        params = self._last.sharded_params if self._last else []
        return sum(self._held.tensors[held_name(Held.PARAM_SHARD, name)].nbytes
                   for name, _ in params)

    @contextlib.contextmanager
    def unsharded(self, writeback: bool = False):
        """Mode fsdp: the model's full parameters inside the block (for
        evaluation, export, model.state_dict()), released again on exit; with
        writeback=True what the block wrote into them becomes the shards the
        next step starts from. Every rank must enter it (it gathers)."""
        params = self._last.sharded_params if self._last else []
        with over(self.process_group), sharded_params.unsharded(
                params, self._held.tensors, writeback, self._sharding()):
            yield

    @_over_its_group
    def sharded_model_state_dict(self, model: torch.nn.Module) -> dict:
        """Mode fsdp: model.state_dict() for torch.distributed.checkpoint, each
        parameter a DTensor (Shard(0) of the flattened parameter) whose local
        part is this rank's shard, each buffer as it is: `dcp.save` writes each
        rank's part, `dcp.load` fills it from a checkpoint of any world size;
        then `load_sharded_model_state_dict`. Works before the first call too
        (the parameters are whole then: each rank's part is cut from them)."""
        params = self._last.sharded_params if self._last else []
        return sharded_params.dcp_state_dict(model, params, self._held.tensors, self._sharding())

    @_over_its_group
    def load_sharded_model_state_dict(self, model: torch.nn.Module, state: dict) -> None:
        """Load a state_dict from sharded_model_state_dict that
        torch.distributed.checkpoint filled: into the shards the next step
        starts from, or (before the first call, and for parameters the step
        keeps whole) gathered into the parameters. A collective: call it on
        every rank."""
        params = self._last.sharded_params if self._last else []
        sharded_params.load_dcp_state_dict(model, params, self._held.tensors, state,
                                           self._sharding())

    def _sharding(self) -> Sharding:
        """How parameters and optimizer state are sharded (mode zero and fsdp)."""
        return self._sharded.sharding if self._sharded else Sharding.of(False)

    def _run_prelude(self, built: Built, runnable: Runnable) -> None:
        """Run the startup program, or the refresh of the held tensors alone,
        where one is due before `runnable`."""
        prelude = self._held.prelude(built.state_key, built.startup is not None, runnable.held)
        if prelude is None:
            return
        startup = built.startup if prelude is Prelude.STARTUP else built.refresh
        self._held.initializing(built.state_key)
        self._executor.run(startup, None)
        self._held.initialized(built.state_key, prelude)
        self.startup_program = startup.program

    def _build(self, step_args, why: str) -> Built:
        """Trace the step and run the passes of every program of the schedule and
        of the startup program; the ranks agree on all of them before any runs."""
        world_size = world()[0]
        try:   # an error here must reach every rank before any collective
            self.schedule.bind(world_size)
            unbound = None
        except TranspileError as exc:
            unbound = exc
        if world_size > 1 and not self._settings_agreed:
            settings = self._describe_settings()
            if unbound is not None:
                settings["schedule"] = f"{type(unbound).__name__}: {unbound}"
            with self._timed("agreement"):
                agreement.agree_on_settings(settings)
            self._settings_agreed = True
        if unbound is not None:
            raise unbound
        mesh = build_mesh(self.settings.nrings, self.settings.hierarchical,
                          [g.group for g in self.groups], self.schedule.partitions)
        error, built, to_agree, new_state = None, None, [], False
        captured = None
        try:
            captured = self._trace(step_args, why)
            if captured.raised is not None:   # what the other ranks are told of this build
                why = f"{why}, where the step raises {captured.raised.describe()}"
            self.schedule.check_params(captured.param_names(), [
                n.meta[INPUT].name for n in captured.program.updated_inputs(InputKind.PARAM)])
            if not step_args.optimizers:
                self._check_update_by_hand()
            start = time.perf_counter()
            device = device_of(captured.program)
            backend = resolve(self.backend, device)
            if world_size > 1:
                check_process_group(device)
                mesh = dataclasses.replace(mesh, reduce_scatter_native=reduce_scatter_native(device))
            if not self._ready_order:   # DDP rebuilds its buckets once: kept from the first
                self._ready_order = captured.program.ready_order()
            ctx = dataclasses.replace(self.settings, mesh=mesh, groups=reduce_groups.assign(
                self.groups, captured.param_names()), ready_order=self._ready_order)
            if self._sharded is not None:   # its gathers run on the mesh's communicators
                self._sharded.mesh = mesh
            with self._timed("passes"):
                programs, startup, refresh = self._programs(captured, ctx, backend, world_size)
            state_key = tuple(id(s.tensor) for s in captured.slots if hasattr(s, "tensor"))
            dropped = _dropped_grads(captured, programs)
            if dropped and captured.reads_grads:
                raise TranspileError(
                    f"the step reads the .grad it starts with, but mode zero leaves .grad None "
                    f"after a step ({dropped[0][0]} and others: each rank keeps only its shard "
                    "of the reduced gradient) where DDP leaves the reduced gradient: call "
                    "optimizer.zero_grad() (set_to_none=True, the default) in the step before "
                    "backward(), or after optimizer.step() when it accumulates over calls")
            built = Built(programs, startup, refresh, captured.returned, state_key, backend,
                           captured.schedulers, captured.cleared + dropped,
                           captured.reads_grads, captured.guards, _sharded_params(captured, programs),
                           captured.shape_guards, captured.host_writes, captured.draws,
                           captured.rng, captured.made_state, captured.decisions,
                           captured.number_guards, captured.argument_edits,
                           captured.values_read, captured.steps, captured.raised,
                           captured.printed)
            to_agree = [r.program for r in programs.values()] + ([startup.program] if startup else [])
            new_state = startup is not None and self._held.needs_startup(state_key)
            log.info("transpiler: passes for %s in %.2fs; collectives per program: %s",
                     ", ".join(programs), time.perf_counter() - start,
                     ", ".join(f"{n} {len(r.program.collectives())}" for n, r in programs.items()))
        except NotRollable:
            # Traced again unrolled (__call__), as the ranks that do not cut
            # their list do at once: none has exchanged anything for this build.
            if captured is not None:
                forget_state(captured.made_state)
            raise
        except Exception as exc:  # noqa: BLE001 - the other ranks must learn of any failure
            error = exc
        try:
            if world_size > 1:
                # A rebuild on some ranks only runs on when its collectives were
                # agreed before (rebuild.py): the others wait in their collectives.
                with self._timed("agreement"):
                    alone = self._agreed.settle(to_agree, error, why, new_state,
                                                everyone=self._everyone_rebuilds)
                    self._everyone_rebuilds = False
                for runnable in built.programs.values():
                    runnable.compile_alone = alone
            elif error is not None:
                raise error
        except BaseException:
            if captured is not None:   # nothing of a failed build stays behind
                forget_state(captured.made_state)
                for w in reversed(captured.host_writes):
                    w.undo()
            raise
        if self._sharded is not None:   # the state the trace made, cut to shards
            self._sharded.shard(step_args.optimizers)
        if self._cache.builds == 0 and backend != "eager" and self._cache.may_turn_symbolic:
            log.info("transpiler: the first call runs the step's programs op by op; they "
                     "compile at the next call if its batch has the same shapes, else the "
                     "step is traced with symbolic batch dimensions and that compiles instead")
            self._pending = built
        return built

    # Passes that work on the optimizer's update (or the parameters around it)
    # and are not written for an update done by hand (p.data.add_(...)).
    _NEED_AN_OPTIMIZER = frozenset({"shard_params", "local_sgd", "mix_params", "gather_grads",
                                    "snapshot_params"})

    def _check_update_by_hand(self) -> None:
        """A step with no optimizer (its update written by hand) runs in the
        modes that reduce gradients only (grad_allreduce, fuse_all_reduce, zero)."""
        used = {pass_name(resolve_pass(p)) for passes in self.schedule.programs.values()
                for p in passes} & self._NEED_AN_OPTIMIZER
        if used:
            raise TranspileError(
                f"the step updates its parameters by hand, without a torch.optim optimizer, "
                f"which the pass {sorted(used)[0]} of this mode does not handle: use a torch.optim "
                "optimizer, or mode grad_allreduce, fuse_all_reduce or zero")

    def _decide_pending(self, call_args) -> None:
        """The second call, after a first build that ran op by op: if every
        rank runs it again, it compiles now on every rank together (once per
        node); if none does (the batch's shapes changed everywhere), every
        rank builds again together, symbolic, and compiles that once; else
        each rank compiles alone what it runs."""
        pending, self._pending = self._pending, None
        fits = self._cache.find(call_args) is pending
        everyone = all_gather_values(fits)
        if all(everyone):
            return
        for runnable in pending.programs.values():
            runnable.compile_alone = True
        self._everyone_rebuilds = not any(everyone)

    def _programs(self, captured: Captured, ctx: PassContext, backend: str, world_size: int):
        """Each program of the schedule after its passes, the startup program
        (several ranks) and the refresh of the held tensors (where any)."""
        programs = {}
        for name, passes in self.schedule.programs.items():
            program = captured.program.copy(name)
            program.place_collectives(ctx.mesh)
            run_passes(program, passes, self.schedule.context(name, ctx))
            reduce_groups.check_program(program, ctx.groups)
            if captured.decisions:
                decisions.hoist_checks(program)
                decisions.check_program(program, captured.decisions, backend, self.step_fn)
            sent = sum(sent_bytes(c.op, c.nbytes, ctx.mesh.size(c.over))
                       for c in (n.meta[COMM] for n in program.collectives()))
            programs[name] = Runnable(program, *self._bind(program, captured), backend, sent_bytes=sent)
            if captured.rolled is not None:
                if backend == "cudagraphs":
                    raise NotRollable("backend cudagraphs captures each program as one graph")
                programs[name].loop = micro_loop.split(programs[name], *captured.rolled)
        held = list({spec.name: spec for r in programs.values() for spec in r.program.inputs
                     if spec.kind is InputKind.HELD and spec.held is not Held.IN_FLIGHT}.values())
        startup = refresh = None
        shard = (ctx.mesh.position(ctx.shard_over), ctx.mesh.size(ctx.shard_over))
        if world_size > 1:
            program = startup_program(captured, held, shard=shard)
            run_passes(program, STARTUP_PASSES, ctx)
            startup = Runnable(program, *self._bind(program, captured), "eager")
        if held:
            program = startup_program(captured, held, name="refresh", shard=shard)
            refresh = Runnable(program, *self._bind(program, captured), "eager")
        return programs, startup, refresh

    @contextlib.contextmanager
    def _timed(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[phase] += time.perf_counter() - start

    def _describe_settings(self) -> dict[str, str]:
        options = {f.name: getattr(self.settings, f.name) for f in dataclasses.fields(self.settings)
                   if f.name not in ("mesh", "groups")}
        if self.settings.hierarchical or any(isinstance(g.group, Dim) for g in self.groups):
            # the nodes every rank's groups are made of
            options["LOCAL_WORLD_SIZE"] = os.environ.get("LOCAL_WORLD_SIZE")
        programs = {name: [p if isinstance(p, str) else pass_name(p) for p in passes]
                    for name, passes in self.schedule.programs.items()}
        return {"programs": str(programs), **{k: repr(v) for k, v in options.items()},
                "backend": repr(self.backend), "check_every": repr(self.check_every),
                "reduce_groups": reduce_groups.describe(self.groups),
                "process_group": repr(None if self.process_group is None else global_ranks()),
                "schedule": repr(self.schedule)}

    def _trace(self, step_args, why: str) -> Captured:
        fn_name = getattr(self.step_fn, "__name__", "step")
        refuse_untraceable(self.step_fn, snapshot())
        refuse_other_options(step_args.modules, step_name(self.step_fn), self.broadcast_buffers,
                             self.settings.find_unused, self.settings.comm_hook,
                             self.process_group)
        start = time.perf_counter()
        with self._timed("trace"), numbers_where_needed(self.backend == "eager"):
            captured = trace_step(self.step_fn, step_args,
                                  self._sharded.stand_in if self._sharded else None,
                                  on_values=self._decides,
                                  zero_unused=self.settings.find_unused)
        self._decides |= bool(captured.decisions)
        record(captured.program, "capture", f"capture: {len(captured.program.graph.nodes)} "
                                            f"nodes from {fn_name} ({why})")
        log.info("transpiler: traced %s (%s) in %.2fs", fn_name, why, time.perf_counter() - start)
        return captured

    def _bind(self, program: Program, captured: Captured) -> tuple[list, list]:
        """The slot each input is read from and each output written to."""
        by_name = {spec.name: slot for spec, slot in zip(captured.program.inputs, captured.slots)}
        own = (OutputKind.STATE, OutputKind.GRAD, OutputKind.ASSIGNED)   # targets capture made
        captured_targets = {(spec.kind, spec.target): target for spec, target
                            in zip(captured.program.outputs, captured.targets) if spec.kind in own}
        # A pass's hyperparameter input of a later update (Hyper.ahead) reads as
        # the captured one, that many updates ahead.
        hypers = {spec.hyper: slot for spec, slot in zip(captured.program.inputs, captured.slots)
                  if spec.kind is InputKind.HYPER}
        slots = [HeldSlot(self._held.tensors, spec.name) if spec.kind is InputKind.HELD
                 else powersgd.StateSlot.of(self.settings.comm_hook.state, spec.hook,
                                            node.meta["val"])
                 if spec.kind is InputKind.HOOK
                 else dataclasses.replace(hypers[dataclasses.replace(spec.hyper, ahead=0)],
                                          ahead=spec.hyper.ahead)
                 if spec.kind is InputKind.HYPER and spec.hyper.ahead
                 else by_name[spec.name]
                 for spec, node in zip(program.inputs, program.placeholders)]
        by_name.update({spec.name: slot for spec, slot in zip(program.inputs, slots)})
        targets = [None if spec.kind is OutputKind.USER
                   else captured_targets[(spec.kind, spec.target)] if spec.kind in own
                   else HeldSlot(self._held.tensors, spec.target, rebind=spec.held is Held.IN_FLIGHT)
                   if spec.kind is OutputKind.HELD
                   else by_name[spec.target] for spec in program.outputs]
        return slots, targets

    def _run_verified(self, runnable: Runnable, built: Built, step_args, leaves,
                      states: list | None) -> list:
        """Run the program functionally and compare everything it would write and
        return with the eager step under DDP's semantics (verify.py); write back
        only if every rank agrees. The eager step draws the host values the
        program was given (`states`: the generators' before them). On a call
        the step ends with its own raise, the two exceptions are compared."""
        drawn = built.draws.states() if built.draws else None
        if states is not None:
            built.draws.restore(states)
        try:
            memo, expected = self._reference.run(self.step_fn, step_args)
            eager_raised = None
        except (Exception, SystemExit) as exc:
            if not raised_by_the_step(exc, None):
                raise
            eager_raised = exc
        if drawn is not None:
            built.draws.restore(drawn)
        with built.rng.drawing(step_args.leaves):   # a failed decision check raises here
            outputs = self._executor.run_uncommitted(runnable, leaves)
        if eager_raised is not None or built.raised is not None:
            # a call the step ends with its raise: the exceptions are compared
            verify.agree_on_verdict(verify.raised_alike(built.raised, eager_raised),
                                    self.schedule.step)
            self._executor.commit(runnable, outputs)
            return outputs
        n_user, n_out = built.returned.user_outputs, built.returned.num_outputs
        names = [f"returned value {i}" for i in range(n_user)]
        ours = outputs[:n_user]
        theirs = [o.detach() for o in built.returned.outputs(expected)]
        for spec, target, value in zip(runnable.program.outputs[n_out:],
                                       runnable.targets[n_out:], outputs[n_out:]):
            mirrored = target.mirror(memo) if target is not None else None
            if mirrored is not None or spec.kind is OutputKind.GRAD:
                names.append(f"{spec.kind.value} {spec.target}")
                ours.append(value)
                theirs.append(mirrored)
        names += [f"grad {name}" for name, _ in built.cleared]
        ours += [None] * len(built.cleared)
        theirs += [memo[id(p)].grad for _, p in built.cleared]
        verdict = verify.first_difference(names, ours, theirs, self.verify_tolerance)
        verify.agree_on_verdict(verdict, self.schedule.step)
        self._executor.commit(runnable, outputs)
        return outputs


def _sharded_params(captured: Captured, programs: dict) -> list:
    """(name, parameter) of each parameter a program keeps as held shards."""
    slots = dict(zip((spec.name for spec in captured.program.inputs), captured.slots))
    names = dict.fromkeys(spec.param for r in programs.values() for spec in r.program.inputs
                          if spec.held is Held.PARAM_SHARD)
    return [(name, slots[name].tensor) for name in names]


def _dropped_grads(captured: Captured, programs: dict[str, Runnable]) -> list:
    """(name, parameter) of each gradient the step leaves that a pass took out of
    the programs' outputs (shard_optimizer: a rank holds only a shard of it): the
    runtime leaves its .grad None rather than stale."""
    kept = {spec.target for r in programs.values() for spec in r.program.outputs
            if spec.kind is OutputKind.GRAD}
    return [(spec.target, target.param) for spec, target
            in zip(captured.program.outputs, captured.targets)
            if spec.kind is OutputKind.GRAD and spec.target not in kept]
