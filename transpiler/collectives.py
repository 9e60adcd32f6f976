"""The collective ops the passes insert: torch.distributed's functional
collectives, which run eagerly and under torch.compile."""

import torch

ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
BROADCAST = torch.ops._c10d_functional.broadcast.default
WAIT = torch.ops._c10d_functional.wait_tensor.default
