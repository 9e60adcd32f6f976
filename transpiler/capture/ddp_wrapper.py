"""A model wrapped in torch DDP, given to the step as it is (code written for
DDP calls `model(x)` on the wrapper and reads `model.module`).

The wrapper's forward runs as in eager while the step is traced, except its
broadcast of the module's buffers from rank 0 (`_sync_buffers`, torch's
`_broadcast_coalesced`, a C++ collective a trace cannot hold): the program
broadcasts them itself (passes/broadcast_buffers.py), as DDP's defaults do.

The program reduces and broadcasts by the transpiled step's own options, not
by the wrapper's: a wrapper built with other ones (broadcast_buffers=False,
find_unused_parameters=True, a comm hook, another process group, mixed
precision) is refused at the first call, naming what to give transpile().
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..errors import TranspileError


@contextlib.contextmanager
def buffers_left_to_the_program():
    sync = DistributedDataParallel._sync_buffers
    DistributedDataParallel._sync_buffers = lambda self: None
    try:
        yield
    finally:
        DistributedDataParallel._sync_buffers = sync


def refuse_other_options(modules, step: str, broadcast_buffers: bool, find_unused: bool,
                         comm_hook, process_group) -> None:
    """Refuse a DDP wrapper among the step's modules whose options the
    transpiled step was not given (`comm_hook`: its CommHook or None;
    `process_group`: its group, None for the world)."""
    for module in modules:
        if not isinstance(module, DistributedDataParallel):
            continue
        differ = []
        if module.broadcast_buffers != broadcast_buffers:
            differ.append(f"broadcast_buffers={module.broadcast_buffers}")
        if module.find_unused_parameters != find_unused:
            differ.append(f"find_unused_parameters={module.find_unused_parameters}")
        hooks = getattr(module, "_comm_hooks", [])
        if hooks and (comm_hook is None or hooks[-1][0] is not comm_hook.hook):
            hook = hooks[-1][0]
            differ.append(f"comm_hook=(state, {getattr(hook, '__qualname__', hook)})")
        if module.process_group is not (process_group or dist.distributed_c10d._get_default_group()):
            differ.append("process_group=<the wrapper's group>")
        if differ:
            raise TranspileError(
                f"{step} is given a model wrapped in DDP with options its transpiled step was "
                f"not given: the program reduces gradients and broadcasts buffers by "
                f"transpile()'s options, not the wrapper's. Give transpile the same "
                f"({', '.join(differ)}), or pass the model without the wrapper")
        if getattr(module, "mixed_precision", None) is not None:
            raise TranspileError(
                f"{step} is given a model wrapped in DDP(mixed_precision=...): the transpiled "
                "step does not cast parameters and gradients as it does; run the forward "
                "under torch.autocast, or reduce in low precision with fuse_dtype=")
