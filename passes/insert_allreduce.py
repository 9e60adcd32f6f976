"""insert_allreduce: one all-reduce per value to reduce.

Requires: a pass that marked the values to reduce over the ranks
(meta["reduce"], a Reduction): average_grads (the gradients, MEAN) or local_sgd
(the parameter deltas, SUM).
Produces: for each marked value that something reads, in program order (for
gradients, the order the backward pass produces them), right after the node
that produces it, `mul(value, 1 / world_size)` for a MEAN (role of the value)
and `all_reduce(., "sum")` on ring 0, and its `wait_tensor` right before its
first use; every use then reads the reduced value. Parameters without a
gradient (frozen, unused) get none; a tied parameter has one gradient and gets
one. The all-reduce and its wait carry role COMM and meta["comm"]. With one
rank it does not apply.
Order: before ring_round_robin, which spreads the collectives over the rings.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from transpiler.collectives import ALL_REDUCE, WAIT, ReduceOp
from transpiler.pipeline import PassContext, requires
from transpiler.program import CommInfo, Program, new_node
from transpiler.roles import COMM, REDUCE, ROLE, Role

aten = torch.ops.aten


def plan_allreduce(program: Program) -> list[fx.Node]:
    """The values to reduce, in the order they are produced; unread ones skipped."""
    return list(program.to_reduce().values())


@requires("average_grads|local_sgd")
def insert_allreduce(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    graph = program.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    for value in plan_allreduce(program):
        users = list(value.users)
        reduction = value.meta[REDUCE]
        comm = CommInfo("all_reduce", ring=0, params=(reduction.key,),
                        nbytes=value.meta["val"].nbytes)
        sent = value
        if reduction.op is ReduceOp.MEAN:
            with graph.inserting_after(value):
                sent = new_node(graph, aten.mul.Tensor, (value, 1 / ctx.world_size),
                                value.meta[ROLE])
        with graph.inserting_after(sent):
            reduced = new_node(graph, ALL_REDUCE, (sent, "sum", ctx.rings[0]), Role.COMM,
                               **{COMM: comm})
        with graph.inserting_before(min(users, key=position.__getitem__)):
            waited = new_node(graph, WAIT, (reduced,), Role.COMM, **{COMM: comm})
        for user in users:
            user.replace_input_with(value, waited)
