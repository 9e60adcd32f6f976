"""Eager's dispatch in a symbolic trace.

A trace with symbolic batch sizes (make_fx's tracing_mode="symbolic") runs with
torch's Python dispatcher on, which calls the Python kernels torch registers at
some ops' autograd and composite keys (`op.py_impl`): decompositions written
for compilers (upsample_bilinear2d into index arithmetic, multilabel_margin_loss
into gathers) that round otherwise than the kernel eager calls, or compute
another value. The static trace dispatches as eager does, so a program traced
again with symbolic sizes after a batch of another size trained otherwise than
eager, silently. While a symbolic trace runs, those Python kernels are taken
off every op with a kernel of its own, which the dispatcher then calls as eager
does. An op that is a composite of C++ keeps its Python kernel (the composite
may read sizes as integers, which a symbolic trace cannot), but for the
upsampling ops' `.vec` forms, whose Python kernels decompose the whole
interpolation: they get eager's composite, the output size computed and the
op's kernel (`.default`) called.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from typing import Callable

import torch
from torch._C import DispatchKey
from torch._decomp.decompositions import upsample_compute_output_size
from torch._ops import OpOverload

# The keys at which a Python kernel takes an op's place above its own kernels
# (the fake and proxy modes' keys below them hold no decompositions).
_KEYS = (DispatchKey.Autograd, DispatchKey.AutogradCPU, DispatchKey.AutogradCUDA,
         DispatchKey.CompositeImplicitAutograd)
# An op with a kernel of its own, which eager runs.
_EAGER = ("CPU", "CUDA", "CompositeExplicitAutograd")


def _python_kernels() -> list[tuple[OpOverload, DispatchKey, Callable | None]]:
    """(op, key, what takes its place: None for the op's own kernel) of every
    Python kernel registered at _KEYS of an aten op that eager runs otherwise.
    Ops get their Python kernels when torch registers them (torch._decomp,
    torch._refs), which creates their OpOverload: the live ones hold them all."""
    found = []
    with warnings.catch_warnings():   # isinstance() on torch's deprecated aliases warns
        warnings.simplefilter("ignore")
        ops = [op for op in gc.get_objects() if isinstance(op, OpOverload)]
    for op in ops:
        if not (op.py_kernels and op.namespace == "aten"):
            continue
        name = op.name()
        if torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"):
            if op._overloadname != "vec" or not op.__name__.lstrip("_").startswith("upsample"):
                continue
            instead = _upsample_composite(op._overloadpacket.default)
        elif any(torch._C._dispatch_has_kernel_for_dispatch_key(name, k) for k in _EAGER):
            instead = None
        else:
            continue
        found += [(op, key, instead) for key in _KEYS if key in op.py_kernels]
    return found


def _upsample_composite(kernel: OpOverload) -> Callable:
    """C++'s composite of an upsampling op's `.vec` form: the output size from
    the scale factors, then the op's kernel with them."""
    def vec(input, output_size, *rest):
        *middle, scale_factors = rest   # align_corners, where the op has it
        size = upsample_compute_output_size(input.size(), output_size, scale_factors)
        scales = scale_factors if scale_factors else [None] * len(size)
        return kernel(input, size, *middle, *scales)
    return vec


@contextlib.contextmanager
def eager_dispatch(symbolic: bool):
    """While a symbolic trace runs (`symbolic`), its ops dispatch as in eager."""
    if not symbolic:
        yield
        return
    taken = []
    try:
        for op, key, instead in _python_kernels():
            taken.append((op, key, op.py_kernels.pop(key)))
            if instead is not None:
                op.py_kernels[key] = instead
            op._dispatch_cache.clear()
        yield
    finally:
        for op, key, kernel in taken:
            op.py_kernels[key] = kernel
            op._dispatch_cache.clear()
