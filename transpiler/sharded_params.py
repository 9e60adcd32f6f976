"""The parameters of mode fsdp between steps. Each rank's shard of a parameter
lives in the step's held tensors (Held.PARAM_SHARD, cut by the startup program,
updated by every step); the parameter itself keeps its shape, dtype and
identity but no storage, so the model holds about 1/N of its parameter bytes.
unsharded() gathers the full values into the parameters for as long as the
caller needs them (evaluation, export, model.state_dict())."""

from __future__ import annotations

import contextlib

import torch

from .program import Held, held_name
from .shards import Sharding, full_of, shard_of


def free(params: list[tuple[str, torch.Tensor]]) -> None:
    """Release the storage of each parameter (a no-op where it is released)."""
    for _, p in params:
        p.untyped_storage().resize_(0)


@contextlib.contextmanager
def unsharded(params: list[tuple[str, torch.Tensor]], held: dict[str, torch.Tensor],
              writeback: bool, sharding: Sharding):
    """The full parameters, gathered from the shards of the ranks they are
    spread over (`sharding`); on exit the shards are cut again from the
    parameters if `writeback`, and the storage released. A collective: every
    rank enters it."""
    for name, p in params:
        full = full_of(held[held_name(Held.PARAM_SHARD, name)], p, sharding)
        p.untyped_storage().resize_(p.numel() * p.element_size())
        with torch.no_grad():
            p.copy_(full)
    try:
        yield
    finally:
        if writeback:
            for name, p in params:
                held[held_name(Held.PARAM_SHARD, name)].copy_(shard_of(p, sharding.index, sharding.count))
        free(params)
