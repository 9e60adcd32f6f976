"""Reinplacing for eager execution.

A Program is functional: every optimizer update allocates a new tensor and the
runtime copies the new state back. Run op by op, that costs eager PyTorch's
in-place optimizer several times over (fresh memory is touched page by page).
`reinplace` derives an executable copy of the graph in which an op runs in
place on its first argument when nothing reads that argument afterwards, and
reports which state outputs were thereby written in place (their write-back is
a no-op).

State inputs (parameters, buffers, optimizer state) are only written after the
backward pass, every collective and every op that may raise on the values it
gets (failure_points.py) have finished, so such an error (a failed collective,
a bad index in the forward pass or after optimizer.step()) never leaves the
state half updated; ops that feed neither the backward pass nor a collective
are moved after them for that purpose (but random ops, which keep their place
in the generator's sequence of draws).
Intermediates may be reused anywhere: an all-reduce of a buffer nothing else
reads reduces it in place instead of cloning it. Only ops from an allowlist of
elementwise, foreach and collective ops whose in-place form computes the same
values are rewritten, and only when the result has the argument's shape and
dtype and no other argument aliases it; `slice_scatter` into a buffer nothing
reads afterwards becomes a copy into a slice of it (how coalesce_tensors packs a
bucket), and where the copied gradient comes from a matmul or a sum that
nothing else reads, that op writes it there itself (its out= form: the same
kernel, one copy and one temporary fewer; a tied weight's second part is then
added there in place) where the slice is aligned as a new tensor is. Last, a foreach multiply by a scalar tensor that only
feeds an in-place foreach add becomes one addcmul_ (SGD's update by -lr), which
saves a temporary per parameter. An op functionalization made of one that
writes several arguments (GradScaler's unscale_: the gradients and found_inf)
gets its in-place form back where each may be overwritten; and a part of a 1-D
intermediate (a bucket's split or slice) may be overwritten where no view of
it that overlaps the part is read later.
"""

from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx

from ..program.collectives import ALL_REDUCE
from .failure_points import is_foreach, may_fail
from ..capture.functionalize import mutated_index
from ..program.program import OutputKind, Program, draws_random, graph_module
from ..program.roles import DECISION, ROLE, Role

aten = torch.ops.aten

_ELEMENTWISE = {
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.mul.Tensor, aten.mul.Scalar,
    aten.div.Tensor, aten.addcmul.default, aten.addcdiv.default, aten.lerp.Scalar,
    aten.lerp.Tensor, aten.sqrt.default, aten.neg.default, aten.maximum.default,
    ALL_REDUCE,
}
_FOREACH_PREFIX = "_foreach_"
# Ops whose result shares storage with their first argument: every op whose
# schema says its result aliases an argument it does not write (view_as_real
# of a complex optimizer state, unfold, narrow, ...), and those that share it
# without saying so in their schema.
_UNDECLARED_VIEWS = {aten.reshape.default, aten._unsafe_view.default}


def _is_view(target) -> bool:
    if target in _UNDECLARED_VIEWS:
        return True
    return isinstance(target, torch._ops.OpOverload) and any(
        r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns)


