"""schedule_comm: overlap communication with computation.

Requires: a pass that inserted collectives (insert_allreduce, coalesce_tensors).
Produces: the same nodes in a new order. Each collective, with the nodes that
pack its buffer (meta["bucket"], not COMM), moves up to right after the
last node it depends on (with ctx.find_unused not above the collective before
it: every rank issues them in the plan's order, though a rank's gradients are
ready in another order), so it is issued as soon as its gradients exist and runs
while the rest of the backward pass computes; each wait, with the nodes that
unpack its result, moves down to right before its first use. Values and
dependencies are unchanged, and the order is a function of the program alone.
Order: after the passes that insert collectives; ring_round_robin may run before
or after (it numbers collectives in program order, which this pass keeps).
"""

from __future__ import annotations

import torch.fx as fx

from transpiler.program.collectives import WAIT
from transpiler.lowering.context import PassContext, requires
from transpiler.program.program import Program
from transpiler.program.roles import BUCKET, COMM, ROLE, Role


def _bucket_chain(start: fx.Node, neighbours, comm_role: bool) -> list[fx.Node]:
    """`start` and the nodes of its bucket reached through `neighbours` that have
    role COMM or not as `comm_role` says (inputs, not COMM: the packing; users,
    COMM: the unpacking, which includes the later stages of a hierarchical
    reduction: they wait with the result, so only the first stage is issued
    early and nothing blocks in the middle of the backward pass)."""
    bucket = start.meta[COMM].bucket
    chain, todo = [], [start]
    while todo:
        node = todo.pop()
        chain.append(node)
        todo += [n for n in neighbours(node)
                 if bucket is not None and n.meta.get(BUCKET) == bucket
                 and bool(n.meta.get(ROLE, 0) & Role.COMM) == comm_role
                 and (comm_role or COMM not in n.meta) and n not in chain]
    return chain


@requires("insert_allreduce|coalesce_tensors|shard_optimizer|gather_grads")
def schedule_comm(program: Program, ctx: PassContext) -> None:
    # fx nodes compare by their place in the graph, kept current as they move.
    graph = program.graph
    previous = None
    for collective in program.collectives():
        pack = _bucket_chain(collective, lambda n: n.all_input_nodes, comm_role=False)
        for node in sorted(pack):
            if not node.all_input_nodes:
                continue
            anchor = max(node.all_input_nodes)
            if node is collective and previous is not None and ctx.find_unused:
                anchor = max(anchor, previous)   # issued in the plan's order
            if anchor.next is not node:
                anchor.append(node)
        previous = collective
    waits = [n for n in graph.nodes if n.op == "call_function" and n.target is WAIT and COMM in n.meta]
    for wait in waits:
        unpack = _bucket_chain(wait, lambda n: n.users, comm_role=True)
        for node in sorted(unpack, reverse=True):
            if not node.users:   # a result nothing reads (a step's unused gather): left where it is
                continue
            first_use = min(node.users)
            if node.next is not first_use:
                first_use.prepend(node)
