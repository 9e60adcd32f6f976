"""Capture: trace a user's unmodified training step into one functional Program.

The step is traced with make_fx on fake tensors (nothing real is computed or
touched), with the modules' parameters and buffers, the optimizers' state and
their lifted hyperparameters swapped for graph inputs. Markers placed during the
trace (a wrapper around backward(), hooks around optimizer.step()) give every
node its role. The graph, which mutates its inputs like the eager step does, is
then made a pure function whose new state values are outputs: by rewriting its
in-place ops out of place (functionalize.py) where that is exact, else by
tracing it once more through torch.func.functionalize, which carries roles and
gradient annotations across node by node. The optimizers' state is made before
the trace as their first step would make it, so that one trace serves every
call with the same signature.
"""

from .arguments import StepArgs, flatten_args
from .build import identifier
from .markers import compiling_flag, intercepted_schedulers
from .optimizer_state import make_first_state
from .signature import describe_change, grad_signature, signature
from .returned import Returned
from .slots import HeldSlot
from .trace import Captured, trace_step

__all__ = ["Captured", "HeldSlot", "Returned", "StepArgs", "compiling_flag", "identifier",
           "describe_change", "flatten_args", "grad_signature", "intercepted_schedulers",
           "make_first_state", "signature", "trace_step"]
