"""scale_loss_grad: divide the loss-gradient seed by the world size.

Requires: a captured program; its seed is the node with role BACKWARD|LOSS.
Produces: `div(seed, world_size)` right after the seed, read by every consumer of
the seed, so that summing the gradients over the ranks gives their mean (the
gradient of the mean loss over the global batch). Marked BACKWARD|LOSS: it is the
seed from now on. Every gradient is marked meta["reduce"] = its parameter, for a
reduction pass to sum. With one rank it does not apply and the program is unchanged.
Order: before the passes that sum gradients (insert_allreduce, coalesce_tensors).
"""

from __future__ import annotations

import torch

from transpiler.pipeline import PassContext
from transpiler.program import Program, new_node
from transpiler.roles import REDUCE, ROLE, Role

SEED = Role.BACKWARD | Role.LOSS


def loss_grad_seed(program: Program):
    """The node whose value seeds the backward pass (the last one, once scaled)."""
    seeds = [n for n in program.graph.nodes if n.meta.get(ROLE) == SEED]
    if not seeds:
        raise ValueError("the program has no loss-gradient seed (role BACKWARD|LOSS)")
    return seeds[-1]


def scale_loss_grad(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    seed = loss_grad_seed(program)
    with program.graph.inserting_after(seed):
        scaled = new_node(program.graph, torch.ops.aten.div.Tensor, (seed, ctx.world_size), SEED)
    seed.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
    for param, grad in program.grads.items():
        grad.meta[REDUCE] = param
