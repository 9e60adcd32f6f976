"""shard_params: ZeRO-3 on top of shard_optimizer. Between steps each rank keeps
only its shard of every parameter the step trains; each bucket of them is
all-gathered just before its first use in the step, the next bucket's gather
issued while the current one computes.

Requires: shard_optimizer (its updated parameter shards, all-gathered per
bucket before the program's outputs, and the nodes that cut a parameter to this
rank's shard, marked meta[PARAM_SHARD]); run after schedule_comm and
schedule_updates, which place zero's collectives.
Produces: for each parameter shard_optimizer shards, a held input
Held.PARAM_SHARD of <param> holding this rank's c = ceil(n / N) elements of the
flattened, padded parameter (the startup program cuts it from the broadcast
parameter) and a held output, its updated shard. The bucket's all-gather now
reads those held shards and sits before the bucket's first use: buckets in
order of first use, bucket k+1's gather issued right after bucket k's wait,
each wait right before its bucket's first use. Every read of the parameter
reads the gathered value, which lives until its last use in the step (the
backward pass included: reshard_after_forward=False); the parameter is no
longer an input or an output of the program. With one rank it does not apply.
Order: last of mode fsdp's passes.
"""

from __future__ import annotations

import torch.fx as fx

from transpiler.collectives import ALL_GATHER
from transpiler.pipeline import PassContext, requires
from transpiler.program import Held, InputKind, InputSpec, OutputKind, OutputSpec, Program, held_name
from transpiler.roles import BUCKET, COMM, GATHERED, INPUT, PARAM_SHARD, ROLE, Role


@requires("shard_optimizer")
def shard_params(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    gathers = [n for n in program.collectives() if n.target is ALL_GATHER]
    params = {node.meta[INPUT].name: node for node in program.placeholders
              if node.meta[INPUT].kind is InputKind.PARAM}
    updated = {spec.target: i for i, spec in enumerate(program.outputs)
               if spec.kind is OutputKind.UPDATE and spec.target in params}
    values = list(program.output_node.args[0])
    cut = {n.meta[PARAM_SHARD]: n for n in program.graph.nodes if PARAM_SHARD in n.meta}
    first_use: dict[fx.Node, fx.Node] = {}
    sharded: set[str] = set()
    for gather in gathers:
        names = gather.meta[COMM].params
        sharded.update(names)
        row = gather.args[0]   # the bucket's updated shards, concatenated
        held = {}
        for name, shard in zip(names, row.args[0]):
            held[name] = program.add_input(InputSpec.of_held(Held.PARAM_SHARD, name), shard,
                                           f"shard_{params[name].name.removeprefix('p_')}")
            values[updated[name]] = shard
            cut[name].replace_all_uses_with(held[name])
        row.args = ([held[name] for name in names],) + row.args[1:]
        first_use[gather] = min(u for name in names for u in params[name].users)
        full = {n.meta[GATHERED]: n for n in _unpacking(gather) if GATHERED in n.meta}
        for name in names:
            params[name].replace_all_uses_with(full[name])
    program.outputs = [OutputSpec(OutputKind.HELD, held_name(Held.PARAM_SHARD, spec.target),
                                  held=Held.PARAM_SHARD)
                       if spec.kind is OutputKind.UPDATE and spec.target in sharded else spec
                       for spec in program.outputs]
    program.output_node.args = (tuple(values),)
    for name in sorted(sharded):
        _erase_unused(program.graph, cut[name])
        program.inputs.remove(params[name].meta[INPUT])
        program.graph.erase_node(params[name])
    _place(program, sorted(gathers, key=first_use.__getitem__), first_use)


def _erase_unused(graph: fx.Graph, node: fx.Node) -> None:
    """node and the nodes only it read (the cut of a parameter to its shard,
    now read from the held shard)."""
    todo = [node]
    while todo:
        node = todo.pop()
        if node.op == "call_function" and not node.users:
            todo += node.all_input_nodes
            graph.erase_node(node)


def _unpacking(gather: fx.Node) -> list[fx.Node]:
    """The gather's wait and the nodes that unpack its result, in graph order."""
    bucket, chain, todo = gather.meta[COMM].bucket, [], list(gather.users)
    while todo:
        node = todo.pop()
        if node not in chain and node.meta.get(BUCKET) == bucket \
                and node.meta.get(ROLE, 0) & Role.COMM:
            chain.append(node)
            todo += list(node.users)
    return sorted(chain)


def _place(program: Program, gathers: list[fx.Node], first_use: dict) -> None:
    """Bucket k's gather (with the concatenation it sends) issued right after
    bucket k-1's wait, its wait and unpacking right before its first use."""
    start = program.placeholders[-1].next
    for k, gather in enumerate(gathers):
        issue = first_use[gathers[k - 1]] if k else start
        unpacking = _unpacking(gather)
        issue.prepend(gather.args[0])
        issue.prepend(gather)
        for node in unpacking:
            first_use[gather].prepend(node)
