"""The world a step is data parallel over: the default process group, or the
group given as transpile(process_group=...) (DDP's process_group), with the
other ranks of the job doing something else.

TranspiledStep does everything it does (its calls, its checkpoints, join,
the consistency checks) inside `over(its group)`; below it, code asks this
module for the group, its size, this rank's position in it and its timeout,
never the default group. Ranks are the group's own (0 .. size - 1) wherever
the transpiler names one: a broadcast "from rank 0" is from the group's first.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, TypeVar

import torch.distributed as dist

from .errors import TranspileError

T = TypeVar("T")

# The group of the step running on this thread; None: the default group.
_group: contextvars.ContextVar = contextvars.ContextVar("transpiler_world", default=None)


def group() -> dist.ProcessGroup:
    """The process group of the step running now (the default group unless
    the step was given one)."""
    return _group.get() or dist.group.WORLD


def is_default() -> bool:
    """Whether the step runs over every rank of the default group."""
    return _group.get() in (None, dist.group.WORLD)


@contextlib.contextmanager
def over(process_group: dist.ProcessGroup | None):
    """Run the block as a step over `process_group` (None: the default group)."""
    token = _group.set(process_group)
    try:
        yield
    finally:
        _group.reset(token)


def per_group(table: dict, make: Callable[[], T]) -> T:
    """What `table` holds for the step's group, made by `make()` on first use
    and again for a new group under an old name (after the default group was
    initialized again). The table holds the group too, which keeps its id
    from being reused by a later one."""
    current = group()
    known = table.get(current.group_name)
    if known is None or known[0] is not current:
        known = table[current.group_name] = (current, make())
    return known[1]


def describe() -> str:
    """The step's group, in words for a message."""
    return "the default group" if is_default() else f"its process_group {group().group_name!r}"


def world() -> tuple[int, int]:
    """(size, this rank's position) of the step's group; (1, 0) without an
    initialized process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group()), dist.get_rank(group())


def global_ranks() -> list[int]:
    """The default group's ranks of the step's group, by position."""
    return dist.get_process_group_ranks(group())


def world_timeout():
    """The timeout the user gave the step's group: new groups would otherwise
    get torch's default (30 minutes for gloo) and wait that long for a dead rank."""
    current = group()
    for device in current._device_types:
        options = getattr(current._get_backend(device), "options", None)
        if options is not None:
            return options._timeout
    return None


def backend_for(device_type: str) -> str:
    """The step's group's backend for tensors of `device_type` (a group may
    name one per device: "cpu:gloo,cuda:nccl")."""
    have = dist.get_backend(group())
    per_device = dict(part.split(":", 1) for part in have.split(",") if ":" in part)
    return per_device.get(device_type, have)


def checked(process_group) -> dist.ProcessGroup | None:
    """transpile()'s process_group option: None (the default group) or a
    process group this rank belongs to."""
    if process_group is None:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise TranspileError("process_group= needs torch.distributed initialized first "
                             "(torch.distributed.init_process_group)")
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise TranspileError(
            f"process_group=: rank {dist.get_rank()} is not in this group "
            "(dist.new_group gave it GroupMember.NON_GROUP_MEMBER): transpile the step "
            "with the group only on the group's ranks, as DDP(process_group=...) is built")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TranspileError(f"process_group must be a torch.distributed process group "
                             f"(dist.new_group(ranks)), got {process_group!r}")
    return None if process_group is dist.group.WORLD else process_group
