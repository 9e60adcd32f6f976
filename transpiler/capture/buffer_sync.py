"""Where a DDP wrapper would broadcast a module's buffers inside the step.

DDP (broadcast_buffers=True, its default) broadcasts rank 0's buffers before a
forward through its wrapper when the wrapper's previous forward ran with grad
enabled outside no_sync (require_forward_param_sync). The transpiled step
broadcasts the buffers it wrote at its end (passes/broadcast_buffers.py), which
stands for the broadcast before the next call's first forward. Inside the
step, a forward of a module passed to the step is such a point too when its
previous forward ran with grad enabled and an optimizer.step() came between
(a validation forward after the update; forwards of micro-batches that
accumulate, which the transpiled step runs as under no_sync, are not).

There each buffer of the module is written with a copy of itself, marked
BUFFER_SYNC with the point's index and the buffer's input name: later reads
see that node's value. broadcast_buffers turns the copies of one point into a
broadcast from rank 0; a mode that does not broadcast buffers leaves them
copies. The sync runs where DDP's does, before the module's own forward
pre-hooks: the trace wraps torch.nn.Module.__call__ while it runs, which
leaves the module's hook dicts (guarded: reads.py) as they were. The same
wrapper records which modules ran a forward (theirs or a submodule's) with
grad enabled (Markers.forwarded: DDP reduces a module's gradients once per
forward).
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from ..program.roles import BUFFER_SYNC
from .markers import Markers, last_node


@contextlib.contextmanager
def buffer_sync_points(markers: Markers, modules):
    """While the step is traced: mark the points above for the step's modules
    (those among its arguments, as DDP would wrap them)."""
    prefixes = {id(m): f"m{i}." if len(modules) > 1 else "" for i, m in enumerate(modules)}
    last: dict[int, tuple[bool, int]] = {}   # module -> (grad enabled, steps so far) of its forward
    points = itertools.count()
    original = torch.nn.Module.__call__

    tree = {id(sub): id(m) for m in modules for sub in m.modules()}

    def call(module, *args, **kwargs):
        key = id(module)
        if torch.is_grad_enabled() and key in tree:
            markers.forwarded.add(tree[key])
        if key not in prefixes:
            return original(module, *args, **kwargs)
        before = last.get(key)
        if before is not None and before[0] and before[1] < len(markers.steps):
            _sync(module, prefixes[key], next(points))
        try:
            return original(module, *args, **kwargs)
        finally:
            last[key] = (torch.is_grad_enabled(), len(markers.steps))

    torch.nn.Module.__call__ = call
    try:
        yield
    finally:
        torch.nn.Module.__call__ = original


def _sync(module: torch.nn.Module, prefix: str, point: int) -> None:
    buffers = list(module.named_buffers())
    # DDP's own guard: a buffer saved for an earlier backward stays usable
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(
            tuple(b for _, b in buffers)):
        for name, buffer in buffers:
            buffer.copy_(buffer)
            last_node().meta[BUFFER_SYNC] = (point, prefix + name)
