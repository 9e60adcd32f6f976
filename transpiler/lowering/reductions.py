"""How a Reduction (transpiler/program/collectives.py) becomes collectives: the one
place that knows, shared by the passes that reduce (insert_allreduce one value
at a time, coalesce_tensors a fused buffer at a time).

A reduction is lowered in two halves, so that a pass can issue the
communication as soon as the value exists and wait for it only where the result
is read: `issue` at the graph's insertion point (for a MEAN the value times
1 / group size, then the first collective), `complete` at another (the wait and
whatever follows it). Over the world with more than one node in the mesh and
ctx.hierarchical the reduction is hierarchical (Paddle fleet's and Horovod's hierarchical
all-reduce): reduce-scatter inside the node, all-reduce of this rank's shard
across the nodes, all-gather inside the node; the value is flattened and padded
to a multiple of the node's ranks for it. Otherwise it is one all-reduce over
its group. A reduction to a SHARD placement is one reduce-scatter over its group
(of a flat value whose size the group's ranks divide: the caller lays it out);
over the world or the node on gloo, whose reduce-scatter is an all-reduce of a
copy, it is that all-reduce and a view of this rank's chunk
(Mesh.reduce_scatter_native). Hierarchical, a SHARD reduction over the world is
hybrid sharding: reduce-scatter inside the node (the value laid out for the
node's ranks: Mesh.shard_over), then this rank's shard all-reduced across the
nodes, so each node holds the whole reduced value in shards.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ..program.collectives import (ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, WAIT, Placement,
                                   ReduceOp, Reduction)
from ..program.mesh import Dim, Over
from .context import PassContext
from ..program.program import CommInfo, new_node
from ..program.roles import AVERAGED, COMM, REDUCE, REDUCED, Role

aten = torch.ops.aten


@dataclasses.dataclass
class Issued:
    """A reduction in flight: its collective and what `complete` needs."""

    reduction: Reduction
    collective: fx.Node
    comm: CommInfo
    shape: list[int]          # the value's shape, restored at the end
    numel: int


def hierarchical(reduction: Reduction, ctx: PassContext) -> bool:
    return ctx.hierarchical and reduction.over is Dim.WORLD and ctx.mesh.nodes > 1


def _scattered_over(reduction: Reduction, ctx: PassContext) -> Over:
    """The group a SHARD reduction's reduce-scatter runs over (and its shards are spread over)."""
    return Dim.NODE if hierarchical(reduction, ctx) else reduction.over


