"""broadcast_buffers: every step starts from rank 0's buffers, as under DDP's
default broadcast_buffers=True (forward_sync_buffers), which broadcasts the
module's buffers from rank 0 before each forward through its wrapper, and so
does every forward between steps (an evaluation with the module itself): each
step ends by broadcasting the buffers it wrote from rank 0, so that every rank
holds rank 0's buffers between steps, as DDP's next forward would see them.

Requires nothing.
Produces: the buffers the program both reads and writes (BatchNorm's running
statistics and batch count) of the modules DDP would wrap (those with a
parameter the program computes a gradient for; not an EMA of the model, nor a
target network, whose buffers stay each rank's own as beside a DDP-wrapped
model): their new values, in input order, planned into
buckets by dtype as coalesce_tensors plans gradients (plan_buckets, every
bucket capped at ctx.bucket_mb), each bucket packed into one flat buffer in its
own dtype, `broadcast(src=0)` over the buffers' group (ctx.over: the world) on
ring 0 and waited for, then split into views that the program outputs in
their place. Placed before the output node (schedule_comm moves each up to
where its values are computed: the forward). Every node has role COMM. With
one rank it does not apply. The first step starts from rank 0's buffers
through the startup program (broadcast_params).

Inside the step, where a DDP wrapper would broadcast too (a forward of a
module after one of its forwards with grad enabled and an optimizer step: a
validation forward after the update), capture marked each of the module's
buffers with a copy of itself (BUFFER_SYNC, capture/buffer_sync.py): the
copies of each point are broadcast there from rank 0 the same way, bucket by
bucket, and later reads see the received values.

Buffers the program never writes (a causal mask, a frozen table) are skipped:
the startup program broadcast them once and no program changes them, so every
rank holds rank 0's value at every step and a broadcast would copy each rank's
value onto itself. (Only host code that writes a buffer in place on some
ranks between steps would tell the difference; DDP would overwrite that edit
with rank 0's value at its next forward.) A buffer the program writes but
never reads needs nothing either: its old value does not matter.
Order: before ring_round_robin, which spreads the collectives over the rings.
The modes whose ranks hold one model (grad_allreduce, fuse_all_reduce, zero,
all_gather, local_sgd's warm-up) run it; those whose ranks train their own
replicas between averages (local_sgd's local and sync steps, decentralized)
do not; transpile(broadcast_buffers=False) drops it, as DDP's option does.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from passes.coalesce_tensors import MB, GradInfo, pack, plan_buckets, unpack
from transpiler.program.collectives import BROADCAST, WAIT
from transpiler.lowering.context import PassContext
from transpiler.program.program import CommInfo, InputKind, OutputKind, Program, new_node
from transpiler.program.roles import BUFFER_SYNC, COMM, INPUT, Role

aten = torch.ops.aten


def wrapped(program: Program) -> set[int | None]:
    """The step's modules whose buffers DDP would broadcast: those holding a
    parameter whose gradient the program reduces (the modules a DDP wrapper
    holds). Another module the step is given (an EMA of the model, a target
    network updated from it) keeps each rank's own buffers, as it does beside
    a DDP-wrapped model. A program that reduces no gradient (a call that
    accumulates, run as under no_sync; a forward without grad) has none: after
    such a forward DDP's next forward does not broadcast either."""
    graded = program.grads
    return {s.module for s in program.inputs if s.kind is InputKind.PARAM and s.name in graded}


def plan_broadcast(program: Program, ctx: PassContext) -> list[list[tuple[str, int]]]:
    """The buffers to broadcast as (name, index of the output holding the
    value the step leaves), in buckets (each of one dtype and group), in input
    order of their first buffer."""
    owners = wrapped(program)
    read = {n.meta[INPUT].name for n in program.updated_inputs(InputKind.BUFFER)
            if n.users and n.meta[INPUT].module in owners}
    written = {spec.target: k for k, spec in enumerate(program.outputs)
               if spec.kind is OutputKind.UPDATE and spec.target in read}
    values = program.output_node.args[0]
    names = [n.meta[INPUT].name for n in program.placeholders if n.meta[INPUT].name in written]
    cap = int(ctx.bucket_mb * MB)
    infos = [GradInfo(name, values[written[name]].meta["val"].dtype,
                      values[written[name]].meta["val"].nbytes, over=ctx.over(name))
             for name in names]
    return [[(name, written[name]) for name in bucket]
            for bucket in plan_buckets(infos, cap, cap)]


def broadcast_buffers(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    graph, out = program.graph, program.output_node
    for point in plan_sync_points(program, ctx):
        sent = [node.args[1] for node in point]
        names = [node.meta[BUFFER_SYNC][1] for node in point]
        with graph.inserting_before(point[0]):
            views = _broadcast(graph, sent, names, ctx)
        for node, view in zip(point, views):
            node.replace_all_uses_with(view)
            graph.erase_node(node)
    values = list(out.args[0])
    for bucket in plan_broadcast(program, ctx):
        with graph.inserting_before(out):
            views = _broadcast(graph, [values[k] for _, k in bucket],
                               [name for name, _ in bucket], ctx)
        for (_, k), view in zip(bucket, views):
            values[k] = view
    out.args = (tuple(values),)


def plan_sync_points(program: Program, ctx: PassContext) -> list[list[fx.Node]]:
    """The copies marked BUFFER_SYNC (capture/buffer_sync.py) of the wrapped
    modules' buffers (those of another module stay copies), one list per
    bucket of a point: by point, then as plan_buckets puts the buffers of one
    dtype and group together, in the order the trace wrote them."""
    owners = wrapped(program)
    module = {spec.name: spec.module for spec in program.inputs}
    points: dict[int, list[fx.Node]] = {}
    for node in program.graph.nodes:
        if BUFFER_SYNC in node.meta and module[node.meta[BUFFER_SYNC][1]] in owners:
            points.setdefault(node.meta[BUFFER_SYNC][0], []).append(node)
    cap = int(ctx.bucket_mb * MB)
    buckets = []
    for _, nodes in sorted(points.items()):
        by_name = {node.meta[BUFFER_SYNC][1]: node for node in nodes}
        infos = [GradInfo(name, node.meta["val"].dtype, node.meta["val"].nbytes,
                          over=ctx.over(name)) for name, node in by_name.items()]
        buckets += [[by_name[name] for name in bucket] for bucket in plan_buckets(infos, cap, cap)]
    return buckets


def _broadcast(graph: fx.Graph, sent: list[fx.Node], names: list[str],
               ctx: PassContext) -> list[fx.Node]:
    """Rank 0's values of `sent` (one dtype, one group), packed into one
    buffer and broadcast: a view of the received buffer for each."""
    over = ctx.over(names[0])
    dtype = sent[0].meta["val"].dtype
    # One buffer is sent through an alias: a collective never reads a value
    # that is also an output as it is.
    flat = pack(graph, sent, dtype, Role.COMM) if len(sent) > 1 else \
        new_node(graph, aten.alias.default, (sent[0],), Role.COMM)
    comm = CommInfo("broadcast", ring=0, over=over, nbytes=flat.meta["val"].nbytes,
                    params=tuple(names))
    # src is the rank within the group
    issued = new_node(graph, BROADCAST, (flat, 0, ctx.mesh.ring(over)), Role.COMM, **{COMM: comm})
    received = new_node(graph, WAIT, (issued,), Role.COMM, **{COMM: comm})
    return unpack(graph, received, sent) if len(sent) > 1 else [received]
