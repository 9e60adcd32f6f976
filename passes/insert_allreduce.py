"""insert_allreduce: one reduction per value to reduce.

Requires: a pass that marked the values to reduce (meta["reduce"], a
Reduction): average_grads (the gradients, MEAN) or local_sgd (the parameter
deltas, SUM).
Produces: for each marked value that something reads, in program order (for
gradients, the order the backward pass produces them; with ctx.find_unused in
reverse order of the parameters, each issued not before the one before it, an
order every rank has), the reduction lowered by
transpiler/lowering/reductions.py: issued right after the node that produces the value
(for a MEAN, `mul(value, 1 / group size)` with the value's role, then
`all_reduce(., "sum")` over its group on ring 0; hierarchical over several
nodes: a reduce-scatter inside the node), completed right before its first use
(the wait; hierarchical: then the all-reduce across nodes and the all-gather
inside the node). Every use then reads the reduced value, but those of the
backward() that produced it (program/averaging.py GradientReads), as under
DDP. Parameters without a gradient (frozen, unused) get none; a tied parameter
has one gradient and gets one. Collectives and waits carry role COMM and meta["comm"]. Every mark is
removed. With one rank it does not apply.
Order: before ring_round_robin, which spreads the collectives over the rings.
"""

from __future__ import annotations

import torch.fx as fx

from transpiler.lowering import reductions as lowering
from transpiler.lowering.context import Mark, PassContext, consumes
from transpiler.program.averaging import GradientReads
from transpiler.program.program import CommInfo, Program
from transpiler.program.roles import REDUCE, ROLE


def plan_allreduce(program: Program, by_parameters: bool = False) -> list[fx.Node]:
    """The values to reduce, in the order they are produced (by_parameters: in
    reverse order of the parameters); unread ones skipped."""
    return list(program.to_reduce(by_parameters).values())


@consumes(Mark.TO_REDUCE)
def insert_allreduce(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    graph = program.graph
    reads = GradientReads(program)
    previous = None
    for value in plan_allreduce(program, ctx.find_unused):
        reduction = value.meta[REDUCE]
        users = [u for u in value.users if reads.average(u, reduction.point)]
        comm = CommInfo("all_reduce", ring=0, params=(reduction.key,),
                        nbytes=value.meta["val"].nbytes)
        # not before the collective before it: the plan's order is every rank's
        after = value if previous is None or value > previous else previous
        with graph.inserting_before(after.next):
            issued = lowering.issue(graph, value, reduction, ctx, comm, value.meta[ROLE])
        previous = issued.collective
        with graph.inserting_before(max(min(users, default=previous.next), previous.next)):
            reduced = lowering.complete(graph, issued, ctx)
        for user in users:
            user.replace_input_with(value, reduced)
    lowering.forget_marks(graph)
