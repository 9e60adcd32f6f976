"""mix_params: average each parameter with this step's group of a decentralized
topology before the optimizer updates it (Decent-DP's gossip step).

Requires: ctx.gossip, the mixing of the program being built (the decentralized
schedule sets it per program: transpiler/schedule.py, transpiler/topology.py).
Produces, for every parameter p the step updates (an UPDATE output of a PARAM
input), where x is p as the step starts and S the sum of x over the group:

    s = alias(x) at the start of the program, marked reduce=<p> (SUM over ctx.gossip.over)
    m = a * x + b * S      (the group's mean S / |R| when the topology gives no weight)

placed before the first node of the update (role OPTIMIZE) that reads x; every
such node, and p's UPDATE output where it is x itself, reads m instead. So the
forward and backward passes and the gradient processing before
optimizer.step() run at x, and the optimizer updates the mixed parameters with
this rank's own gradient. Buffers and optimizer state are not mixed. New nodes
have role OPTIMIZE. The sums are left to a reduction pass (coalesce_tensors),
which must run after this one; schedule_comm then issues them as the program
starts, so the communication overlaps the forward and backward passes. With one
rank it does not apply.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from transpiler.collectives import Reduction
from transpiler.pipeline import Mark, PassContext, produces
from transpiler.program import InputKind, OutputKind, Program, new_node
from transpiler.roles import INPUT, REDUCE, ROLE, Role

aten = torch.ops.aten


def mixed_parameters(program: Program) -> list[fx.Node]:
    """The placeholders of the parameters the step updates, in input order."""
    updated = {spec.target for spec in program.outputs if spec.kind is OutputKind.UPDATE}
    return [n for n in program.placeholders
            if n.meta[INPUT].kind is InputKind.PARAM and n.meta[INPUT].name in updated]


@produces(Mark.TO_REDUCE)
def mix_params(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    if ctx.gossip is None:
        raise ValueError("mix_params needs the topology's mixing of this program "
                         "(transpile(..., mode='decentralized', topology=...))")
    graph, out = program.graph, program.output_node
    params = mixed_parameters(program)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        sums = {p: new_node(graph, aten.alias.default, (p,), Role.OPTIMIZE,
                            **{REDUCE: Reduction(p.meta[INPUT].name, over=ctx.gossip.over)})
                for p in params}
    values = list(out.args[0])
    updates = {spec.target: i for i, spec in enumerate(program.outputs)
               if spec.kind is OutputKind.UPDATE}
    position = {n: i for i, n in enumerate(graph.nodes)}
    for p in params:
        readers = [n for n in p.users if n.meta.get(ROLE, 0) & Role.OPTIMIZE and n is not sums[p]]
        before = min(readers, key=position.__getitem__) if readers else out
        with graph.inserting_before(before):
            mixed = _mix(graph, p, sums[p], ctx)
        for reader in readers:
            reader.replace_input_with(p, mixed)
        i = updates[p.meta[INPUT].name]
        if values[i] is p:
            values[i] = mixed
    out.args = (tuple(values),)


def _mix(graph: fx.Graph, x: fx.Node, total: fx.Node, ctx: PassContext) -> fx.Node:
    def node(target, args):
        return new_node(graph, target, args, Role.OPTIMIZE)

    if ctx.gossip.coefficients is None:
        return node(aten.div.Tensor, (total, ctx.gossip.over.size))
    a, b = ctx.gossip.coefficients
    mixed = node(aten.mul.Tensor, (total, float(b)))
    return mixed if a == 0 else node(aten.add.Tensor, (node(aten.mul.Tensor, (x, float(a))), mixed))

