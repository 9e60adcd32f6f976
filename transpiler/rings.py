"""Communicators ("rings"): process groups over all ranks, created once per world.

Every rank must create them in the same order, which holds because every rank
transpiles the same program. The groups are kept for the life of the process
and have the default group's timeout, so a collective whose peer died raises
within the timeout the user configured.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

log = logging.getLogger("transpiler")

_groups: dict[int, list[dist.ProcessGroup]] = {}


def world() -> tuple[int, int]:
    """(world_size, rank); (1, 0) without an initialized process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(), dist.get_rank()


def world_timeout():
    """The timeout the user gave init_process_group: new groups would otherwise
    get torch's default (30 minutes for gloo) and wait that long for a dead rank."""
    world = dist.group.WORLD
    for device in world._device_types:
        options = getattr(world._get_backend(device), "options", None)
        if options is not None:
            return options._timeout
    return None


def ring_names(nrings: int) -> tuple[str, ...]:
    """Group names of `nrings` communicators over the whole world."""
    if world()[0] == 1:
        return ()
    key = id(dist.group.WORLD)
    groups = _groups.setdefault(key, [])
    while len(groups) < nrings:
        groups.append(dist.new_group(ranks=list(range(dist.get_world_size())),
                                     timeout=world_timeout()))
        log.debug("created ring %d (group %s)", len(groups) - 1, groups[-1].group_name)
    return tuple(g.group_name for g in groups[:nrings])
