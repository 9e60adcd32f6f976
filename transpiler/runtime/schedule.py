"""Schedules: which program runs at each step, chosen on the host.

A schedule names its programs and the passes that build each from the traced
step; the runtime asks it which one to run next and tells it when a step has
succeeded. The choice depends only on the step counter and on values every
rank holds identically (an all-reduced loss), so every rank runs the same
program at the same step and no program has a data-dependent branch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Mapping, Sequence

import torch

from ..errors import TranspileError
from ..lowering.context import PassContext, PassLike, SyncPart
from ..lowering.layers import layers_of
from ..program.program import Held, held_name
from ..lowering.rings import local_world_size
from ..lowering.topology import Topology, resolve

log = logging.getLogger("transpiler")

# Held values the sync program of adaptive local SGD outputs (passes/local_sgd.py).
MEAN_LOSS = held_name(Held.MEAN_LOSS)
LR = held_name(Held.LR)
MAX_K = 16
# Held value a program outputs with skip_nonfinite: whether it skipped its update.
NONFINITE = held_name(Held.SKIPPED)


class Schedule:
    """Counts the steps taken and the updates skip_nonfinite skipped."""

    programs: dict[str, tuple[PassLike, ...]]
    # Partitions of the ranks whose groups the programs reduce over (decentralized
    # topologies); the runtime creates their communicators.
    partitions: tuple = ()
    # Whether it updates the parameters on the host after a step (host_update).
    updates_on_host = False

    def __init__(self):
        self.step = 0
        self.skipped = 0

    def bind(self, world_size: int) -> None:
        """Before anything is built: settle what depends on the world's size."""

    def context(self, program: str, ctx: PassContext) -> PassContext:
        """The settings the passes of `program` run with."""
        return ctx

    def parameters_agree_after(self, program: str) -> bool:
        """Whether every rank holds the same parameters after `program` ran."""
        return True

    def next_program(self) -> str:
        raise NotImplementedError

    def check_params(self, names: Mapping[int, str], updated: Sequence[str]) -> None:
        """Raise, on the first build before anything runs, if the step's
        parameters (id -> name; `updated`: those it updates) do not fit."""

    def host_update(self, held: Mapping[str, torch.Tensor],
                    params: Mapping[str, torch.Tensor]) -> None:
        """After advance(), where updates_on_host: update the parameters (by name)."""

    def advance(self, program: str, held: Mapping[str, torch.Tensor]) -> None:
        self.step += 1
        if NONFINITE in held:
            self.skipped += int(held[NONFINITE])

    def state_dict(self) -> dict:
        return {"step": self.step, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.skipped = int(state["step"]), int(state.get("skipped", 0))

    def __repr__(self) -> str:   # the same on every rank (the settings they agree on)
        return f"{type(self).__name__} { {k: v for k, v in vars(self).items() if k != 'programs'} }"


class EveryStep(Schedule):
    """One program, "main", at every step."""

    def __init__(self, passes: Sequence[PassLike]):
        super().__init__()
        self.programs = {"main": tuple(passes)}

    def next_program(self) -> str:
        return "main"


class FirstIterationApart(EveryStep):
    """Mode fuse_all_reduce: "main" at every step, except that with more than
    two ranks the first step this process runs is "first", whose buckets are
    DDP's first-iteration layout (passes/coalesce_tensors.py): DDP rebuilds its
    buckets once, after its first iteration, and a sum over more than two ranks
    rounds by the layout. (Two ranks sum alike in any layout.) Which step is
    first is this process's, not the checkpointed counter: a resumed DDP
    starts from its first layout too."""

    def __init__(self, passes: Sequence[PassLike]):
        super().__init__(passes)
        self.first_done = False

    def bind(self, world_size: int) -> None:
        if world_size > 2 and "first" not in self.programs:
            self.programs = {"first": self.programs["main"], **self.programs}

    def context(self, program: str, ctx: PassContext) -> PassContext:
        return dataclasses.replace(ctx, initial_buckets=True) if program == "first" else ctx

    def next_program(self) -> str:
        return "first" if "first" in self.programs and not self.first_done else "main"

    def advance(self, program: str, held: Mapping[str, torch.Tensor]) -> None:
        super().advance(program, held)
        self.first_done = True


class CommHookPhases(Schedule):
    """A comm hook whose state says what it does at a step (PowerSGD: plain
    all-reduces for its first start_powerSGD_iter iterations, then
    compression; powersgd.py): `base`'s programs while the hook reduces
    plainly, then "compress" (base's passes, the hook traced in its
    compressed phase) once its state says so."""

    def __init__(self, base: EveryStep, hook):
        super().__init__()
        self.base, self.hook = base, hook

    @property
    def programs(self) -> dict[str, tuple[PassLike, ...]]:
        return {**self.base.programs, "compress": self.base.programs["main"]}

    @programs.setter
    def programs(self, programs: dict[str, tuple[PassLike, ...]]) -> None:
        self.base.programs = {name: p for name, p in programs.items() if name != "compress"}

    def bind(self, world_size: int) -> None:
        self.base.bind(world_size)

    def context(self, program: str, ctx: PassContext) -> PassContext:
        if program == "compress":
            return dataclasses.replace(ctx, comm_hook=dataclasses.replace(self.hook, compress=True))
        return self.base.context(program, ctx)

    def next_program(self) -> str:
        return "compress" if self.hook.compresses() else self.base.next_program()

    def advance(self, program: str, held: Mapping[str, torch.Tensor]) -> None:
        super().advance(program, held)
        self.base.advance(program, held)


class LocalSGD(Schedule):
    """Steps before `begin_step` run "warmup" (gradients averaged every step).
    Then each period of k steps runs "local" k-1 times and ends with "sync",
    which averages the parameters. With `adaptive`, k is recomputed after each
    sync from the all-reduced mean loss and the learning rate (Paddle's adaptive
    local SGD): ceil(sqrt(lr0 * loss / (lr * loss0) * k_steps)) clamped to
    [1, 16], where loss0 and lr0 are the values at the first sync."""

    def __init__(self, programs: Mapping[str, Sequence[PassLike]], k_steps: int,
                 begin_step: int, adaptive: bool):
        super().__init__()
        runs = {"warmup": begin_step > 0, "local": k_steps > 1 or adaptive, "sync": True}
        self.programs = {name: tuple(p) for name, p in programs.items() if runs[name]}
        self.k_steps, self.begin_step, self.adaptive = k_steps, begin_step, adaptive
        self.since_sync = 0           # local steps since the last sync
        self.k = k_steps
        self.loss0: float | None = None
        self.lr0: float | None = None

    def next_program(self) -> str:
        if self.step < self.begin_step:
            return "warmup"
        return "sync" if self.since_sync + 1 >= self.k else "local"

    def parameters_agree_after(self, program: str) -> bool:
        return program != "local"

    def advance(self, program: str, held: Mapping[str, torch.Tensor]) -> None:
        super().advance(program, held)
        if program == "local":
            self.since_sync += 1
        elif program == "sync":
            self.since_sync = 0
            if self.adaptive:
                self.k = self.next_k(held[MEAN_LOSS].item(), held[LR].item())

    def next_k(self, loss: float, lr: float) -> int:
        """The period after a sync with this mean loss and learning rate."""
        if self.loss0 is None:
            self.loss0, self.lr0 = loss, lr
        ratio = (self.lr0 * loss) / (lr * self.loss0) if lr * self.loss0 != 0 else math.nan
        if not math.isfinite(ratio) or ratio < 0:
            log.warning("transpiler: adaptive local SGD keeps k=%d: loss %g, lr %g against "
                        "loss0 %g, lr0 %g give no usable ratio", self.k, loss, lr,
                        self.loss0, self.lr0)
            return self.k
        return min(MAX_K, max(1, math.ceil(math.sqrt(ratio * self.k_steps))))

    def state_dict(self) -> dict:
        return {**super().state_dict(), "since_sync": self.since_sync, "k": self.k,
                "loss0": self.loss0, "lr0": self.lr0}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.since_sync, self.k = int(state["since_sync"]), int(state["k"])
        self.loss0, self.lr0 = state["loss0"], state["lr0"]


class Decentralized(Schedule):
    """Decentralized training over a topology (transpiler/lowering/topology.py): step t
    runs the program of phase t mod the topology's period, whose passes mix
    each rank's parameters with its group of that phase. The topology, a
    built-in name or a Topology, is resolved for the world on the first build."""

    def __init__(self, passes: Sequence[PassLike], topology: str | Topology):
        super().__init__()
        self.passes = tuple(passes)
        self.topology = topology
        self.resolved: Topology | None = None
        self.programs = {"phase0": self.passes}

    def bind(self, world_size: int) -> None:
        if self.resolved is not None or world_size == 1:
            return
        self.resolved = resolve(self.topology, world_size, local_world_size())
        self.programs = {f"phase{k}": self.passes for k in range(len(self.resolved.mixings))}
        self.partitions = self.resolved.partitions
        log.info("transpiler: decentralized over %s, %d step(s) per period, %s",
                 self.resolved.name, len(self.programs),
                 "; ".join(f"step {k}: {[list(g) for g in m.groups]}"
                           for k, m in enumerate(self.resolved.mixings)))

    def context(self, program: str, ctx: PassContext) -> PassContext:
        if self.resolved is None:
            return ctx
        phase = list(self.programs).index(program)
        return dataclasses.replace(ctx, gossip=self.resolved.gossip(phase, ctx.rank))

    def parameters_agree_after(self, program: str) -> bool:
        return False

    def next_program(self) -> str:
        names = list(self.programs)
        return names[self.step % len(names)]


class DiLoCo(Schedule):
    """DiLoCo (arXiv 2311.08105) and Streaming DiLoCo (arXiv 2501.18512), on
    torchft's schedule (torchft/local_sgd.py, DiLoCo). The parameters are cut
    into `fragments` (passes/pseudo_gradients.py); each period of
    sync_every // fragments steps ends with the outer step of one fragment, in
    turn. Every step runs the step's own (inner) update; the period's last
    step runs "sync<f>" ("sync" with one fragment), which also averages the
    fragment's pseudo-gradients (snapshot - parameter) over the ranks. With
    fragment_sync_delay = d > 0 the average is cut in two programs: the step
    d steps before the period's end runs "send<f>", which issues the sums,
    and the period's last step "receive<f>", which waits on them, so that
    the d - 1 steps between and the last step's own work overlap them
    (passes/defer_waits.py). After the period's
    last step, on the host (torchft's perform_sync): the fragment's parameters
    are reset to their snapshots, the outer optimizers stepped with the
    averaged pseudo-gradients as the parameters' .grad (left None after, as
    torchft's outer zero_grad leaves them), the snapshots set to the result,
    and the parameters mixed with the values the inner steps reached:
    lerp(new, local, alpha). Buffers stay each rank's own."""

    updates_on_host = True

    def __init__(self, programs: Mapping[str, Sequence[PassLike]], outer: Sequence,
                 sync_every: int, fragments: int, delay: int, alpha: float):
        super().__init__()
        self.outer = tuple(outer)
        self.period, self.fragments = sync_every // fragments, fragments
        self.delay, self.alpha = delay, alpha
        # program name -> (fragment, part of its sync)
        self.parts: dict[str, tuple[int, SyncPart | None]] = {}
        for f in range(fragments):
            suffix = "" if fragments == 1 else str(f)
            self.parts.update({f"send{suffix}": (f, SyncPart.SEND),
                               f"receive{suffix}": (f, SyncPart.RECEIVE)}
                              if delay else {f"sync{suffix}": (f, None)})
        self.programs = {"local": tuple(programs["local"]),
                         **{name: tuple(programs["deferred" if part else "sync"])
                            for name, (_, part) in self.parts.items()}}
        self.since = 0      # steps of this period taken
        self.synced = 0     # outer steps taken (torchft's manager step)
        self.pending: dict[str, torch.Tensor] = {}   # parameter -> pseudo-gradient, averaged

    def context(self, program: str, ctx: PassContext) -> PassContext:
        fragment, part = self.parts.get(program, (None, None))
        return dataclasses.replace(ctx, keep_snapshots=True, sync_part=part,
                                   fragment=None if fragment is None else (fragment, self.fragments))

    def parameters_agree_after(self, program: str) -> bool:
        return False   # buffers stay each rank's own

    def next_program(self) -> str:
        fragment = self.synced % self.fragments
        part = SyncPart.SEND if self.since + 1 == self.period - self.delay else \
            SyncPart.RECEIVE if self.since + 1 == self.period else None
        if part is None:
            return "local"
        if self.delay == 0:
            part = None
        return next(name for name, p in self.parts.items() if p == (fragment, part))

    def check_params(self, names: Mapping[int, str], updated: Sequence[str]) -> None:
        """Before anything runs: the outer optimizers step exactly the parameters
        the step updates (`names`: id of each parameter of the step -> its name)."""
        layers = len(layers_of([name for name in names.values() if name in updated]))
        if self.fragments > layers:
            raise TranspileError(f"mode diloco: fragments={self.fragments}, but the step updates "
                                 f"the parameters of {layers} layer(s), and a fragment is whole "
                                 f"layers: give at most {layers}")
        held = {id(p) for opt in self.outer for g in opt.param_groups for p in g["params"]}
        foreign = len(held - names.keys())
        missing = [name for i, name in names.items() if name in updated and i not in held]
        if foreign or missing:
            what = f"{foreign} tensor(s) that are not parameters of the step" if foreign else \
                f"no parameter {missing[0]!r}, which the step updates"
            raise TranspileError(f"mode diloco's outer_optimizer holds {what}: build it over "
                                 "the model's parameters, as the inner optimizer "
                                 "(torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, "
                                 "nesterov=True))")

    def advance(self, program: str, held: Mapping[str, torch.Tensor]) -> None:
        super().advance(program, held)
        self.since += 1

    def host_update(self, held: Mapping[str, torch.Tensor],
                    params: Mapping[str, torch.Tensor]) -> None:
        """After advance(): keep the pseudo-gradients the step averaged, and take
        the outer step when this step ended a period."""
        for name in params:
            average = held.get(held_name(Held.PSEUDO_GRAD, name))
            if average is not None:
                # a copy: a compiled program's outputs may live in memory its next run reuses
                self.pending[name] = average.clone()
        if self.since < self.period:
            return
        names = list(self.pending)
        snapshots = [held[held_name(Held.SNAPSHOT, n)] for n in names]
        stepped = [params[n] for n in names]
        outer_params = [p for opt in self.outer for g in opt.param_groups for p in g["params"]]
        others = {id(p): p.grad for p in outer_params}
        with torch.no_grad():
            local = [p.detach().clone() for p in stepped] if self.alpha else []
            for p, s in zip(stepped, snapshots):
                p.copy_(s)
        for p in outer_params:
            p.grad = None
        for p, n in zip(stepped, names):
            p.grad = self.pending[n]
        for opt in self.outer:
            opt.step()
        with torch.no_grad():
            for p, s in zip(stepped, snapshots):
                s.copy_(p)
            for p, mine in zip(stepped, local):
                p.lerp_(mine, self.alpha)
        mine = {id(p) for p in stepped}
        for p in outer_params:
            p.grad = None if id(p) in mine else others[id(p)]
        log.debug("transpiler: DiLoCo outer step %d of fragment %d (%d parameters)",
                  self.synced, self.synced % self.fragments, len(names))
        self.synced += 1
        self.since = 0
        self.pending = {}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "since": self.since, "synced": self.synced,
                "pending": {n: t.clone() for n, t in self.pending.items()}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.since, self.synced = int(state["since"]), int(state["synced"])
        self.pending = {n: t.clone() for n, t in state["pending"].items()}

    def __repr__(self) -> str:   # the settings the ranks agree on
        return (f"DiLoCo(period={self.period}, fragments={self.fragments}, delay={self.delay}, "
                f"alpha={self.alpha}, outer={[type(o).__name__ for o in self.outer]})")
