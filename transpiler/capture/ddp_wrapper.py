"""A model wrapped in torch DDP, given to the step as it is (code written for
DDP calls `model(x)` on the wrapper and reads `model.module`).

The wrapper's forward runs as in eager while the step is traced, except its
broadcast of the module's buffers from rank 0 (`_sync_buffers`, torch's
`_broadcast_coalesced`, a C++ collective a trace cannot hold): the program
broadcasts them itself (passes/broadcast_buffers.py), as DDP's defaults do.
"""

from __future__ import annotations

import contextlib

from torch.nn.parallel import DistributedDataParallel


@contextlib.contextmanager
def buffers_left_to_the_program():
    sync = DistributedDataParallel._sync_buffers
    DistributedDataParallel._sync_buffers = lambda self: None
    try:
        yield
    finally:
        DistributedDataParallel._sync_buffers = sync
