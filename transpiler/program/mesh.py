"""The device mesh: the world as nodes x local ranks, and the groups of ranks a
value can be reduced over, each with its communicators ("rings").

Ranks are numbered node by node (rank = node * local_size + local rank), as
torchrun assigns them, and torchrun tells each process how many ranks its node
runs (LOCAL_WORLD_SIZE). A reduction names the group it runs over with a `Dim`
(the world, this rank's node, or the ranks across nodes that share this rank's
local rank), a `UserGroup` (a process group the user gave for some
parameters) or `Peers` (this rank's group at a step of a decentralized topology); the mesh maps each to its size and to the process-group names of
its rings. The mesh is plain data: passes read it and create nothing.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Union


class Dim(enum.Enum):
    WORLD = "world"     # every rank
    NODE = "node"       # the ranks of this rank's node
    ACROSS = "across"   # one rank per node: those with this rank's local rank

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class UserGroup:
    """A process group given with transpile(reduce_groups=...): its position in that
    list and its size. Equal on every rank, whichever group each rank is in."""

    index: int
    size: int

    def __str__(self) -> str:
        return f"group{self.index}"


@dataclasses.dataclass(frozen=True)
class Peers:
    """This rank's group in partition `index` of a decentralized topology
    (transpiler/lowering/topology.py), of `size` ranks. Printed without the size: the
    ranks of one partition may be in groups of different sizes, and issue the
    same collective on each."""

    index: int
    size: int

    def __str__(self) -> str:
        return f"peers{self.index}"


Over = Union[Dim, UserGroup, Peers]


@dataclasses.dataclass(frozen=True)
class Mesh:
    world_size: int = 1
    rank: int = 0
    local_size: int = 1   # ranks per node
    # The process-group names of each group's rings, for the groups this
    # process created communicators for (Dim.WORLD always, with more than one rank).
    rings: dict[Over, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # Whether the communicators reduce-scatter natively (nccl, hccl). gloo's
    # reduce-scatter copies the whole value, all-reduces the copy and copies
    # this rank's chunk out of it; a world reduce-scatter is then lowered as
    # that all-reduce, in place, and a view of the chunk (transpiler/lowering/reductions.py).
    reduce_scatter_native: bool = True

    def __post_init__(self):
        if self.local_size < 1 or self.world_size % self.local_size:
            raise ValueError(f"{self.world_size} ranks cannot form nodes of {self.local_size}")

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_size

    def size(self, over: Over) -> int:
        if not isinstance(over, Dim):
            return over.size
        return {Dim.WORLD: self.world_size, Dim.NODE: self.local_size,
                Dim.ACROSS: self.nodes}[over]

    def position(self, dim: Dim) -> int:
        """This rank's index in its group along `dim`."""
        return {Dim.WORLD: self.rank, Dim.NODE: self.rank % self.local_size,
                Dim.ACROSS: self.rank // self.local_size}[dim]

    def shard_over(self, hierarchical: bool) -> Dim:
        """The group modes zero and fsdp spread their shards over: the world, or
        with `hierarchical` and more than one node, the node (hybrid sharding:
        each node holds the whole, its shards replicated across the nodes)."""
        return Dim.NODE if hierarchical and self.nodes > 1 else Dim.WORLD

    def ring(self, over: Over, i: int = 0) -> str:
        """The process-group name of ring i (modulo the group's rings) of `over`."""
        names = self.rings.get(over)
        if not names:
            raise ValueError(f"the mesh has no communicator for group {over}: "
                             f"it was built for {', '.join(map(str, self.rings)) or 'no group'}")
        return names[i % len(names)]

    def nrings(self, over: Over) -> int:
        return len(self.rings.get(over, ()))
