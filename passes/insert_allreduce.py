"""insert_allreduce: one all-reduce (sum) per value to reduce.

Requires: a pass that marked the values to sum over the ranks (meta["reduce"]):
scale_loss_grad (the gradients, scaled so that their sum is the mean) or
local_sgd (the parameter deltas).
Produces: for each marked value that something reads, in program order (for
gradients, the order the backward pass produces them), `all_reduce(value,
"sum")` on ring 0 right after the node that produces it, and its `wait_tensor`
right before its first use; every use then reads the reduced value. Parameters
without a gradient (frozen, unused) get none; a tied parameter has one gradient
and gets one. Both nodes carry role COMM and meta["comm"]. With one rank it does
not apply.
Order: before ring_round_robin, which spreads the collectives over the rings.
"""

from __future__ import annotations

import torch.fx as fx

from transpiler.collectives import ALL_REDUCE, WAIT
from transpiler.pipeline import PassContext, requires
from transpiler.program import CommInfo, Program, new_node
from transpiler.roles import COMM, REDUCE, Role


def plan_allreduce(program: Program) -> list[fx.Node]:
    """The values to reduce, in the order they are produced; unread ones skipped."""
    return list(program.to_reduce().values())


@requires("scale_loss_grad|local_sgd")
def insert_allreduce(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    graph = program.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    for value in plan_allreduce(program):
        users = list(value.users)
        comm = CommInfo("all_reduce", ring=0, params=(value.meta[REDUCE],),
                        nbytes=value.meta["val"].nbytes)
        with graph.inserting_after(value):
            reduced = new_node(graph, ALL_REDUCE, (value, "sum", ctx.rings[0]), Role.COMM,
                               **{COMM: comm})
        with graph.inserting_before(min(users, key=position.__getitem__)):
            waited = new_node(graph, WAIT, (reduced,), Role.COMM, **{COMM: comm})
        for user in users:
            user.replace_input_with(value, waited)
