"""Each op runs once on the real twins in a trace on real values, as in eager.

With real-tensor propagation (decisions.on_real_values), a fake tensor op
first runs on the real twins of its inputs, then computes its fake result;
where that result comes from one of torch's Python decompositions, the ops
of the decomposition run on the real twins again. An in-place op whose fake
result comes so is applied twice to its twin: `out.index_add_(0, idx, v)`
adds v twice (an MoE layer's sum built in place, routed on again). A random
op draws twice: `torch.empty(1).uniform_()` (fairseq's LayerDrop), and, in
torch's own symbolic traces, normal_, exponential_ and dropout; every later
draw is shifted. The trace then decides on other values than the program's
run computes, and the step was refused as if it decided on something it
could not repeat.

While active, each decomposition's effects on the real twins are undone:
the twins of the tensors its op writes hold the values of the op's own real
run again, and torch's generators are put back where that run left them.
Its fake result is untouched (the fake mode sets the outputs' twins to the
op's own run's results after the decomposition returns)."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch._decomp import decomposition_table
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from .torch_rng import real_states, restore_real_states


def _written(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[FakeTensor]:
    """The fake tensors among the arguments that the op's schema writes."""
    written = []
    for i, arg in enumerate(op._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written += [t for t in tree_leaves(value) if isinstance(t, FakeTensor)]
    return written


def _ran_on_real_twins(leaves: list) -> bool:
    """Whether the fake mode ran the op on the real twins before decomposing
    it (FakeTensorMode._dispatch_impl's condition): every fake argument has
    one, and every unbacked symbol among the arguments has a real value."""
    fakes = [t for t in leaves if isinstance(t, FakeTensor)]
    if not all(t.real_tensor is not None for t in fakes):
        return False
    symbols = [s for a in leaves if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool))
               for s in free_unbacked_symbols(a)]
    if not symbols:
        return True
    shape_env = fakes[0].fake_mode.shape_env if fakes else None
    return shape_env is not None and all(s in shape_env.real_tensor_prop_unbacked_vals
                                         for s in symbols)


def _once(op, decomposition):
    @functools.wraps(decomposition)
    def run(*args, **kwargs):
        if not _ran_on_real_twins(tree_leaves((args, kwargs))):
            return decomposition(*args, **kwargs)   # its only run on the twins
        with _disable_current_modes():
            states = real_states()
            kept = [(t.real_tensor, t.real_tensor.clone()) for t in _written(op, args, kwargs)]
        out = decomposition(*args, **kwargs)
        with _disable_current_modes():
            restore_real_states(states)
            for real, values in kept:
                real.copy_(values)
        return out
    return run


@contextlib.contextmanager
def each_op_once():
    """While real-tensor propagation traces: each op runs once on the real
    twins (its decomposition's runs on them undone). The table's entries are
    replaced in place and put back, so that one registered meanwhile stays."""
    originals = {op: decomposition for op, decomposition in decomposition_table.items()
                 if isinstance(op, torch._ops.OpOverload)}
    decomposition_table.update({op: _once(op, decomposition)
                                for op, decomposition in originals.items()})
    try:
        yield
    finally:
        decomposition_table.update(originals)
