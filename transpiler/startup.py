"""The startup program: run once before the first step, over the parameters and
buffers of the main program. Captured as the identity; passes (broadcast_params)
make it what it must do."""

from __future__ import annotations

from torch.fx.experimental.proxy_tensor import make_fx

from .capture import Captured
from .pipeline import record
from .program import OutputSpec, Program
from .roles import INPUT


def startup_program(captured: Captured) -> tuple[Program, list]:
    """The identity program over the main program's parameters and buffers, and
    the slot each output is written back to."""
    chosen = [(spec, slot) for spec, slot in zip(captured.program.inputs, captured.slots)
              if spec.kind in ("param", "buffer")]
    values = [slot.read(None) for _, slot in chosen]
    gm = make_fx(lambda *ts: list(ts), tracing_mode="fake")(*values)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, (spec, _) in zip(placeholders, chosen):
        node.meta[INPUT] = spec
        node._rename(captured.program.input_node(spec.name).name)
    gm.recompile()
    program = Program("startup", gm, [spec for spec, _ in chosen],
                      [OutputSpec("update", spec.name) for spec, _ in chosen])
    record(program, "capture", f"capture: identity over {len(chosen)} parameters and buffers")
    return program, [slot for _, slot in chosen]
