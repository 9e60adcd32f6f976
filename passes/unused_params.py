"""unused_params: DDP's find_unused_parameters. A parameter that got no
gradient on this rank (an expert no token of its batch was routed to) was
given zeros by the trace (meta[UNUSED]), which the reduction passes averaged
with the other ranks' gradients, as DDP's bucket does. What is left is DDP's
other half: a parameter no rank gave a gradient keeps its value and its
optimizer state, as DDP leaves its .grad None and the optimizer skips it.

Requires: the trace's zero gradients (transpile(find_unused_parameters=True)),
the gradients reduced (after insert_allreduce or coalesce_tensors).
Produces: one all-reduce (sum) of a float32 vector over every parameter with a
gradient, by name: 1 where this rank's backward pass gave it one, 0 where the
trace gave zeros. The vector's length and order come from the parameter names
alone, so every rank issues the same collective whatever its batch routed. For
each parameter with zeros here, its update and its optimizer state outputs
become where(count > 0, new, old) (program.keep_old_unless). New nodes have
role OPTIMIZE (the collective COMM). With one rank, a parameter with zeros is
used nowhere: its outputs keep their old values without a collective.
Order: after the reduction passes, before skip_nonfinite.
"""

from __future__ import annotations

import torch

from transpiler.lowering import reductions as lowering
from transpiler.lowering.context import PassContext
from transpiler.program.program import InputKind, OutputKind, Program, keep_old_unless, new_node
from transpiler.program.roles import UNUSED, Role

aten = torch.ops.aten


def unused_params(program: Program, ctx: PassContext) -> None:
    graph, grads = program.graph, program.grads
    names = sorted(grads)
    unused = {n.meta[UNUSED] for n in graph.nodes if UNUSED in n.meta}
    if not names:
        return
    like = grads[names[0]]   # the device the vector lives on

    def node(target, args, kwargs=None):
        return new_node(graph, target, args, Role.OPTIMIZE, kwargs)

    with graph.inserting_before(program.output_node):
        if ctx.world_size > 1:
            counts = lowering.all_reduce_now(graph, _here(node, like, names, unused), "sum", ctx)
            used = {name: node(aten.gt.Scalar, (node(aten.select.int, (counts, 0, i)), 0))
                    for i, name in enumerate(names) if name in unused}
        else:
            never = node(aten.new_zeros.default, (like, []), {"dtype": torch.bool})
            used = dict.fromkeys(unused, never)
    param_of = {spec.name: spec.param if spec.kind is InputKind.STATE else spec.name
                for spec in program.inputs}
    keep_old_unless(program, [used.get(spec.param if spec.kind is OutputKind.STATE
                                       else param_of.get(spec.target))
                              for spec in program.outputs])


def _here(node, like, names: list[str], unused: set[str]):
    """1.0 for each parameter this rank's backward pass gave a gradient, 0.0
    for one with the trace's zeros, in the order of `names`: a run of equal
    values is one node."""
    runs: list[tuple[float, int]] = []
    for name in names:
        value = 0.0 if name in unused else 1.0
        if runs and runs[-1][0] == value:
            runs[-1] = (value, runs[-1][1] + 1)
        else:
            runs.append((value, 1))
    parts = [node(aten.new_full.default, (like, [n], value), {"dtype": torch.float32})
             for value, n in runs]
    return parts[0] if len(parts) == 1 else node(aten.cat.default, (parts,))
