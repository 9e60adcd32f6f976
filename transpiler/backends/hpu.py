"""Intel Gaudi (HPU). The Gaudi software stack is imported here, and only when
backend="hpu" is chosen (or "auto" finds the model on a Gaudi device).

- Eager mode (PT_HPU_LAZY_MODE=0): the program is compiled with
  torch.compile(backend="hpu_backend").
- Lazy mode (the stack's default): the program is captured once as an HPU graph
  and replayed, as optimum-habana's fast_ddp does for its pack and unpack.
  Parameters, buffers, optimizer state and held tensors keep their addresses
  between calls, so the graph reads and updates them where they are; the batch
  and the hyperparameters are copied into the graph's static input buffers.
  A replay writes its outputs into the same tensors every time: the values the
  step returns to the caller are cloned, so a loss kept from one step is not
  overwritten by the next; the other outputs (optimizer state, .grad, held
  values) go to places the next step rewrites anyway, and are not copied (a
  .grad stays the graph's own tensor, as with DDP's gradient_as_bucket_view).

Written against Habana's documented API (habana_frameworks.torch.hpu.HPUGraph,
hpu.Stream, hpu.stream); the process group must use hccl
(habana_frameworks.torch.distributed.hccl registers it).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Callable

import torch
import torch.fx as fx

from ..errors import TranspileError


def present() -> bool:
    """Whether the Gaudi stack is installed (without importing it)."""
    return importlib.util.find_spec("habana_frameworks") is not None


def require():
    """The Gaudi stack's torch module, or a TranspileError saying how to get it."""
    try:
        import habana_frameworks.torch as ht
        import habana_frameworks.torch.core  # noqa: F401 - registers the hpu device
    except ImportError as exc:
        raise TranspileError(
            "backend='hpu' needs the Intel Gaudi software stack (habana_frameworks.torch), "
            "which is not installed: install the Intel Gaudi software stack and its PyTorch "
            "packages (they ship with the stack, not on PyPI), or choose backend='inductor' "
            f"or 'eager' ({exc})") from exc
    return ht


def lazy_mode() -> bool:
    return os.environ.get("PT_HPU_LAZY_MODE", "1") != "0"


def compile_graph(gm: fx.GraphModule, static: list[bool], returned: list[bool]) -> Callable:
    """static: per input, whether it keeps its address between calls;
    returned: per output, whether it is returned to the caller."""
    ht = require()
    if not lazy_mode():
        return torch.compile(gm, backend="hpu_backend", fullgraph=True, dynamic=False)
    return _GraphReplay(ht, gm, static, returned)


class _GraphReplay:
    """Capture on the first call, replay on every call after it; the outputs
    returned to the caller are fresh tensors (clones of the graph's own)."""

    def __init__(self, ht, gm: fx.GraphModule, static: list[bool], returned: list[bool]):
        self.ht, self.gm, self.static, self.returned = ht, gm, static, returned
        self.graph = None
        self.inputs: list[torch.Tensor] = []
        self.outputs = None

    def __call__(self, *inputs):
        if self.graph is None:
            self.inputs = [t if keep else t.to("hpu", copy=True)
                           for t, keep in zip(inputs, self.static)]
            self.graph = self.ht.hpu.HPUGraph()
            with self.ht.hpu.stream(self.ht.hpu.Stream()):
                self.graph.capture_begin()
                self.outputs = self.gm(*self.inputs)
                self.graph.capture_end()
        else:
            for buffer, t, keep in zip(self.inputs, inputs, self.static):
                if not keep:
                    buffer.copy_(t, non_blocking=True)
        self.graph.replay()
        return [out.clone() if fresh else out for out, fresh in zip(self.outputs, self.returned)]
