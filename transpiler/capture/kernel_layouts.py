"""Each op's result laid out as its kernel lays it out.

The trace computes every result's strides with the op's meta function or
decomposition, which are written to agree with the device's kernel and
sometimes do not: on CPU, batch norm's kernel returns a contiguous result for
a transposed input where its decomposition keeps the input's strides (torch
issue 192668; PatchTST normalizes that way), and softplus_backward's
decomposition returns a contiguous result where the kernel follows its
transposed gradient (Qwen3-Next's gated delta rule). Later choices the trace
makes from the strides then differ from eager's: reshape's decomposition
records a view where eager copies (the program's view then raises), and a
random op fills another memory order than eager's (other dropout masks).

While the step is traced, an aten op with a tensor input that is not
contiguous (where the two disagree) also runs its kernel once on zero tensors
of its inputs' exact layouts; where the kernel's result has the same shapes
and dtypes but another order in memory, the traced result takes the kernel's
order (a fresh tensor of that order: symbolic sizes stay symbolic).
Skipped: views and ops that return an input (their strides are the view's own
computation), random ops (the kernel would draw), ops of backend libraries
(their buffers are not valid as zeros), and any op whose kernel raises on
zeros (its meta function's layout stands). Symbolic sizes run at their hints.
"""

from __future__ import annotations

import contextlib
import re

import torch
import torch.utils._pytree as pytree
from torch._subclasses import fake_tensor
from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw, has_guarding_hint
from torch.utils._mode_utils import no_dispatch

_SKIPPED_TAGS = (torch.Tag.nondeterministic_seeded, torch.Tag.dynamic_output_shape,
                 torch.Tag.data_dependent_output, torch.Tag.inplace_view)
# Ops of a backend library (oneDNN's, cuDNN's, ...) or fused kernels: they read
# buffers of their own layout (an LSTM layer's workspace), which zeros do not
# make valid; oneDNN's LSTM backward on zeros ends the process.
_LIBRARY_OPS = re.compile(r"mkldnn|cudnn|miopen|nnpack|fbgemm|quantiz|sparse|_flash_|_efficient_"
                          r"|fused|mps|xpu|vulkan|_cslt|_cufft|_nested")


@contextlib.contextmanager
def results_laid_out_as_kernels():
    original = fake_tensor.FakeTensorMode._dispatch_impl

    def dispatch(mode, func, types, args, kwargs):
        out = original(mode, func, types, args, kwargs)
        if not _checked(func):
            return out
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        layouts = [_hinted(t) for t in tensors]
        if None in layouts or all(_contiguous(shape_strides) for shape_strides, _ in layouts):
            return out
        return _as_kernel(mode, func, args, kwargs, out)

    fake_tensor.FakeTensorMode._dispatch_impl = dispatch
    try:
        yield
    finally:
        fake_tensor.FakeTensorMode._dispatch_impl = original


def _checked(func) -> bool:
    return (isinstance(func, torch._ops.OpOverload) and func.namespace == "aten"
            and not func.is_view and not any(tag in func.tags for tag in _SKIPPED_TAGS)
            and all(r.alias_info is None for r in func._schema.returns)
            and _LIBRARY_OPS.search(func._schema.name) is None)


def _hinted(t: torch.Tensor):
    """((sizes, strides), storage offset) of t as integers, symbolic ones at
    their hints (no guard is added); None where one has no hint, or t is not
    strided (a sparse tensor)."""
    if t.layout is not torch.strided:
        return None
    values = (*t.shape, *t.stride(), t.storage_offset())
    if not all(has_guarding_hint(v) for v in values):
        return None
    ints = [guarding_hint_or_throw(v) for v in values]
    n = t.dim()
    return (tuple(ints[:n]), tuple(ints[n:2 * n])), ints[-1]


def _dense_order(shape, strides) -> tuple[int, ...] | None:
    """The dimensions of more than one element in their order in memory,
    outermost first, of a tensor that covers its memory without gaps or
    overlaps; None for another one (or an empty one)."""
    if not all(shape):
        return None
    order = sorted((d for d in range(len(shape)) if shape[d] > 1), key=lambda d: (-strides[d], d))
    expected = 1
    for d in reversed(order):
        if strides[d] != expected:
            return None
        expected *= shape[d]
    return tuple(order)


def _contiguous(shape_strides) -> bool:
    order = _dense_order(*shape_strides)
    return not all(shape_strides[0]) or (order is not None and list(order) == sorted(order))


def _zeros_like_layout(t: torch.Tensor) -> torch.Tensor:
    """Zeros with t's (hinted) shape, strides, storage offset, dtype and device."""
    (shape, strides), offset = _hinted(t)
    extent = offset + 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else offset
    device = getattr(t, "fake_device", t.device)
    return torch.zeros(extent, dtype=t.dtype, device=device).as_strided(shape, strides, offset)


def _as_kernel(mode, func, args, kwargs, out):
    """out with each tensor the kernel lays out in another order replaced by a
    fake tensor of the kernel's order; out itself where the kernel cannot tell."""
    try:
        with no_dispatch():
            real_args, real_kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: _zeros_like_layout(t) if mode.is_our_fake(t) else t,
                (args, kwargs))
            kernel = func(*real_args, **real_kwargs)
    except Exception:   # noqa: BLE001 - the meta function's layout stands
        return out
    fakes, spec = pytree.tree_flatten(out)
    reals, real_spec = pytree.tree_flatten(kernel)
    if spec != real_spec or not all(map(_comparable, fakes, reals)):
        return out
    return pytree.tree_unflatten([_relaid(mode, f, r) for f, r in zip(fakes, reals)], spec)


def _comparable(fake, real) -> bool:
    if not isinstance(fake, torch.Tensor):
        return not isinstance(real, torch.Tensor)
    hinted = _hinted(fake)
    return (isinstance(real, torch.Tensor) and hinted is not None
            and hinted[0][0] == tuple(real.shape) and fake.dtype == real.dtype
            and fake.layout is real.layout is torch.strided)


def _relaid(mode, fake, real):
    """fake, or a fake tensor of its shape laid out in real's order where
    real, a dense tensor, has another order."""
    if not isinstance(fake, torch.Tensor):
        return fake
    order = memory_order(real)
    if order is None or order == memory_order(fake):
        return fake
    with mode:
        relaid = torch.empty_permuted(fake.shape, order, dtype=fake.dtype, device=fake.device)
    if getattr(fake, "real_tensor", None) is not None:   # a trace on the call's real values
        relaid.real_tensor = fake.real_tensor
    return relaid


def memory_order(t: torch.Tensor) -> list[int] | None:
    """t's dimensions in their order in memory, outermost first (dimensions of
    one element last), for `torch.empty_permuted`; None where t does not cover
    its memory without gaps or overlaps, or has sizes without hints."""
    hinted = _hinted(t)
    order = None if hinted is None else _dense_order(*hinted[0])
    return None if order is None else [*order, *(d for d in range(t.dim()) if d not in order)]


def laid_out_alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b, of one shape, have the same order in memory (True
    where either is not dense or has sizes without hints: no order to keep)."""
    ha, hb = _hinted(a), _hinted(b)
    if ha is None or hb is None:
        return True
    oa, ob = _dense_order(*ha[0]), _dense_order(*hb[0])
    return oa is None or ob is None or oa == ob
