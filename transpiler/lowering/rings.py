"""Communicators ("rings"): the process groups the programs' collectives run
on, created once per world and kept for the life of the process.

Every rank must create them in the same order, which holds because every rank
transpiles the same program with the same settings (the rank agreement checks
them before any group is created). The groups have the step's group's timeout,
so a collective whose peer died raises within the timeout the user configured.
A step given a process group of its own (transpile(process_group=...)) runs
on that group alone, as DDP does: nothing is created for it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Sequence

import torch.distributed as dist

from ..errors import TranspileError
from ..program.mesh import Dim, Mesh, Over, Peers, UserGroup
from ..world import group as step_group, is_default, world, world_timeout

log = logging.getLogger("transpiler")

# (dim, ring, ranks per node) or (partition, ring) -> the name of this rank's
# group, for every communicator created so far over `_world` (holding it keeps
# its id from being reused by a later default group)
_names: dict[tuple, str] = {}
_world: list = [None]


def local_world_size() -> int:
    """Ranks per node, as torchrun tells each process (LOCAL_WORLD_SIZE); the
    whole world when it is unset (one node)."""
    world_size = world()[0]
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        return world_size
    if not value.isdigit() or int(value) < 1 or world_size % int(value):
        raise TranspileError(f"LOCAL_WORLD_SIZE={value!r} does not divide the world of "
                             f"{world_size} ranks into nodes: launch the same number of "
                             "processes on every node (torchrun --nproc-per-node)")
    return int(value)


def reduce_scatter_native(device) -> bool:
    """Whether the step's communicator for `device` reduce-scatters natively.
    gloo's reduce-scatter (ProcessGroupGloo.reduce_scatter_tensor_coalesced)
    clones its input, all-reduces the clone and copies this rank's chunk out."""
    gloo = getattr(dist, "ProcessGroupGloo", None)
    return gloo is None or not isinstance(step_group()._get_backend(device), gloo)


def plain_mesh(nodes: bool) -> Mesh:
    """This world without communicators: with `nodes`, as torchrun's nodes
    (LOCAL_WORLD_SIZE ranks each), else as one node. A step over a group of
    its own (process_group=) is one node."""
    world_size, rank = world()
    if world_size == 1:
        return Mesh()
    return Mesh(world_size, rank, local_world_size() if nodes and is_default() else world_size)


def build_mesh(nrings: int, hierarchical: bool,
               groups: Sequence[dist.ProcessGroup | Dim] = (),
               partitions: Sequence[Sequence[Sequence[int]]] = ()) -> Mesh:
    """The mesh of this world with `nrings` rings over the world, and over the
    node and across-node groups where they are used: by a hierarchical
    reduction (with more than one node), or by a reduce group given as a mesh
    dimension. A reduce group given as a process group is its own single ring,
    numbered by its position in `groups`. Each partition of a decentralized
    topology gets `nrings` rings over each of its groups (Peers, numbered by
    the partition's position)."""
    dims = {g for g in groups if isinstance(g, Dim)}
    mesh = plain_mesh(hierarchical or bool(dims))
    if mesh.world_size == 1:
        return mesh
    if not is_default():   # the user's group is the one communicator (as DDP's)
        return dataclasses.replace(mesh, rings={Dim.WORLD: (step_group().group_name,)})
    world_size, rank, local_size = mesh.world_size, mesh.rank, mesh.local_size
    if hierarchical and mesh.nodes > 1:
        dims |= {Dim.NODE, Dim.ACROSS}
    rings: dict[Over, tuple[str, ...]] = {Dim.WORLD: _rings(mesh, Dim.WORLD, nrings)}
    for dim in (Dim.NODE, Dim.ACROSS):
        if dim in dims:
            rings[dim] = _rings(mesh, dim, nrings)
    for i, group in enumerate(groups):
        if not isinstance(group, Dim):
            rings[UserGroup(i, group.size())] = (group.group_name,)
    for i, partition in enumerate(partitions):
        mine = next(g for g in partition if rank in g)
        rings[Peers(i, len(mine))] = tuple(
            _created((tuple(map(tuple, partition)), ring), [list(g) for g in partition])
            for ring in range(nrings))
    return Mesh(world_size, rank, local_size, rings)


def _partition(mesh: Mesh, dim: Dim) -> list[list[int]]:
    """The groups of ranks `dim` splits the world into."""
    nodes, local = mesh.nodes, mesh.local_size
    if dim is Dim.WORLD:
        return [list(range(mesh.world_size))]
    if dim is Dim.NODE:
        return [[n * local + i for i in range(local)] for n in range(nodes)]
    return [[n * local + i for n in range(nodes)] for i in range(local)]


def _rings(mesh: Mesh, dim: Dim, nrings: int) -> tuple[str, ...]:
    """Names of `nrings` communicators of this rank's group along `dim`."""
    key = 0 if dim is Dim.WORLD else mesh.local_size
    return tuple(_created((dim, ring, key), _partition(mesh, dim)) for ring in range(nrings))


def _created(key: tuple, partition: list[list[int]]) -> str:
    """The name of this rank's group of `partition`, created under `key` unless
    it was already (every rank creates every group of the partition)."""
    if _world[0] is not dist.group.WORLD:   # a new default group: new communicators
        _names.clear()
        _world[0] = dist.group.WORLD
    if key not in _names:
        if len(partition) == 1:
            group = dist.new_group(ranks=partition[0], timeout=world_timeout())
        else:
            group, _ = dist.new_subgroups_by_enumeration(partition, timeout=world_timeout())
        _names[key] = group.group_name
        log.debug("created communicator %s (group %s)", key, group.group_name)
    return _names[key]


def shut_down() -> None:
    """Destroy every communicator created for this world: a rank waiting in one
    of their collectives fails at once (gloo: "Connection closed by peer")
    rather than at the timeout. Their names stay taken, so this world's
    programs cannot run again (a new default group gets new communicators)."""
    if _world[0] is not dist.group.WORLD or not is_default():
        return   # a step over the user's group (process_group=) created none
    for name in _names.values():
        dist.destroy_process_group(dist.distributed_c10d._resolve_process_group(name))
        log.debug("destroyed communicator group %s", name)
