"""Join for uneven inputs, as DDP's: `with step.join(): for batch in loader: step(...)`.

A rank whose loader runs out leaves the loop and, in the context's exit, shadows
the collectives of the ranks still stepping until every rank is done: for each
of their steps it issues the same collectives of its own last program, in the
same order on the same communicators, with zeros (a joined rank contributes no
gradient). In modes zero and fsdp, where each rank alone updates its shard, a
joined rank runs its last program with zero gradients instead, which issues
the same collectives and updates its shard from the others' gradients, with
their hyperparameters (joined_update.py). The gradients are divided by the
initial world size, as under DDP's Join with divide_by_initial_world_size=True
(its default): the program's own averaging; with False, by the ranks still
stepping, as DDP's divide factor of the iteration: while a rank has joined the
others run a copy of their program whose means divide so (`divided_by`). When
every rank is done, the parameters and buffers are broadcast from the highest
rank among those that stepped last, as DDP's join hook does (torch's own
_sync_module_states): every rank ends with the same model, and a joined rank's
optimizer state stays where its last step left it, as under DDP.

Before each step in the context every rank says on the control plane whether it
steps (and the digest of the collectives of the program it is about to run) or
has joined (and the digest of the program it shadows); the ranks go on only if
those agree, else every rank raises the same error: a rank never waits on a
collective that no other rank issues. A joined rank cannot trace or compile with
the others, so a step that would build a new program (a new batch shape, another
decision on a tensor value) while a rank has joined is refused on every rank.
What a joined rank cannot shadow with zeros is refused the same way: a broadcast
(the buffers the step writes, which DDP under Join takes from another rank), a
gather of every rank's gradients (mode all_gather), a collective of the forward
(SyncBatchNorm's statistics) in modes zero and fsdp.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch.distributed.utils import _sync_module_states, _sync_params_and_buffers

from . import sharded_params
from .. import world
from .agreement import summarize
from ..program.collectives import ALL_REDUCE, WAIT
from .control_plane import all_gather_values
from ..errors import TranspileError
from .runnable import Runnable
from .joined_update import GIVEN, joined_update, kept_outputs
from ..program.mesh import Dim
from ..program.program import Program
from ..program.roles import AVERAGED

log = logging.getLogger("transpiler")

# DDP's broadcast_bucket_size (int(250 * 1024 * 1024)) for the final broadcast
_BROADCAST_BYTES = 250 * 1024 * 1024
# all-reduces whose zeros leave the others' result as it is
_NEUTRAL = ("sum", "max")


@dataclasses.dataclass(frozen=True)
class _Collective:
    op: str
    shape: tuple
    dtype: torch.dtype
    device: torch.device
    group: str


@dataclasses.dataclass(frozen=True)
class Status:
    """What a rank says before each step in the context: it steps (`steps`)
    or has joined; `digest`: the collectives of the program it runs or
    shadows ("" where it would build one, or has none); `problem`: why it
    cannot (a joined rank's program it cannot shadow); `given`: in modes zero
    and fsdp, the values of the hyperparameters and numbers the program of a
    rank that steps reads (joined_update.GIVEN), for a joined rank's update."""

    steps: bool
    digest: str = ""
    problem: str = ""
    given: tuple = ()


def shadow_of(program: Program) -> list[_Collective]:
    """The collectives a joined rank issues for one step of `program`, with
    zeros; a TranspileError where one cannot be shadowed with zeros."""
    shadow = []
    for node in program.collectives():
        val = node.meta["val"]
        if node.target is not ALL_REDUCE or node.args[1] not in _NEUTRAL:
            kind = node.target._opname if node.target is not ALL_REDUCE else \
                f"all_reduce({node.args[1]})"
            raise TranspileError(
                f"program {program.name!r} issues a {kind}, which a rank that has joined cannot "
                "shadow with zeros (a broadcast of the buffers the step writes: pass "
                "broadcast_buffers=False, or give every rank as many batches; modes zero, "
                "fsdp and all_gather gather shards each rank holds)")
        if any(isinstance(d, torch.SymInt) for d in val.shape):
            raise TranspileError(f"program {program.name!r} reduces a value of symbolic size, "
                                 "which a rank that has joined cannot shadow")
        shadow.append(_Collective(node.args[1], tuple(val.shape), val.dtype, val.device,
                                  node.args[2]))
    return shadow


def _run(shadow: list[_Collective]) -> None:
    issued = [ALL_REDUCE(torch.zeros(c.shape, dtype=c.dtype, device=c.device), c.op, c.group)
              for c in shadow]
    for t in issued:
        WAIT(t)


@dataclasses.dataclass(frozen=True)
class _Given:
    """The slot of an input whose value a rank that steps gave."""

    value: object

    def read(self, leaves):
        return self.value


def given_values(runnable: Runnable, leaves) -> tuple:
    """(name, value) of each input of `runnable` a joined rank takes from the
    ranks that step (joined_update.GIVEN), read for this call."""
    values = []
    for spec, slot in zip(runnable.program.inputs, runnable.slots):
        if spec.kind in GIVEN:
            value = slot.read(leaves)
            values.append((spec.name, value.detach().cpu().clone()
                           if isinstance(value, torch.Tensor) else value))
    return tuple(values)


def divided_by(program: Program, ranks: int) -> Program:
    """A copy of `program` whose means over the world divide by `ranks`."""
    divided = program.copy(program.name)
    for node in divided.graph.nodes:
        if node.meta.get(AVERAGED) is Dim.WORLD:
            node.args = (node.args[0], 1 / ranks)
    divided.gm.recompile()
    return divided


class _JoinedUpdate:
    """Modes zero and fsdp: a joined rank's run of its last program with zero
    gradients (joined_update.py), on the inputs of its last call but those the
    ranks that step give."""

    def __init__(self, step, leaves):
        self._step, self._leaves = step, leaves
        self._built = step._last
        runnable = self._built.programs[step._last_run]
        kept = kept_outputs(runnable.program)
        self.runnable = dataclasses.replace(
            runnable, program=joined_update(runnable.program), executable=None, ran=False,
            targets=[t for t, keep in zip(runnable.targets, kept) if keep])
        self.wants = tuple((name, None) for name, _ in given_values(self.runnable, leaves))

    def __call__(self, given: tuple) -> None:
        step, joined = self._step, self.runnable
        values = iter(value for _, value in given)
        slots = [_Given(_like(next(values), node.meta["val"])) if spec.kind in GIVEN else slot
                 for spec, slot, node in zip(joined.program.inputs, joined.slots,
                                             joined.program.placeholders)]
        this = dataclasses.replace(joined, slots=slots)
        sharded_params.restore(self._built.sharded_params)
        try:
            outputs = step._executor.run_uncommitted(this, self._leaves)
            step._executor.commit(this, outputs)
        finally:
            sharded_params.free(self._built.sharded_params)
        step._held.step_done(carried=bool(this.held), transient=this.transient)
        step.bytes_sent += this.sent_bytes


def _like(value, like):
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device)
    return value


