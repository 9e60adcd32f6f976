"""The optimizer state of mode "zero", kept as shards in the optimizers' own
state (passes/shard_optimizer.py says the layout): an entry shaped like its
parameter (momentum, Adam's moments) holds this rank's c = ceil(n / N)
elements of the flattened, padded parameter; scalar entries (Adam's step) stay
whole. Everything else that reads the state goes through here: the trace sees
a full-shaped stand-in, a full entry (made for the first step, or loaded from
a full state_dict) is cut to its shard before the signature is taken, and a
full state_dict is gathered back for checkpoints and single-process optimizers."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .errors import TranspileError


def shard_numel(numel: int, world_size: int) -> int:
    """Elements of each rank's shard of a tensor of `numel` elements."""
    return -(-numel // world_size)


def shard_of(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's shard of a full tensor, as a new tensor (zeros past its end)."""
    chunk = shard_numel(full.numel(), world_size)
    flat = F.pad(full.detach().reshape(-1), (0, chunk * world_size - full.numel()))
    return flat[rank * chunk:(rank + 1) * chunk].clone()


class ShardedState:
    """Which optimizer state entries hold shards, and the moves between full
    and sharded entries. `rank` and `world_size` are the process group's."""

    def __init__(self):
        self._shards: dict[int, weakref.ref] = {}   # the shard tensors placed, by id

    @staticmethod
    def _world() -> tuple[int, int]:
        return dist.get_rank(), dist.get_world_size()

    def is_shard(self, value) -> bool:
        ref = self._shards.get(id(value))
        return ref is not None and ref() is value

    def shard(self, optimizers) -> None:
        """Replace every full entry shaped like its parameter by this rank's
        shard: state made for the first step, state a user loaded. A shard the
        program wrote (state it created) is recognized by its shape."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        rank, world_size = self._world()
        for opt in optimizers:
            for p, entries in opt.state.items():
                for key, value in list(entries.items()):
                    if not isinstance(value, torch.Tensor) or self.is_shard(value) \
                            or value.dim() == 0:
                        continue
                    if value.shape == p.shape:
                        value = entries[key] = shard_of(value, rank, world_size)
                    elif value.shape != (shard_numel(p.numel(), world_size),):
                        raise TranspileError(
                            f"optimizer state '{key}' of a parameter of shape {tuple(p.shape)} "
                            f"has shape {tuple(value.shape)}: neither the parameter's (a full "
                            f"entry) nor a shard of {world_size} ranks; a state saved with "
                            "another number of ranks loads through full_state_dict or "
                            "torch.distributed.checkpoint")
                    self._shards[id(value)] = weakref.ref(value)

    def stand_in(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """What the trace sees of a state entry: a shard's full layout
        (uninitialized: only its layout is read)."""
        if not self.is_shard(value):
            return value
        return torch.empty_like(param, dtype=value.dtype, memory_format=torch.preserve_format)

    def full_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """optimizer.state_dict() with every shard gathered into its full entry,
        loadable by the same optimizer on one process or any number of ranks. A
        collective: every rank calls it, in the same order of optimizers."""
        state = optimizer.state_dict()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        full = {}
        for index, entries in state["state"].items():
            p = params[index]
            full[index] = dict(entries)
            for key in sorted(entries):
                value = optimizer.state[p][key]
                if self.is_shard(value):
                    parts = [torch.empty_like(value) for _ in range(world_size)]
                    dist.all_gather(parts, value.contiguous())
                    full[index][key] = torch.cat(parts)[:p.numel()].view(p.shape).clone()
        return {"state": full, "param_groups": state["param_groups"]}

    def dcp_state_dict(self, optimizer: torch.optim.Optimizer, make_state) -> dict:
        """optimizer.state_dict() with each shard as a DTensor over the world:
        Shard(0) of the flattened parameter, unpadded (global shape (numel,)),
        whose local tensor is this rank's part of it. What
        torch.distributed.checkpoint saves (each rank its part) and loads into
        (reading the parts of any world size). An optimizer with no state yet
        (a fresh process about to resume) first gets the state its first step
        would make, from `make_state(optimizers)`, as shards to load into."""
        if not optimizer.state:
            make_state([optimizer])
            self.shard([optimizer])
        if not optimizer.state:
            raise TranspileError(
                f"{type(optimizer).__name__} has no state to save or load into, and its first "
                "state cannot be made ahead of a step: run one step before saving, or resume "
                "through full_optimizer_state_dict")
        state = optimizer.state_dict()
        rank, _ = self._world()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        mesh = DeviceMesh.from_group(dist.group.WORLD, params[0].device.type)
        sharded = {}
        for index, entries in state["state"].items():
            p = params[index]
            sharded[index] = dict(entries)
            for key in entries:
                value = optimizer.state[p][key]
                if self.is_shard(value):
                    start = min(rank * value.numel(), p.numel())
                    local = value[:max(0, min(value.numel(), p.numel() - start))]
                    sharded[index][key] = DTensor.from_local(
                        local, mesh, [Shard(0)], shape=torch.Size([p.numel()]), stride=(1,))
        return {"state": sharded, "param_groups": state["param_groups"]}

    def load_dcp_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load what dcp_state_dict gave once torch.distributed.checkpoint has
        filled it: each DTensor's local part becomes this rank's shard (padded)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        plain = {}
        for index, entries in state["state"].items():
            plain[index] = dict(entries)
            for key, value in entries.items():
                if isinstance(value, DTensor):
                    n = shard_numel(params[index].numel(), dist.get_world_size())
                    plain[index][key] = F.pad(value.to_local(), (0, n - value.to_local().numel()))
        optimizer.load_state_dict({"state": plain, "param_groups": state["param_groups"]})
        self.shard([optimizer])
