"""ring_round_robin: spread the collectives round robin over the rings.

Requires: a pass that inserted collectives (insert_allreduce, coalesce_tensors,
broadcast_params or broadcast_buffers); every collective was issued on ring 0 of its group.
Produces: the i-th collective in program order over a group (meta["comm"].over:
the world, the node, across nodes, a user's group) runs on ring
i % (that group's rings in ctx.mesh): its group argument and meta["comm"].ring
are set. A user's group has one ring. Deterministic in the program alone, so
every rank agrees. With one rank or one ring it does not apply.
Order: after every pass that inserts collectives.
"""

from __future__ import annotations

from transpiler.program.collectives import set_group
from transpiler.lowering.context import PassContext, requires
from transpiler.program.program import Program
from transpiler.program.roles import COMM


def plan_rings(n_collectives: int, nrings: int) -> list[int]:
    """Ring of each collective over one group, in program order."""
    if nrings < 1:
        raise ValueError(f"nrings must be >= 1, got {nrings}")
    return [i % nrings for i in range(n_collectives)]


@requires("insert_allreduce|coalesce_tensors|shard_optimizer|gather_grads|broadcast_params|"
          "broadcast_buffers")
def ring_round_robin(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1 or ctx.nrings == 1:
        return
    by_group: dict = {}
    for node in program.collectives():
        by_group.setdefault(node.meta[COMM].over, []).append(node)
    for over, nodes in by_group.items():
        for node, ring in zip(nodes, plan_rings(len(nodes), ctx.mesh.nrings(over))):
            set_group(node, ctx.mesh.ring(over, ring))
            node.meta[COMM].ring = ring
