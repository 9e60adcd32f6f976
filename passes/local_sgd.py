"""local_sgd: average the parameters over the ranks (Paddle's LocalSGD).

Builds the sync program of mode local_sgd, which ends each period of k local
steps (the schedule in transpiler/runtime/schedule.py picks it on the host).
Requires: snapshot_params.
Produces, before the output, for every parameter p with a snapshot s, where
p_new is the step's own new value of p:

    delta = s - p_new                      marked reduce=<p> over p's group (ctx.over)
    p_avg = s - delta / group size         (delta read after the reduction: the sum)
    outputs  p := p_avg,  s := p_avg

Every floating-point buffer the step updates (BatchNorm statistics) becomes the
mean of its new values (a copy marked reduce, divided by world_size). With
ctx.adaptive_k the loss, likewise averaged, and the learning rate become held
outputs the schedule reads to choose the next k. New nodes have role OPTIMIZE.
The sums themselves are left to a reduction pass (coalesce_tensors or
insert_allreduce), which must run after this one. With one rank it does not apply.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from transpiler.program.collectives import Reduction
from transpiler.lowering.context import Mark, PassContext, produces, requires
from transpiler.program.program import Held, InputKind, OutputKind, OutputSpec, Program, new_node
from transpiler.program.roles import INPUT, REDUCE, ROLE, Role

from .snapshot_params import snapshots

aten = torch.ops.aten
LOSS = Role.FORWARD | Role.LOSS


@requires("snapshot_params")
@produces(Mark.TO_REDUCE)
def local_sgd(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    graph, out = program.graph, program.output_node
    values = list(out.args[0])
    kinds = {spec.name: spec.kind for spec in program.inputs}
    held: list[tuple[OutputSpec, fx.Node]] = []

    def node(target, args, **meta):
        return new_node(graph, target, args, Role.OPTIMIZE, **meta)

    # First every value to sum over the ranks (per parameter its delta, per
    # floating-point buffer its new value, the loss for adaptive k), then what
    # reads the sums: a reduction pass issues a bucket after its last value.
    snaps = snapshots(program)
    summed: dict[int, fx.Node] = {}   # output index -> the node marked reduce
    with graph.inserting_before(out):
        for i, spec in enumerate(program.outputs):
            if spec.kind is not OutputKind.UPDATE:
                continue
            if spec.target in snaps:
                summed[i] = node(aten.sub.Tensor, (snaps[spec.target], values[i]),
                                 **{REDUCE: Reduction(spec.target, over=ctx.over(spec.target))})
            elif (kinds[spec.target] is InputKind.BUFFER
                  and values[i].meta["val"].is_floating_point()):
                summed[i] = node(aten.clone.default, (values[i],), **{REDUCE: Reduction(spec.target)})
        loss = node(aten.clone.default, (_loss(program),), **{REDUCE: Reduction("loss")}) \
            if ctx.adaptive_k else None
        for i, total in summed.items():
            target = program.outputs[i].target
            values[i] = node(aten.div.Tensor, (total, ctx.mesh.size(total.meta[REDUCE].over)))
            if target in snaps:   # p_avg = s - sum(delta) / group size
                values[i] = node(aten.sub.Tensor, (snaps[target], values[i]))
                snapshot = snaps[target].meta[INPUT].name
                held.append((OutputSpec(OutputKind.UPDATE, snapshot), values[i]))
        if loss is not None:
            held += [(OutputSpec.of_held(Held.MEAN_LOSS),
                      node(aten.div.Tensor, (loss, ctx.world_size))),
                     (OutputSpec.of_held(Held.LR), _learning_rate(program))]
    out.args = (tuple(values),)
    for spec, value in held:
        program.add_output(spec, value)


def _loss(program: Program) -> fx.Node:
    losses = [n for n in program.graph.nodes if n.meta.get(ROLE) == LOSS]
    if not losses:
        raise ValueError("adaptive local SGD needs the loss: the program has no node with "
                         "role FORWARD|LOSS")
    return losses[-1]


def _learning_rate(program: Program) -> fx.Node:
    """The learning rate of the first param group (of the first optimizer that lifts it)."""
    for node in program.placeholders:
        hyper = node.meta[INPUT].hyper
        if hyper is not None and hyper.key == "lr" and hyper.group == 0:
            return node
    raise ValueError("adaptive local SGD needs the learning rate as a program input; the "
                     "optimizer's lr is baked into the program (only SGD, Adam and AdamW "
                     "lift it): use one of them or adaptive=False")
