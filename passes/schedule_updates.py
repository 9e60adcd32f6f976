"""schedule_updates: process and apply each bucket's gradients as soon as its
communication is done, instead of once every bucket has arrived (what
Decent-DP and torch's DDP comm hooks do in a hook per bucket, done here as a
scheduling pass over the program).

Requires: a pass that inserted collectives and their waits (coalesce_tensors,
shard_optimizer, gather_grads, insert_allreduce); runs after schedule_comm.
Produces: the same values, reordered after the backward pass. Each node there
gets a readiness: the issue order of the last collective it depends on (a
wait: that of its collective; nothing: -1). A foreach op (the optimizers'
updates, clipping's norms) whose elements depend on different collectives is
split into one foreach op per readiness, each reading only its elements; then
the nodes are sorted by readiness, keeping program order among equals (a valid
order: nothing is ready before what it reads). A random op (gradient noise)
is ready no earlier than the random ops before it, so the generator's draws
keep the program's order. So the update of the bucket
reduced first runs while the later buckets are still in flight, and a
collective fed by an update (mode zero's all-gathers) is issued as soon as its
bucket's update is done. What depends on every bucket (a global gradient norm)
still waits for all of them. Deterministic in the program alone.
Order: last (after schedule_comm and ring_round_robin).
"""

from __future__ import annotations

import operator

import torch.fx as fx

from transpiler.program.collectives import WAIT
from transpiler.lowering.context import PassContext, requires
from transpiler.program.program import Program, draws_random, new_node
from transpiler.program.roles import COMM, ROLE, Role


@requires("schedule_comm")
def schedule_updates(program: Program, ctx: PassContext) -> None:
    graph = program.graph
    region = _after_backward(graph)
    if not region:
        return
    issued = {n: i for i, n in enumerate(program.collectives())}
    keys: dict[fx.Node, int | list[int]] = {}
    drawn = -1   # the latest readiness of a random op so far
    for node in region:
        keys[node] = _readiness(node, keys, issued)
        if draws_random(node):   # random ops draw in program order (eager's numbers)
            keys[node] = drawn = max(drawn, keys[node])
        if isinstance(keys[node], list) and len(set(keys[node])) > 1:
            _split(graph, node, keys)
    region = _after_backward(graph)
    order = sorted(region, key=lambda n: _scalar(keys[n]))   # stable: program order among equals
    anchor = region[0].prev
    for node in order:
        anchor.append(node)
        anchor = node


def _after_backward(graph: fx.Graph) -> list[fx.Node]:
    """The call_function nodes after the last node of the forward or backward pass."""
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    last = max((i for i, n in enumerate(nodes)
                if n.meta.get(ROLE, 0) & (Role.FORWARD | Role.BACKWARD)), default=-1)
    return nodes[last + 1:]


def _scalar(key) -> int:
    return max(key, default=-1) if isinstance(key, list) else key


def _of(arg, keys) -> int:
    return _scalar(keys.get(arg, -1)) if isinstance(arg, fx.Node) else -1


def _elements(node: fx.Node) -> int | None:
    """How many elements a foreach op has, if every list argument and its
    result have that many and only getitems read it; else None."""
    val = node.meta.get("val")
    name = getattr(node.target, "__name__", "")
    if not name.startswith("_foreach_") or not isinstance(val, (list, tuple)):
        return None
    lists = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, (list, tuple))]
    if not lists or any(len(a) != len(val) for a in lists) or \
            any(u.target is not operator.getitem for u in node.users):
        return None
    return len(val)


def _readiness(node: fx.Node, keys: dict, issued: dict) -> int | list[int]:
    if node.target is WAIT and COMM in node.meta:
        return max(issued.get(node.args[0], -1), _of(node.args[0], keys))
    if node.target is operator.getitem and isinstance(keys.get(node.args[0]), list):
        return keys[node.args[0]][node.args[1]]
    n = _elements(node)
    if n is None:
        return max((_of(a, keys) for a in node.all_input_nodes), default=-1)
    args = (*node.args, *node.kwargs.values())
    common = max((_of(a, keys) for a in args if not isinstance(a, (list, tuple))), default=-1)
    return [max([common] + [_of(a[i], keys) for a in args if isinstance(a, (list, tuple))])
            for i in range(n)]


def _split(graph: fx.Graph, node: fx.Node, keys: dict) -> None:
    """Replace a foreach node by one per readiness of its elements, each
    reading its elements only; its getitems read the new nodes."""
    groups: dict[int, list[int]] = {}
    for i, key in enumerate(keys[node]):
        groups.setdefault(key, []).append(i)

    def part(a, members):
        return [a[i] for i in members] if isinstance(a, (list, tuple)) else a

    where: dict[int, tuple[fx.Node, int]] = {}
    with graph.inserting_before(node):
        for key, members in sorted(groups.items()):
            meta = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta", ROLE)}
            piece = new_node(graph, node.target, tuple(part(a, members) for a in node.args),
                             node.meta[ROLE], {k: part(v, members) for k, v in node.kwargs.items()},
                             **meta)
            keys[piece] = key
            where.update({i: (piece, j) for j, i in enumerate(members)})
    for user in list(node.users):
        user.args = where[user.args[1]]
    graph.erase_node(node)
