"""The first rank of each node: it compiles a program before the node's other
ranks, which then load it from inductor's on-disk cache (TORCHINDUCTOR_CACHE_DIR,
shared by the processes of a host unless set apart)."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from .control import all_gather_bytes
from .mesh import Dim
from .rings import plain_mesh
from .world import group, is_default, world

# (the step's group, the first rank of this rank's host in it) where the nodes
# are not torchrun's (no LOCAL_WORLD_SIZE, or a group of the step's own), whose
# hostnames were gathered
_gathered: tuple[dist.ProcessGroup, int] | None = None


def node_first_rank() -> int:
    """The first rank of this rank's node: of the nodes torchrun describes
    (LOCAL_WORLD_SIZE, as the mesh reads it), or else of the step's ranks
    that run on its host, from the hostnames gathered once per group (a
    collective then: every rank of the group calls it)."""
    global _gathered
    world_size, rank = world()
    if world_size == 1:
        return 0
    if "LOCAL_WORLD_SIZE" in os.environ and is_default():
        return rank - plain_mesh(nodes=True).position(Dim.NODE)
    if _gathered is None or _gathered[0] is not group():
        hosts = all_gather_bytes(socket.gethostname().encode())
        _gathered = (group(), hosts.index(hosts[rank]))
    return _gathered[1]
