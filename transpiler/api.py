"""The public entry point."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Callable, Sequence

from .backends import hpu
from . import mode_specs, world
from .backends.compile import BACKENDS
from .errors import TranspileError
from .mode_specs import ModeSpec, is_int
from .modes import BROADCAST_BUFFERS, SHARD_OPTIMIZER
from .lowering.context import PassContext, PassLike
from .pipeline import check_order, resolve
from .lowering.reduce_groups import check as check_groups
from .runtime.step import TranspiledStep

MAX_RINGS = 16


@dataclasses.dataclass
class Common:
    """transpile()'s options of every mode, checked as they are given."""

    backend: str = "eager"
    nrings: int = 2
    check_every: int | None = None
    skip_nonfinite: bool = False
    verify: int = 0
    verify_tolerance: float = 1e-3
    hierarchical: bool = False
    reduce_groups: Sequence[tuple] = ()
    broadcast_buffers: bool = True
    find_unused_parameters: bool = False
    process_group: object = None

    def __post_init__(self):
        self.process_group = world.checked(self.process_group)
        if self.process_group is not None and (self.hierarchical or self.reduce_groups):
            raise TranspileError("process_group= runs the step over that group alone, as "
                                 "DDP(process_group=...): not with hierarchical or reduce_groups, "
                                 "which build groups over the default group's ranks")
        for name in ("skip_nonfinite", "broadcast_buffers", "hierarchical",
                     "find_unused_parameters"):
            if not isinstance(getattr(self, name), bool):
                raise TranspileError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not is_int(self.nrings) or not 1 <= self.nrings <= MAX_RINGS:
            raise TranspileError(f"nrings must be an integer from 1 to {MAX_RINGS}, "
                                 f"got {self.nrings!r}")
        if self.backend not in BACKENDS:
            raise TranspileError(f"unknown backend {self.backend!r}; available: "
                                 f"{', '.join(BACKENDS)}")
        if self.backend == "hpu":
            hpu.require()
        if self.check_every is not None and (not is_int(self.check_every) or self.check_every < 1):
            raise TranspileError(f"check_every must be an integer >= 1 or None, "
                                 f"got {self.check_every!r}")
        if not is_int(self.verify) or self.verify < 0:
            raise TranspileError(f"verify must be an integer >= 0 (steps to check), "
                                 f"got {self.verify!r}")
        tolerance = self.verify_tolerance
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) \
                or not tolerance >= 0:
            raise TranspileError(f"verify_tolerance must be a number >= 0, got {tolerance!r}")
        self.reduce_groups = check_groups(self.reduce_groups)
        if self.verify and self.reduce_groups:
            raise TranspileError("verify compares with DDP's semantics, which average every "
                                 "gradient over the world: it cannot check reduce_groups")

    def adjust(self, passes: Sequence[PassLike]) -> tuple[PassLike, ...]:
        """A program's passes under these options: without broadcast_buffers
        (DDP(broadcast_buffers=False)), with unused_params and skip_nonfinite."""
        if not self.broadcast_buffers:
            dropped = resolve(BROADCAST_BUFFERS)
            passes = tuple(p for p in passes if resolve(p) is not dropped)
        return (tuple(passes) + (("unused_params",) if self.find_unused_parameters else ())
                + (("skip_nonfinite",) if self.skip_nonfinite else ()))


