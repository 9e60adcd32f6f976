"""Are the ranks' parameters the same? A checksum of each parameter's bits,
gathered from every rank over the control plane's gloo group and compared
with rank 0's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .control_plane import control_group

_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def checksum(t: torch.Tensor) -> torch.Tensor:
    """An int64 that changes with any bit of any element and with their order:
    sum over i of bits[i] * (i + 1), wrapping on overflow."""
    bits = t.detach().contiguous().reshape(-1).view(_BITS[t.element_size()]).long()
    return (bits * torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=t.device)).sum()


def divergent(named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """One line per parameter whose checksum differs between ranks, naming
    the ranks that differ from rank 0; empty when every rank agrees. A
    collective over the control group: every rank must call it."""
    if not named:
        return []
    # computed on the parameters' device, exchanged on gloo: one copy to the CPU
    mine = torch.stack([checksum(t) for _, t in named]).cpu()
    group = control_group()
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    lines = []
    for i, (name, _) in enumerate(named):
        ranks = [r for r, sums in enumerate(every) if sums[i] != every[0][i]]
        if ranks:
            lines.append(f"{name}: ranks {', '.join(map(str, ranks))} differ from rank 0")
    return lines