class Join:
    """The context manager `TranspiledStep.join()` returns."""

    def __init__(self, step, divide_by_initial_world_size: bool = True):
        self._step = step
        self._divide_by_initial = divide_by_initial_world_size
        self._sharded = step._sharded is not None   # modes zero and fsdp
        self._stepped_after_a_join = False   # is_last_joiner, negated (DDP's Join)
        self.every_rank_steps = True   # at the step being run: no rank has joined
        self._stepping = 0   # how many ranks step at the step being run
        self._divided: dict[tuple[int, int], Runnable] = {}
        self._modules: list[torch.nn.Module] = []
        self._leaves = None   # the last call's

    def __enter__(self) -> "Join":
        if self._step._join is not None:
            raise TranspileError("step.join() is already entered")
        self._step._join = self
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._step._join = None
        with world.over(self._step.process_group):
            if exc_type is not None or world.world()[0] == 1:
                return False
            self._shadow_until_every_rank_is_done()
            self._sync_final_model()
        return False

    def before_step(self, built, name: str | None, modules, leaves) -> None:
        """On a rank that steps, before the program runs (or is built):
        every rank's status; raises on every rank if they cannot go on."""
        self._modules, self._leaves = list(modules), leaves
        if built is None or built.decisions:
            mine = Status(steps=True)
        else:
            runnable = built.programs[name]
            mine = Status(steps=True, digest=summarize([runnable.program])[0],
                          given=given_values(runnable, leaves) if self._sharded else ())
        everyone = all_gather_values(mine)
        _check(everyone)
        self.every_rank_steps = all(s.steps for s in everyone)
        self._stepping = sum(s.steps for s in everyone)

    def runnable(self, runnable: Runnable) -> Runnable:
        """What a rank that steps runs for `runnable`: with
        divide_by_initial_world_size=False while a rank has joined, the
        program whose means divide by the ranks still stepping (DDP's divide
        factor of the iteration), built here once per count (a local copy:
        its collectives are the same)."""
        if self._divide_by_initial or self.every_rank_steps:
            return runnable
        key = (id(runnable), self._stepping)
        if key not in self._divided:
            self._divided[key] = dataclasses.replace(
                runnable, program=divided_by(runnable.program, self._stepping),
                executable=None, ran=False)
        return self._divided[key]

    def _shadow_until_every_rank_is_done(self) -> None:
        step = self._step
        run, mine = None, Status(steps=False)
        if step._last is not None:
            program = step._last.programs[step._last_run].program
            try:
                if self._sharded:
                    run = _JoinedUpdate(step, self._leaves)
                    mine = Status(steps=False, digest=summarize([program])[0], given=run.wants)
                else:
                    shadow = shadow_of(program)
                    run = lambda given: _run(shadow)   # noqa: E731
                    mine = Status(steps=False, digest=summarize([program])[0])
            except TranspileError as exc:
                mine = Status(steps=False, problem=str(exc))
        while True:
            everyone = all_gather_values(mine)
            if not any(s.steps for s in everyone):
                return
            _check(everyone)
            run(next(s.given for s in everyone if s.steps))
            self._stepped_after_a_join = True

    def _sync_final_model(self) -> None:
        """DDP's post hook: the parameters and buffers of the highest rank
        among those that stepped last, broadcast to every rank. (In modes
        zero and fsdp every rank's parameters are already the same, their
        shards updated by their owners: the buffers alone.)"""
        everyone = all_gather_values((-1 if self._stepped_after_a_join else world.world()[1],
                                      len(self._modules)))
        src = max(candidate for candidate, _ in everyone)
        modules = [n for _, n in everyone]
        if len(set(modules)) != 1:
            raise TranspileError(f"the ranks' steps took different numbers of modules ({modules})")
        for module in self._modules:
            if self._sharded:
                _sync_params_and_buffers(world.group(), list(module.buffers()),
                                         _BROADCAST_BYTES, src)
            else:
                _sync_module_states(module, world.group(), _BROADCAST_BYTES, src, set(),
                                    broadcast_buffers=True)
        log.info("transpiler: join: every rank done; the model broadcast from rank %d", src)


