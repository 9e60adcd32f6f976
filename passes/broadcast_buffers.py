"""broadcast_buffers: every step starts from rank 0's buffers, as under DDP's
default broadcast_buffers=True (forward_sync_buffers), which broadcasts the
module's buffers from rank 0 before each forward through its wrapper, and so
does every forward between steps (an evaluation with the module itself): each
step ends by broadcasting the buffers it wrote from rank 0, so that every rank
holds rank 0's buffers between steps, as DDP's next forward would see them.

Requires nothing.
Produces: the buffers the program both reads and writes (BatchNorm's running
statistics and batch count): their new values, in input order, planned into
buckets by dtype as coalesce_tensors plans gradients (plan_buckets, every
bucket capped at ctx.bucket_mb), each bucket packed into one flat buffer in its
own dtype, `broadcast(src=0)` over the buffers' group (ctx.over: the world) on
ring 0 and waited for, then split into views that the program outputs in
their place. Placed before the output node (schedule_comm moves each up to
where its values are computed: the forward). Every node has role COMM. With
one rank it does not apply. The first step starts from rank 0's buffers
through the startup program (broadcast_params).

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

from passes.coalesce_tensors import MB, GradInfo, pack, plan_buckets, unpack
from transpiler.program.collectives import BROADCAST, WAIT
from transpiler.lowering.context import PassContext
from transpiler.program.program import CommInfo, InputKind, OutputKind, Program, new_node
from transpiler.program.roles import COMM, INPUT, Role

aten = torch.ops.aten


def plan_broadcast(program: Program, ctx: PassContext) -> list[list[tuple[str, int]]]:
    """The buffers to broadcast as (name, index of the output holding the
    value the step leaves), in buckets (each of one dtype and group), in input
    order of their first buffer."""
    read = {n.meta[INPUT].name for n in program.updated_inputs(InputKind.BUFFER) if n.users}
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
    values = list(out.args[0])
    for bucket in plan_broadcast(program, ctx):
        written = [values[k] for _, k in bucket]
        over = ctx.over(bucket[0][0])
        dtype = written[0].meta["val"].dtype
        with graph.inserting_before(out):
            # One buffer is sent through an alias: a collective never reads a
            # value that is also an output as it is.
            flat = pack(graph, written, dtype, Role.COMM) if len(written) > 1 else \
                new_node(graph, aten.alias.default, (written[0],), Role.COMM)
            comm = CommInfo("broadcast", ring=0, over=over, nbytes=flat.meta["val"].nbytes,
                            params=tuple(name for name, _ in bucket))
            # src is the rank within the group
            sent = new_node(graph, BROADCAST, (flat, 0, ctx.mesh.ring(over)), Role.COMM,
                            **{COMM: comm})
            received = new_node(graph, WAIT, (sent,), Role.COMM, **{COMM: comm})
            views = unpack(graph, received, written) if len(written) > 1 else [received]
        for (_, k), view in zip(bucket, views):
            values[k] = view
    out.args = (tuple(values),)
