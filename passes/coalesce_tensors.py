"""coalesce_tensors: all-reduce gradients (any values to reduce) in fused buckets
instead of one by one.

Requires: a pass that marked the values to reduce over the ranks
(meta["reduce"], a Reduction): average_grads (the gradients, MEAN) or local_sgd
(the parameter deltas, SUM).
Produces: buckets of the marked values planned by `plan_buckets` as DDP's
reducer lays them out, so that a ring all-reduce over any number of ranks
adds each element in DDP's order (by dtype, op and group; gradients in the
order the autograd engine accumulated them while the step was first traced,
ctx.ready_order (else this trace's, Program.ready_order), which is the order
DDP rebuilds its buckets by after its first iteration, once; with
ctx.initial_buckets DDP's first iteration: each dtype's in one bucket, in the
parameters' order; with ctx.find_unused in reverse order of the parameters,
each bucket placed not before the one before it, an order every rank has;
other values in program order), closed at ctx.bucket_mb, the first one per
dtype at ctx.first_bucket_mb; values of different reduction points,
Reduction.point, in buckets of their own). For each bucket, placed right
after its last value: the values flattened and concatenated into one buffer
(optionally cast to ctx.fuse_dtype), its reduction
lowered by transpiler/lowering/reductions.py (for a MEAN the buffer times 1 / group size,
as DDP's reducer scales, then `all_reduce(sum)` over the group on ring 0 and
its wait; hierarchical over several nodes: reduce-scatter inside the node,
all-reduce across, all-gather inside), the cast back, and the reduced buffer
split into views shaped like the values, which every former use of a value now
reads (no copy back), but those of the backward() that produced it
(program/averaging.py GradientReads), as under DDP. With ctx.comm_hook (DDP's
comm hook) the bucket's buffer, not averaged, is reduced by the hook traced
into the program instead
(transpiler/lowering/comm_hooks.py). Pack nodes have the role of the bucket's last value
(BACKWARD for gradients), the rest COMM; all carry meta["bucket"]. Values of
different dtypes or groups never share a buffer. Every mark is removed. With one
rank it does not apply.
Order: before schedule_comm (which overlaps the all-reduces with the backward
pass) and ring_round_robin (which spreads the buckets over the rings).
"""

from __future__ import annotations

import dataclasses
import operator
import sys
from typing import Sequence

import torch
import torch.fx as fx

from transpiler.lowering import comm_hooks, reductions as lowering
from transpiler.program.collectives import ReduceOp
from transpiler.program.mesh import Dim, Over
from transpiler.lowering.context import Mark, PassContext, consumes
from transpiler.program.averaging import GradientReads
from transpiler.program.program import CommInfo, InputKind, Program, new_node
from transpiler.program.roles import BUCKET, PARAM, REDUCE, ROLE, Role

aten = torch.ops.aten
MB = 1 << 20


@dataclasses.dataclass(frozen=True)
class GradInfo:
    name: str
    dtype: torch.dtype
    nbytes: int
    op: ReduceOp = ReduceOp.SUM
    over: Over = Dim.WORLD
    point: int = 0   # Reduction.point


def plan_buckets(grads: Sequence[GradInfo], bucket_bytes: int,
                 first_bucket_bytes: int) -> list[list[str]]:
    """Group gradients, given in the order they are produced, into buckets, as
    DDP's reducer does (compute_bucket_assignment_by_size).

    Each dtype (with each reduce op, group and reduction point) fills its own
    open bucket; a bucket closes once it holds at least its cap (the first
    bucket of a dtype: first_bucket_bytes, later ones: bucket_bytes), so a
    gradient larger than the cap gets a bucket of its own; what is left at the
    end forms a last bucket. Buckets are returned in the order their last
    gradient is produced, which is when they can be reduced. A pure function
    of its arguments: every rank that has the same program plans the same
    buckets.
    """
    if bucket_bytes <= 0 or first_bucket_bytes <= 0:
        raise ValueError("bucket sizes must be positive")
    closed: list[tuple[int, list[str]]] = []
    open_: dict[tuple, tuple[list[str], int, int]] = {}   # kind -> names, bytes, buckets closed
    for i, g in enumerate(grads):
        kind = (g.dtype, g.op, g.over, g.point)
        names, size, done = open_.get(kind, ([], 0, 0))
        names, size = names + [g.name], size + g.nbytes
        if size >= (bucket_bytes if done else first_bucket_bytes):
            closed.append((i, names))
            open_[kind] = ([], 0, done + 1)
        else:
            open_[kind] = (names, size, done)
    last = {g.name: i for i, g in enumerate(grads)}
    closed += [(last[names[-1]], names) for names, _, _ in open_.values() if names]
    return [names for _, names in sorted(closed, key=lambda item: item[0])]


