"""Ops whose meta function refuses what the device's kernel computes.

The trace computes shapes with each op's meta function, written to agree with
its kernels; a few are stricter (aten._grouped_mm's requires bfloat16 where
the CPU kernel computes float32, which transformers' MoE layers call in eager).
While the step is traced, an aten op whose meta function raises is run once on
zero tensors of its fake inputs' layouts (the fallback FakeTensorMode takes for
ops with no meta function): if the kernel computes, the op takes its result's
shape, dtype and strides, as eager does; if it raises too, or its inputs have
symbolic sizes, the meta function's error stands. So does an op whose sizes
come from its integer arguments though torch tags it as depending on values
(_SIZED_BY_ARGUMENTS).
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.utils._pytree as pytree
from torch._subclasses import fake_tensor

# Ops tagged dynamic_output_shape whose sizes come from their integer arguments
# (CTC's loss: the lengths as lists, which trace.py reads from its tensor
# overload's arguments), not from tensor values: their kernel on zeros gives them.
_SIZED_BY_ARGUMENTS = {torch.ops.aten._ctc_loss.default}

# FakeTensorMode logs a failed meta function with its traceback before it raises.
_META_FAILED = "failed while attempting to run meta for"


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_META_FAILED)


@contextlib.contextmanager
def kernels_where_meta_refuses():
    original = fake_tensor.FakeTensorMode._dispatch_impl

    def dispatch(mode, func, types, args, kwargs):
        try:
            return original(mode, func, types, args, kwargs)
        except fake_tensor.DynamicOutputShapeException as exc:
            if func not in _SIZED_BY_ARGUMENTS:
                raise
            flat, spec = pytree.tree_flatten((args, kwargs))
            return fake_tensor.run_fallback_kernel(mode, func, flat, spec, exc)
        except (NotImplementedError, fake_tensor.DataDependentOutputException):
            raise
        except RuntimeError as exc:
            if func.namespace != "aten" or not mode.allow_fallback_kernels:
                raise
            flat, spec = pytree.tree_flatten((args, kwargs))
            try:
                return fake_tensor.run_fallback_kernel(mode, func, flat, spec, exc)
            except Exception:   # noqa: BLE001 - the meta function's error stands
                raise exc from None

    quiet = _Quiet()
    fake_tensor.log.addFilter(quiet)
    fake_tensor.FakeTensorMode._dispatch_impl = dispatch
    try:
        yield
    finally:
        fake_tensor.FakeTensorMode._dispatch_impl = original
        fake_tensor.log.removeFilter(quiet)
