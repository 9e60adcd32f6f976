"""What a pass is given and what it declares: PassContext (the settings every
pass reads), Pass, and the contracts the pass manager (transpiler/pipeline.py)
checks: requires, produces and consumes a Mark."""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Union

import torch

from ..program.mesh import Dim, Mesh, Over
from ..program.program import Program
from .comm_hooks import CommHook
from .topology import Gossip


class SyncPart(enum.Enum):
    """A sync cut in two programs (defer_waits): the one that issues its
    collectives, and the one, steps later, that waits on them."""

    SEND = "send"
    RECEIVE = "receive"


@dataclasses.dataclass(frozen=True)
class PassContext:
    """Settings every pass reads. Passes take nothing from globals or the environment."""

    mesh: Mesh = Mesh()           # the ranks, their nodes and the communicators of each group
    nrings: int = 2
    # Reduce over the world hierarchically when there is more than one node
    # (the runtime then builds the mesh with nodes).
    hierarchical: bool = False
    # Parameters whose gradients are reduced over a group of their own, by name
    # (transpile(reduce_groups=...)); every other parameter's over the world.
    groups: dict[str, Over] = dataclasses.field(default_factory=dict)
    bucket_mb: float = 25.0       # coalesce_tensors: bucket cap
    first_bucket_mb: float = 1.0  # coalesce_tensors: cap of the first bucket per dtype
    # coalesce_tensors: DDP's layout of its first iteration (each dtype's
    # gradients in one bucket, in the parameters' order), not the rebuilt one
    initial_buckets: bool = False
    # coalesce_tensors: the order of the gradients in the rebuilt buckets (the
    # first build's accumulation order, Program.ready_order; DDP rebuilds once)
    ready_order: tuple[str, ...] = ()
    fuse_dtype: torch.dtype | None = None  # coalesce_tensors: dtype on the wire
    comm_hook: CommHook | None = None      # coalesce_tensors: DDP's comm hook on each bucket
    adaptive_k: bool = False      # local_sgd: output the mean loss and lr for the schedule
    # snapshot_params: with one rank too (DiLoCo's outer step reads the snapshots)
    keep_snapshots: bool = False
    # pseudo_gradients: the fragment of the parameters this program averages,
    # as (index, number of fragments)
    fragment: tuple[int, int] | None = None
    # defer_waits: which part of a sync whose sums are waited on later this program is
    sync_part: SyncPart | None = None
    # shard_params: gather a bucket again in each forward or backward pass
    # that reads it rather than keeping it to its last use in the step
    reshard_after_forward: bool = True
    # transpile(find_unused_parameters=True): a parameter may get a gradient on
    # some ranks only (the trace gives it zeros where it gets none), so what
    # the ranks reduce is laid out from the parameters, not from the order one
    # rank's backward pass produced their gradients in
    find_unused: bool = False
    # mix_params: this rank's mixing in the program being built (decentralized
    # mode; the schedule sets it per program)
    gossip: Gossip | None = None

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def rank(self) -> int:
        return self.mesh.rank

    @property
    def shard_over(self) -> Dim:
        """The group shard_optimizer spreads each value's shards over (Mesh.shard_over)."""
        return self.mesh.shard_over(self.hierarchical)

    def over(self, param: str) -> Over:
        """The group a parameter's gradient (and local SGD's delta) is reduced over."""
        return self.groups.get(param, Dim.WORLD)


Pass = Callable[[Program, PassContext], None]
PassLike = Union[str, Pass]


def requires(*names: str):
    """Declare the passes that must have run before this one. "a|b": either."""
    def mark(fn):
        fn.requires = names
        return fn
    return mark


class Mark(enum.Enum):
    """What a pass leaves on the program for a later pass to act on."""

    TO_REDUCE = "values marked to reduce (meta['reduce'])"


def produces(mark: Mark):
    """Declare that the pass leaves `mark` for a later pass to consume."""
    def decorate(fn):
        fn.produces = mark
        return fn
    return decorate


def consumes(mark: Mark):
    """Declare that the pass acts on `mark` and removes it: a producer must run
    before it, and a second consumer needs a producer in between."""
    def decorate(fn):
        fn.consumes = mark
        return fn
    return decorate
