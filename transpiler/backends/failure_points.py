"""Where a program may write state in place: only where nothing that can raise
is left to run, so that a call that fails leaves the state as it was.

An op may fail on the values it gets (`may_fail`): an index out of range
(embedding, gather, nll_loss's target), an assertion, a collective (a rank
gone), a user's op. A pointwise or reduction op, a foreach op, a view, a copy
or an allocation cannot, where the trace's shapes and dtypes hold (they fail
only as any op can: out of memory, or interrupted). Run op by op, a program
writes state only after the last op that may fail (reinplace.py). A compiler
orders and fuses kernels its own way: there a state update is written in place
only where its value depends on every op that may fail (`written_safely`),
element by element through foreach ops, which a compiler splits per tensor.
Two kinds are left out of that: a backward op, which fails only where its
forward op did (and that one runs first), and a collective: a state update is
computed after the collectives it depends on, not after the others, and a
collective that fails (a rank gone) ends the job.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..program.roles import ROLE, Role

aten = torch.ops.aten

# Ops that cannot raise on values of the shapes and dtypes they were traced
# with, besides pointwise, reduction and foreach ops and views.
_CANNOT_FAIL = {
    operator.getitem, aten.copy_.default, aten._to_copy.default, aten.clone.default,
    aten.cat.default, aten.stack.default, aten.mm.default, aten.addmm.default,
    aten.bmm.default, aten._unsafe_view.default, aten.detach.default,
    aten.new_empty.default, aten.new_zeros.default, aten.empty_like.default,
    aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
    aten.full.default, aten.scalar_tensor.default,
    aten._amp_foreach_non_finite_check_and_unscale.default, aten._amp_update_scale.default,
    aten.slice_scatter.default, aten._local_scalar_dense.default, aten.sym_size.int,
    aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default,
}
# Python's arithmetic on symbolic sizes and numbers.
_ARITHMETIC_MODULES = ("_operator", "math")


def is_foreach(target) -> bool:
    """An aten foreach op (one result per element of its list arguments)."""
    return (isinstance(target, torch._ops.OpOverload)
            and target._schema.name.split("::")[1].startswith("_foreach_"))


def may_fail(node: fx.Node) -> bool:
    """Whether the node's op can raise on the values it gets."""
    target = node.target
    if node.op != "call_function" or target in _CANNOT_FAIL:
        return False
    if not isinstance(target, torch._ops.OpOverload):
        return getattr(target, "__module__", None) not in _ARITHMETIC_MODULES
    return not (torch.Tag.pointwise in target.tags or torch.Tag.reduction in target.tags
                or torch.Tag.view_copy in target.tags or is_foreach(target)
                or target.is_view)


def written_safely(graph: fx.Graph) -> set[fx.Node]:
    """The nodes whose value a compiled program may write into a state input
    in place (see the module's docstring)."""
    failing = [n for n in graph.nodes if may_fail(n)
               and not n.meta.get(ROLE, Role.FORWARD) & (Role.BACKWARD | Role.COMM)]
    every = (1 << len(failing)) - 1
    bits = {n: 1 << i for i, n in enumerate(failing)}
    masks: dict[fx.Node, int | list[int]] = {}
    for n in graph.nodes:
        masks[n] = _foreach_masks(n, masks) if is_foreach(n.target) \
            else _mask(n, masks) | bits.get(n, 0)
    return {n for n, mask in masks.items() if mask == every}


def _union(a, masks: dict) -> int:
    mask = masks.get(a, 0)
    return mask if isinstance(mask, int) else _or(mask)


def _or(masks) -> int:
    result = 0
    for m in masks:
        result |= m
    return result


def _mask(n: fx.Node, masks: dict) -> int:
    """The ops that may fail that n's value depends on, as bits."""
    source = n.args[0] if n.target is operator.getitem and n.args else None
    if isinstance(masks.get(source), list):   # one tensor of a foreach op's results
        return masks[source][n.args[1]]
    return _or(_union(a, masks) for a in n.all_input_nodes)


def _foreach_masks(n: fx.Node, masks: dict) -> list[int]:
    """Per tensor of a foreach op's results: what it depends on (its own
    elements of the list arguments, and every other argument)."""
    count = len(n.meta["val"]) if isinstance(n.meta.get("val"), (list, tuple)) else 1
    lists = [a for a in (*n.args, *n.kwargs.values())
             if isinstance(a, (list, tuple)) and len(a) == count]
    shared = _or(_union(a, masks) for a in n.all_input_nodes
                 if not any(a in items for items in lists))
    return [shared | _or(_union(items[k], masks) for items in lists
                         if isinstance(items[k], fx.Node)) for k in range(count)]
