"""ring_round_robin: spread the collectives round robin over the rings.

Requires: a pass that inserted collectives (insert_allreduce, coalesce_tensors or
broadcast_params); every collective was issued on ring 0.
Produces: the i-th collective in program order runs on ring i % nrings: its
group argument and meta["comm"].ring are set. Deterministic in the program
alone, so every rank agrees. With one rank or one ring it does not apply.
Order: after every pass that inserts collectives.
"""

from __future__ import annotations

from transpiler.pipeline import PassContext, requires
from transpiler.program import Program
from transpiler.roles import COMM


def plan_rings(n_collectives: int, nrings: int) -> list[int]:
    """Ring of each collective, in program order."""
    if nrings < 1:
        raise ValueError(f"nrings must be >= 1, got {nrings}")
    return [i % nrings for i in range(n_collectives)]


@requires("insert_allreduce|coalesce_tensors|broadcast_params")
def ring_round_robin(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1 or ctx.nrings == 1:
        return
    collectives = program.collectives()
    for node, ring in zip(collectives, plan_rings(len(collectives), ctx.nrings)):
        names = [a.name for a in node.target._schema.arguments]
        node.update_arg(names.index("group_name"), ctx.rings[ring])
        node.meta[COMM].ring = ring
