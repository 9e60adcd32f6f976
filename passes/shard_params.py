"""shard_params: ZeRO-3 on top of shard_optimizer. Between steps each rank keeps
only its shard of every parameter the step trains; each bucket of them is
all-gathered just before its first use in each forward and backward pass, the
next gather issued while the current bucket computes.

Requires: shard_optimizer (its updated parameter shards, all-gathered per
bucket before the program's outputs, and the nodes that cut a parameter to this
rank's shard, marked meta[PARAM_SHARD]); run after schedule_comm and
schedule_updates, which place zero's collectives.
Produces: for each parameter shard_optimizer shards, a held input
Held.PARAM_SHARD of <param> holding this rank's c = ceil(n / N) elements of the
flattened, padded parameter (the startup program cuts it from the broadcast
parameter) and a held output, its updated shard. The bucket's all-gather reads
those held shards; every read of the parameter reads a gathered value, and the
parameter is no longer an input or an output of the program.
With ctx.reshard_after_forward (the default) the step is cut into passes, a
pass being a run of forward nodes or of backward nodes (micro-batches
alternate them; what follows the last backward pass belongs to it). A bucket
is gathered once per pass that reads it, and each gathered value and what is
computed from the parameters alone (a transpose, a cast) is read only within
its pass: read in a later pass, that is computed again there from the new
gather, bit for bit the same. So a bucket's gathered values die after its last
use in the forward pass. The bucket read last in a pass is kept into the next
pass when that pass reads it (it would be gathered again at once). Without
reshard_after_forward a bucket is gathered once and lives to its last use.
The gathers are issued in order of first use: each right after the previous
one's wait, but not before its own pass begins; each wait right before its
gather's first use. With one rank it does not apply.
Order: last of mode fsdp's passes.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from transpiler.errors import PassError
from transpiler.program.collectives import ALL_GATHER
from transpiler.lowering.context import PassContext, requires
from transpiler.program.program import (Held, InputKind, InputSpec, OutputKind, OutputSpec, Program,
                                        draws_random, erase_unread, held_name)
from transpiler.program.roles import BUCKET, COMM, GATHERED, INPUT, PARAM_SHARD, ROLE, Role


@dataclasses.dataclass
class Bucket:
    """One all-gather of shard_optimizer and what its values are read by."""

    gather: fx.Node
    full: dict[str, fx.Node]     # parameter name -> its gathered value
    derived: list[fx.Node]       # computed from the gathered values alone, graph order
    readers: list[fx.Node]       # nodes that read a gathered or derived value


@dataclasses.dataclass
class Gather:
    """One all-gather of a bucket in the program: it serves `phases`."""

    bucket: Bucket
    phases: tuple[int, ...]
    first_use: fx.Node
    gather: fx.Node | None = None       # set when the graph is edited
    values: dict[fx.Node, fx.Node] = dataclasses.field(default_factory=dict)


@requires("shard_optimizer")
def shard_params(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    buckets = _hold_shards(program)
    phase = _phases(program.graph)
    gathers = plan_gathers(buckets, phase, ctx.reshard_after_forward)
    start = _phase_starts(program, phase)
    for g in gathers:
        _materialize(program.graph, g)
    _place(gathers, start)
    for g in gathers:
        _rewire(program.graph, g, phase)


# ------------------------------------------------------------------ planning

def _phases(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's pass: how often the roles switched between forward and
    backward before it, in graph order."""
    phase, backward, of = 0, False, {}
    for node in graph.nodes:
        role = node.meta.get(ROLE, Role(0))
        if role & (Role.FORWARD | Role.BACKWARD) and bool(role & Role.BACKWARD) != backward:
            backward, phase = not backward, phase + 1
        of[node] = phase
    return of


def plan_gathers(buckets: list[Bucket], phase: dict[fx.Node, int],
                 reshard: bool) -> list[Gather]:
    """The gathers of every bucket, in order of first use. Without reshard a
    bucket's one gather serves every pass; with it, one gather per pass that
    reads the bucket, except that the bucket read last in a pass (of those,
    the one the next pass reads first) serves the next pass too when that
    pass reads it."""
    pos = {node: i for i, node in enumerate(phase)}
    reads = [{p: [pos[r] for r in b.readers if phase[r] == p] for p in {phase[r] for r in b.readers}}
             for b in buckets]
    kept = {}   # pass -> the bucket kept into the next one
    for p in set(phase.values()):
        later = [(max(r[p]), -min(r.get(p + 1, [len(pos)])), i) for i, r in enumerate(reads) if p in r]
        if later:
            kept[p] = buckets[max(later)[2]]
    gathers = []
    for b, r in zip(buckets, reads):
        phases = sorted(r)
        runs = [[phases[0]]]
        for p in phases[1:]:
            if not reshard or (p == runs[-1][-1] + 1 and kept[p - 1] is b):
                runs[-1].append(p)
            else:
                runs.append([p])
        for run in runs:
            gathers.append(Gather(b, tuple(run), min(x for x in b.readers if phase[x] in run)))
    return sorted(gathers, key=lambda g: g.first_use)


def _phase_starts(program: Program, phase: dict[fx.Node, int]) -> dict[int, fx.Node]:
    """The node each pass begins with; the first pass begins the program."""
    start = {0: program.placeholders[-1].next}
    for node in program.graph.nodes:
        start.setdefault(phase[node], node)
    return start


