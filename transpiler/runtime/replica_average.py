"""The ranks' average of tensors that differ between them by design (the
parameters of decentralized training), and how far they are from it. Both are
collectives over the step's group: every rank calls them at the same point."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .. import world


def _groups(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors by (device, dtype), in order: one flat buffer each."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


@torch.no_grad()
def global_average(tensors: Sequence[torch.Tensor]) -> None:
    """Set each tensor, in place, to its mean over the ranks (the sum of one
    flat buffer per dtype, divided by the world size): afterwards every rank
    holds the same values."""
    world_size = world.world()[0]
    for same in _groups(tensors):
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=world.group())
        flat.div_(world_size)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


@torch.no_grad()
def consensus_distance(tensors: Sequence[torch.Tensor]) -> float:
    """The mean over the ranks of the Euclidean distance between this rank's
    tensors (all of them as one vector) and the ranks' average, in float64."""
    if not tensors:
        return 0.0
    world_size = world.world()[0]
    x = torch.cat([t.reshape(-1).double() for t in tensors])
    mean = x.clone()
    dist.all_reduce(mean, group=world.group())
    mean.div_(world_size)
    distance = torch.linalg.vector_norm(x - mean).reshape(1)
    dist.all_reduce(distance, group=world.group())
    return distance.item() / world_size