def _underscored(target: torch._ops.OpOverload):
    """The overload of the op named target's name + "_" (its in-place form), or None."""
    namespace, name = target._schema.name.split("::")
    packet = getattr(getattr(torch.ops, namespace), name + "_", None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


def _inplace_variant(target):
    if not isinstance(target, torch._ops.OpOverload):
        return None
    namespace, name = target._schema.name.split("::")
    if target not in _ELEMENTWISE and not (namespace == "aten" and name.startswith(_FOREACH_PREFIX)):
        return None
    return _underscored(target)


def _mutating_variant(target) -> tuple[torch._ops.OpOverload, list[int]] | None:
    """(op_, the positions of the arguments it writes) where target is the
    functional form functionalization makes of an op that writes several
    arguments and returns nothing (_amp_foreach_non_finite_check_and_unscale_
    writes the gradients and found_inf): one result per written argument, in
    order, each named after it. (An op that writes one argument is
    _inplace_variant's.)"""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    variant = _underscored(target)
    if variant is None or variant._schema.returns:
        return None
    written = [i for i, a in enumerate(variant._schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write]
    names = [variant._schema.arguments[i].name + "_out" for i in written]
    if len(written) < 2 or [r.name for r in target._schema.returns] != names:
        return None
    return variant, written


def _aliases(node: fx.Node) -> set[fx.Node]:
    """The node and every view taken of it, transitively."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo += [u for u in n.users if _is_view(u.target)
                 or (u.target is operator.getitem and _is_view(u.args[0].target))]
    return seen


def _is_base(node: fx.Node) -> bool:
    """Not itself a view of another tensor."""
    if node.op == "placeholder":
        return True
    if node.target is operator.getitem:
        return not _is_view(node.args[0].target)
    return node.op == "call_function" and not _is_view(node.target)


def _sink_after_gradients(graph: fx.Graph) -> fx.Node | None:
    """Move the nodes that feed neither the backward pass nor a collective after
    the last node that does, keeping their order; return that node (None if
    there is none). A random op stays (and what it reads): moved, it would draw
    after the backward pass's random ops, other numbers than eager's. So does a
    decision's check: moved, a rank whose decision changed would issue the
    collectives of the program it leaves (capture/decisions.py)."""
    nodes = list(graph.nodes)
    ends = [i for i, n in enumerate(nodes) if n.op == "call_function"
            and n.meta.get(ROLE, Role.FORWARD) & (Role.BACKWARD | Role.COMM)]
    if not ends:
        return None
    feeds: set[fx.Node] = set()
    for n in reversed(nodes[:ends[-1] + 1]):
        if (n.meta.get(ROLE, Role.FORWARD) & (Role.BACKWARD | Role.COMM) or draws_random(n)
                or DECISION in n.meta or any(u in feeds for u in n.users)):
            feeds.add(n)
    end = anchor = nodes[ends[-1]]
    for n in nodes[:ends[-1]]:
        if n.op == "call_function" and n not in feeds:
            anchor.append(n)
            anchor = n
    return end


def reinplace(program: Program) -> tuple[fx.GraphModule, list[bool]]:
    """An executable copy of the program's graph with in-place updates, and for
    each output whether it is an `update` already written in place."""
    gm = graph_module(program.gm, copy.deepcopy(program.graph))
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    out = graph.output_node()
    by_name = {spec.name: node for spec, node in zip(program.inputs, placeholders)}
    # The placeholder each output writes back to (None for the step's own outputs).
    written_to = [by_name[spec.target] if spec.kind is OutputKind.UPDATE else None
                  for spec in program.outputs]
    donated = {p for p in written_to if p is not None}
    # State is written only after `end`; fx nodes compare by their place in the graph.
    end = max(filter(None, [_sink_after_gradients(graph), *filter(may_fail, graph.nodes)]),
              default=None)

    def reusable(x, node, others: set[fx.Node]) -> bool:
        """x (an input of node) may be overwritten by node: `others` are node's
        other inputs, which must not alias it."""
        if not isinstance(x, fx.Node) or out in x.users:
            return False
        if not _is_base(x):
            return _part_reusable(x, node, others, out)
        if x.op == "placeholder" and (x not in donated or (end is not None and node <= end)):
            return False
        alias = _aliases(x)
        late = any(u is not node and u > node for a in alias for u in a.users)
        return not late and alias.isdisjoint(others)

    def other_inputs(node) -> set[fx.Node]:
        return {a for a in torch.utils._pytree.tree_leaves((node.args[1:], node.kwargs))
                if isinstance(a, fx.Node)}

    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.slice_scatter.default:
            buffer = node.args[0]
            if reusable(buffer, node, other_inputs(node)) and _same_layout(buffer, node.meta["val"]):
                _scatter_in_place(graph, node)
            continue
        mutating = _mutating_variant(node.target)
        if mutating is not None:
            _write_arguments_in_place(graph, node, *mutating, reusable)
            continue
        variant = _inplace_variant(node.target)
        if variant is None or not node.args:
            continue
        if is_foreach(node.target):
            selves = node.args[0]
            vals = node.meta["val"]
            others = other_inputs(node)
            if not isinstance(selves, (list, tuple)) or not all(
                    reusable(x, node, others) and _same_layout(x, v) for x, v in zip(selves, vals)):
                continue
            if len(set(selves)) != len(selves) or not _read_by_item(node):
                continue
            node.target = variant
            _items_to_selves(graph, node, selves)
        else:
            x = node.args[0]
            if not (reusable(x, node, other_inputs(node)) and _same_layout(x, node.meta["val"])):
                continue
            node.target = variant
            node.replace_all_uses_with(x, delete_user_cb=lambda u: u is not node)
    _produce_into_slices(graph)
    _write_rows_in_place(graph, written_to)
    _fuse_scaled_adds(graph)
    graph.lint()
    gm.recompile()
    in_place = [target is not None and value is target
                for target, value in zip(written_to, out.args[0])]
    return gm, in_place


def _write_arguments_in_place(graph: fx.Graph, node: fx.Node, variant, written: list[int],
                              reusable) -> None:
    """node -> variant(...) writing its arguments at `written` in place, where
    each tensor there (each of a list) may be overwritten and has its result's
    layout: result k becomes the k-th written argument. A tensor may be
    written only once; what the node only reads must not alias what it writes."""
    args = list(node.args)
    if len(args) <= max(written):
        return
    targets = [args[i] for i in written]
    flat = torch.utils._pytree.tree_leaves(targets)
    read = {a for i, a in enumerate(args) if i not in written for a in
            torch.utils._pytree.tree_leaves(a) if isinstance(a, fx.Node)}
    read |= {a for a in torch.utils._pytree.tree_leaves(node.kwargs) if isinstance(a, fx.Node)}
    vals = torch.utils._pytree.tree_leaves(list(node.meta["val"]))
    items = [u for u in node.users if u.target is operator.getitem]
    if len(items) != len(node.users) or not all(
            _read_by_item(u) for u in items if isinstance(targets[u.args[1]], (list, tuple))):
        return
    if len(flat) != len(vals) or len(set(flat)) != len(flat) or not all(
            reusable(x, node, read | (set(flat) - {x})) and _same_layout(x, v)
            for x, v in zip(flat, vals)):
        return
    for item in items:
        target = targets[item.args[1]]
        if isinstance(target, (list, tuple)):
            _items_to_selves(graph, item, target)
        else:
            item.replace_all_uses_with(target)
        graph.erase_node(item)
    node.target = variant


def _part(x: fx.Node) -> tuple[fx.Node, int, int] | None:
    """(base, start, end) where x is elements start:end of a 1-D intermediate
    base, in order (a bucket's slice or split part, reshaped); else None."""
    while x.target in _RESHAPES:
        x = x.args[0]
    if x.target is operator.getitem and x.args[0].target in _SPLITS:
        split = x.args[0]
        base, sizes = split.args[0], split.args[1]
        if split.args[2:] not in ((), (0,)) or split.kwargs:
            return None
        if isinstance(sizes, int):   # split(base, size): equal parts, the last one shorter
            sizes = [sizes] * x.args[1] + [sizes]
        start = sum(sizes[:x.args[1]])
        end = start + sizes[x.args[1]]
    elif (span := _span(x)) is not None:
        base, (start, end) = x.args[0], span
    else:
        return None
    if not _is_base(base) or base.op == "placeholder" or base.meta["val"].dim() != 1:
        return None
    return base, start, min(end, base.meta["val"].shape[0])


def _part_reusable(x: fx.Node, node: fx.Node, others: set[fx.Node], out: fx.Node) -> bool:
    """x, a part of an intermediate (_part), may be overwritten by node: no
    view of its base that overlaps it is read after node (or output), or is
    one of node's other inputs. A view whose elements are not known overlaps."""
    part = _part(x)
    if part is None:
        return False
    base, start, end = part
    for alias in _aliases(base):
        other = _part(alias) if alias is not base else None
        if other is not None and (other[1] >= end or other[2] <= start):
            continue
        if alias in others or any(u is not node and (u > node or u is out) for u in alias.users):
            return False
    return True


def _read_by_item(node: fx.Node) -> bool:
    """Whether a list result is read only item by item (an in-place op returns
    no list to pass on whole)."""
    return all(u.target is operator.getitem for u in node.users)


def _items_to_selves(graph: fx.Graph, node: fx.Node, selves) -> None:
    """Every use of getitem(node, i) becomes selves[i], and the getitems go:
    one rewrite of each user's arguments, not one per item (a foreach op's
    user lists hundreds)."""
    items = {u: selves[u.args[1]] for u in node.users if u.target is operator.getitem}
    for user in dict.fromkeys(v for item in items for v in item.users):
        user.args, user.kwargs = fx.node.map_arg((user.args, user.kwargs), lambda a: items.get(a, a))
    for item in items:
        graph.erase_node(item)


def _scatter_in_place(graph: fx.Graph, node: fx.Node) -> None:
    """slice_scatter(buf, src, dim, start, end, step) ->
    copy_(slice(buf, dim, start, end, step), src)."""
    buffer, src, *rest = node.args
    dim, start, end, step = (list(rest) + [0, None, None, 1][len(rest):])
    with graph.inserting_before(node):
        part = graph.call_function(aten.slice.Tensor, (buffer, dim, start, end)
                                   + ((step,) if step != 1 else ()))
        copy = graph.call_function(aten.copy_.default, (part, src))
    part.meta.update(node.meta)
    copy.meta.update(node.meta)
    node.replace_all_uses_with(buffer)
    graph.erase_node(node)


# Ops that compute a gradient and can write it into a given tensor, with the
# same kernel: the out= overload of each.
_OUT_FORMS = {aten.mm.default: aten.mm.out, aten.sum.dim_IntList: aten.sum.IntList_out}
# The alignment of a new CPU tensor (c10's allocator), in bytes. mm's kernels
# round differently into an output less aligned than that (a 7x13 product into
# a slice 4 bytes off), so a gradient is produced into its slice only where the
# slice starts at this alignment from the bucket's start (itself a new tensor).
ALIGNMENT = 64
# Views that keep the elements in order (a gradient reshaped to its slice).
_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
# Views into consecutive parts along a dimension (a bucket unpacked).
_SPLITS = (aten.split_with_sizes.default, aten.split.Tensor)


def _produce_into_slices(graph: fx.Graph) -> None:
    """copy_(slice(buf, 0, ...), reshape(op(...))) -> op(..., out=view(slice(buf, 0, ...)))
    where op has an out= form (_OUT_FORMS), its contiguous result of buf's dtype
    is read only by that copy (through views) and written only by in-place ops
    before it (a tied weight's second contribution, added in place), buf is a
    1-D intermediate (never state, written only after the collectives) and
    nothing between op and the copy touches buf outside the other gradients'
    slices: the gradient is computed straight into its bucket. A bucket
    allocated after op (new_empty like its first gradient) is allocated before
    it instead, like op's first input."""
    views: dict[fx.Node, _BucketViews] = {}
    for write in [n for n in graph.nodes if n.target is aten.copy_.default]:
        found = _producer(write)
        if found is None:
            continue
        op, chain, adds = found
        part = write.args[0]
        buffer = part.args[0]
        span = _span(part)
        if span is None or span[0] * buffer.meta["val"].element_size() % ALIGNMENT:
            continue   # a kernel may round otherwise where its output is not aligned as a new tensor
        if buffer not in views:
            views[buffer] = _BucketViews(buffer)
        bucket = views[buffer]
        elsewhere = bucket.elsewhere(span)
        alias, n = bucket.all - elsewhere, op.next
        while n is not write and (n in chain or n is part or n is buffer or n in elsewhere
                                  or alias.isdisjoint(n.all_input_nodes)):
            adds.discard(n)
            n = n.next
        if n is not write or adds:   # something touched buf, or op is written after the copy
            continue
        if buffer > op:   # fx keeps the graph's order as nodes move
            like = op.args[0]
            if (buffer.target is not aten.new_empty.default or len(buffer.all_input_nodes) != 1
                    or buffer.kwargs.get("dtype") != buffer.meta["val"].dtype
                    or not isinstance(like, fx.Node)):
                continue
            buffer.args = (like,) + tuple(buffer.args[1:])
            op.prepend(buffer)
        shape = list(op.meta["val"].shape)
        with graph.inserting_before(op):
            dst = graph.call_function(aten.slice.Tensor, part.args, part.kwargs)
            dst.meta.update(part.meta)
            if shape != [op.meta["val"].numel()]:
                dst = graph.call_function(aten.view.default, (dst, shape))
                dst.meta.update(part.meta)
        bucket.add(span, {dst, dst.args[0]} - {buffer})
        op.target = _OUT_FORMS[op.target]
        op.kwargs = {**op.kwargs, "out": dst}
        graph.erase_node(write)
        for n in [part] + chain:
            if not n.users:
                graph.erase_node(n)


def _span(node: fx.Node) -> tuple[int, int] | None:
    """(start, end) of slice(x, 0, start, end) with constant bounds, else None."""
    if (node.target is not aten.slice.Tensor or len(node.args) != 4 or node.args[1] != 0
            or not all(isinstance(i, int) for i in node.args[2:])):
        return None
    return node.args[2], node.args[3]


class _BucketViews:
    """The views of a bucket: all of them, and those of each slice of it."""

    def __init__(self, buffer: fx.Node):
        self.all = _aliases(buffer)
        self.slices = [(span, _aliases(s)) for s in buffer.users if (span := _span(s))]

    def elsewhere(self, span: tuple[int, int]) -> set[fx.Node]:
        """The views of the slices that do not overlap `span` (the other
        gradients' places in the bucket)."""
        start, end = span
        return {a for (s, e), nodes in self.slices if e <= start or s >= end for a in nodes}

    def add(self, span: tuple[int, int], nodes: set[fx.Node]) -> None:
        self.all |= nodes
        self.slices.append((span, nodes))


def _producer(write: fx.Node) -> tuple[fx.Node, list[fx.Node], set[fx.Node]] | None:
    """For copy_(slice(buf, 0, a, b), src) of a 1-D intermediate buf: the op
    with an out= form that src views, the views between them, and the in-place
    ops that write op's result (read by nothing); None if there is no such op,
    or anything else reads its result."""
    part, src = write.args
    if write.users or not isinstance(src, fx.Node) or len(src.users) != 1 or not _span(part):
        return None
    buffer = part.args[0]   # new_empty may be like the gradient or a view of it
    into = buffer.meta.get("val")
    if buffer.op == "placeholder" or not isinstance(into, torch.Tensor) or into.dim() != 1:
        return None
    chain, op = [], src
    while op.target in _RESHAPES and len(set(op.users) - {buffer}) == 1:
        chain.append(op)
        op = op.args[0]
    val = op.meta.get("val")
    if (op.target not in _OUT_FORMS or "out" in op.kwargs or not isinstance(val, torch.Tensor)
            or not val.is_contiguous() or val.dtype != into.dtype):
        return None
    adds = set(op.users) - {buffer, (chain or [write])[-1]}
    if not all(_writes_in_place(u, op) for u in adds):
        return None
    return op, chain, adds


def _writes_in_place(node: fx.Node, x: fx.Node) -> bool:
    """node is an in-place op on x (its first argument, the only one it writes)
    that reads x nowhere else and whose result nothing reads."""
    return (isinstance(node.target, torch._ops.OpOverload) and mutated_index(node.target) == 0
            and node.args[:1] == (x,) and not node.users
            and x not in torch.utils._pytree.tree_leaves((node.args[1:], node.kwargs)))


def _fuse_scaled_adds(graph: fx.Graph) -> None:
    """_foreach_add_(xs, getitems(_foreach_mul(ys, s))) -> _foreach_addcmul_(xs, ys, [s] * n)
    when s is a tensor and the products feed nothing else."""
    for add in list(graph.nodes):
        if add.target is not aten._foreach_add_.List or add.kwargs:
            continue
        items = add.args[1]
        mul = items[0].args[0] if items and items[0].target is operator.getitem else None
        if (mul is None or mul.target is not aten._foreach_mul.Tensor
                or len(mul.users) != len(items)
                or any(i.target is not operator.getitem or i.args != (mul, k) or len(i.users) != 1
                       for k, i in enumerate(items))):
            continue
        ys, scale = mul.args
        with graph.inserting_before(add):
            fused = graph.call_function(aten._foreach_addcmul_.Scalar,
                                        (add.args[0], ys, [scale] * len(ys)))
        fused.meta.update(add.meta)
        graph.erase_node(add)
        for item in items:
            graph.erase_node(item)
        graph.erase_node(mul)


def _write_rows_in_place(graph: fx.Graph, written_to: list) -> None:
    """An update of an input computed as rows [N, c] (strided) flattened, cut
    to the input's size and viewed as it (mode zero unpacks each parameter from
    its all-gathered bucket so) -> the rows copied straight into the input, at
    the end (after every collective): one copy where the reshape and the
    write-back made two."""
    out = graph.output_node()
    values = list(out.args[0])

    def node(op, *args):   # the update's write, after every collective
        new = graph.call_function(op, args)
        new.meta[ROLE] = Role.OPTIMIZE
        return new

    for i, (target, value) in enumerate(zip(written_to, values)):
        rows, m = _unpacked_rows(value, target)
        if rows is None or any(a in values for a in _aliases(target)) or values.count(value) > 1:
            continue
        c = rows.meta["val"].shape[1]
        full, rest = divmod(m, c)
        with graph.inserting_before(out):
            flat = node(aten.view.default, target, [-1])
            if full:
                part = node(aten.view.default, node(aten.slice.Tensor, flat, 0, 0, full * c),
                            [full, c])
                node(aten.copy_.default, part, node(aten.slice.Tensor, rows, 0, 0, full))
            if rest:
                part = node(aten.slice.Tensor, flat, 0, full * c, m)
                src = node(aten.select.int, rows, 0, full)
                node(aten.copy_.default, part, node(aten.slice.Tensor, src, 0, 0, rest))
        values[i] = target
        out.args = (values,)
        while value is not rows and not value.users:
            below = value.args[0]
            graph.erase_node(value)
            value = below


def _unpacked_rows(value, target) -> tuple[fx.Node | None, int]:
    """(rows, the target's numel) when value is view(slice?(reshape(rows, [-1])),
    shape) of strided 2-D rows, each step read only by the next; else (None, 0)."""
    if target is None or not isinstance(value, fx.Node) or value.target is not aten.view.default:
        return None, 0
    tv = target.meta["val"]
    flat = value.args[0]
    if flat.target is aten.slice.Tensor and flat.args[1:] == (0, 0, tv.numel()):
        if len(flat.users) != 1:
            return None, 0
        flat = flat.args[0]
    if flat.target is not aten.reshape.default or flat.args[1] != [-1] or len(flat.users) != 1:
        return None, 0
    rows = flat.args[0]
    rv = rows.meta.get("val")
    if (len(value.users) != 1 or not isinstance(rv, torch.Tensor) or rv.dim() != 2
            or rv.is_contiguous() or not tv.is_contiguous() or rv.dtype != tv.dtype
            or list(value.args[1]) != list(tv.shape) or rv.numel() < tv.numel()):
        return None, 0
    return rows, tv.numel()


def _same_layout(x: fx.Node, val) -> bool:
    xv = x.meta.get("val")
    return (isinstance(xv, torch.Tensor) and isinstance(val, torch.Tensor)
            and xv.shape == val.shape and xv.dtype == val.dtype and xv.stride() == val.stride())
