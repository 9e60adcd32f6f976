"""snapshot_params: give each parameter the step updates a snapshot the
transpiled step keeps between calls.

Requires nothing.
Produces: for each parameter with an `update` output, in input order, a held
input of kind HELD holding Held.SNAPSHOT of <param> that this pass
leaves unread and unchanged. The startup program initializes it as a copy of
the parameter (after broadcasting the parameters) before the first program that
has it runs; the passes after this one (local_sgd, pseudo_gradients) read and
update it. With one rank it does not apply, unless ctx.keep_snapshots (DiLoCo).
Order: first; local_sgd and pseudo_gradients require it.
"""

from __future__ import annotations

import torch.fx as fx

from transpiler.lowering.context import PassContext
from transpiler.program.program import Held, InputKind, InputSpec, Program
from transpiler.program.roles import INPUT


def snapshots(program: Program) -> dict[str, fx.Node]:
    """Parameter name -> the placeholder of its snapshot."""
    return {n.meta[INPUT].param: n for n in program.placeholders
            if n.meta[INPUT].held is Held.SNAPSHOT}


def snapshot_params(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1 and not ctx.keep_snapshots:
        return
    for param in program.updated_inputs(InputKind.PARAM):
        name = param.meta[INPUT].name
        program.add_input(InputSpec.of_held(Held.SNAPSHOT, name), param,
                          "snap_" + param.name.removeprefix("p_"))
