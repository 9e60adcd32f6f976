"""broadcast_params: every rank starts from rank 0's parameters and buffers.

Runs on the startup program, which is the identity over the parameters and
buffers (transpiler/startup.py). Requires nothing before it.
Produces: each output becomes `wait_tensor(broadcast(input, src=0))` on ring 0, in
input order. With one rank it does not apply.
Order: before ring_round_robin.
"""

from __future__ import annotations

from transpiler.collectives import BROADCAST, WAIT
from transpiler.pipeline import PassContext
from transpiler.program import CommInfo, Program, new_node
from transpiler.roles import COMM, INPUT, Role


def broadcast_params(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    graph = program.graph
    out = program.output_node
    results = []
    for value in out.args[0]:
        val = value.meta["val"]
        comm = CommInfo("broadcast", ring=0, params=(value.meta[INPUT].name,),
                        nbytes=val.nbytes)
        with graph.inserting_before(out):
            sent = new_node(graph, BROADCAST, (value, 0, ctx.rings[0]), Role.COMM, **{COMM: comm})
            results.append(new_node(graph, WAIT, (sent,), Role.COMM, **{COMM: comm}))
    out.args = (tuple(results),)
