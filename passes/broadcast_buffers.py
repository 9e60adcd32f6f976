"""broadcast_buffers: every step starts from rank 0's buffers, as under DDP's
default broadcast_buffers=True (forward_sync_buffers), which broadcasts the
module's buffers from rank 0 before the forward.

Requires nothing.
Produces: the buffers the program both reads and writes (BatchNorm's running
statistics and batch count), in input order, planned into buckets by dtype as
coalesce_tensors plans gradients (plan_buckets, every bucket capped at
ctx.bucket_mb), each bucket packed into one flat buffer in its own dtype,
`broadcast(src=0)` over the buffers' group (ctx.over: the world) on ring 0 and
waited for, then split into views that every former reader of a buffer reads.
Placed right after the placeholders, before the forward. Every node has role
COMM. With one rank it does not apply.

Buffers the program never writes (a causal mask, a frozen table) are skipped:
the startup program broadcast them once (broadcast_params) and no program
changes them, so every rank holds rank 0's value at every step and a broadcast
would copy each rank's value onto itself. (Only host code that writes such a
buffer in place on some ranks between steps would tell the difference; DDP
would overwrite that edit with rank 0's value.) A buffer the program writes but
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
from transpiler.collectives import BROADCAST, WAIT
from transpiler.pipeline import PassContext
from transpiler.program import CommInfo, InputKind, Program, new_node
from transpiler.roles import COMM, INPUT, Role

aten = torch.ops.aten


def plan_broadcast(program: Program, ctx: PassContext) -> list[list[fx.Node]]:
    """The buffer placeholders to broadcast, in buckets (each of one dtype and
    group), in input order of their first buffer."""
    buffers = [n for n in program.updated_inputs(InputKind.BUFFER) if n.users]
    by_name = {n.meta[INPUT].name: n for n in buffers}
    cap = int(ctx.bucket_mb * MB)
    infos = [GradInfo(name, n.meta["val"].dtype, n.meta["val"].nbytes, over=ctx.over(name))
             for name, n in by_name.items()]
    return [[by_name[name] for name in bucket] for bucket in plan_buckets(infos, cap, cap)]


def broadcast_buffers(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    graph = program.graph
    first_use = program.placeholders[-1].next
    for buffers in plan_broadcast(program, ctx):
        users = {b: list(b.users) for b in buffers}
        over = ctx.over(buffers[0].meta[INPUT].name)
        dtype = buffers[0].meta["val"].dtype
        with graph.inserting_before(first_use):
            # One buffer is sent as is, through an alias: a collective that read a
            # placeholder would be moved among the placeholders (schedule_comm).
            flat = pack(graph, buffers, dtype, Role.COMM) if len(buffers) > 1 else \
                new_node(graph, aten.alias.default, (buffers[0],), Role.COMM)
            comm = CommInfo("broadcast", ring=0, over=over, nbytes=flat.meta["val"].nbytes,
                            params=tuple(b.meta[INPUT].name for b in buffers))
            # src is the rank within the group
            sent = new_node(graph, BROADCAST, (flat, 0, ctx.mesh.ring(over)), Role.COMM,
                            **{COMM: comm})
            received = new_node(graph, WAIT, (sent,), Role.COMM, **{COMM: comm})
            views = unpack(graph, received, buffers) if len(buffers) > 1 else [received]
        for buffer, view in zip(buffers, views):
            for user in users[buffer]:
                user.replace_input_with(buffer, view)
