"""The public entry point."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from . import hpu
from .reduce_groups import check as check_groups
from .backends import BACKENDS
from .errors import TranspileError
from .modes import BROADCAST_BUFFERS, MODES
from .pipeline import PassContext, PassLike, check_order, pass_name, resolve
from .runtime import TranspiledStep
from .schedule import Decentralized, EveryStep, LocalSGD
from .topology import Topology
from .topology import check_spec as check_topology

MAX_RINGS = 16
# What values may be reduced in: gloo and nccl sum these (not float8, for one).
REDUCIBLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# Passes of a mode and the options they do not combine with yet, refused up front.
_UNSUPPORTED = {
    "shard_optimizer": ("zero", ("verify", "reduce_groups", "hierarchical")),
    "gather_grads": ("all_gather", ("verify", "reduce_groups", "hierarchical",
                                    "skip_nonfinite", "fuse_dtype")),
    "mix_params": ("decentralized", ("verify", "reduce_groups", "hierarchical",
                                     "skip_nonfinite", "fuse_dtype")),
}


def transpile(step_fn: Callable, mode: str | None = None, *,
              passes: Sequence[PassLike] | None = None, nrings: int = 2,
              bucket_mb: float = 25.0, first_bucket_mb: float = 1.0,
              fuse_dtype: torch.dtype | None = None,
              k_steps: int | None = None, begin_step: int | None = None,
              adaptive: bool | None = None, topology: str | Topology | None = None,
              backend: str = "eager", check_every: int | None = None,
              skip_nonfinite: bool = False, verify: int = 0,
              verify_tolerance: float = 1e-3, hierarchical: bool = False,
              reduce_groups: Sequence[tuple] = (),
              broadcast_buffers: bool = True) -> TranspiledStep:
    """Return a callable with the signature of `step_fn` that runs the whole
    training step (forward, backward, optimizer update) as one transpiled
    program on every rank.

    mode: a named preset of passes (see MODES; default "grad_allreduce"); or give
    `passes=[...]` instead, pass names or functions `(program, ctx) -> None`,
    run in order on the program of every step.
    nrings: how many communicators the collectives are spread over.
    bucket_mb, first_bucket_mb: fused-bucket caps (fuse_all_reduce, local_sgd), in MiB.
    fuse_dtype: dtype values are all-reduced in (fuse_all_reduce, local_sgd), e.g.
    torch.bfloat16; None keeps each value's own dtype.
    k_steps, begin_step, adaptive (local_sgd only): average the parameters every
    k_steps steps (default 4), after begin_step steps of gradient averaging
    (default 0); adaptive=True recomputes k after each average from the loss and
    the learning rate.
    topology (decentralized only): who averages parameters with whom at each
    step: "ring" (the default), "complete", "one-peer-exp",
    "alternating-exp-ring", or a Topology of one's own (topology.of(...)); see
    transpiler/topology.py.
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
    relative to the largest magnitude of the eager value (transpiler/verify.py).
    hierarchical: reduce over the world hierarchically when there is more than
    one node (torchrun's LOCAL_WORLD_SIZE ranks per node): reduce-scatter inside
    the node, all-reduce across nodes, all-gather inside the node.
    reduce_groups: pairs (group, parameters) whose gradients (local SGD:
    values) are averaged over that group instead of the world, such as the
    experts of a mixture of experts; a group is a process group (each rank
    gives the one it belongs to, in the same position on every rank) or a
    dimension of the mesh, Dim.NODE or Dim.ACROSS (transpiler/reduce_groups.py).
    broadcast_buffers: start every step from rank 0's buffers (BatchNorm's
    statistics), as DDP does by default (its broadcast_buffers=True); False keeps
    each rank's own, as DDP(broadcast_buffers=False). Applies to the modes whose
    ranks hold one model (not decentralized, nor local_sgd's local steps);
    passes/broadcast_buffers.py says which buffers.
    """
    if not callable(step_fn):
        raise TranspileError(f"transpile needs the training step function, got {step_fn!r}")
    if passes is None:
        mode = mode or "grad_allreduce"
        if mode not in MODES:
            raise TranspileError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)} "
                                 "or give passes=[...]")
    elif mode is not None:
        raise TranspileError("give either mode or passes, not both")
    local = {"k_steps": k_steps, "begin_step": begin_step, "adaptive": adaptive}
    given = [name for name, value in local.items() if value is not None]
    if given and mode != "local_sgd":
        raise TranspileError(f"{', '.join(given)} apply only to mode='local_sgd'")
    if check_every is not None and mode == "decentralized":
        raise TranspileError("check_every compares the ranks' parameters, which differ by "
                             "design in mode 'decentralized'; watch step.consensus_distance() "
                             "instead")
    if topology is not None and mode != "decentralized":
        raise TranspileError("topology applies only to mode='decentralized'")
    if mode == "local_sgd":
        schedule = _local_sgd(k_steps, begin_step, adaptive)
    elif mode == "decentralized":
        topology = "ring" if topology is None else topology
        check_topology(topology)
        schedule = Decentralized(MODES[mode], topology)
    else:
        schedule = EveryStep(MODES[mode] if passes is None else passes)
    if not isinstance(skip_nonfinite, bool):
        raise TranspileError(f"skip_nonfinite must be True or False, got {skip_nonfinite!r}")
    if not isinstance(broadcast_buffers, bool):
        raise TranspileError(f"broadcast_buffers must be True or False, got {broadcast_buffers!r}")
    if not broadcast_buffers:
        dropped = resolve(BROADCAST_BUFFERS)
        schedule.programs = {name: tuple(q for q in p if q != BROADCAST_BUFFERS and q is not dropped)
                             for name, p in schedule.programs.items()}
    if skip_nonfinite:
        schedule.programs = {name: p + ("skip_nonfinite",) for name, p in schedule.programs.items()}
    for program_passes in schedule.programs.values():
        check_order(program_passes)
    if not _is_int(nrings) or not 1 <= nrings <= MAX_RINGS:
        raise TranspileError(f"nrings must be an integer from 1 to {MAX_RINGS}, got {nrings!r}")
    for name, value in (("bucket_mb", bucket_mb), ("first_bucket_mb", first_bucket_mb)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise TranspileError(f"{name} must be a positive number of MiB, got {value!r}")
    if fuse_dtype is not None and fuse_dtype not in REDUCIBLE_DTYPES:
        raise TranspileError(f"fuse_dtype must be None or one of the floating-point dtypes "
                             f"gloo and nccl sum ({', '.join(map(str, REDUCIBLE_DTYPES))}), "
                             f"got {fuse_dtype!r}")
    if backend not in BACKENDS:
        raise TranspileError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
    if backend == "hpu":
        hpu.require()
    if check_every is not None and (not _is_int(check_every) or check_every < 1):
        raise TranspileError(f"check_every must be an integer >= 1 or None, got {check_every!r}")
    if not _is_int(verify) or verify < 0:
        raise TranspileError(f"verify must be an integer >= 0 (steps to check), got {verify!r}")
    if isinstance(verify_tolerance, bool) or not isinstance(verify_tolerance, (int, float)) \
            or not verify_tolerance >= 0:
        raise TranspileError(f"verify_tolerance must be a number >= 0, got {verify_tolerance!r}")
    if verify and mode == "local_sgd":
        raise TranspileError("verify compares with the eager step under DDP's semantics, which "
                             "local SGD does not follow by design: use verify with "
                             "grad_allreduce or fuse_all_reduce")
    if not isinstance(hierarchical, bool):
        raise TranspileError(f"hierarchical must be True or False, got {hierarchical!r}")
    groups = check_groups(reduce_groups)
    if verify and groups:
        raise TranspileError("verify compares with DDP's semantics, which average every "
                             "gradient over the world: it cannot check reduce_groups")
    used = {pass_name(resolve(p)) for program_passes in schedule.programs.values()
            for p in program_passes}
    options = {"verify": verify, "reduce_groups": groups, "hierarchical": hierarchical,
               "skip_nonfinite": skip_nonfinite, "fuse_dtype": fuse_dtype}
    for used_pass in sorted(used & _UNSUPPORTED.keys()):
        mode_name, refused = _UNSUPPORTED[used_pass]
        given = [name for name in refused if options[name]]
        if given:
            raise TranspileError(f"mode {mode_name!r} ({used_pass}) does not support "
                                 f"{', '.join(given)} yet; use fuse_all_reduce for them")
    sharded = "shard_optimizer" in used
    settings = PassContext(nrings=nrings, bucket_mb=float(bucket_mb),
                           first_bucket_mb=float(first_bucket_mb), fuse_dtype=fuse_dtype,
                           adaptive_k=bool(adaptive), hierarchical=hierarchical)
    return TranspiledStep(step_fn, schedule, settings, backend=backend, check_every=check_every,
                          verify=verify, verify_tolerance=float(verify_tolerance), groups=groups,
                          sharded_state=sharded)


def _local_sgd(k_steps, begin_step, adaptive) -> LocalSGD:
    k_steps = 4 if k_steps is None else k_steps
    begin_step = 0 if begin_step is None else begin_step
    if not _is_int(k_steps) or k_steps < 1:
        raise TranspileError(f"k_steps must be an integer >= 1, got {k_steps!r}")
    if not _is_int(begin_step) or begin_step < 0:
        raise TranspileError(f"begin_step must be an integer >= 0, got {begin_step!r}")
    if adaptive is not None and not isinstance(adaptive, bool):
        raise TranspileError(f"adaptive must be True or False, got {adaptive!r}")
    return LocalSGD(MODES["local_sgd"], k_steps, begin_step, bool(adaptive))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