def issue(graph: fx.Graph, value: fx.Node, reduction: Reduction, ctx: PassContext,
          comm: CommInfo, role: Role, **meta) -> Issued:
    """At the insertion point: what goes before the wait. `role` is that of the
    nodes preparing the value (the producer's); `meta` goes on every node."""
    def node(target, args, role, **extra):
        return new_node(graph, target, args, role, **meta, **extra)

    mesh, val = ctx.mesh, value.meta["val"]
    sent = value
    if reduction.op is ReduceOp.MEAN:
        sent = node(aten.mul.Tensor, (sent, 1 / mesh.size(reduction.over)), role,
                    **{AVERAGED: reduction.over})
    shape, numel = list(val.shape), val.numel()
    if reduction.placement is Placement.SHARD:
        over = _scattered_over(reduction, ctx)
        size = mesh.size(over)
        if len(shape) != 1 or numel % size:
            raise ValueError(f"internal: a sharded reduction of a {shape} value over {size} ranks")
        if _scatter_by_all_reduce(over, mesh):
            comm = dataclasses.replace(comm, op="all_reduce", over=over)
            collective = node(ALL_REDUCE, (sent, "sum", mesh.ring(over)), Role.COMM,
                              **{COMM: comm})
        else:
            comm = dataclasses.replace(comm, op="reduce_scatter", over=over)
            collective = node(REDUCE_SCATTER, (sent, "sum", size, mesh.ring(over)),
                              Role.COMM, **{COMM: comm})
        return Issued(reduction, collective, comm, [numel // size], numel // size)
    if not hierarchical(reduction, ctx):
        comm = dataclasses.replace(comm, over=reduction.over)
        collective = node(ALL_REDUCE, (sent, "sum", mesh.ring(reduction.over)), Role.COMM,
                          **{COMM: comm})
        return Issued(reduction, collective, comm, shape, numel)
    local = mesh.local_size
    flat = sent if len(shape) == 1 else node(aten.reshape.default, (sent, [-1]), role)
    pad = -numel % local
    if pad:
        flat = node(aten.constant_pad_nd.default, (flat, [0, pad]), role)
    comm = dataclasses.replace(comm, op="reduce_scatter", over=Dim.NODE)
    collective = node(REDUCE_SCATTER, (flat, "sum", local, mesh.ring(Dim.NODE)), Role.COMM,
                      **{COMM: comm})
    return Issued(reduction, collective, comm, shape, numel)


def _scatter_by_all_reduce(over: Over, mesh) -> bool:
    """A reduce-scatter over the world or the node on communicators without a
    native one (gloo) runs as what that backend would do anyway, less its two
    copies: the value all-reduced (in place, in eager), and a view of this rank's chunk."""
    return not mesh.reduce_scatter_native and over in (Dim.WORLD, Dim.NODE)


def all_reduce_now(graph: fx.Graph, value: fx.Node, op: str, ctx: PassContext,
                   over: Dim = Dim.WORLD) -> fx.Node:
    """At the insertion point: `value` all-reduced with `op` ("sum", "max") over
    `over` on ring 0, and waited for at once (a scalar a pass must combine
    across ranks: a partial norm, a verdict). Returns the waited node."""
    comm = CommInfo("all_reduce", nbytes=value.meta["val"].nbytes, over=over)
    issued = new_node(graph, ALL_REDUCE, (value, op, ctx.mesh.ring(over)), Role.COMM,
                      **{COMM: comm})
    return new_node(graph, WAIT, (issued,), Role.COMM, **{COMM: comm})


def forget_marks(graph: fx.Graph) -> None:
    """Remove every mark to reduce: a reduction pass has lowered them all."""
    for node in graph.nodes:
        node.meta.pop(REDUCE, None)


def complete(graph: fx.Graph, issued: Issued, ctx: PassContext, **meta) -> fx.Node:
    """At the insertion point: the wait and what follows; returns the reduced
    value, shaped like the value that was issued (SHARD: this rank's part), marked meta["reduced"] (what
    reads reduced values, such as skip_nonfinite, finds it so). Every node has
    role COMM."""
    result = _result(graph, issued, ctx, **meta)
    result.meta[REDUCED] = issued.reduction
    return result


def _result(graph: fx.Graph, issued: Issued, ctx: PassContext, **meta) -> fx.Node:
    def node(target, args, **extra):
        return new_node(graph, target, args, Role.COMM, **meta, **extra)

    mesh = ctx.mesh
    waited = node(WAIT, (issued.collective,), **{COMM: issued.comm})
    if issued.reduction.placement is Placement.SHARD:
        over = _scattered_over(issued.reduction, ctx)
        if _scatter_by_all_reduce(over, mesh):
            rows = node(aten.view.default, (waited, [mesh.size(over), issued.numel]))
            waited = node(aten.select.int, (rows, 0, mesh.position(over)))
        return _across(node, waited, issued.comm, mesh) \
            if hierarchical(issued.reduction, ctx) else waited
    if not hierarchical(issued.reduction, ctx):
        return waited
    shard_bytes = waited.meta["val"].nbytes
    summed = _across(node, waited, issued.comm, mesh)
    inside = dataclasses.replace(issued.comm, op="all_gather", over=Dim.NODE,
                                 nbytes=shard_bytes * mesh.local_size)
    gathered = node(ALL_GATHER, (summed, mesh.local_size, mesh.ring(Dim.NODE)), **{COMM: inside})
    full = node(WAIT, (gathered,), **{COMM: inside})
    if full.meta["val"].numel() != issued.numel:
        full = node(aten.slice.Tensor, (full, 0, 0, issued.numel))
    return full if issued.shape == [issued.numel] else node(aten.view.default, (full, issued.shape))


def _across(node, shard: fx.Node, comm: CommInfo, mesh) -> fx.Node:
    """This rank's shard summed over the ranks of its local rank on every node, waited for."""
    across = dataclasses.replace(comm, op="all_reduce", over=Dim.ACROSS,
                                 nbytes=shard.meta["val"].nbytes)
    summed = node(ALL_REDUCE, (shard, "sum", mesh.ring(Dim.ACROSS)), **{COMM: across})
    return node(WAIT, (summed,), **{COMM: across})
