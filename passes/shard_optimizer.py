"""shard_optimizer: ZeRO-2 as a rewrite of the program. Each rank reduces,
keeps and updates only its shard of every gradient, optimizer state and
parameter, and the updated parameters are gathered back.

Layout: each parameter p of n elements is flattened and padded to a multiple of
the N ranks its shards are spread over (ctx.shard_over: the world; with
ctx.hierarchical and several nodes, the node, the shards replicated across the
nodes: hybrid sharding); the rank r-th of them owns elements [r*c, (r+1)*c),
c = ceil(n / N) (torch's chunk(N) boundaries, which DTensor's Shard(0) uses
too). A shard has c elements on every rank, so every rank's program has the
same shapes.

Requires: the gradients marked to reduce over the world (average_grads); the
optimizer's state entries shaped like their parameter (momentum, Adam's
moments) fed as shards of c elements (the runtime keeps them so: shards.py).
Produces:
- buckets of gradients as fuse_all_reduce plans them (plan_buckets). Each
  bucket is packed as an [N, L] buffer whose row r is the concatenation of
  rank r's shards of its gradients (cast to ctx.fuse_dtype on the wire where
  set, and back), scaled by 1 / world size and reduce-scattered (hybrid: inside
  the node, then each shard all-reduced across the nodes: transpiler/lowering/reductions.py):
  rank r receives row r, split into the shards of the reduced gradients (marked
  meta["reduced"]);
  the parameters are gathered in their own dtype;
- the gradient processing and the optimizer update (roles GRADIENT and
  OPTIMIZE) computed on shards: every node that reads a gradient, a parameter
  (its shard: flatten, pad, row r) or a sharded state entry is recreated on
  shards; it must be elementwise (pointwise ops, the foreach ops but norms,
  views that keep the flat order). A norm over all gradients (clip_grad_norm_)
  is the rank's partial norm, completed by an all-reduce over the N ranks where
  it is read; GradScaler's unscale runs on the shards, and its found-inf flag,
  this rank's, is completed the same way (a max);
- for each bucket, the updated parameter shards all-gathered (over the N ranks) and unpacked into
  the parameters' new values (role COMM);
- the state outputs are the new shards; the gradients are not outputs (the
  runtime leaves .grad None: a rank holds a shard of the reduced gradient only).
Gradients to average at an earlier backward() (SAM: Reduction.point) are
refused. Anything else that reads a sharded value (a returned gradient, a view that
reorders it, a reduction other than a norm) is an error that names it. Every
mark to reduce is removed. With one rank it does not apply.
Order: after average_grads, before ring_round_robin and schedule_comm (which
issues each reduce-scatter as soon as its gradients exist and each all-gather
as soon as its shards are updated, waiting for both where their results are read).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Sequence

import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from passes.coalesce_tensors import MB, GradInfo, plan_buckets
from transpiler.lowering import reductions as lowering
from transpiler.program.collectives import ALL_GATHER, WAIT, Placement, ReduceOp
from transpiler.errors import PassError
from transpiler.program.mesh import Dim
from transpiler.lowering.context import Mark, PassContext, consumes
from transpiler.program.program import CommInfo, InputKind, OutputKind, Program, new_node
from transpiler.lowering.shards import shard_numel
from transpiler.program.roles import (BUCKET, COMM, GATHERED, INPUT, PARAM_SHARD, REDUCE, REDUCED,
                                      ROLE, Role)

aten = torch.ops.aten

# Ops that are elementwise on every tensor they read besides 0-d ones, so that
# applied to shards they give the shards of their result.
_LIKE = {aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
         aten.full_like.default, aten.detach.default, aten.alias.default,
         aten._to_copy.default, aten.copy.default, aten.clone.default, operator.getitem}
# Views that keep the flat order of a contiguous tensor: a shard's view is the shard.
_FLAT_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
# Views between a complex tensor and its (real, imaginary) pairs, which torch's
# optimizers update a complex parameter's state through: element i of a shard
# is element i of the whole, so the view of a shard is the shard of the view.
_PAIR_VIEWS = {aten.view_as_real.default, aten.view_as_complex.default}
_NORMS = {aten.linalg_vector_norm.default, aten._foreach_norm.Scalar}
_NOT_ELEMENTWISE_FOREACH = {"_foreach_norm", "_foreach_max"}
# torch's fused optimizer kernels (their functional forms): elementwise on
# every tensor of their lists
_FUSED_UPDATES = {aten._fused_adam.tensor_lr, aten._fused_adamw.tensor_lr}
# GradScaler's unscale: elementwise on the gradients, and a flag set where any
# is not finite, which over shards is this rank's flag (completed by a max).
_UNSCALE = aten._amp_foreach_non_finite_check_and_unscale.default


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """A bucket's parameters in order and the size of each one's shard."""

    params: tuple[str, ...]
    chunks: tuple[int, ...]

    @property
    def row(self) -> int:
        return sum(self.chunks)


def plan_layout(buckets: Sequence[Sequence[str]], numels: dict[str, int],
                world_size: int) -> list[BucketLayout]:
    """The shard sizes of each bucket's parameters: a pure function of the plan."""
    return [BucketLayout(tuple(b), tuple(shard_numel(numels[p], world_size) for p in b))
            for b in buckets]


