"""skip_nonfinite: skip the update of a step whose summed values are not all finite.

Requires nothing; reads what the reduction passes produced, so it runs after them.
Produces: `ok`, a 0-d bool that is true when every reduced value (meta["reduced"]:
the averaged gradients, local SGD's summed deltas, whole also when reduced
hierarchically) is finite; a program without
collectives checks its gradients. Where the reduced values are shards
(shard_optimizer: each rank holds its part of each averaged gradient), each
rank's verdict is combined by one all-reduce (max of "not finite") over the
world, so every rank still decides alike. Then each `update` output v of input x
(and each parameter shard mode fsdp holds, of its held input x) becomes
where(ok, v, x), and each optimizer state entry the step creates
where(ok, v, 0) (zeros are what SGD's momentum and Adam's moments and step count
start from); a held output (Held.SKIPPED) says whether the step
was skipped, for the schedule to count. Every rank computes ok from the same
reduced values, so every rank skips alike. New nodes have role OPTIMIZE.
Order: after insert_allreduce or coalesce_tensors (and local_sgd).
"""

from __future__ import annotations

import torch

from transpiler.lowering import reductions as lowering
from transpiler.program.collectives import Placement
from transpiler.lowering.context import PassContext
from transpiler.program.program import Held, OutputSpec, Program, keep_old_unless, new_node
from transpiler.program.roles import REDUCED, Role

aten = torch.ops.aten


def skip_nonfinite(program: Program, ctx: PassContext) -> None:
    graph, out = program.graph, program.output_node
    summed = [n for n in graph.nodes if REDUCED in n.meta]
    checked = summed or list(program.grads.values())
    if not checked:
        return
    def node(target, args, kwargs=None):
        return new_node(graph, target, args, Role.OPTIMIZE, kwargs)

    with graph.inserting_before(out):
        ok = None
        for value in checked:
            finite = node(aten.all.default, (node(aten.isfinite.default, (value,)),))
            ok = finite if ok is None else node(aten.logical_and.default, (ok, finite))
        skipped = node(aten.logical_not.default, (ok,))
        if any(n.meta[REDUCED].placement is Placement.SHARD for n in summed):
            flag = node(aten._to_copy.default, (skipped,), kwargs={"dtype": torch.float32})
            anywhere = lowering.all_reduce_now(graph, flag, "max", ctx)
            skipped = node(aten.gt.Scalar, (anywhere, 0))
            ok = node(aten.logical_not.default, (skipped,))
    keep_old_unless(program, [ok] * len(program.outputs), skippable=True)
    program.add_output(OutputSpec.of_held(Held.SKIPPED), skipped)
