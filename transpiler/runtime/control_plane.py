"""The control plane: the process group over which the ranks exchange what they
must agree on (settings, program digests, parameter checksums, verify's
verdicts), apart from the data plane the programs' collectives run on.

Those exchanges are small CPU tensors, which nccl and hccl cannot take; so they
run on a gloo group of their own whatever the default group's backend is, as
torch's monitored_barrier does. A step's group that is gloo alone already
takes CPU tensors and is reused: one group fewer to connect, and the groups a
gloo run creates are the same as before the control plane had its own.
"""

from __future__ import annotations

import logging
import pickle

import torch
import torch.distributed as dist

from ..world import global_ranks, group, is_default, per_group, world, world_timeout

log = logging.getLogger("transpiler")

# the step's group's control group, per group (world.per_group)
_control: dict = {}


def control_group() -> dist.ProcessGroup:
    """The gloo group over the step's ranks for control exchanges, created on
    first use with the step's group's timeout. A collective: every rank of the
    step's group calls it."""
    # Every rank must create its groups in the same order. The first control
    # exchange is the settings agreement at the start of a step's first build,
    # which every rank reaches at the same point, before that build creates
    # its rings; so creating the group here, lazily, is the same on every rank.
    return per_group(_control, _new_control_group)


def _new_control_group() -> dist.ProcessGroup:
    current = group()
    if dist.get_backend(current) == dist.Backend.GLOO:
        control = current
    elif is_default():
        control = dist.new_group(backend=dist.Backend.GLOO, timeout=world_timeout())
    else:   # the other ranks of the job are not here to create it with us
        control = dist.new_group(global_ranks(), backend=dist.Backend.GLOO,
                                 timeout=world_timeout(), use_local_synchronization=True)
    log.debug("control plane: %s (group %s) beside the step's group's %s",
              "the step's group itself" if control is current else "a new gloo group",
              control.group_name, dist.get_backend(current))
    return control


def all_gather_values(value) -> list:
    """Every rank's `value` (anything pickle takes), by rank, over the control
    group; [value] without a process group of several ranks."""
    if world()[0] == 1:
        return [value]
    return [pickle.loads(b) for b in all_gather_bytes(pickle.dumps(value))]


def all_gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's bytes, over the control group. (all_gather_object would need numpy.)"""
    group = control_group()
    world_size = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=group)
    return [bytes(t[:int(n)].tolist()) for t, n in zip(gathered, sizes)]
