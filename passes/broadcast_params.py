"""broadcast_params: every rank starts from rank 0's parameters and buffers.

Runs on the startup program (transpiler/runtime/startup.py): the identity over the
parameters and buffers, plus a copy of a parameter for each held tensor it
initializes. Requires nothing before it.
Produces: for each parameter and buffer, in input order, `wait_tensor(broadcast(
input, src=0))` on ring 0 of its group, read by every former use of the input
(its output and the copies). The group is the world, except for a parameter
reduced over a group of its own (ctx.over: transpile(reduce_groups=...)), which starts
from the first rank of that group, since the groups' copies may differ by
design (experts of a mixture of experts). With one rank it does not apply.
Order: before ring_round_robin.
"""

from __future__ import annotations

from transpiler.program.collectives import BROADCAST, WAIT
from transpiler.lowering.context import PassContext
from transpiler.program.program import CommInfo, InputKind, Program, new_node
from transpiler.program.roles import COMM, INPUT, Role


def broadcast_params(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    graph = program.graph
    placeholders = program.placeholders
    first_use = placeholders[-1].next
    for node in placeholders:
        spec = node.meta[INPUT]
        if spec.kind not in (InputKind.PARAM, InputKind.BUFFER):
            continue
        over = ctx.over(spec.name)
        comm = CommInfo("broadcast", ring=0, params=(spec.name,), nbytes=node.meta["val"].nbytes,
                        over=over)
        users = list(node.users)
        with graph.inserting_before(first_use):
            # src is the rank within the group
            sent = new_node(graph, BROADCAST, (node, 0, ctx.mesh.ring(over)), Role.COMM,
                            **{COMM: comm})
            received = new_node(graph, WAIT, (sent,), Role.COMM, **{COMM: comm})
        for user in users:
            user.replace_input_with(node, received)
