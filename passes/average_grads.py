"""average_grads: declare that every gradient is averaged over the ranks.

Requires: a captured program. Its gradients are the nodes marked
meta["param"] at capture: each parameter's .grad as the backward passes leave
it (summed over every backward() of the step), where the last backward()
before optimizer.step() ends; and the gradients each earlier backward() leaves
(meta["grad_at"]).
Produces: on each gradient, meta["reduce"] = Reduction(<param>, MEAN, over) with
`over` the parameter's group (ctx.over: the world unless transpile(reduce_groups=...)
names one). Where the step reads the gradients of an earlier backward() other
than by accumulating into them (SAM; transpiler/program/averaging.py), each gradient
it leaves is marked too, Reduction("<param>@<backward>", MEAN, over,
point=<backward>): averaged where that backward() ends, as DDP does at every
backward() outside no_sync; what reads it then (the next backward()'s
accumulation included) reads the average. A reduction pass (insert_allreduce, coalesce_tensors) lowers it:
the gradient times 1 / group size, summed over the group, which is how DDP's
reducer averages, so the result rounds as DDP's does; everything that reads the
gradient after the backward pass (clipping, unscaling, the optimizer) then
reads the average. Parameters without a gradient (frozen, unused) get none.
With one rank it does not apply and the program is unchanged.
Order: before the passes that reduce (insert_allreduce, coalesce_tensors).
"""

from __future__ import annotations

from transpiler.program.averaging import early_averages
from transpiler.program.collectives import ReduceOp, Reduction
from transpiler.lowering.context import Mark, PassContext, produces
from transpiler.program.program import Program
from transpiler.program.roles import GRAD_AT, REDUCE


@produces(Mark.TO_REDUCE)
def average_grads(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    for param, grad in program.grads.items():
        grad.meta[REDUCE] = Reduction(param, ReduceOp.MEAN, ctx.over(param))
    for backward, grads in early_averages(program).items():
        for grad in grads:
            param = grad.meta[GRAD_AT].param
            grad.meta[REDUCE] = Reduction(f"{param}@{backward}", ReduceOp.MEAN, ctx.over(param),
                                          point=backward)
