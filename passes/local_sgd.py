"""local_sgd: average the parameters over the ranks (Paddle's LocalSGD).

Builds the sync program of mode local_sgd, which ends each period of k local
steps (the schedule in transpiler/schedule.py picks it on the host).
Requires: snapshot_params.
Produces, before the output, for every parameter p with a snapshot s, where
p_new is the step's own new value of p:

    delta = s - p_new                      marked reduce=<p>
    p_avg = s - delta / world_size         (delta read after the reduction: the sum)
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

from transpiler.collectives import Reduction
from transpiler.pipeline import PassContext, requires
from transpiler.program import OutputSpec, Program, new_node
from transpiler.roles import REDUCE, ROLE, Role
from transpiler.schedule import LR, MEAN_LOSS

from .snapshot_params import snapshot_name, snapshots

aten = torch.ops.aten
LOSS = Role.FORWARD | Role.LOSS


@requires("snapshot_params")
def local_sgd(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    graph, out = program.graph, program.output_node
    values = list(out.args[0])
    kinds = {spec.name: spec.kind for spec in program.inputs}
    held = []

    def node(target, args, **meta):
        return new_node(graph, target, args, Role.OPTIMIZE, **meta)

    # First every value to sum over the ranks (per parameter its delta, per
    # floating-point buffer its new value, the loss for adaptive k), then what
    # reads the sums: a reduction pass issues a bucket after its last value.
    snaps = snapshots(program)
    summed: dict[int, fx.Node] = {}   # output index -> the node marked reduce
    with graph.inserting_before(out):
        for i, spec in enumerate(program.outputs):
            if spec.kind != "update":
                continue
            if spec.target in snaps:
                summed[i] = node(aten.sub.Tensor, (snaps[spec.target], values[i]),
                                 **{REDUCE: Reduction(spec.target)})
            elif kinds[spec.target] == "buffer" and values[i].meta["val"].is_floating_point():
                summed[i] = node(aten.clone.default, (values[i],), **{REDUCE: Reduction(spec.target)})
        loss = node(aten.clone.default, (_loss(program),), **{REDUCE: Reduction("loss")}) \
            if ctx.adaptive_k else None
        for i, total in summed.items():
            target = program.outputs[i].target
            values[i] = node(aten.div.Tensor, (total, ctx.world_size))
            if target in snaps:   # p_avg = s - sum(delta) / world_size
                values[i] = node(aten.sub.Tensor, (snaps[target], values[i]))
                held.append((snapshot_name(target), values[i]))
        if loss is not None:
            held += [(MEAN_LOSS, node(aten.div.Tensor, (loss, ctx.world_size))),
                     (LR, _learning_rate(program))]
    out.args = (tuple(values),)
    for name, value in held:
        spec = OutputSpec("update" if name in kinds else "held", name)
        program.add_output(spec, value)


def _loss(program: Program) -> fx.Node:
    losses = [n for n in program.graph.nodes if n.meta.get(ROLE) == LOSS]
    if not losses:
        raise ValueError("adaptive local SGD needs the loss: the program has no node with "
                         "role FORWARD|LOSS")
    return losses[-1]


def _learning_rate(program: Program) -> fx.Node:
    for spec in program.inputs:
        if spec.kind == "hyper" and spec.name.rsplit(".", 1)[-1] == "lr[0]":
            return program.input_node(spec.name)
    raise ValueError("adaptive local SGD needs the learning rate as a program input; the "
                     "optimizer's lr is baked into the program (only SGD, Adam and AdamW "
                     "lift it): use one of them or adaptive=False")
