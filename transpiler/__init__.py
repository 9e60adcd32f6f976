"""A static-graph transpiler for data-parallel collectives.

    step = transpile(train_step, mode="grad_allreduce")
    step = transpile(train_step, mode=LocalSGD(k_steps=4, begin_step=100))
    loss = step(model, optimizer, x, y)
    print(step.program)
"""

from .api import transpile
from .errors import DivergenceError, PassError, TranspileError, VerificationError
from .mesh import Dim
from .mode_specs import (AllGather, Decentralized, DiLoCo, FuseAllReduce, GradAllReduce, LocalSGD,
                         Fsdp, ModeSpec, Pipeline, Zero)
from .modes import MODES
from .pipeline import PassContext, run_passes
from .program import Program
from .roles import Role

__all__ = ["transpile", "TranspileError", "PassError", "DivergenceError", "VerificationError",
           "MODES", "PassContext", "run_passes", "Program", "Role", "Dim", "ModeSpec",
           "GradAllReduce", "FuseAllReduce", "LocalSGD", "DiLoCo", "Zero", "Fsdp", "AllGather", "Decentralized",
           "Pipeline"]
