"""The collective ops the passes insert: torch.distributed's functional
collectives, which run eagerly and under torch.compile; and the spec a pass puts
on a value (meta["reduce"]) for a reduction pass to lower (transpiler/lowering/reductions.py)."""

import dataclasses
import enum

import torch

from .mesh import Dim, Over

_functional = torch.ops._c10d_functional
ALL_REDUCE = _functional.all_reduce.default
REDUCE_SCATTER = _functional.reduce_scatter_tensor.default
ALL_GATHER = _functional.all_gather_into_tensor.default
BROADCAST = _functional.broadcast.default
WAIT = _functional.wait_tensor.default
# CommInfo.op of each collective
OP_NAMES = {ALL_REDUCE: "all_reduce", REDUCE_SCATTER: "reduce_scatter", ALL_GATHER: "all_gather",
            BROADCAST: "broadcast"}


def set_group(node, group_name: str) -> None:
    """Issue the collective `node` on the process group named `group_name`."""
    names = [a.name for a in node.target._schema.arguments]
    node.update_arg(names.index("group_name"), group_name)


def sent_bytes(op: str, nbytes: int, group_size: int) -> float:
    """Bytes one rank sends in a collective over a buffer of `nbytes` (its whole
    size) among `group_size` ranks, counted for the bandwidth-optimal ring
    algorithms: an all-reduce sends 2 (g - 1) / g of the buffer, a
    reduce-scatter or an all-gather (g - 1) / g, a broadcast the buffer.
    (What a backend's algorithm sends may differ; this is the usual measure.)"""
    if op == "broadcast":
        return float(nbytes)
    share = (group_size - 1) / group_size
    return (2 if op == "all_reduce" else 1) * share * nbytes


class ReduceOp(enum.Enum):
    SUM = "sum"
    # The mean over the group: each rank's value times 1 / group size, then the
    # sum, which is how DDP's reducer averages gradients (same rounding).
    MEAN = "mean"


class Placement(enum.Enum):
    """Where the reduced value lives."""

    REPLICATE = "replicate"   # every rank of the group holds all of it (all-reduce)
    # Rank r of the group holds the r-th of as many equal parts of the (flat,
    # padded) value (reduce-scatter): shard_optimizer's gradient buckets.
    SHARD = "shard"


@dataclasses.dataclass(frozen=True)
class Reduction:
    """A value to reduce: `key` names it, uniquely in the program (the
    parameter, for a gradient), `op` says how, `over` which group of ranks
    (transpiler/program/mesh.py), `placement` where the result lives. `point`: values
    of different points never share a collective; 0 for the values reduced
    once per step, else the backward() (from 1) whose gradients are averaged
    where it ends (transpiler/program/averaging.py). A reduction pass lowers it and
    removes it from the node, so no value is reduced twice."""

    key: str
    op: ReduceOp = ReduceOp.SUM
    over: Over = Dim.WORLD
    placement: Placement = Placement.REPLICATE
    point: int = 0

    def __str__(self) -> str:
        op = "" if self.op is ReduceOp.SUM else f"({self.op.value})"
        over = "" if self.over is Dim.WORLD else f" over={self.over}"
        placed = "" if self.placement is Placement.REPLICATE else f" {self.placement.value}"
        point = f" at backward {self.point}" if self.point else ""
        return f"{op}{over}{placed}{point}"
