"""nn.SyncBatchNorm in the trace: its statistics gathered by collectives of the program.

torch's SyncBatchNorm runs only on accelerators (its CPU forward raises) and
issues its collectives from an autograd Function, which torch.compile breaks
the graph on. While the step is traced, its training forward is this module's:
each rank's per-channel mean, sum of squared deviations and count are
all-gathered (one collective per layer, as torch's; passes/
coalesce_model_collectives.py issues independent layers' as one), combined into the global
batch's mean and variance (Chan's parallel formula: no sum of squares to
cancel), and the input normalized with them. The gather's backward all-reduces
the gradient of every rank's statistics and keeps this rank's row, so the input
gradient is the one of the global batch, as torch's backward (an all-reduce of
sum_dy and sum_dy_xmu) gives. The running statistics are updated with the global
mean and unbiased variance, as torch's. Evaluation, and one process, run torch's
own forward.

The collectives carry meta["comm"] (over the step's world, on its group
until the runtime places them on its communicators, Program.place_collectives), so
every pass, the rank agreement and the scheduler see them as the passes' own.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from ..program.collectives import ALL_GATHER, ALL_REDUCE
from ..errors import TranspileError
from .traced_collectives import issued
from ..world import describe, group as step_group


class _Gathered(torch.autograd.Function):
    """Every rank's `row` stacked, (world, n); the gradient of this rank's row
    is the sum over the ranks of the gradients of the stacked value's row."""

    @staticmethod
    def forward(ctx, row, group_name: str, world: int, rank: int):
        ctx.group_name, ctx.rank = group_name, rank
        return issued(ALL_GATHER, row, world, group_name).view(world, -1)

    @staticmethod
    def backward(ctx, grad):
        summed = issued(ALL_REDUCE, grad.contiguous(), "sum", ctx.group_name)
        return summed[ctx.rank], None, None, None


def _synced(bn: nn.SyncBatchNorm, x: torch.Tensor, group, factor) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    c = x.shape[1]
    dims = [0, *range(2, x.dim())]
    shape = [1, c] + [1] * (x.dim() - 2)
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    mean = xf.mean(dims)
    m2 = (xf - mean.view(shape)).square().sum(dims)
    count = xf.new_ones(1) * (xf.numel() // c)
    rows = _Gathered.apply(torch.cat([mean, m2, count]), group.group_name, world, rank)
    means, m2s, counts = rows[:, :c], rows[:, c:2 * c], rows[:, 2 * c:]
    total = counts.sum(0)
    mean_all = (counts * means).sum(0) / total
    m2_all = (m2s + counts * (means - mean_all).square()).sum(0)
    invstd = torch.rsqrt(m2_all / total + bn.eps)
    y = (xf - mean_all.view(shape)) * invstd.view(shape)
    if bn.weight is not None:
        y = y * bn.weight.view(shape) + bn.bias.view(shape)
    if bn.track_running_stats:
        with torch.no_grad():
            unbiased = m2_all / (total - 1)
            bn.running_mean.copy_(bn.running_mean * (1 - factor) + mean_all * factor)
            bn.running_var.copy_(bn.running_var * (1 - factor) + unbiased * factor)
    return y.to(x.dtype)


def _forward(bn: nn.SyncBatchNorm, x: torch.Tensor) -> torch.Tensor:
    if not (bn.training and dist.is_available() and dist.is_initialized()):
        return _ORIGINAL(bn, x)
    group = bn.process_group or dist.group.WORLD
    if group is not step_group():
        step = describe()
        raise TranspileError(
            f"a SyncBatchNorm over the process group {group.group_name!r}, while the step runs "
            f"over {step}: its statistics are gathered over the step's ranks; convert with "
            "nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group) and the step's group "
            "(or none, for a step over the default group)")
    if dist.get_world_size(group) == 1:
        return _ORIGINAL(bn, x)
    bn._check_input_dim(x)
    bn._check_non_zero_input_channels(x)
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.track_running_stats:
        bn.num_batches_tracked.add_(1)
        if bn.momentum is None:   # the cumulative average, as a tensor (torch reads it with .item())
            factor = 1.0 / bn.num_batches_tracked
    return _synced(bn, x, group, factor)


_ORIGINAL = nn.SyncBatchNorm.forward


@contextlib.contextmanager
def synced_batch_norms():
    """While the step is traced: SyncBatchNorm's training forward as above."""
    nn.SyncBatchNorm.forward = _forward
    try:
        yield
    finally:
        nn.SyncBatchNorm.forward = _ORIGINAL
