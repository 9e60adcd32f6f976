"""mix_params: average each parameter with this step's group of a decentralized
topology before the optimizer updates it (Decent-DP's gossip step).

Requires: ctx.gossip, the mixing of the program being built (the decentralized
schedule sets it per program: transpiler/runtime/schedule.py, transpiler/lowering/topology.py);
a step with one update (a backward() after an optimizer's step is refused).
Produces, for every parameter p the step updates (an UPDATE output of a PARAM
input), where x is p as the step starts and S the sum of x over the group:

    s = alias(x) at the start of the program, marked reduce=<p> over ctx.gossip.over:
        MEAN where the mixing is the group's plain mean (no weight, or w = 1/|R|:
        each x times 1/|R|, then summed, one multiply per bucket), else SUM
    m = s (the mean) or a * x + b * S

then, before the first node of the update (role OPTIMIZE) that reads any x,
one `_foreach_copy` of every m into its parameter's layout (eager runs it in
place: the mixed values land in the parameters, which the update then updates
in place); every such node, and p's UPDATE output where it is x itself, reads
the copy instead of x. So the forward and backward passes and the gradient
processing before optimizer.step() run at x, and the optimizer updates the
mixed parameters with this rank's own gradient. Buffers and optimizer state
are not mixed. New nodes have role OPTIMIZE. The sums are left to a reduction
pass (coalesce_tensors), which must run after this one; schedule_comm then
issues them as the program starts, so the communication overlaps the forward
and backward passes. With one rank it does not apply.
"""

from __future__ import annotations

import operator
from fractions import Fraction

import torch
import torch.fx as fx

from transpiler.program.averaging import refuse_backward_after_update
from transpiler.program.collectives import Reduction, ReduceOp
from transpiler.lowering.context import Mark, PassContext, produces
from transpiler.program.program import InputKind, OutputKind, Program, new_node
from transpiler.program.roles import INPUT, REDUCE, ROLE, Role

aten = torch.ops.aten


@produces(Mark.TO_REDUCE)
def mix_params(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    if ctx.gossip is None:
        raise ValueError("mix_params needs the topology's mixing of this program "
                         "(transpile(..., mode='decentralized', topology=...))")
    refuse_backward_after_update(program, "mix_params mixes the parameters before the update")
    graph, out = program.graph, program.output_node
    params = program.updated_inputs(InputKind.PARAM)
    if not params:
        return
    mean = _is_mean(ctx)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        sums = [new_node(graph, aten.alias.default, (p,), Role.OPTIMIZE, **{REDUCE: Reduction(
            p.meta[INPUT].name, ReduceOp.MEAN if mean else ReduceOp.SUM, ctx.gossip.over)})
            for p in params]
    position = {n: i for i, n in enumerate(graph.nodes)}
    marked = set(sums)
    readers = {p: [n for n in p.users if n.meta.get(ROLE, 0) & Role.OPTIMIZE and n not in marked]
               for p in params}
    before = min((r for rs in readers.values() for r in rs), key=position.__getitem__, default=out)
    with graph.inserting_before(before):
        mixed = sums if mean else [_mix(graph, p, s, ctx) for p, s in zip(params, sums)]
        copied = new_node(graph, aten._foreach_copy.default, (params, mixed), Role.OPTIMIZE)
        mixed = [new_node(graph, operator.getitem, (copied, i), Role.OPTIMIZE)
                 for i in range(len(params))]
    values = list(out.args[0])
    updates = {spec.target: i for i, spec in enumerate(program.outputs)
               if spec.kind is OutputKind.UPDATE}
    for p, m in zip(params, mixed):
        for reader in readers[p]:
            reader.replace_input_with(p, m)
        i = updates[p.meta[INPUT].name]
        if values[i] is p:
            values[i] = m
    out.args = (tuple(values),)


def _is_mean(ctx: PassContext) -> bool:
    """Whether this rank's mixing is its group's plain mean."""
    coefficients = ctx.gossip.coefficients
    return coefficients is None or coefficients == (0, Fraction(1, ctx.gossip.over.size))


def _mix(graph: fx.Graph, x: fx.Node, total: fx.Node, ctx: PassContext) -> fx.Node:
    """a * x + b * total (b * total where a is 0)."""
    def node(target, args):
        return new_node(graph, target, args, Role.OPTIMIZE)

    a, b = ctx.gossip.coefficients
    mixed = node(aten.mul.Tensor, (total, float(b)))
    return mixed if a == 0 else node(aten.add.Tensor, (node(aten.mul.Tensor, (x, float(a))), mixed))
