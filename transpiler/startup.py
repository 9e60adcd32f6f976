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

from .capture import Captured, identifier
from .pipeline import record
from .program import InputKind, InputSpec, OutputKind, OutputSpec, Program
from .roles import INPUT, ROLE, Role


def startup_program(captured: Captured, held: Sequence[InputSpec] = (),
                    name: str = "startup") -> Program:
    """Outputs: the parameters and buffers (updates), then the held tensors."""
    chosen = [(spec, slot) for spec, slot in zip(captured.program.inputs, captured.slots)
              if spec.kind in (InputKind.PARAM, InputKind.BUFFER)]
    index = {spec.name: i for i, (spec, _) in enumerate(chosen)}
    sources = [index[spec.param] for spec in held]
    values = [slot.read(None) for _, slot in chosen]
    gm = make_fx(lambda *ts: list(ts) + [torch.clone(ts[i]) for i in sources],
                 tracing_mode="fake")(*values)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, (spec, _) in zip(placeholders, chosen):
        node.meta[INPUT] = spec
        node._rename(captured.program.input_node(spec.name).name)
    copies = [n for n in gm.graph.nodes if n.op == "call_function"]
    for node, spec in zip(copies, held):
        node.meta[ROLE] = Role.OPTIMIZE
        node._rename(identifier("", spec.name))
    gm.recompile()
    program = Program(name, gm, [spec for spec, _ in chosen],
                      [OutputSpec(OutputKind.UPDATE, spec.name) for spec, _ in chosen]
                      + [OutputSpec(OutputKind.HELD, spec.name, held=spec.held) for spec in held])
    record(program, "capture", f"capture: identity over {len(chosen)} parameters and buffers"
                               + (f", {len(held)} held copies" if held else ""))
    return program
