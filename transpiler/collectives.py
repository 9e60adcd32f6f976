"""The collective ops the passes insert: torch.distributed's functional
collectives, which run eagerly and under torch.compile; and the spec a pass puts
on a value (meta["reduce"]) for a reduction pass to lower."""

import dataclasses
import enum

import torch

ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
BROADCAST = torch.ops._c10d_functional.broadcast.default
WAIT = torch.ops._c10d_functional.wait_tensor.default


class ReduceOp(enum.Enum):
    SUM = "sum"
    # The mean over the ranks: each rank's value times 1 / world_size, then the
    # sum, which is how DDP's reducer averages gradients (same rounding).
    MEAN = "mean"


@dataclasses.dataclass(frozen=True)
class Reduction:
    """A value to reduce over all ranks: `key` names it (the parameter, for a
    gradient), `op` says how."""

    key: str
    op: ReduceOp = ReduceOp.SUM
