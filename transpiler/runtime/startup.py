"""The startup program: run before the first program of a state set. Captured
as the identity over the main program's parameters and buffers, plus a copy of
its parameter for each held tensor (local SGD's snapshots); passes
(broadcast_params) make it what it must do. Without passes, the same capture is
the refresh program, which initializes the held tensors again before a program
that reads them runs after one that left them stale (the warm-up)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ..capture import Captured, identifier
from ..pipeline import record
from ..program.program import Held, InputKind, InputSpec, OutputKind, OutputSpec, Program
from ..lowering.shards import shard_of
from ..program.roles import INPUT, ROLE, Role


def startup_program(captured: Captured, held: Sequence[InputSpec] = (),
                    name: str = "startup", shard: tuple[int, int] = (0, 1)) -> Program:
    """Outputs: the parameters and buffers (updates), then the held tensors:
    a copy of its parameter, or this rank's shard of it (Held.PARAM_SHARD):
    part shard[0] of shard[1] (transpiler/lowering/shards.py: Sharding)."""
    chosen = [(spec, slot) for spec, slot in zip(captured.program.inputs, captured.slots)
              if spec.kind in (InputKind.PARAM, InputKind.BUFFER)]
    index = {spec.name: i for i, (spec, _) in enumerate(chosen)}
    sources = [index[spec.param] for spec in held]
    values = [slot.read(None) for _, slot in chosen]
    def initial(spec: InputSpec, value: torch.Tensor) -> torch.Tensor:
        if spec.held is Held.PARAM_SHARD:
            return shard_of(value, *shard)
        return torch.clone(value)
    gm = make_fx(lambda *ts: list(ts) + [initial(spec, ts[i]) for spec, i in zip(held, sources)],
                 tracing_mode="fake")(*values)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, (spec, _) in zip(placeholders, chosen):
        node.meta[INPUT] = spec
        node._rename(captured.program.input_node(spec.name).name)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta[ROLE] = Role.OPTIMIZE
    for node, spec in zip(gm.graph.output_node().args[0][len(chosen):], held):
        node._rename(identifier("", spec.name))
    gm.recompile()
    program = Program(name, gm, [spec for spec, _ in chosen],
                      [OutputSpec(OutputKind.UPDATE, spec.name) for spec, _ in chosen]
                      + [OutputSpec(OutputKind.HELD, spec.name, held=spec.held) for spec in held])
    record(program, "capture", f"capture: identity over {len(chosen)} parameters and buffers"
                               + (f", {len(held)} held copies" if held else ""))
    return program
