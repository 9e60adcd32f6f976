"""The program's graph as a compiler gets it (backends.py): the same values, in
forms the compiler lowers well. Each rewrite edits a copy of the program's
graph, never the program (its listing stays as traced).

    packs_as_cat        a bucket's pack (new_empty, slice_scatter per value) -> one cat
    views_as_reshapes   view -> reshape, chosen again from the compiler's strides
    reshapes_in_steps   a reshape that splits and merges dimensions at once ->
                        a split, then a merge (symbolic batch dimensions)
    draws_as_kernels    bernoulli(x, p), randperm(n) -> a kernel that returns its own buffer
    draws_in_eager_order  a random op's input -> laid out as eager's
    pool_grads_as_kernels  avg_pool's backward with ceil_mode -> ATen's kernel
    scatters_as_kernels    index_put with accumulate -> ATen's kernel
    unscales_as_math    GradScaler's unscale -> a multiply and a finiteness check
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from ..capture.kernel_layouts import memory_order
from ..capture.shapes import is_symbolic
from ..program.program import draws_random, new_node
from ..program.roles import ROLE

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default)
_BERNOULLI_P = aten.bernoulli.p
_RESHAPE = aten.reshape.default
_UNSCALE = aten._amp_foreach_non_finite_check_and_unscale.default
_INDEX_PUT = aten.index_put.default
_AVG_POOL_BACKWARD = {2: aten.avg_pool2d_backward.default, 3: aten.avg_pool3d_backward.default}


def views_as_reshapes(graph: fx.Graph) -> None:
    """view(x, shape) -> reshape(x, shape). Capture recorded a view wherever
    x's strides, as eager computes them, allowed one (matmul's and reshape's
    own decompositions choose between a view and a copy from the strides).
    A compiler retraces the program through its own decompositions, which
    may lay a value out differently: inductor's cat drops an empty 1-D input
    (an empty KV cache) and clones the other one with its strides, where
    eager's cat is contiguous, and the view after it no longer exists.
    reshape makes the same choice again from the strides the compiler gets.
    The program is functional (no value is written through a view), so both
    compute the same values; inductor turns its own views into reshapes too
    (post_grad.view_to_reshape), but only after that retrace."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _VIEWS:
            node.target = _RESHAPE


@torch.library.custom_op("transpiler::bernoulli", mutates_args=(),
                         tags=torch.Tag.nondeterministic_seeded)
def _bernoulli(like: torch.Tensor, p: float) -> torch.Tensor:
    return torch.bernoulli(like, p)


@_bernoulli.register_fake
def _(like, p):
    return torch.empty_like(like)


@torch.library.custom_op("transpiler::randperm", mutates_args=(),
                         tags=torch.Tag.nondeterministic_seeded)