def _recomputable(node: fx.Node) -> bool:
    """A pure op whose value a second run reproduces bit for bit."""
    if node.op != "call_function" or node.meta.get(ROLE, Role(0)) & Role.COMM:
        return False
    if node.target is operator.getitem:
        return True
    return isinstance(node.target, torch._ops.OpOverload) \
        and not node.target._schema.is_mutable and not draws_random(node)


def _derived(graph: fx.Graph, full: set[fx.Node]) -> list[fx.Node]:
    """The nodes computed from these gathered values alone (a transpose, a
    cast): what a later pass computes again from its own gather."""
    values, derived = set(full), []
    for node in graph.nodes:
        inputs = node.all_input_nodes
        if inputs and _recomputable(node) and all(i in values for i in inputs):
            values.add(node)
            derived.append(node)
    return derived


# ------------------------------------------------------------------ editing

def _hold_shards(program: Program) -> list[Bucket]:
    """Feed each bucket's all-gather from held shards and every read of a
    parameter from its gathered value; the parameters leave the program."""
    # shard_optimizer's gathers of parameters (not a SyncBatchNorm's of statistics)
    gathers = [n for n in program.collectives() if n.target is ALL_GATHER and n.meta[COMM].params]
    params = {node.meta[INPUT].name: node for node in program.placeholders
              if node.meta[INPUT].kind is InputKind.PARAM}
    updated = {spec.target: i for i, spec in enumerate(program.outputs)
               if spec.kind is OutputKind.UPDATE and spec.target in params}
    values = list(program.output_node.args[0])
    cut = {n.meta[PARAM_SHARD]: n for n in program.graph.nodes if PARAM_SHARD in n.meta}
    buckets, sharded = [], set()
    for gather in gathers:
        _refuse_reads_after_update(program, gather)
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
        full = {n.meta[GATHERED]: n for n in _unpacking(gather) if GATHERED in n.meta}
        for name in names:
            params[name].replace_all_uses_with(full[name])
        buckets.append(Bucket(gather, full, [], []))
    program.outputs = [OutputSpec(OutputKind.HELD, held_name(Held.PARAM_SHARD, spec.target),
                                  held=Held.PARAM_SHARD)
                       if spec.kind is OutputKind.UPDATE and spec.target in sharded else spec
                       for spec in program.outputs]
    program.output_node.args = (tuple(values),)
    for name in sorted(sharded):
        erase_unread([cut[name]])
        program.inputs.remove(params[name].meta[INPUT])
        program.graph.erase_node(params[name])
    for b in buckets:
        b.derived = _derived(program.graph, set(b.full.values()))
        b.readers = sorted({r for v in [*b.full.values(), *b.derived] for r in v.users})
    return buckets


def _refuse_reads_after_update(program: Program, gather: fx.Node) -> None:
    """A parameter read after its update in the step (an EMA of the model, an
    evaluation: shard_optimizer has them read its gathered new value) would
    read the gather this pass makes of the held shards, the old value."""
    out = program.output_node
    for node in _unpacking(gather):
        if GATHERED in node.meta and any(u is not out for u in node.users):
            raise PassError(
                f"the step reads {node.meta[GATHERED]} after optimizer.step() updated it (an "
                "EMA of the model, an evaluation after the update): mode fsdp holds the "
                "updated parameters as shards until the next step; read them after the call "
                "(inside `with step.unsharded():`), or use mode zero or fuse_all_reduce")


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


def _materialize(graph: fx.Graph, g: Gather) -> None:
    """The bucket's first gather is shard_optimizer's; each later one a copy
    of it (the concatenation of the held shards, the collective, its wait and
    unpacking)."""
    b = g.bucket
    if g.first_use is min(b.readers):
        g.gather = b.gather
        g.values = {v: v for v in b.full.values()}
        return
    row = b.gather.args[0]
    with graph.inserting_before(g.first_use):
        copies = {row: graph.node_copy(row)}
        for node in [b.gather, *_unpacking(b.gather)]:
            copies[node] = graph.node_copy(node, lambda a: copies.get(a, a))
    g.gather = copies[b.gather]
    g.values = {v: copies[v] for v in b.full.values()}


def _place(gathers: list[Gather], start: dict[int, fx.Node]) -> None:
    """Gather k (with the concatenation it sends) issued right after gather
    k-1's wait, but not before its own pass begins; its wait and unpacking
    right before its first use."""
    for k, g in enumerate(gathers):
        issue = max(start[g.phases[0]], gathers[k - 1].first_use) if k else start[g.phases[0]]
        issue.prepend(g.gather.args[0])
        issue.prepend(g.gather)
        for node in _unpacking(g.gather):
            g.first_use.prepend(node)


def _rewire(graph: fx.Graph, g: Gather, phase: dict[fx.Node, int]) -> None:
    """The readers in g's passes read g's values; a derived value of an
    earlier pass is computed again, right before g's first use. The values
    these passes do not read are not unpacked."""
    if g.gather is g.bucket.gather:
        return
    derived = set(g.bucket.derived)

    def value(v: fx.Node) -> fx.Node:
        if v not in g.values:
            assert v in derived
            with graph.inserting_before(g.first_use):
                g.values[v] = graph.node_copy(v, lambda a: value(a) if a in derived
                                              or a in g.values else a)
        return g.values[v]

    for r in g.bucket.readers:
        if phase[r] in g.phases:
            r.args, r.kwargs = fx.map_arg((r.args, r.kwargs), lambda a: value(a) if (
                a in derived and phase[a] not in g.phases) or a in g.values else a)
    for full in g.bucket.full.values():
        erase_unread([g.values[full]])   # what this pass does not read
