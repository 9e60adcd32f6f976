"""The parameters of mode fsdp between steps. Each rank's shard of a parameter
lives in the step's held tensors (Held.PARAM_SHARD, cut by the startup program,
updated by every step); the parameter itself keeps its shape, dtype and
identity but no storage, so the model holds about 1/N of its parameter bytes.
unsharded() gathers the full values into the parameters for as long as the
caller needs them (evaluation, export, model.state_dict()); dcp_state_dict and
load_dcp_state_dict give torch.distributed.checkpoint each rank's shards.

Every parameter, held as a shard or whole (frozen, unused, or before the
step's first call), is saved as the same DTensor: Shard(0) of the flattened
parameter (shards.as_dtensor). The layout is thus a function of the model
alone, and a checkpoint loads before the first call, into another world size
(DCP reshards), or into a step that keeps other parameters whole."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..errors import TranspileError
from ..program.program import Held, held_name
from ..lowering.shards import (Sharding, as_dtensor, from_dtensor, full_of, refuse_hybrid_dcp,
                               shard_of, world_mesh)
from ..world import group as step_group


def free(params: list[tuple[str, torch.Tensor]]) -> None:
    """Release the storage of each parameter (a no-op where it is released);
    until restore(), an op that reads one raises (Released)."""
    for name, p in params:
        p.untyped_storage().resize_(0)
        if type(p) is torch.nn.Parameter:
            p.__class__ = Released
            p._released_as = name


def restore(params: list[tuple[str, torch.Tensor]]) -> None:
    """Each released parameter a plain parameter again (its storage still released)."""
    for _, p in params:
        if type(p) is Released:
            p.__class__ = torch.nn.Parameter
            del p._released_as


# What a released parameter answers: its metadata, never its values.
_METADATA = {getattr(torch.Tensor, name).__get__ for name in (
    "shape", "dtype", "device", "layout", "ndim", "requires_grad", "is_leaf", "grad",
    "_grad", "grad_fn", "_grad_fn", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized",
    "is_mkldnn", "is_nested", "_version", "output_nr", "_base", "_cdata")} | {
    getattr(torch.Tensor, name).__set__ for name in ("grad", "_grad", "requires_grad")} | {
    getattr(torch.Tensor, name) for name in (
        "size", "dim", "numel", "nelement", "stride", "storage_offset", "untyped_storage",
        "element_size", "is_contiguous", "is_floating_point", "is_complex", "data_ptr",
        "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
        "__hash__", "__format__", "_is_view", "is_shared", "is_pinned")}


class Released(torch.nn.Parameter):
    """A parameter of mode fsdp between steps: its shape, dtype and identity
    are kept (an optimizer, a module and the step's guards hold it), its
    storage is released and its values live in the ranks' shards. An op that
    would read the values (an EMA update, p.sum(), torch.save, deepcopy, an
    optimizer outside the step) raises, instead of reading released memory."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        released = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                    if type(a) is Released]
        name = getattr(released[0], "_released_as", "a parameter") if released else "a parameter"
        what = getattr(func, "__name__", "")
        what = f"{what} reads it" if what and what not in ("__get__", "__set__") else "read"
        raise TranspileError(
            f"{name} is kept as shards between the steps of mode fsdp and holds no value "
            f"here ({what}): read or change the "
            "parameters between steps inside `with step.unsharded():` (every rank enters it; "
            "writeback=True keeps what the block wrote)")


@contextlib.contextmanager
def unsharded(params: list[tuple[str, torch.Tensor]], held: dict[str, torch.Tensor],
              writeback: bool, sharding: Sharding):
    """The full parameters, gathered from the shards of the ranks they are
    spread over (`sharding`); on exit the shards are cut again from the
    parameters if `writeback`, and the storage released. A collective: every
    rank enters it."""
    restore(params)
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


def _entries(model: torch.nn.Module, params, held) -> list[tuple[str, torch.Tensor, object]]:
    """(key, tensor, held shard or None) of each model.state_dict() entry:
    the shard for a parameter the step holds as one, None for a parameter held
    whole and for a buffer (not a parameter). A parameter whose storage is
    released but that the step holds no shard of (another step's) is refused."""
    shards = {id(p): held[held_name(Held.PARAM_SHARD, name)] for name, p in params}
    entries = []
    for key, value in model.state_dict(keep_vars=True).items():
        shard = shards.get(id(value))
        if shard is None and value.numel() and not value.untyped_storage().nbytes():
            raise TranspileError(
                f"{key} holds no storage and this step keeps no shard of it: it is sharded by "
                "another step in mode fsdp; save or load it through that step")
        entries.append((key, value, shard))
    return entries


def _rank0(buffer: torch.Tensor) -> torch.Tensor:
    """A copy of the step's rank 0's value of a buffer (a collective). DCP writes a plain
    tensor once, from whichever rank it picks; the ranks' buffers differ after
    a step, and the next step starts from rank 0's (DDP's broadcast_buffers)."""
    copy = buffer.detach().clone()
    dist.broadcast(copy, group=step_group(), group_src=0)
    return copy


def dcp_state_dict(model: torch.nn.Module, params, held, sharding: Sharding) -> dict:
    """model.state_dict() for torch.distributed.checkpoint: each parameter a
    DTensor of this rank's shard (a view of the held shard, or cut from the
    parameter held whole), each buffer rank 0's. A collective."""
    refuse_hybrid_dcp(sharding, "the model's parameters", "step.unsharded()")
    mesh = world_mesh(next(model.parameters()).device)
    is_param = {id(p) for p in model.parameters()}
    return {key: (as_dtensor(shard if shard is not None
                             else shard_of(value, sharding.index, sharding.count),
                             value, mesh) if id(value) in is_param else _rank0(value))
            for key, value, shard in _entries(model, params, held)}


def load_dcp_state_dict(model: torch.nn.Module, params, held, state: dict,
                        sharding: Sharding) -> None:
    """Load a state from dcp_state_dict that torch.distributed.checkpoint
    filled: a held shard takes its DTensor's part (padded); a parameter held
    whole (before the first call: all of them) is gathered from the ranks'
    parts (a collective); a buffer is copied. Keys and layouts are checked
    before anything is gathered or written."""
    refuse_hybrid_dcp(sharding, "the model's parameters", "step.unsharded()")
    entries = _entries(model, params, held)
    is_param = {id(p) for p in model.parameters()}
    missing = [key for key, _, _ in entries if key not in state]
    unexpected = sorted(set(state) - {key for key, _, _ in entries})
    wrong = [key for key, value, _ in entries if key in state and (
        (id(value) in is_param) != isinstance(state[key], DTensor)
        or tuple(state[key].shape) != ((value.numel(),) if id(value) in is_param
                                       else tuple(value.shape)))]
    if missing or unexpected or wrong:
        raise TranspileError(
            "load_sharded_model_state_dict: the state does not fit the model (missing "
            f"{missing}, unexpected {unexpected}, of another layout {wrong}); nothing was loaded. "
            "Load what step.sharded_model_state_dict(model) gave, filled by dcp.load")
    values = [(value, shard, from_dtensor(state[key], value) if id(value) in is_param
               else state[key]) for key, value, shard in entries]
    values = [(value, shard, full_of(new, value, sharding)
               if shard is None and id(value) in is_param else new)
              for value, shard, new in values]
    with torch.no_grad():
        for value, shard, new in values:
            (shard if shard is not None else value).copy_(new)