def transpile(step_fn: Callable, mode: str | ModeSpec | None = None, *,
              passes: Sequence[PassLike] | None = None, backend: str = "eager",
              nrings: int = 2, check_every: int | None = None,
              skip_nonfinite: bool = False, verify: int = 0,
              verify_tolerance: float = 1e-3, hierarchical: bool = False,
              reduce_groups: Sequence[tuple] = (), broadcast_buffers: bool = True,
              find_unused_parameters: bool = False, process_group=None,
              dynamic: bool | Mapping[str, Iterable[int]] | None = None,
              micro_batches: str | None = None, **mode_options) -> TranspiledStep:
    """Return a callable with the signature of `step_fn` that runs the whole
    training step (forward, backward, optimizer update) as one transpiled
    program on every rank.

    mode: a mode spec carrying its own options (transpiler/mode_specs.py), e.g.
    LocalSGD(k_steps=4, begin_step=100), Zero(bucket_mb=50),
    Decentralized(topology="ring"); or its name (see MODES; default
    "grad_allreduce") with its options as keywords (`**mode_options`:
    mode="local_sgd", k_steps=4), an option the mode does not take refused.
    passes: instead of a mode, a pipeline of one's own: pass names or functions
    `(program, ctx) -> None`, run in order on the program of every step; its
    options (bucket_mb, first_bucket_mb, fuse_dtype) as keywords.
    nrings: how many communicators the collectives are spread over.
    backend: how the programs run: "eager" (op by op, the reference), "inductor"
    (compiled by inductor, CPU and CUDA), "cudagraphs" (inductor plus one CUDA graph per
    program), "hpu" (Intel Gaudi), or "auto" (hpu on a Gaudi device, else
    inductor). Each program compiles on its first run.
    skip_nonfinite: skip the update (parameters, buffers, optimizer state) of a
    step whose summed gradients contain NaN or Inf, on every rank alike, and
    count it in step.skipped_steps.
    check_every: every this many steps, compare a checksum of the parameters
    across the ranks (local_sgd: at the next sync) and raise DivergenceError if
    they differ; None: never (call step.check_consistency() yourself).
    verify: check the first `verify` steps against the eager step under DDP's
    semantics, run on copies, and raise VerificationError on every rank, with
    nothing written back, where a value differs by more than verify_tolerance
    relative to the largest magnitude of the eager value (transpiler/runtime/verify.py).
    hierarchical: reduce over the world hierarchically when there is more than
    one node (torchrun's LOCAL_WORLD_SIZE ranks per node): reduce-scatter inside
    the node, all-reduce across nodes, all-gather inside the node.
    reduce_groups: pairs (group, parameters) whose gradients (local SGD:
    values) are averaged over that group instead of the world, such as the
    experts of a mixture of experts; a group is a process group (each rank
    gives the one it belongs to, in the same position on every rank) or a
    dimension of the mesh, Dim.NODE or Dim.ACROSS (transpiler/lowering/reduce_groups.py).
    broadcast_buffers: start every step from rank 0's buffers (BatchNorm's
    statistics), as DDP does by default (its broadcast_buffers=True); False keeps
    each rank's own, as DDP(broadcast_buffers=False). Applies to the modes whose
    ranks hold one model (not decentralized, nor local_sgd's local steps);
    passes/broadcast_buffers.py says which buffers.
    find_unused_parameters: as DDP's: a parameter that gets no gradient on some
    ranks (an expert no token of this rank's batch is routed to) takes part in
    the reduction with zeros, and its update (and optimizer state) is kept as
    it was where no rank gave it a gradient (passes/unused_params.py). Without
    it, ranks whose programs reduce different parameters stop with an error.
    process_group: as DDP's: the step is data parallel over this group's ranks
    alone (a group from dist.new_group that this rank is in; None: every rank).
    Its collectives run on that group and nothing is created over ranks outside
    it, so the other ranks of the job may do something else meanwhile
    (transpiler/world.py). Not with hierarchical, reduce_groups or mode
    decentralized.
    dynamic: which batch dimensions are traced as symbols, so that one program
    serves every size (capture/shapes.py). None: after a batch tensor's shape
    changes, every batch dimension (the first call is traced with the shapes
    it brings); True: every batch dimension from the first call; a mapping
    {argument name: dimensions}, e.g. {"x": {0, 1}}: those from the first
    call (and every one after a change); False: never, one program per shape.
    micro_batches: the name of the step's argument that is the list (or tuple)
    of micro-batches it loops over, each a tensor or a pytree of tensors of one
    structure, shapes and dtypes. The step is traced over two of them and runs
    its loop body once per further micro-batch, so tracing and compiling cost
    the same for every k; the step must treat every micro-batch after the first
    alike and use the list only by iterating over it once (else it is traced
    unrolled, as without the option: capture/micro.py, micro_loop.py).
    """
    if not callable(step_fn):
        raise TranspileError(f"transpile needs the training step function, got {step_fn!r}")
    if micro_batches is not None and not isinstance(micro_batches, str):
        raise TranspileError(f"micro_batches must be the name of the step's argument holding "
                             f"the list of micro-batches, got {micro_batches!r}")
    dynamic = _dynamic_dims(dynamic)
    spec = mode_specs.build(mode, passes, mode_options)
    common = Common(backend, nrings, check_every, skip_nonfinite, verify, verify_tolerance,
                    hierarchical, reduce_groups, broadcast_buffers, find_unused_parameters,
                    process_group)
    spec.refuse(common)
    schedule = spec.schedule(common)
    schedule.programs = {name: common.adjust(p) for name, p in schedule.programs.items()}
    for program_passes in schedule.programs.values():
        check_order(program_passes)
    used = {resolve(p) for program_passes in schedule.programs.values() for p in program_passes}
    settings = spec.settings()
    mode_specs.check_supported(used, {**vars(common), "fuse_dtype": settings.get("fuse_dtype")})
    context = PassContext(nrings=nrings, hierarchical=hierarchical,
                          find_unused=find_unused_parameters, **settings)
    return TranspiledStep(step_fn, schedule, context, backend=backend, check_every=check_every,
                          verify=verify, verify_tolerance=float(verify_tolerance),
                          groups=common.reduce_groups,
                          sharded_state=resolve(SHARD_OPTIMIZER) in used, dynamic=dynamic,
                          micro_batches=micro_batches, process_group=common.process_group,
                          broadcast_buffers=common.broadcast_buffers)


def _dynamic_dims(dynamic) -> bool | dict[str, frozenset[int]] | None:
    """transpile's dynamic= checked: None, a bool, or {name: dims}."""
    if dynamic is None or isinstance(dynamic, bool):
        return dynamic
    if isinstance(dynamic, Mapping) and all(isinstance(k, str) for k in dynamic):
        dims = {name: frozenset([d] if isinstance(d, int) else d) for name, d in dynamic.items()}
        if all(isinstance(d, int) for ds in dims.values() for d in ds):
            return dims
    raise TranspileError(f"dynamic must be None, True, False or a mapping from argument names "
                         f"to dimensions, e.g. dynamic={{'x': {{0, 1}}}}; got {dynamic!r}")