@dataclasses.dataclass(frozen=True)
class _Partial:
    """A norm over this rank's elements only, of order `ord`; its value over
    every rank needs one all-reduce."""

    ord: float


@consumes(Mark.TO_REDUCE)
def shard_optimizer(program: Program, ctx: PassContext) -> None:
    if ctx.world_size == 1:
        return
    marked = program.to_reduce()
    for name, g in marked.items():
        reduction = g.meta[REDUCE]
        if reduction.point:
            raise PassError(
                f"the step reads the gradients of backward() number {reduction.point} before "
                "a later backward() (a GAN's discriminator step, SAM, a lookahead), which DDP "
                "averages where that backward() ends; shard_optimizer averages the gradients "
                "once per step, where the last backward() ends: use mode 'fuse_all_reduce' or "
                "'grad_allreduce' for this step")
        if reduction.over is not Dim.WORLD or reduction.op is not ReduceOp.MEAN:
            raise PassError(f"the gradient of {name} is reduced {reduction}: shard_optimizer "
                            "shards gradients averaged over the world only")
    n = ctx.mesh.size(ctx.shard_over)
    infos = [GradInfo(name, g.meta["val"].dtype,
                      shard_numel(g.meta["val"].numel(), n) * n * g.meta["val"].itemsize)
             for name, g in marked.items()]
    buckets = plan_buckets(infos, int(ctx.bucket_mb * MB), int(ctx.first_bucket_mb * MB))
    layouts = plan_layout(buckets, {k: g.meta["val"].numel() for k, g in marked.items()}, n)
    _Rewrite(program, ctx, marked, layouts).run()
    lowering.forget_marks(program.graph)


