"""The eager backend's code: FX's code of a graph, with each ATen op called at
its C++ entry point.

FX's code calls an op as `torch.ops.aten.mm.default(a, b)`, through
OpOverload.__call__: a Python frame that only passes its arguments on to the
op's C++ function (OpOverload._op). A program runs a thousand ops or more per
step, and that frame costs 0.4 to 1.5 us a call (a view: 2.1 us through _op,
4.3 us through the OpOverload): several percent of a small model's step on CPU.
`direct` compiles FX's own code with `torch` bound to a namespace whose
`ops.<namespace>.<op>.<overload>` is that C++ function and whose every other
name is torch's: the same op is called with the same arguments.
"""

from __future__ import annotations

import itertools
import linecache
from typing import Callable

import torch
import torch.fx as fx
from torch._ops import OpOverload

_NAMESPACES = (torch._ops._Ops, torch._ops._OpNamespace, torch._ops.OpOverloadPacket)
_numbers = itertools.count()


class _Direct:
    """A view of `real` (torch, torch.ops, the aten namespace or one of its
    ops) whose overloads are their C++ functions; looked up once per name.
    Other namespaces (collectives, custom ops) are torch's own: a call
    looks their ops up as FX's code does."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name: str):
        value = getattr(self._real, name)
        if type(value) is OpOverload:   # not a subclass that calls otherwise (torchbind's)
            value = value._op
        elif isinstance(value, _NAMESPACES) and (not isinstance(self._real, torch._ops._Ops)
                                                 or name == "aten"):
            value = _Direct(value)
        setattr(self, name, value)
        return value


_TORCH = _Direct(torch)


def direct(gm: fx.GraphModule) -> Callable:
    """gm's forward, as a function of its inputs, calling its ops directly."""
    code = gm.graph.python_code(root_module="self")
    key = f"<program code {next(_numbers)}>"
    linecache.cache[key] = (len(code.src), None, code.src.splitlines(True), key)
    namespace = {**code.globals, "torch": _TORCH}
    exec(compile(code.src, key, "exec"), namespace)
    forward = namespace["forward"]
    return lambda *inputs: forward(gm, *inputs)
