"""Typed modes: each mode of transpile() as a dataclass that carries its own
options, checked where they are declared, and the passes it runs.

    transpile(step, mode=LocalSGD(k_steps=4, begin_step=100))
    transpile(step, mode="local_sgd", k_steps=4)    # the same spec, built from keywords

An option a mode does not take cannot be written in its spec; in the string
form it is refused with the modes that take it. transpile()'s own keywords
are the options of every mode (backend, verify, ...)."""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, Mapping, Sequence

import torch

from . import modes
from .runtime import schedule as schedules
from .lowering.comm_hooks import CommHook
from .errors import TranspileError
from .lowering.context import Pass, PassLike
from .pipeline import pass_name, resolve
from .lowering.topology import Topology
from .lowering.topology import check_spec as check_topology

# What values may be reduced in: gloo and nccl sum these (not float8, for one).
REDUCIBLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _mib(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise TranspileError(f"{name} must be a positive number of MiB, got {value!r}")


def _wire_dtype(name: str, value) -> None:
    if value is not None and value not in REDUCIBLE_DTYPES:
        raise TranspileError(f"{name} must be None or one of the floating-point dtypes "
                             f"gloo and nccl sum ({', '.join(map(str, REDUCIBLE_DTYPES))}), "
                             f"got {value!r}")


def _int_from(low: int):
    def check(name: str, value) -> None:
        if not is_int(value) or value < low:
            raise TranspileError(f"{name} must be an integer >= {low}, got {value!r}")
    return check


def _flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TranspileError(f"{name} must be True or False, got {value!r}")


def _option(default, check):
    """A mode option: its default and the check __post_init__ runs on it."""
    return dataclasses.field(default=default, metadata={"check": check})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModeSpec:
    """A mode: its options (the dataclass fields) and the passes it runs
    (`passes`: a tuple, or a mapping of program name to tuple)."""

    name: ClassVar[str]
    # The pass of this mode that does not combine with some of transpile()'s
    # options yet, and those options; refused wherever the pass runs.
    unsupported: ClassVar[tuple[str, tuple[str, ...]] | None] = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            f.metadata["check"](f.name, getattr(self, f.name))

    @classmethod
    def options(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def label(cls) -> str:
        return f"mode={cls.name!r}"

    def schedule(self, common) -> schedules.Schedule:
        """Which program runs at each step, under transpile()'s options `common`."""
        return schedules.EveryStep(self.passes)

    def settings(self) -> dict:
        """The PassContext fields this mode sets."""
        return {}

    def refuse(self, common) -> None:
        """Raise if one of transpile()'s options (`common`) makes no sense in this mode."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _BucketCap(ModeSpec):
    bucket_mb: float = _option(25.0, _mib)      # cap of a fused bucket, MiB

    def settings(self) -> dict:
        return {**super().settings(), "bucket_mb": float(self.bucket_mb)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Buckets(_BucketCap):
    first_bucket_mb: float = _option(1.0, _mib)   # cap of the first bucket per dtype, MiB

    def settings(self) -> dict:
        return {**super().settings(), "first_bucket_mb": float(self.first_bucket_mb)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Fused(_Buckets):
    fuse_dtype: torch.dtype | None = _option(None, _wire_dtype)   # dtype on the wire

    def settings(self) -> dict:
        return {**super().settings(), "fuse_dtype": self.fuse_dtype}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GradAllReduce(_BucketCap):
    """Each gradient averaged by its own all-reduce; bucket_mb caps the buckets
    the buffers are broadcast in."""

    name = "grad_allreduce"
    passes = modes.GRAD_ALLREDUCE


def _comm_hook(name: str, value) -> None:
    CommHook.of(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FuseAllReduce(_Fused):
    """Gradients all-reduced in fused buckets, overlapped with the backward pass;
    comm_hook=(state, hook): each bucket reduced by DDP's comm hook instead."""

    name = "fuse_all_reduce"
    passes = modes.FUSE_ALL_REDUCE
    comm_hook: tuple | None = _option(None, _comm_hook)

    def __post_init__(self):
        super().__post_init__()
        if self.comm_hook is not None and self.fuse_dtype is not None:
            raise TranspileError("comm_hook and fuse_dtype both say what the buckets are "
                                 "reduced in: give one (fp16_compress_hook is fuse_dtype="
                                 "torch.float16's DDP form)")

    def settings(self) -> dict:
        return {**super().settings(), "comm_hook": CommHook.of(self.comm_hook)}

    def schedule(self, common) -> schedules.Schedule:
        # DDP's first iteration has buckets of its own; matched where it is exact
        # (eager) and needs to be (find_unused_parameters keeps the parameters' order)
        if common.backend == "eager" and not common.find_unused_parameters:
            base = schedules.FirstIterationApart(self.passes)
        else:
            base = super().schedule(common)
        hook = CommHook.of(self.comm_hook)
        return schedules.CommHookPhases(base, hook) if hook is not None and hook.stateful \
            else base

    def refuse(self, common) -> None:
        if self.comm_hook is not None and (common.reduce_groups or common.hierarchical):
            raise TranspileError("comm_hook reduces every bucket over the world as the hook "
                                 "writes it (DDP's hooks average over their process group): "
                                 "not with reduce_groups or hierarchical")
        if self.comm_hook is not None:
            hook = CommHook.of(self.comm_hook)
            hook.refuse_other_group(common.process_group)
            if hook.stateful and common.verify:
                raise TranspileError("verify= runs the eager step under DDP with the same comm "
                                     "hook, which would advance PowerSGD's state a second time: "
                                     "not with a PowerSGDState")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalSGD(_Fused):
    """Parameters averaged every k_steps steps, after begin_step steps of
    gradient averaging; adaptive: k recomputed after each average."""

    name = "local_sgd"
    passes = modes.LOCAL_SGD
    k_steps: int = _option(4, _int_from(1))
    begin_step: int = _option(0, _int_from(0))
    adaptive: bool = _option(False, _flag)

    def schedule(self, common) -> schedules.Schedule:
        return schedules.LocalSGD(self.passes, self.k_steps, self.begin_step, self.adaptive)

    def settings(self) -> dict:
        return {**super().settings(), "adaptive_k": self.adaptive}

    def refuse(self, common) -> None:
        if common.verify:
            raise TranspileError("verify compares with the eager step under DDP's semantics, "
                                 "which local SGD does not follow by design: use verify with "
                                 "grad_allreduce or fuse_all_reduce")
        if common.find_unused_parameters:
            raise TranspileError("find_unused_parameters follows DDP's semantics, which local "
                                 "SGD does not by design (its ranks update their own replicas): "
                                 "use it with grad_allreduce or fuse_all_reduce")


def _outer_optimizers(name: str, value) -> None:
    if not (isinstance(value, torch.optim.Optimizer) or isinstance(value, tuple) and value
            and all(isinstance(o, torch.optim.Optimizer) for o in value)):
        raise TranspileError(f"mode diloco needs {name}=: a torch optimizer over the model's "
                             "parameters (or a list of them), which steps on the averaged "
                             "pseudo-gradients (DiLoCo's: torch.optim.SGD(model.parameters(), "
                             f"lr=0.7, momentum=0.9, nesterov=True)); got {value!r}")


def _fraction(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise TranspileError(f"{name} must be a number in [0, 1], got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiLoCo(_Fused):
    """DiLoCo: the step's own (inner) optimizer with no communication, and every
    sync_every steps the pseudo-gradients (parameters at the last sync minus
    now) averaged over the ranks and stepped by outer_optimizer. With
    fragments > 1, Streaming DiLoCo: one fragment of the parameters synced
    every sync_every // fragments steps, in turn; its average taken
    fragment_sync_delay steps before its outer step; the parameters after it
    mixed with their local values by fragment_update_alpha. fuse_dtype: the
    dtype the pseudo-gradients are summed in (torch.bfloat16 halves the bytes)."""

    name = "diloco"
    passes = modes.DILOCO
    outer_optimizer: object = _option(None, _outer_optimizers)
    sync_every: int = _option(100, _int_from(1))
    fragments: int = _option(1, _int_from(1))
    fragment_sync_delay: int = _option(0, _int_from(0))
    fragment_update_alpha: float = _option(0.0, _fraction)

    def __post_init__(self):
        if isinstance(self.outer_optimizer, list):   # kept hashable, as a frozen spec is
            object.__setattr__(self, "outer_optimizer", tuple(self.outer_optimizer))
        super().__post_init__()
        if self.sync_every % self.fragments:
            raise TranspileError(f"sync_every={self.sync_every} must be a multiple of "
                                 f"fragments={self.fragments}: each fragment is synced once "
                                 "every sync_every steps")
        if self.fragment_sync_delay >= self.sync_every // self.fragments:
            raise TranspileError(f"fragment_sync_delay={self.fragment_sync_delay} must be less "
                                 f"than sync_every // fragments = "
                                 f"{self.sync_every // self.fragments}: a fragment's average is "
                                 "taken within its own period")

    def schedule(self, common) -> schedules.Schedule:
        outer = self.outer_optimizer if isinstance(self.outer_optimizer, tuple) \
            else (self.outer_optimizer,)
        return schedules.DiLoCo(self.passes, outer, self.sync_every, self.fragments,
                                self.fragment_sync_delay, float(self.fragment_update_alpha))

    def refuse(self, common) -> None:
        for option, given in (("verify", common.verify),
                              ("find_unused_parameters", common.find_unused_parameters),
                              ("check_every", common.check_every),
                              ("skip_nonfinite", common.skip_nonfinite)):
            if given:
                raise TranspileError(f"{option} follows DDP's semantics, which mode diloco does "
                                     "not by design (its ranks train replicas of their own "
                                     "between outer steps): use it with grad_allreduce or "
                                     "fuse_all_reduce")
        if common.backend == "cudagraphs" and self.fragment_sync_delay:
            raise TranspileError("fragment_sync_delay keeps a collective in flight from one "
                                 "program to a later one, which a CUDA graph's replay does not "
                                 "carry: use backend='inductor' or 'eager' with it")
        if common.hierarchical and self.fragment_sync_delay:
            raise TranspileError("fragment_sync_delay waits on one all-reduce per bucket in a "
                                 "later step; a hierarchical reduction has three stages: not "
                                 "with hierarchical=True yet (fragment_sync_delay=0 takes it)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Zero(_Fused):
    """ZeRO-2: gradients reduce-scattered, optimizer state sharded, parameters
    all-gathered; with hierarchical=True over several nodes, sharded over each
    node's ranks and replicated across the nodes (hybrid sharding)."""

    name = "zero"
    passes = modes.ZERO
    unsupported = (modes.SHARD_OPTIMIZER, ("verify", "reduce_groups", "find_unused_parameters"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fsdp(_Fused):
    """ZeRO-3 (FSDP): parameters, gradients and optimizer state sharded; each
    bucket of parameters gathered just before its first use in the step; with
    hierarchical=True over several nodes, sharded over each node's ranks and
    replicated across the nodes (HSDP)."""

    name = "fsdp"
    passes = modes.FSDP
    unsupported = ("shard_params", ("verify", "reduce_groups", "check_every",
                                    "find_unused_parameters"))
    # Free a gathered bucket after its last use in the forward pass and gather
    # it again for the backward pass (torch FSDP2's default); False keeps it
    # to its last use in the step.
    reshard_after_forward: bool = _option(True, _flag)

    def settings(self) -> dict:
        return {**super().settings(), "reshard_after_forward": self.reshard_after_forward}


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllGather(_Buckets):
    """Every rank gathers every rank's gradients and applies them in rank order."""

    name = "all_gather"
    passes = modes.ALL_GATHER
    unsupported = ("gather_grads", ("verify", "reduce_groups", "hierarchical",
                                    "skip_nonfinite", "fuse_dtype", "find_unused_parameters"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decentralized(_Buckets):
    """Each rank averages its parameters with its group of the topology at each
    step: "ring", "complete", "one-peer-exp", "alternating-exp-ring" or a Topology."""

    name = "decentralized"
    passes = modes.DECENTRALIZED
    unsupported = ("mix_params", ("verify", "reduce_groups", "hierarchical",
                                  "skip_nonfinite", "fuse_dtype", "find_unused_parameters"))
    topology: str | Topology = _option("ring", lambda _, value: check_topology(value))

    def schedule(self, common) -> schedules.Schedule:
        return schedules.Decentralized(self.passes, self.topology)

    def refuse(self, common) -> None:
        if common.check_every is not None:
            raise TranspileError("check_every compares the ranks' parameters, which differ by "
                                 "design in mode 'decentralized'; watch "
                                 "step.consensus_distance() instead")
        if common.process_group is not None:
            raise TranspileError("mode 'decentralized' builds its topology's groups over the "
                                 "default group's ranks: not with process_group=")


def _pass_list(name: str, value) -> None:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TranspileError(f"{name} must be a list of passes (names or functions), "
                             f"got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pipeline(_Fused):
    """A pipeline of one's own: passes (names or functions (program, ctx) -> None)
    run in order on the program of every step; transpile(passes=[...])."""

    name = "passes"
    passes: Sequence[PassLike] = _option((), _pass_list)

    @classmethod
    def label(cls) -> str:
        return "passes=[...]"


SPECS: dict[str, type[ModeSpec]] = {cls.name: cls for cls in (
    GradAllReduce, FuseAllReduce, LocalSGD, DiLoCo, Zero, Fsdp, AllGather, Decentralized)}


def build(mode: str | ModeSpec | None, passes: Sequence[PassLike] | None,
          options: Mapping[str, object]) -> ModeSpec:
    """The spec transpile(mode=..., passes=..., **options) asks for. In the
    string form an option given as None counts as not given (as it did when
    each was a keyword of transpile())."""
    if passes is not None and mode is not None:
        raise TranspileError("give either mode or passes, not both")
    if isinstance(mode, ModeSpec):
        if options:
            _refuse_keywords(mode, list(options))
        return mode
    if passes is not None:
        cls = Pipeline
    elif mode is None:
        cls = GradAllReduce
    elif isinstance(mode, str) and mode in SPECS:
        cls = SPECS[mode]
    else:
        raise TranspileError(f"unknown mode {mode!r}; choose one of {', '.join(SPECS)} "
                             f"(or its spec: {', '.join(c.__name__ for c in SPECS.values())}) "
                             f"or give passes=[...]")
    given = {k: v for k, v in options.items() if v is not None}
    not_taken = [k for k in given if k not in cls.options()]
    if not_taken:
        raise TranspileError(_not_taken(cls, not_taken))
    return cls(**given, **({"passes": passes} if cls is Pipeline else {}))


def _not_taken(cls: type[ModeSpec], names: list[str]) -> str:
    """Which modes take the options `cls` does not, and what it takes."""
    by_takers: dict[tuple[str, ...], list[str]] = {}
    for name in names:
        takers = tuple(c.label() for c in (*SPECS.values(), Pipeline) if name in c.options())
        if not takers:   # no mode's option: what Python says of an unknown keyword
            raise TypeError(f"transpile() got an unexpected keyword argument {name!r}")
        by_takers.setdefault(takers, []).append(name)
    clauses = [f"{', '.join(group)} appl{'y' if len(group) > 1 else 'ies'} only to "
               f"{', '.join(takers)}" for takers, group in by_takers.items()]
    takes = [o for o in cls.options() if o != "passes"]
    return f"{'; '.join(clauses)}; {cls.label()} takes {', '.join(takes) or 'no options'}"


def _refuse_keywords(spec: ModeSpec, names: list[str]) -> None:
    cls = type(spec)
    not_taken = [n for n in names if n not in cls.options()]
    if not_taken:
        raise TranspileError(_not_taken(cls, not_taken))
    raise TranspileError(f"{', '.join(names)} given both in mode={cls.__name__}(...) and as "
                         f"keywords of transpile(); give the mode's options in the spec only")


@functools.cache
def _refusing_passes() -> dict[Pass, type[ModeSpec]]:
    """The passes that do not combine with some options yet, by function."""
    return {resolve(cls.unsupported[0]): cls for cls in SPECS.values() if cls.unsupported}


def check_supported(used: set[Pass], given: Mapping[str, object]) -> None:
    """Raise if a pass the programs run does not combine with an option given
    (`given`: option name -> value, falsy when not given) yet."""
    refusing = _refusing_passes()
    for fn in sorted(used & refusing.keys(), key=pass_name):
        cls = refusing[fn]
        refused = [name for name in cls.unsupported[1] if given[name]]
        if refused:
            raise TranspileError(f"mode {cls.name!r} ({pass_name(fn)}) does not support "
                                 f"{', '.join(refused)} yet; use fuse_all_reduce for them")