def _randperm(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randperm(n, dtype=dtype, device=device)


@_randperm.register_fake
def _(n, dtype, device):
    return torch.empty(n, dtype=dtype, device=device)


def draws_as_kernels(graph: fx.Graph) -> None:
    """bernoulli(x, p) (dropout's mask, as sdpa's math path draws it) and
    randperm(n) -> the same ATen kernel behind a custom op, which returns a
    buffer of its own; each draws what eager draws, from the default
    generator, at the same point. With fallback_random, inductor lowers
    bernoulli(x, p) as bernoulli_ on a clone of x, and fuses the clone's
    kernel (of an empty_like: NaN) with a consumer of the mask, which then
    reads the mask before bernoulli_ has drawn it: T5's attention dropout gave
    NaN losses, and ViT's dropout (traced with generator=None spelled out)
    from its second call. inductor's pattern for a batch indexed by a
    randperm (`x[torch.randperm(n)]`, mixup's partner batch) failed to compile
    where the permutation is not sliced (torch 2.13; torch.compile fails on
    it too)."""
    for node in graph.nodes:
        if (node.op == "call_function" and node.target is _BERNOULLI_P
                and set(node.kwargs) <= {"generator"} and node.kwargs.get("generator") is None):
            node.target = torch.ops.transpiler.bernoulli.default
            node.kwargs = {}
        elif node.op == "call_function" and node.target is aten.randperm.default \
                and node.kwargs.get("layout") in (None, torch.strided):
            val = node.meta["val"]
            node.target = torch.ops.transpiler.randperm.default
            node.args, node.kwargs = (node.args[0], val.dtype, val.device), {}


@torch.library.custom_op("transpiler::in_order", mutates_args=())
def _in_order(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    return torch.empty_permuted(x.shape, order, dtype=x.dtype, device=x.device).copy_(x)


@_in_order.register_fake
def _(x, order):
    return torch.empty_permuted(x.shape, order, dtype=x.dtype, device=x.device)


def lower_in_order() -> None:
    """Inductor's lowering of in_order: x's buffer takes that order where its
    layout is still inductor's to choose (no copy), and is copied into it
    where not. Registered where inductor is imported (backends/compile.py)."""
    from torch._inductor import ir
    from torch._inductor.lowering import lowerings, register_lowering
    if torch.ops.transpiler.in_order.default in lowerings:
        return

    @register_lowering(torch.ops.transpiler.in_order.default, type_promotion_kind=None)
    def _(x, order):
        rank = {d: len(order) - 1 - k for k, d in enumerate(order)}   # 0: the innermost
        return ir.ExternKernel.require_stride_order(x, [rank[d] for d in range(len(order))])


def draws_in_eager_order(graph: fx.Graph) -> None:
    """draw(x, ...) -> draw(in_order(x, order), ...) for each random op and
    each tensor x it takes, order: x's order in memory as traced, which is
    eager's (capture/kernel_layouts.py). A random kernel's numbers follow the
    layouts of its inputs: rand_like(x), dropout and an in-place draw's twin
    (capture/random_layout.py) fill a tensor laid out as x in memory order,
    multinomial reads its rows in x's order, and some kernels draw another
    count of numbers for a contiguous tensor (normal_'s vectorized fill). A
    compiler lays its values out as it chooses: inductor's batch norm keeps a
    transposed input's layout where CPU's kernel returns a contiguous tensor,
    and dropout after it drew other masks than eager from the second call on;
    inductor made a channels_last copy contiguous, and randn_like of it drew
    other numbers. An x that is not dense (a strided view filled in place),
    has one dimension, or has symbolic sizes keeps the compiler's layout: an
    order read at the sizes' hints would differ between ranks of one node
    (a dimension of one row on one of them), which compile one program, and
    from eager's at other sizes. An attention op whose dropout probability
    is 0 draws nothing (CPU's flash attention, which carries the random tag,
    takes no other): its q, k and v keep the compiler's layout, which a copy
    into eager's cost the bench's transformer about a tenth of its step."""
    for node in list(graph.nodes):
        if node.op != "call_function" or not draws_random(node) or _without_dropout(node):
            continue
        for x in {x for x in node.all_input_nodes if isinstance(x.meta.get("val"), torch.Tensor)}:
            val = x.meta["val"]
            order = memory_order(val) if val.dim() > 1 and not is_symbolic(val) else None
            if order is not None:
                with graph.inserting_before(node):
                    pinned = _call(graph, node, torch.ops.transpiler.in_order.default, x, order)
                node.replace_input_with(x, pinned)


def _without_dropout(node: fx.Node) -> bool:
    """A random op with a `dropout_p` argument of 0 (attention without dropout)."""
    for k, arg in enumerate(node.target._schema.arguments):
        if arg.name == "dropout_p":
            p = node.args[k] if k < len(node.args) else node.kwargs.get("dropout_p", arg.default_value)
            return p == 0
    return False


@torch.library.custom_op("transpiler::avg_pool_backward", mutates_args=())
def _avg_pool_backward(grad_output: torch.Tensor, x: torch.Tensor, kernel_size: list[int],
                       stride: list[int], padding: list[int], ceil_mode: bool,
                       count_include_pad: bool, divisor_override: int | None) -> torch.Tensor:
    return _AVG_POOL_BACKWARD[len(kernel_size)](grad_output, x, kernel_size, stride, padding,
                                                ceil_mode, count_include_pad, divisor_override)


@_avg_pool_backward.register_fake
def _(grad_output, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
      divisor_override):
    return torch.empty_like(x)


def pool_grads_as_kernels(graph: fx.Graph) -> None:
    """avg_pool2d/3d's backward with ceil_mode -> ATen's kernel behind a
    custom op. Inductor's lowering divides the gradient of a window that
    ceil_mode lets run past the input by the whole kernel's size, where the
    kernel (and the forward) divide by the part inside the input and its
    padding: transformers' EfficientNet pools its last 4x4 map with
    AvgPool2d(160, ceil_mode=True), and every gradient before the pool came
    out 1600 times too small (torch 2.13)."""
    for node in graph.nodes:
        if (node.op == "call_function" and node.target in _AVG_POOL_BACKWARD.values()
                and len(node.args) == 8 and node.args[5]):
            node.target = torch.ops.transpiler.avg_pool_backward.default


@torch.library.custom_op("transpiler::index_put_accumulate", mutates_args=())
def _index_put_accumulate(x: torch.Tensor, indices: list[torch.Tensor | None],
                          values: torch.Tensor) -> torch.Tensor:
    return _INDEX_PUT(x, indices, values, True)


@_index_put_accumulate.register_fake
def _(x, indices, values):
    return torch.empty_like(x)


def scatters_as_kernels(graph: fx.Graph) -> None:
    """index_put(x, indices, values, accumulate=True) (the backward of indexing
    with a tensor, x[..., [i], :]) -> ATen's kernel behind a custom op.
    Inductor's CPU code for it, where the scatter is read transposed and the
    kernel runs on several threads, applies the tile's inner offset twice
    (CppTile2DKernel's atomic_add store): gradients land in the wrong slots and
    past the buffer's end. Falcon's key and value, picked with x[..., [-2], :]
    and read transposed by its attention, trained on wrong gradients, or
    crashed the process (torch 2.13)."""
    for node in graph.nodes:
        if (node.op == "call_function" and node.target is _INDEX_PUT
                and len(node.args) == 4 and node.args[3] is True and not node.kwargs):
            node.target = torch.ops.transpiler.index_put_accumulate.default
            node.args = node.args[:3]


def packs_as_cat(graph: fx.Graph) -> None:
    """new_empty, then slice_scatter of each value into its slice (how
    coalesce_tensors packs a bucket, which runs well op by op) -> one cat of
    the values, which a compiler lowers to one write per value into its slice
    (a chain of slice_scatters compiles to a select per element among all of them)."""
    scatter = aten.slice_scatter.default
    for node in list(graph.nodes):
        if node.target is not scatter or any(u.target is scatter for u in node.users):
            continue
        chain = [node]
        while chain[-1].args[0].target is scatter:
            chain.append(chain[-1].args[0])
        chain.reverse()
        base = chain[0].args[0]
        ends = [0] + [n.args[4] for n in chain]
        if (base.target is not aten.new_empty.default
                or any(n.args[2] != 0 or n.args[3] != start for n, start in zip(chain, ends))
                or ends[-1] != base.meta["val"].numel()
                or any(len(n.users) > 1 for n in chain[:-1])):
            continue
        with graph.inserting_before(node):
            cat = graph.call_function(aten.cat.default, ([n.args[1] for n in chain],))
        cat.meta.update(node.meta)
        node.replace_all_uses_with(cat)
        for n in reversed(chain):
            graph.erase_node(n)
        graph.erase_node(base)


def reshapes_in_steps(graph: fx.Graph) -> None:
    """reshape(x, shape) that splits one dimension and merges it with another
    at once -> a reshape to the finest shape both are made of (only splits),
    then a reshape to `shape` (only merges). Attention's heads do this:
    (S, B, 128) <-> (S, 4*B, 32) goes through (S, B, 4, 32). Inductor indexes
    a pure split or a pure merge dimension by dimension; the mixed reshape it
    indexes through the flat offset, (x3 + 128*x0) // 32 % (4*B) and so on,
    which it simplifies back to a linear index only where it can bound the
    loop variables by numbers. With a symbolic batch size B it cannot, and
    the kernel that reads the reshape runs unvectorized, several times slower
    than the static program's. The values are the same: every step is a
    reshape of the same elements in the same order."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _RESHAPE:
            continue
        source, target = node.args[0].meta.get("val"), node.meta.get("val")
        if not (isinstance(source, torch.Tensor) and isinstance(target, torch.Tensor)):
            continue
        sizes_from, sizes_to = _exprs(source.shape), _exprs(target.shape)
        finest = _finest_common(sizes_from, sizes_to)
        if finest is None or finest in (sizes_from, sizes_to):
            continue
        sizes = _size_args(graph, node, finest)
        if sizes is None:
            continue
        with graph.inserting_before(node):
            split = graph.call_function(_RESHAPE, (node.args[0], sizes))
        split.meta["val"] = source.reshape(
            [a.meta["val"] if isinstance(a, fx.Node) else a for a in sizes])
        node.args = (split, *node.args[1:])


def _expr(size) -> sympy.Expr:
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)


def _exprs(shape) -> list[sympy.Expr]:
    """A shape's sizes as expressions, size 1 left out (compared as
    expressions: comparing SymInts would add guards to the trace's shapes)."""
    return [e for e in map(_expr, shape) if e != 1]


def _finest_common(source: list[sympy.Expr], target: list[sympy.Expr]) -> list | None:
    """The shape both `source` and `target` are merges of (sizes as
    expressions, none of them 1); None where the two do not nest
    (6 x 4 against 4 x 6)."""
    source, target = list(source), list(target)
    finest: list = []
    a = b = None
    while True:
        a = a if a is not None else (source.pop() if source else None)
        b = b if b is not None else (target.pop() if target else None)
        if a is None or b is None:
            return finest[::-1] if a is None and b is None else None
        if a == b:
            finest.append(a)
            a = b = None
        elif (q := _quotient(a, b)) is not None:
            finest.append(b)
            a, b = q, None
        elif (q := _quotient(b, a)) is not None:
            finest.append(a)
            a, b = None, q
        else:
            return None


def _quotient(size: sympy.Expr, factor: sympy.Expr) -> sympy.Expr | None:
    """size / factor where it is a whole size (4*B / B = 4, 4*B / 4 = B), else None."""
    numerator, denominator = sympy.fraction(sympy.cancel(size / factor))
    return numerator if denominator == 1 else None


def _size_args(graph: fx.Graph, node: fx.Node, sizes: list[sympy.Expr]) -> list | None:
    """`sizes` as a reshape's shape argument: numbers as they are, a symbolic
    size as a node of the graph that holds it (an element of `node`'s own
    shape argument, or a sym_size of its input, inserted); None where a size
    is held by neither."""
    held = {_expr(a.meta["val"]): a for a in node.args[1]
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.SymInt)}
    source = node.args[0]
    for dim, size in enumerate(source.meta["val"].shape):
        held.setdefault(_expr(size), (source, dim, size))
    if any(not size.is_Integer and size not in held for size in sizes):
        return None
    args = []
    for size in sizes:
        found = int(size) if size.is_Integer else held[size]
        if isinstance(found, tuple):
            with graph.inserting_before(node):
                sym_size = graph.call_function(aten.sym_size.int, found[:2])
            sym_size.meta["val"] = found[2]
            found = held[size] = sym_size
        args.append(found)
    return args


def unscales_as_math(graph: fx.Graph) -> None:
    """_amp_foreach_non_finite_check_and_unscale(grads, found_inf, inv_scale)
    (GradScaler.unscale_, functionalized) -> each gradient times inv_scale in
    its opmath type (float32 for half types, rounded back), and found_inf set
    to 1 where an element of any gradient is not finite: what the kernel
    computes (its `inv_scale == 1 ? x : x * inv_scale` is the same number).
    A compiler has no lowering of the op: it copies every gradient (the
    functional form returns new tensors) and runs the kernel over the copies,
    two passes over the model that the multiply, fused into the next reader
    of each gradient, does not make."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _UNSCALE:
            continue
        if not _all_getitems(node):
            continue
        items = {u.args[1]: u for u in node.users}
        grads_item = items.get(0)
        if grads_item is not None and not _all_getitems(grads_item):
            continue
        grads, found_inf, inv_scale = node.args
        with graph.inserting_before(node):
            unscaled = [_unscaled(graph, node, g, inv_scale) for g in grads]
            nonfinite = [_call(graph, node, aten.any.default,
                               _call(graph, node, aten.logical_not.default,
                                     _call(graph, node, aten.isfinite.default, g)))
                         for g in grads]
            found = found_inf if not grads else _call(
                graph, node, aten.where.ScalarSelf,
                _call(graph, node, aten.any.default,
                      _call(graph, node, aten.stack.default, nonfinite)), 1.0, found_inf)
        for item in list(grads_item.users) if grads_item is not None else ():
            item.replace_all_uses_with(unscaled[item.args[1]])
            graph.erase_node(item)
        if 1 in items:
            items[1].replace_all_uses_with(found)
        for item in items.values():
            graph.erase_node(item)
        graph.erase_node(node)


def _all_getitems(node: fx.Node) -> bool:
    return all(u.op == "call_function" and u.target is operator.getitem for u in node.users)


def _unscaled(graph: fx.Graph, like: fx.Node, grad: fx.Node, inv_scale: fx.Node) -> fx.Node:
    dtype = grad.meta["val"].dtype
    if dtype not in (torch.float16, torch.bfloat16):
        return _call(graph, like, aten.mul.Tensor, grad, inv_scale)
    wide = _call(graph, like, aten._to_copy.default, grad, dtype=torch.float32)
    return _call(graph, like, aten._to_copy.default,
                 _call(graph, like, aten.mul.Tensor, wide, inv_scale), dtype=dtype)


def _call(graph: fx.Graph, like: fx.Node, target, *args, **kwargs) -> fx.Node:
    """A node calling `target` with the role of `like`, the node it replaces."""
    return new_node(graph, target, args, like.meta.get(ROLE), kwargs)