@consumes(Mark.TO_REDUCE)
def coalesce_tensors(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    grads = program.to_reduce(by_parameters=ctx.find_unused)
    caps = int(ctx.bucket_mb * MB), int(ctx.first_bucket_mb * MB)
    if ctx.initial_buckets:   # DDP's first iteration: each dtype's in one, in parameter order
        grads, caps = in_parameter_order(program, grads), (sys.maxsize, sys.maxsize)
    elif not ctx.find_unused:
        grads = in_ready_order(grads, ctx.ready_order or program.ready_order())
    infos = [GradInfo(name, g.meta["val"].dtype, g.meta["val"].nbytes, g.meta[REDUCE].op,
                      g.meta[REDUCE].over, g.meta[REDUCE].point) for name, g in grads.items()]
    plan = plan_buckets(infos, *caps)
    reads = GradientReads(program)
    end = None
    for bucket, names in enumerate(plan):
        end = _fuse(program, ctx, bucket, [grads[n] for n in names], reads,
                    end if ctx.find_unused else None, is_last=bucket == len(plan) - 1)
    lowering.forget_marks(program.graph)


def in_ready_order(grads: dict[str, fx.Node], order: Sequence[str]) -> dict[str, fx.Node]:
    """The gradients of the parameters in `order` (the order the autograd
    engine accumulated them in the step's first trace, which DDP rebuilds its
    buckets by after its first iteration and keeps), then the others (an
    earlier backward()'s, or values that are not gradients) in program order."""
    return {name: grads[name] for name in order
            if name in grads and grads[name].meta.get(PARAM) == name} | grads


def in_parameter_order(program: Program, grads: dict[str, fx.Node]) -> dict[str, fx.Node]:
    """The parameters' gradients in the order of the parameters (DDP's first
    layout), then any others in program order."""
    params = [s.name for s in program.inputs if s.kind is InputKind.PARAM]
    return {name: grads[name] for name in params if name in grads} | grads


def _fuse(program: Program, ctx: PassContext, bucket: int, grads: list[fx.Node],
          reads: GradientReads, after: fx.Node | None = None, is_last: bool = False) -> fx.Node:
    """The bucket packed, reduced and unpacked right after its last gradient
    (and after `after`, the bucket before it); returns its last node. The
    nodes that read the average read the unpacked views."""
    graph = program.graph
    users = {g: list(g.users) for g in grads}
    vals = [g.meta["val"] for g in grads]
    dtype = vals[0].dtype
    comm_dtype = ctx.fuse_dtype or dtype
    comm = CommInfo("all_reduce", ring=0, bucket=bucket,
                    params=tuple(g.meta[REDUCE].key for g in grads),
                    nbytes=sum(v.numel() for v in vals) * comm_dtype.itemsize)
    last = max(grads, key=reads.position.__getitem__)
    pack_role = last.meta[ROLE]
    if after is not None and after > last:
        last = after
    with graph.inserting_before(last.next):
        buffer = pack(graph, grads, comm_dtype, pack_role, **{BUCKET: bucket})
        if ctx.comm_hook is not None:
            waited = comm_hooks.reduce(program, ctx.comm_hook, buffer, grads, bucket, is_last, comm,
                                       ctx.mesh.ring(comm.over), pack_role)
            comm_dtype = waited.meta["val"].dtype   # DDP copies it into the gradients: cast
        else:
            issued = lowering.issue(graph, buffer, grads[0].meta[REDUCE], ctx, comm, pack_role,
                                    **{BUCKET: bucket})
            waited = lowering.complete(graph, issued, ctx, **{BUCKET: bucket})
        if comm_dtype != dtype:
            waited = new_node(graph, aten._to_copy.default, (waited,), Role.COMM,
                              {"dtype": dtype}, **{BUCKET: bucket})
        views = unpack(graph, waited, grads, **{BUCKET: bucket})
    for g, view in zip(grads, views):
        for user in users[g]:
            if reads.average(user, g.meta[REDUCE].point):
                user.replace_input_with(g, view)
    return max(views)


def pack(graph: fx.Graph, values: list[fx.Node], dtype: torch.dtype, role: Role,
         **meta) -> fx.Node:
    """At the insertion point: the values flattened (cast to `dtype` where they
    differ) into one new 1-d buffer, in order. Nodes have `role` and `meta`."""
    def node(target, args, kwargs=None):
        return new_node(graph, target, args, role, kwargs, **meta)

    sizes = [v.meta["val"].numel() for v in values]
    buffer = node(aten.new_empty.default, (values[0], [sum(sizes)]), {"dtype": dtype})
    offset = 0
    for v, size in zip(values, sizes):
        flat = node(aten.reshape.default, (v, [-1]))
        if v.meta["val"].dtype != dtype:
            flat = node(aten._to_copy.default, (flat,), {"dtype": dtype})
        buffer = node(aten.slice_scatter.default, (buffer, flat, 0, offset, offset + size))
        offset += size
    return buffer


def unpack(graph: fx.Graph, buffer: fx.Node, like: list[fx.Node], **meta) -> list[fx.Node]:
    """At the insertion point: views of a buffer `pack` laid out, one shaped
    like each of `like` (no copy). Nodes have role COMM and `meta`."""
    def node(target, args):
        return new_node(graph, target, args, Role.COMM, **meta)

    vals = [v.meta["val"] for v in like]
    parts = node(aten.split_with_sizes.default, (buffer, [v.numel() for v in vals]))
    return [node(aten.view.default, (node(operator.getitem, (parts, i)), list(v.shape)))
            for i, v in enumerate(vals)]
