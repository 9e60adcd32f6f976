"""Each random op draws once in a trace on real values, as eager's op does.

With real-tensor propagation (decisions.on_real_values), a fake tensor op
first runs on the real twins of its inputs, then computes its fake result;
where that result comes from one of torch's Python decompositions, the ops
of the decomposition run on the real twins again. For a random op the second
run draws again: `torch.empty(1).uniform_()` (fairseq's LayerDrop) draws
twice, and so do normal_, exponential_ and dropout on symbolic sizes in
torch's own symbolic traces. The trace's values then differ from eager's (an
in-place op's twin ends with the second draw), every later draw is shifted,
and a decision on them goes otherwise than the program's run: the step was
refused as if it decided on a draw it could not repeat.

While active, a decomposition that moved torch's generators is undone as
far as the real twins go: the generators are put back where the op's own real
run left them, and the twins of the tensors it writes hold that run's values
again. Its fake result is untouched (the fake mode sets the outputs' twins to
the op's own run's results after the decomposition returns)."""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import torch
from torch._decomp import decomposition_table
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves


def _generator_states() -> list[tuple[torch.Generator, torch.Tensor]]:
    """torch's default generators and their states, read from the generator
    objects (the trace patches torch.get_rng_state: torch_rng.py)."""
    generators = [torch.default_generator]
    if torch.cuda.is_initialized():
        generators += list(torch.cuda.default_generators)
    return [(g, g.get_state()) for g in generators]


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


def _drawing_once(op, decomposition):
    @functools.wraps(decomposition)
    def run(*args, **kwargs):
        if not _ran_on_real_twins(tree_leaves((args, kwargs))):
            return decomposition(*args, **kwargs)   # its only run on the twins: it draws
        with _disable_current_modes():
            states = _generator_states()
            kept = [(t.real_tensor, t.real_tensor.clone()) for t in _written(op, args, kwargs)]
        out = decomposition(*args, **kwargs)
        with _disable_current_modes():
            if any(not torch.equal(g.get_state(), state) for g, state in states):
                for g, state in states:
                    g.set_state(state)
                for real, values in kept:
                    real.copy_(values)
        return out
    return run


@contextlib.contextmanager
def drawing_once():
    """While real-tensor propagation traces: random ops draw once."""
    with mock.patch.dict(decomposition_table, {
            op: _drawing_once(op, decomposition) for op, decomposition
            in decomposition_table.items() if isinstance(op, torch._ops.OpOverload)}):
        yield
