"""snapshot_params: give each parameter the step updates a snapshot the
transpiled step keeps between calls.

Requires nothing.
Produces: for each parameter with an `update` output, in input order, a held
input "snapshot:<param>" (InputSpec kind held, param=<param>) that this pass
leaves unread and unchanged. The startup program initializes it as a copy of
the parameter (after broadcasting the parameters) before the first program that
has it runs; the passes after this one (local_sgd) read and update it. With one
rank it does not apply.
Order: first; local_sgd requires it.
"""

from __future__ import annotations

import torch.fx as fx

from transpiler.pipeline import PassContext
from transpiler.program import InputSpec, Program
from transpiler.roles import INPUT


def snapshot_name(param: str) -> str:
    return f"snapshot:{param}"


def snapshots(program: Program) -> dict[str, fx.Node]:
    """Parameter name -> the placeholder of its snapshot."""
    specs = {n: n.meta[INPUT] for n in program.placeholders}
    return {spec.param: n for n, spec in specs.items()
            if spec.kind == "held" and spec.name == snapshot_name(spec.param)}


def snapshot_params(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    updated = {spec.target for spec in program.outputs if spec.kind == "update"}
    for spec in list(program.inputs):
        if spec.kind == "param" and spec.name in updated:
            param = program.input_node(spec.name)
            program.add_input(InputSpec("held", snapshot_name(spec.name), param=spec.name),
                              param, "snap_" + param.name.removeprefix("p_"))
