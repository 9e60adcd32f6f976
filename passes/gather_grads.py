"""gather_grads: Paddle's all_gather mode. Every rank gathers every rank's
gradients and applies the update once per rank's gradient, in rank order, so
all ranks take the same N updates per step.

Requires: a captured program whose optimizer state exists before the step
(state the step creates would start again from zeros at every replay: refused)
and no torch.amp.GradScaler among its optimizers' steps (refused: its found_inf
decides one skip and one scale update for the whole step, which N replays of
the update, each with one rank's gradients, do not have).
Produces:
- buckets of the gradients as fuse_all_reduce plans them (plan_buckets); each
  bucket flattened and concatenated into a row (role of its last gradient,
  meta["bucket"]), all-gathered over the world into N rows (role COMM);
- the gradient processing and the update (roles GRADIENT and OPTIMIZE) replayed
  N times after the last of them: replay r reads rank r's gradients, and the
  parameters and optimizer state as replay r - 1 left them (the inputs for
  r = 0), and for r > 0 its own inputs of the values the host derives from the
  step count (Adam's bias corrections: Hyper.ahead = r). The new parameters
  and state are the last replay's. What the step
  returns and the .grad it leaves come from the replay of the rank's own
  gradient (the program's only rank-dependent choice, as in DDP's local
  .grad). The original region is removed.
A step that reads the gradients of an earlier backward() (SAM;
transpiler/program/averaging.py) is refused. With one rank it does not apply.
Order: first, then ring_round_robin and schedule_comm (which issues each
all-gather as soon as its gradients exist).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from transpiler.program.averaging import early_averages
from transpiler.program.collectives import ALL_GATHER, WAIT
from transpiler.errors import PassError
from transpiler.program.mesh import Dim
from transpiler.capture.optimizers import PER_STEP
from transpiler.capture.scaler import SKIPS
from transpiler.lowering.context import PassContext
from transpiler.program.program import CommInfo, InputKind, OutputKind, Program, new_node
from transpiler.program.roles import BUCKET, COMM, INPUT, PARAM, ROLE, Role

from .coalesce_tensors import MB, GradInfo, plan_buckets

aten = torch.ops.aten
_REGION = Role.GRADIENT | Role.OPTIMIZE


def gather_grads(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    early = early_averages(program)
    if early:
        raise PassError(
            f"the step reads the gradients of backward() number {min(early)} before a later "
            "backward() (a GAN's discriminator step, SAM, a lookahead); gather_grads gathers "
            "the gradients once per step, where the last backward() ends: use mode "
            "'fuse_all_reduce' or 'grad_allreduce' for this step")
    grads = program.grads
    region = [n for n in program.graph.nodes
              if n.op == "call_function" and n.meta.get(ROLE, 0) & _REGION]
    if not grads or not region:
        return
    if any(SKIPS in n.meta for n in program.graph.nodes):
        raise PassError(
            "the step steps its optimizer through a torch.amp.GradScaler, whose found_inf "
            "(from unscale_) decides one skip and one scale update for the whole step; mode "
            "all_gather applies one update per rank's gradients and has no such single "
            "decision: use mode 'fuse_all_reduce' or 'grad_allreduce' with a GradScaler")
    infos = [GradInfo(name, g.meta["val"].dtype, g.meta["val"].nbytes) for name, g in grads.items()]
    plan = plan_buckets(infos, int(ctx.bucket_mb * MB), int(ctx.first_bucket_mb * MB))
    position = {node: i for i, node in enumerate(program.graph.nodes)}
    gathered: dict[fx.Node, list[fx.Node]] = {}   # gradient -> its value on each rank
    for bucket, names in enumerate(plan):
        gathered.update(_gather(program, ctx, bucket, [grads[n] for n in names], position))
    _replay(program, ctx, region, gathered)


def _gather(program: Program, ctx: PassContext, bucket: int, grads: list[fx.Node], position):
    graph, n = program.graph, ctx.world_size
    last = max(grads, key=position.__getitem__)
    sizes = [g.meta["val"].numel() for g in grads]
    comm = CommInfo("all_gather", bucket=bucket, params=tuple(g.meta[PARAM] for g in grads),
                    nbytes=sum(sizes) * n * grads[0].meta["val"].itemsize)

    def node(target, args, role, **meta):
        return new_node(graph, target, args, role, **{BUCKET: bucket}, **meta)

    per_rank = {}
    with graph.inserting_before(last.next):
        flats = [node(aten.reshape.default, (g, [-1]), last.meta[ROLE]) for g in grads]
        row = node(aten.cat.default, (flats,), last.meta[ROLE])
        issued = node(ALL_GATHER, (row, n, ctx.mesh.ring(Dim.WORLD)), Role.COMM, **{COMM: comm})
        rows = node(aten.view.default, (node(WAIT, (issued,), Role.COMM, **{COMM: comm}),
                                        [n, sum(sizes)]), Role.COMM)
        parts = node(aten.split_with_sizes.default, (rows, sizes, 1), Role.COMM)
        for i, g in enumerate(grads):
            part = node(operator.getitem, (parts, i), Role.COMM)
            per_rank[g] = [node(aten.view.default, (node(aten.select.int, (part, 0, r), Role.COMM),
                                                    list(g.meta["val"].shape)), Role.COMM)
                           for r in range(n)]
    return per_rank


def _replay(program: Program, ctx: PassContext, region: list[fx.Node],
            gathered: dict[fx.Node, list[fx.Node]]) -> None:
    graph, out = program.graph, program.output_node
    in_region = set(region)
    values = list(out.args[0])
    placeholders = {node.meta[INPUT].name: node for node in program.placeholders}
    threaded = {}   # placeholder -> the output that is its new value, computed in the region
    for spec, value in zip(program.outputs, values):
        if value not in in_region:
            continue
        if spec.kind is OutputKind.STATE:
            raise PassError(f"the step creates optimizer state ({spec.target}): mode all_gather "
                            "replays the update once per rank and needs the state to exist "
                            "before the step; take one step of the optimizer first")
        if spec.kind is OutputKind.UPDATE:
            threaded[placeholders[spec.target]] = value
    outside = [u for node in region for u in node.users if u not in in_region and u is not out]
    position = {node: i for i, node in enumerate(graph.nodes)}
    if any(position[u] < position[region[-1]] for u in outside):
        raise PassError(f"{outside[0].name} reads the update before it ends: mode all_gather "
                        "replays the whole update after its last node")
    per_step = [node for node in placeholders.values()
                if node.meta[INPUT].kind is InputKind.HYPER and node.meta[INPUT].hyper.key in PER_STEP]
    copies: list[dict[fx.Node, fx.Node]] = []
    anchor = region[-1]
    for r in range(ctx.world_size):
        env = {g: ranks[r] for g, ranks in gathered.items()}
        if copies:
            env.update({p: copies[-1][value] for p, value in threaded.items()})
            env.update({p: _ahead(program, p, r) for p in per_step})
        for node in region:
            with graph.inserting_after(anchor):
                anchor = env[node] = graph.node_copy(node, lambda a: env.get(a, a))
        copies.append(env)
    final, own = copies[-1], copies[ctx.rank]
    kinds = [spec.kind for spec in program.outputs]
    out.args = (tuple(final[v] if v in in_region and kind is OutputKind.UPDATE
                      else own.get(v, v) for v, kind in zip(values, kinds)),)
    for u in outside:
        u.args, u.kwargs = fx.node.map_arg((u.args, u.kwargs), lambda a: own.get(a, a))
    for node in reversed(region):
        graph.erase_node(node)


def _ahead(program: Program, node: fx.Node, r: int) -> fx.Node:
    """A new input of what hyperparameter input `node` holds, for the r-th update after it."""
    spec = node.meta[INPUT]
    hyper = dataclasses.replace(spec.hyper, ahead=r)
    return program.add_input(dataclasses.replace(spec, name=f"{spec.name}+{r}", hyper=hyper),
                             node, f"{node.name}_{r}")
