"""A static-graph transpiler for data-parallel collectives.

    step = transpile(train_step, mode="grad_allreduce")
    step = transpile(train_step, mode=LocalSGD(k_steps=4, begin_step=100))
    loss = step(model, optimizer, x, y)
    print(step.program)
"""

from .api import transpile
from .backends.compile import BACKENDS
from .lowering import topology   # topology.of(...): a gossip topology of your own
from .errors import DivergenceError, PassError, TranspileError, VerificationError
from .program.mesh import Dim
from .mode_specs import (AllGather, Decentralized, DiLoCo, FuseAllReduce, GradAllReduce, LocalSGD,
                         Fsdp, ModeSpec, Pipeline, Zero)
from .modes import MODES
from .lowering.context import PassContext
from .pipeline import run_passes
from .program.program import Program
from .program.roles import Role

__all__ = ["transpile", "BACKENDS", "topology", "TranspileError", "PassError", "DivergenceError",
           "VerificationError", "MODES", "PassContext", "run_passes", "Program", "Role", "Dim",
           "ModeSpec", "GradAllReduce", "FuseAllReduce", "LocalSGD", "DiLoCo", "Zero", "Fsdp",
           "AllGather", "Decentralized", "Pipeline"]
