"""The first rank of each node: it compiles a program before the node's other
ranks, which then load it from inductor's on-disk cache (TORCHINDUCTOR_CACHE_DIR,
shared by the processes of a host unless set apart)."""

from __future__ import annotations

import os
import socket

from .control_plane import all_gather_bytes
from ..program.mesh import Dim
from ..lowering.rings import plain_mesh
from ..world import is_default, per_group, world

# the first rank of this rank's host in the step's group, per group
# (world.per_group), where the nodes are not torchrun's (no LOCAL_WORLD_SIZE,
# or a group of the step's own): from the hostnames gathered
_gathered: dict = {}


def node_first_rank() -> int:
    """The first rank of this rank's node: of the nodes torchrun describes
    (LOCAL_WORLD_SIZE, as the mesh reads it), or else of the step's ranks
    that run on its host, from the hostnames gathered once per group (a
    collective then: every rank of the group calls it)."""
    world_size, rank = world()
    if world_size == 1:
        return 0
    if "LOCAL_WORLD_SIZE" in os.environ and is_default():
        return rank - plain_mesh(nodes=True).position(Dim.NODE)
    return per_group(_gathered, _first_rank_of_this_host)


def _first_rank_of_this_host() -> int:
    hosts = all_gather_bytes(socket.gethostname().encode())
    return hosts.index(hosts[world()[1]])