class _Rewrite:
    """Recreates the gradient processing and the update on shards."""

    def __init__(self, program: Program, ctx: PassContext, grads: dict[str, fx.Node],
                 layouts: list[BucketLayout]):
        self.program, self.ctx, self.graph = program, ctx, program.graph
        self.grads, self.layouts = grads, layouts
        self.over = ctx.shard_over   # the ranks the shards are spread over
        self.n = ctx.mesh.size(self.over)
        self.bucket_of = {p: b for b, layout in enumerate(layouts) for p in layout.params}
        self.param_nodes = {node.meta[INPUT].name: node for node in program.placeholders
                            if node.meta[INPUT].kind is InputKind.PARAM}
        self.shard: dict[fx.Node, fx.Node] = {}         # full value -> this rank's shard
        self.partial: dict[fx.Node, _Partial | list[_Partial]] = {}
        self.completed: dict[fx.Node, fx.Node] = {}    # partial -> its value over all ranks
        self.replaced: list[fx.Node] = []

    def run(self) -> None:
        position = {node: i for i, node in enumerate(self.graph.nodes)}
        for b, layout in enumerate(self.layouts):
            self._reduce_scatter(b, layout, position)
        self._shard_state()
        region = [node for node in self.graph.nodes if node.op == "call_function"
                  and node.meta.get(ROLE, 0) & (Role.GRADIENT | Role.OPTIMIZE)]
        for node in region:
            self._rewrite(node)
        self._outputs()
        for node in reversed(self.replaced):
            if not node.users:
                self.graph.erase_node(node)

    # ------------------------------------------------------------ gradients

    def _reduce_scatter(self, b: int, layout: BucketLayout, position) -> None:
        grads = [self.grads[p] for p in layout.params]
        last = max(grads, key=position.__getitem__)
        pack = last.meta[ROLE]
        dtype = grads[0].meta["val"].dtype
        wire = self.ctx.fuse_dtype or dtype
        comm = CommInfo("reduce_scatter", bucket=b, params=layout.params,
                        nbytes=layout.row * self.n * wire.itemsize)
        with self.graph.inserting_before(last.next):
            rows = [self._rows(g, c, pack, b) for g, c in zip(grads, layout.chunks)]
            buffer = self._node(aten.cat.default, (rows, 1), pack, b)
            buffer = self._node(aten.view.default, (buffer, [-1]), pack, b)
            if wire != dtype:
                buffer = self._node(aten._to_copy.default, (buffer,), pack, b, {"dtype": wire})
            reduction = dataclasses.replace(grads[0].meta[REDUCE], placement=Placement.SHARD)
            issued = lowering.issue(self.graph, buffer, reduction, self.ctx, comm, pack,
                                    **{BUCKET: b})
            mine = lowering.complete(self.graph, issued, self.ctx, **{BUCKET: b})
            if wire != dtype:
                reduced = mine.meta.pop(REDUCED)
                mine = self._node(aten._to_copy.default, (mine,), Role.COMM, b, {"dtype": dtype})
                mine.meta[REDUCED] = reduced
            parts = self._node(aten.split_with_sizes.default, (mine, list(layout.chunks)),
                               Role.COMM, b)
            for i, g in enumerate(grads):
                self.shard[g] = self._node(operator.getitem, (parts, i), Role.COMM, b)

    def _rows(self, value: fx.Node, chunk: int, role: Role, bucket: int | None) -> fx.Node:
        """value flattened, padded to N * chunk and viewed as N rows of chunk."""
        flat = self._node(aten.reshape.default, (value, [-1]), role, bucket)
        pad = self.n * chunk - value.meta["val"].numel()
        if pad:
            flat = self._node(aten.constant_pad_nd.default, (flat, [0, pad]), role, bucket)
        return self._node(aten.view.default, (flat, [self.n, chunk]), role, bucket)

    # ------------------------------------------------------------ parameters and state

    def _param_shard(self, placeholder: fx.Node, before: fx.Node) -> fx.Node:
        if placeholder not in self.shard:
            chunk = shard_numel(placeholder.meta["val"].numel(), self.n)
            with self.graph.inserting_before(before):
                rows = self._rows(placeholder, chunk, Role.OPTIMIZE, None)
                self.shard[placeholder] = self._node(
                    aten.select.int, (rows, 0, self.ctx.mesh.position(self.over)),
                    Role.OPTIMIZE, None,
                    **{PARAM_SHARD: placeholder.meta[INPUT].name})
        return self.shard[placeholder]

    def _shard_state(self) -> None:
        """State inputs shaped like their sharded parameter hold shards: the
        placeholder's value becomes one (the runtime feeds it so)."""
        for node in self.program.placeholders:
            spec = node.meta[INPUT]
            if spec.kind is not InputKind.STATE or spec.param not in self.bucket_of:
                continue
            val, param = node.meta["val"], self.param_nodes[spec.param].meta["val"]
            if val.shape != param.shape:
                continue
            with val.fake_mode:
                node.meta["val"] = torch.empty(shard_numel(val.numel(), self.n), dtype=val.dtype,
                                               device=val.device)
            node.meta["tensor_meta"] = _extract_tensor_metadata(node.meta["val"])
            self.shard[node] = node

    # ------------------------------------------------------------ the update

    def _rewrite(self, node: fx.Node) -> None:
        inputs = node.all_input_nodes
        reads_partial = [a for a in inputs if a in self.partial]
        reads_shard = [a for a in inputs if a in self.shard or self._sharded_param(a)]
        if not reads_shard and not reads_partial:
            return
        if node.target is _UNSCALE:
            self._unscale(node)
            return
        combines = node.target in (aten.stack.default, operator.getitem)
        if node.target in _NORMS or (combines and reads_partial and not reads_shard):
            self._partial_norm(node)
            return
        for a in reads_partial:   # an ordinary op reads the norm's value over all ranks
            node.replace_input_with(a, self._complete(a))
        if not reads_shard:
            return
        self._check_elementwise(node)
        if node.target in _FLAT_VIEWS:
            self.shard[node] = self.shard[node.args[0]]
            self.replaced.append(node)
            return
        self.shard[node] = self._on_shards(node)
        self.replaced.append(node)

    def _on_shards(self, node: fx.Node) -> fx.Node:
        """node recreated before it, reading shards where it read full values,
        with its meta but its value's, which is computed anew."""
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: self._arg(a, node))
        meta = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
        with self.graph.inserting_before(node):
            return new_node(self.graph, node.target, args, meta.pop(ROLE), kwargs, **meta)

    def _sharded_param(self, node: fx.Node) -> bool:
        return node.op == "placeholder" and node.meta[INPUT].kind is InputKind.PARAM \
            and node.meta[INPUT].name in self.bucket_of

    def _arg(self, a: fx.Node, user: fx.Node) -> fx.Node:
        if a in self.shard:
            return self.shard[a]
        return self._param_shard(a, user) if self._sharded_param(a) else a

    def _check_elementwise(self, node: fx.Node) -> None:
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if node.target in _FLAT_VIEWS:
            ok = node.args[0] in self.shard and node.args[0].meta["val"].is_contiguous()
        elif node.target in _PAIR_VIEWS:
            ok = True
        elif name.startswith("_foreach_"):
            ok = name not in _NOT_ELEMENTWISE_FOREACH
        elif node.target in _FUSED_UPDATES:
            self._check_fused(node)
            ok = True
        else:
            ok = node.target in _LIKE or (isinstance(node.target, torch._ops.OpOverload)
                                         and torch.Tag.pointwise in node.target.tags)
        full = [a for a in node.all_input_nodes if a not in self.shard and not self._sharded_param(a)
                and isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dim() > 0]
        if not ok or full:
            why = (f"it reads {full[0].name}, a full tensor, with shards (a value the step "
                   "computes in full, such as a parameter it writes before the update: "
                   "param.data.clamp_(...) in the forward)" if ok
                   else "it is not elementwise")
            raise PassError(f"{node.name} ({name}) cannot run on shards of the "
                            f"gradients and parameters: {why}. Mode zero shards the update; "
                            "use fuse_all_reduce for this step")

    def _check_fused(self, node: fx.Node) -> None:
        """torch's fused CPU kernel computes the last elements of each tensor
        (those past its last full vector) on a scalar path that rounds
        otherwise: on a shard, other elements are last, and the update would
        not be eager's."""
        if node.args[0][0].meta["val"].device.type == "cpu":
            raise PassError(
                f"{node.name} is torch's fused optimizer update on the CPU, which rounds the "
                "last elements of each tensor otherwise than the rest: on this rank's shards it "
                "would not update as eager does. Use fused=False (torch's foreach update, the "
                "default) on the CPU, or mode fuse_all_reduce")

    def _unscale(self, node: fx.Node) -> None:
        """GradScaler's unscale on shards: its gradients are the shards of the
        unscaled gradients, its flag a partial max over the ranks."""
        new = self._on_shards(node)
        self.replaced.append(node)
        role = node.meta[ROLE]
        with self.graph.inserting_after(new):
            found = self._node(operator.getitem, (new, 1), role, None)
            grads = self._node(operator.getitem, (new, 0), role, None)
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise PassError(f"{user.name} reads {node.name} whole: mode zero unscales shards")
            if user.args[1] == 0:
                self.shard[user] = grads
            else:
                user.replace_all_uses_with(found)
                self.partial[found] = _Partial(float("inf"))
            self.replaced.append(user)

    # ------------------------------------------------------------ norms

    def _partial_norm(self, node: fx.Node) -> None:
        """A norm over shards is the norm over this rank's elements; a stack or
        a norm of such norms (clip_grad_norm_'s total) is too, when their orders agree."""
        if node.target is operator.getitem:
            self.partial[node] = self.partial[node.args[0]][node.args[1]]
            return
        if node.target is aten.stack.default:
            orders = {self.partial[a].ord for a in node.args[0] if a in self.partial}
            if len(orders) != 1 or any(a not in self.partial for a in node.args[0]):
                raise PassError(f"{node.name}: a stack of norms of different orders or of "
                                "other values cannot be computed from shards")
            self.partial[node] = _Partial(orders.pop())
            return
        ord = float(node.args[1] if len(node.args) > 1 else node.kwargs.get("ord", 2.0))
        if node.target is aten.linalg_vector_norm.default:
            source = node.args[0]
            if len(node.args) > 2 or set(node.kwargs) - {"ord"}:
                raise PassError(f"{node.name}: a norm over some dimensions of a gradient cannot "
                                "be computed from shards")
            if source in self.partial and self.partial[source].ord != ord:
                raise PassError(f"{node.name}: a norm of order {ord} of norms of order "
                                f"{self.partial[source].ord} cannot be computed from shards")
        if any(a in self.shard or self._sharded_param(a) for a in node.all_input_nodes):
            new = self._on_shards(node)
            node.replace_all_uses_with(new)
            self.replaced.append(node)
            node = new
        val = node.meta["val"]
        self.partial[node] = [_Partial(ord)] * len(val) if isinstance(val, (list, tuple)) \
            else _Partial(ord)

    def _complete(self, node: fx.Node) -> fx.Node:
        """The norm over every rank's elements: for a finite order p, the p-th
        powers summed over the ranks, then the p-th root; for inf, the max."""
        if node not in self.completed:
            ord, role = self.partial[node].ord, node.meta[ROLE]
            with self.graph.inserting_before(node.next):
                if ord == float("inf"):
                    reduced = lowering.all_reduce_now(self.graph, node, "max", self.ctx,
                                                      self.over)
                elif ord in (0.0, float("-inf")):
                    raise PassError(f"{node.name}: a norm of order {ord} over shards is not supported")
                else:
                    powered = self._node(aten.pow.Tensor_Scalar, (node, ord), role, None)
                    summed = lowering.all_reduce_now(self.graph, powered, "sum", self.ctx,
                                                     self.over)
                    reduced = self._node(aten.pow.Tensor_Scalar, (summed, 1 / ord), role, None)
            self.completed[node] = reduced
        return self.completed[node]

    # ------------------------------------------------------------ outputs

    def _outputs(self) -> None:
        out = self.program.output_node
        values = list(out.args[0])
        inputs = {spec.name: spec for spec in self.program.inputs}
        updated: dict[str, fx.Node] = {}
        new_values: dict[str, fx.Node] = {}   # parameter -> its new value, computed whole
        kept = []
        for spec, value in zip(self.program.outputs, values):
            if value in self.partial:
                value = self._complete(value)
            if value not in self.shard:
                kept.append((spec, value))
                continue
            target = inputs.get(spec.target) if spec.kind is OutputKind.UPDATE else None
            if target is not None and target.kind is InputKind.PARAM:
                updated[spec.target] = self.shard[value]
                new_values[spec.target] = value
                kept.append((spec, spec.target))   # filled in by the all-gather
            elif spec.kind is OutputKind.STATE or (target is not None
                                                   and target.kind is InputKind.STATE):
                kept.append((spec, self.shard[value]))   # state is kept as shards
            elif spec.kind is not OutputKind.GRAD:
                raise PassError(f"the step returns {value.name}, computed elementwise from the "
                                "gradients: mode zero holds only each rank's shard of them; "
                                "return a reduction of it (a norm) or use fuse_all_reduce")
        missing = sorted(set(self.bucket_of) - set(updated))
        if missing:
            raise PassError(f"{missing[0]} has a gradient but the step does not update it from "
                            "that gradient: mode zero keeps only a shard of each reduced "
                            "gradient, for the optimizer; give the parameter to an optimizer "
                            "or set requires_grad=False")
        full = {}
        with self.graph.inserting_before(out):
            for b, layout in enumerate(self.layouts):
                full.update(self._all_gather(b, layout, updated))
        self.program.outputs = [spec for spec, _ in kept]
        out.args = ([full[v] if isinstance(v, str) else v for _, v in kept],)
        self._read_gathered(new_values, full)

    def _read_gathered(self, new_values: dict[str, fx.Node], full: dict[str, fx.Node]) -> None:
        """What the step does with a parameter after its update other than
        update it (an EMA of the model, an evaluation: roles FORWARD, as they
        read the parameter the update wrote in place) reads its gathered new
        value, and runs after the all-gathers with whatever reads it. It read
        the whole update, which computes from the rank's own gradient."""
        out = self.program.output_node
        moved: set[fx.Node] = set()
        for name, value in new_values.items():
            for user in [u for u in value.users if u is not out]:
                user.replace_input_with(value, full[name])
                moved.add(user)
        if not moved:
            return
        for node in self.graph.nodes:   # in order: what reads a moved node moves too
            if node is not out and any(a in moved for a in node.all_input_nodes):
                moved.add(node)
        for node in [n for n in self.graph.nodes if n in moved]:
            out.prepend(node)

    def _all_gather(self, b: int, layout: BucketLayout, updated: dict[str, fx.Node]):
        shards = [updated[p] for p in layout.params]
        row = self._node(aten.cat.default, (shards,), Role.OPTIMIZE, b)
        comm = CommInfo("all_gather", bucket=b, over=self.over, params=layout.params,
                        nbytes=layout.row * self.n * row.meta["val"].itemsize)
        ring = self.ctx.mesh.ring(self.over)
        gathered = self._node(ALL_GATHER, (row, self.n, ring), Role.COMM, b, **{COMM: comm})
        gathered = self._node(WAIT, (gathered,), Role.COMM, b, **{COMM: comm})
        rows = self._node(aten.view.default, (gathered, [self.n, layout.row]), Role.COMM, b)
        parts = self._node(aten.split_with_sizes.default, (rows, list(layout.chunks), 1),
                           Role.COMM, b)
        full = {}
        for i, p in enumerate(layout.params):
            val = self.param_nodes[p].meta["val"]
            flat = self._node(aten.reshape.default,
                              (self._node(operator.getitem, (parts, i), Role.COMM, b), [-1]),
                              Role.COMM, b)
            if flat.meta["val"].numel() != val.numel():
                flat = self._node(aten.slice.Tensor, (flat, 0, 0, val.numel()), Role.COMM, b)
            full[p] = self._laid_out(flat, val, b)
            full[p].meta[GATHERED] = p
        return full

    def _laid_out(self, flat: fx.Node, val: torch.Tensor, b: int) -> fx.Node:
        """The parameter's elements (flat, in index order) with the parameter's
        own strides. Kernels choose their path by layout (BatchNorm's fast path
        wants a contiguous weight, a convolution follows a channels_last
        weight) and paths round differently, so a gathered value is laid out
        as eager's parameter is: a one-element shard's rows are strided, and
        a permuted or channels_last parameter is not in index order."""
        if not flat.meta["val"].is_contiguous():
            flat = self._node(aten.clone.default, (flat,), Role.COMM, b,
                              {"memory_format": torch.contiguous_format})
        if val.is_contiguous():
            return self._node(aten.view.default, (flat, list(val.shape)), Role.COMM, b)
        order = sorted(range(val.dim()), key=lambda d: (-val.stride(d), d))
        shaped = self._node(aten.view.default, (flat, list(val.shape)), Role.COMM, b)
        ordered = self._node(aten.permute.default, (shaped, order), Role.COMM, b)
        packed = self._node(aten.clone.default, (ordered,), Role.COMM, b,
                            {"memory_format": torch.contiguous_format})
        back = sorted(range(val.dim()), key=order.__getitem__)
        return self._node(aten.permute.default, (packed, back), Role.COMM, b)

    def _node(self, target, args, role: Role, bucket: int | None, kwargs=None,
              **meta) -> fx.Node:
        if bucket is not None:
            meta[BUCKET] = bucket
        return new_node(self.graph, target, args, role, kwargs, **meta)
