"""insert_allreduce: one all-reduce (sum) per gradient.

Requires: scale_loss_grad, so that the sum over ranks is the mean gradient.
Produces: for each distinct gradient, in the order the backward pass produces
them, `all_reduce(grad, "sum")` on ring 0 right after the node that produces the
gradient, and its `wait_tensor` right before the gradient's first use; every use
of the gradient then reads the reduced value. Parameters without a gradient
(frozen, unused) get none; a tied parameter has one gradient and gets one. Both
nodes carry role COMM and meta["comm"]. With one rank it does not apply.
Order: before ring_round_robin, which spreads the collectives over the rings.
"""

from __future__ import annotations

import torch.fx as fx

from transpiler.collectives import ALL_REDUCE, WAIT
from transpiler.pipeline import PassContext, requires
from transpiler.program import CommInfo, Program, new_node
from transpiler.roles import COMM, PARAM, Role


def plan_allreduce(program: Program) -> list[fx.Node]:
    """The gradients to reduce, in the order they are produced; unused ones skipped."""
    return [g for g in program.grads.values() if g.users]


@requires("scale_loss_grad")
def insert_allreduce(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    graph = program.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    for grad in plan_allreduce(program):
        users = list(grad.users)
        val = grad.meta["val"]
        comm = CommInfo("all_reduce", ring=0, params=(grad.meta[PARAM],),
                        nbytes=val.nbytes)
        with graph.inserting_after(grad):
            reduced = new_node(graph, ALL_REDUCE, (grad, "sum", ctx.rings[0]), Role.COMM,
                               **{COMM: comm})
        with graph.inserting_before(min(users, key=position.__getitem__)):
            waited = new_node(graph, WAIT, (reduced,), Role.COMM, **{COMM: comm})
        for user in users:
            user.replace_input_with(grad, waited)
