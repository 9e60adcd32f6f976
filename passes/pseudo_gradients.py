"""pseudo_gradients: DiLoCo's averaged pseudo-gradients of one fragment.

Builds the sync programs of mode diloco (the schedule, transpiler/runtime/schedule.py
DiLoCo, picks one every sync_every / fragments steps and takes the outer
optimizer's step on the host with what it outputs).
Requires: snapshot_params; a step with one update (a backward() after an
optimizer's step is refused).
Produces, before the output, for every parameter p with a snapshot s of
fragment ctx.fragment (index f of F: the updated parameters in input order,
grouped by the module that owns them, cut into F contiguous runs of about
equal bytes: fragment_of), where p_new is the step's own new value of p:

    delta = s - p_new                      marked reduce=<p> over p's group (ctx.over)
    held output Held.PSEUDO_GRAD of p := delta / group size   (delta read after the reduction)

The parameters' own outputs stay p_new: the outer step writes them on the host.
New nodes have role OPTIMIZE. The sums are left to a reduction pass
(coalesce_tensors or insert_allreduce), which must run after this one; with one
rank nothing is marked and the pseudo-gradient is the delta itself.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from transpiler.program.averaging import refuse_backward_after_update
from transpiler.program.collectives import Reduction
from transpiler.lowering.context import Mark, PassContext, produces, requires
from transpiler.lowering.layers import layers_of
from transpiler.program.program import Held, InputKind, OutputKind, OutputSpec, Program, new_node
from transpiler.program.roles import INPUT, REDUCE, Role

from .snapshot_params import snapshots

aten = torch.ops.aten


def fragment_of(params: list[fx.Node], index: int, fragments: int) -> list[fx.Node]:
    """Fragment `index` of `fragments`: the parameters, in input order, grouped
    by the module that owns them (a layer is never cut) and the groups cut into
    `fragments` contiguous runs, each closed where the bytes so far first reach
    its share of the total (and early enough to leave a group to each later one)."""
    layers = [[params[i] for i in layer] for layer in
              layers_of([n.meta[INPUT].name for n in params])]
    if fragments > len(layers):   # the schedule refuses it first (DiLoCo.check_params)
        raise ValueError(f"{fragments} fragments of {len(layers)} layers")
    sizes = [sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in layer)
             for layer in layers]
    total, ends, acc = sum(sizes), [], 0
    for i, size in enumerate(sizes):
        acc += size
        f = len(ends)
        if f < fragments - 1 and (acc * fragments >= total * (f + 1)
                                  or len(layers) - i - 1 == fragments - 1 - f):
            ends.append(i + 1)
    bounds = [0, *ends, len(layers)]
    return [n for layer in layers[bounds[index]:bounds[index + 1]] for n in layer]


@requires("snapshot_params")
@produces(Mark.TO_REDUCE)
def pseudo_gradients(program: Program, ctx: PassContext) -> None:
    refuse_backward_after_update(program, "pseudo_gradients averages the parameters' change "
                                   "for the outer optimizer")
    index, fragments = ctx.fragment or (0, 1)
    snaps = snapshots(program)
    updated = [n for n in program.updated_inputs(InputKind.PARAM) if n.meta[INPUT].name in snaps]
    values = {spec.target: value for spec, value in zip(program.outputs, program.output_node.args[0])
              if spec.kind is OutputKind.UPDATE}
    graph = program.graph
    held: list[tuple[OutputSpec, fx.Node]] = []
    with graph.inserting_before(program.output_node):
        deltas = {}
        for param in fragment_of(updated, index, fragments):   # every sum, then what reads them
            name = param.meta[INPUT].name
            summed = {REDUCE: Reduction(name, over=ctx.over(name))} if ctx.world_size > 1 else {}
            deltas[name] = new_node(graph, aten.sub.Tensor, (snaps[name], values[name]),
                                    Role.OPTIMIZE, **summed)
        for name, delta in deltas.items():
            if REDUCE in delta.meta:
                size = ctx.mesh.size(delta.meta[REDUCE].over)
                delta = new_node(graph, aten.div.Tensor, (delta, size), Role.OPTIMIZE)
            held.append((OutputSpec.of_held(Held.PSEUDO_GRAD, name), delta))
    for spec, value in held:
        program.add_output(spec, value)