def _check(everyone: list[Status]) -> None:
    """Raise the same error on every rank unless the ranks that step all run
    the program the joined ones shadow."""
    joined = [r for r, s in enumerate(everyone) if not s.steps]
    if not joined:
        return
    stepping = [r for r, s in enumerate(everyone) if s.steps]
    for r in joined:
        if everyone[r].problem:
            raise TranspileError(f"rank {r} has joined (its batches ran out) and cannot shadow "
                                 f"the others' steps: {everyone[r].problem}")
        if not everyone[r].digest:
            raise TranspileError(f"rank {r} has joined before its first step: it has no program "
                                 "to shadow the others' with; give every rank a batch at least")
    building = [r for r in stepping if not everyone[r].digest]
    if building:
        raise TranspileError(
            f"rank {building[0]} steps with a batch that needs a new program (new shapes, or "
            f"another decision on a tensor value) while rank {joined[0]} has joined, which "
            "cannot trace it with the others: give the last batches the shapes of the others "
            "(DataLoader(drop_last=True)), or pass transpile(..., dynamic=True)")
    digests = {everyone[r].digest for r in stepping + joined}
    if len(digests) != 1:
        raise TranspileError(
            f"ranks {stepping} step with a program whose collectives differ from those rank "
            f"{joined[0]} shadows (it has joined): every rank's steps must run one program")
    wanted = [name for name, _ in everyone[stepping[0]].given]
    for r in joined:
        if [name for name, _ in everyone[r].given] != wanted:
            raise TranspileError(
                f"rank {r} has joined and updates its shards with the hyperparameters of the "
                f"ranks that step, but its program reads others than theirs")
