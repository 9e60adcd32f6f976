"""coalesce_model_collectives: the collectives the model's own code issues
(SyncBatchNorm's gathers of statistics and the all-reduces of their gradients,
capture/sync_batch_norm.py) issued together where they do not depend on each
other: one collective per group of layers, not one per layer.

Requires nothing (the collectives come from the capture).
Produces: the model's collectives (meta["comm"] with no parameters and no
bucket) grouped by `plan_groups`, in program order, by op, group and dtype: a
collective joins the group of an earlier one when what it reduces depends on
no result of the group's collectives (a downsampling shortcut's BatchNorm
beside the block's first one; their gradients in the backward pass), and the
nodes that compute its input after the group's first collective can move
above it (none draws random numbers, no decision's check lies between).
Those nodes move right above the group's first collective, in their order;
there the inputs are
concatenated, reduced by one collective and split into views shaped as the
former results, which their users read. Every rank plans the same groups:
they are a function of the program.
Order: before ring_round_robin and schedule_comm (which place and spread the
collectives). With one rank, or no model collectives, it does not apply.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from transpiler.program.collectives import ALL_GATHER, ALL_REDUCE, WAIT
from transpiler.lowering.context import PassContext
from transpiler.program.program import CommInfo, Program, draws_random, new_node
from transpiler.program.roles import COMM, DECISION, ROLE, Role

aten = torch.ops.aten
_OPS = (ALL_GATHER, ALL_REDUCE)


def _model_collectives(program: Program) -> list[fx.Node]:
    return [n for n in program.collectives() if n.target in _OPS
            and not n.meta[COMM].params and n.meta[COMM].bucket is None]


def _wait_of(collective: fx.Node) -> fx.Node:
    (wait,) = [u for u in collective.users if u.target is WAIT]
    return wait


def _key(collective: fx.Node) -> tuple:
    """What collectives must share to be issued as one: op, its reduction
    and group arguments, the dtype."""
    return (collective.target, *collective.args[1:], collective.args[0].meta["val"].dtype)


def _cone(node: fx.Node, after: int, position: dict[fx.Node, int]) -> set[fx.Node]:
    """The nodes `node` is computed from (itself included) placed after `after`."""
    cone, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in cone or position[n] <= after:
            continue
        cone.add(n)
        todo += n.all_input_nodes
    return cone


def _movable(cone: set[fx.Node]) -> bool:
    """Whether these nodes can move above a collective: pure ops that draw
    no random numbers and issue or wait on no collective."""
    for n in cone:
        if n.op != "call_function" or n.target is WAIT or n.target in _OPS:
            return False
        if n.target is not operator.getitem and (
                not isinstance(n.target, torch._ops.OpOverload) or n.is_impure()
                or draws_random(n)):
            return False
    return True


def plan_groups(program: Program) -> list[list[fx.Node]]:
    """The model's collectives in groups issued as one (each in program order);
    a group of one is left as it is."""
    position = {n: i for i, n in enumerate(program.graph.nodes)}
    # a decision's check guards what comes after it (capture/decisions.py):
    # nothing moves above one
    checks = [position[n] for n in program.graph.nodes if DECISION in n.meta]
    groups: list[list[fx.Node]] = []
    results: dict[int, set[fx.Node]] = {}   # group -> its collectives' and waits' nodes
    for c in _model_collectives(program):
        placed = False
        for g, group in enumerate(groups):
            if _key(group[0]) != _key(c) or any(position[group[0]] < p < position[c]
                                                for p in checks):
                continue
            cone = _cone(c.args[0], position[group[0]], position)
            if _movable(cone) and not _depends(c.args[0], results[g], position,
                                               position[group[0]]):
                group.append(c)
                results[g] |= {c, _wait_of(c)}
                placed = True
                break
        if not placed:
            groups.append([c])
            results[len(groups) - 1] = {c, _wait_of(c)}
    return [g for g in groups if len(g) > 1]


def _depends(node: fx.Node, on: set[fx.Node], position, after: int) -> bool:
    """Whether `node` is computed from one of `on` (looking back to `after`)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in on:
            return True
        if n in seen or position[n] <= after:
            continue
        seen.add(n)
        todo += n.all_input_nodes
    return False


def coalesce_model_collectives(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    for group in plan_groups(program):
        _coalesce(program, group)


def _coalesce(program: Program, group: list[fx.Node]) -> None:
    graph, first = program.graph, group[0]
    position = {n: i for i, n in enumerate(graph.nodes)}
    moved = set().union(*(_cone(c.args[0], position[first], position) for c in group[1:]))
    for n in sorted(moved, key=position.__getitem__):
        first.prepend(n)
    inputs = [c.args[0] for c in group]
    role = first.args[0].meta[ROLE] if first.args[0].op == "call_function" else Role.FORWARD
    sizes = [i.meta["val"].numel() for i in inputs]
    gather = first.target is ALL_GATHER
    world = first.args[1] if gather else None
    comm = CommInfo(first.meta[COMM].op, over=first.meta[COMM].over,
                    nbytes=sum(c.meta[COMM].nbytes for c in group))

    def node(target, args, role_=Role.COMM, **meta):
        return new_node(graph, target, args, role_, **meta)

    with graph.inserting_before(first):
        flat = node(aten.cat.default, ([node(aten.reshape.default, (i, [-1]), role)
                                        for i in inputs],), role)
        issued = node(first.target, (flat, *first.args[1:]), **{COMM: comm})
        waited = node(WAIT, (issued,), **{COMM: comm})
        rows = node(aten.view.default, (waited, [world, sum(sizes)])) if gather else waited
        parts = node(aten.split_with_sizes.default, (rows, sizes, 1 if gather else 0))
        values = [node(aten.reshape.default, (node(operator.getitem, (parts, k)),
                                              list(_wait_of(c).meta["val"].shape)))
                  for k, c in enumerate(group)]
    for c, value in zip(group, values):
        old = _wait_of(c)
        old.replace_all_uses_with(value)
        graph.erase_node(old)
        graph.erase_node(c)
