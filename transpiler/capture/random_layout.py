"""In-place random ops drawn on their target's layout.

A random kernel fills a tensor in its memory order, and some take another path
for a contiguous tensor than for a strided one (normal_'s vectorized fill on
CPU): what `t.bernoulli_(p)` draws depends on t's strides. Functionalization
replaces `t.op_(...)` by the out-of-place op, which allocates its result by a
rule of its own (bernoulli.p: contiguous; normal: like a dense input, else
contiguous), so dropout on a transposed tensor (what
nn.MultiheadAttention(batch_first=True) returns) drew another mask than eager.

While the graph is functionalized (trace.py), such an op on a tensor that is
not contiguous runs as `t.copy_(twin(t, ...))`. The twin is an op of this
package, one per in-place random op: it runs that op on a fresh tensor of t's
shape and strides and returns it, so it draws what eager draws, eagerly and
under inductor (a kernel inductor calls, as it calls ATen's random kernels
with fallback_random). It carries the nondeterministic_seeded tag, so every
schedule keeps it in the program's order of draws.
"""

from __future__ import annotations

import torch
from torch._ops import OpOverload

from ..program.program import same_layout

_LIBRARY = torch.library.Library("transpiler", "FRAGMENT")
_TWINS: dict[OpOverload, OpOverload] = {}


def drawn_in_place(op, args) -> bool:
    """Whether `op(*args)` fills args[0], a tensor that is not contiguous, with
    random numbers."""
    if not (isinstance(op, OpOverload) and torch.Tag.nondeterministic_seeded in op.tags):
        return False
    first = op._schema.arguments[0] if op._schema.arguments else None
    written = first is not None and first.alias_info is not None and first.alias_info.is_write
    return written and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous()


def twin(op: OpOverload) -> OpOverload:
    """The functional op that runs the in-place random op `op` on a fresh
    tensor with its first argument's layout, and returns that tensor."""
    if op not in _TWINS:
        schema = str(op._schema)
        name = f"{op._schema.name.split('::')[1].rstrip('_')}_{op._overloadname}_on_layout"
        arguments = schema[schema.index("("):schema.rindex(") ->") + 1]
        _LIBRARY.define(name + arguments.replace("Tensor(a!) self", "Tensor self", 1) + " -> Tensor",
                        tags=(torch.Tag.nondeterministic_seeded,))

        def draw(self, *args, **kwargs):
            return op(same_layout(self), *args, **kwargs)

        _LIBRARY.impl(name, draw, "CompositeExplicitAutograd")
        torch.library.register_fake(f"transpiler::{name}", lambda self, *args, **kwargs: same_layout(self),
                                    lib=_LIBRARY)
        _TWINS[op] = getattr(torch.ops.transpiler, name).default
    return _TWINS[op]
