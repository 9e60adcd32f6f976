"""DDP's communication hooks, traced into the program on each bucket.

`transpile(step, mode="fuse_all_reduce", comm_hook=(state, hook))` takes what
`DistributedDataParallel.register_comm_hook(state, hook)` takes: `hook(state,
bucket) -> Future[Tensor]`, where the bucket's buffer holds this rank's
gradients (not divided by the world size: the hook averages) and the future's
tensor is what the bucket's gradients become. coalesce_tensors calls `reduce`
for each bucket: the hook runs once under make_fx on a stand-in bucket, with
torch.distributed's collectives run as functional collectives and futures that
are complete at once (traced_collectives.py), and the graph it gives is put into the program where the
bucket's all-reduce would be: its collectives are collectives of the program
(meta["comm"]), scheduled and spread over the rings as the passes' own.

The hook is traced once, so it must be a function of the bucket (buffer,
gradients, index, is_last) and of a state that is a process group or None, as
torch's allreduce_hook, fp16_compress_hook and bf16_compress_hook are. A state
with Python values that change between steps (PowerSGD's iteration counter,
error feedback and warm start) is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from .collectives import OP_NAMES, WAIT, set_group
from .errors import TranspileError
from .program import CommInfo, new_node
from .roles import BUCKET, COMM, Role
from .traced_collectives import traced_collectives

@dataclasses.dataclass(frozen=True)
class CommHook:
    """A hook and its state, as register_comm_hook takes them."""

    state: Any
    hook: Callable

    @classmethod
    def of(cls, value) -> "CommHook | None":
        """transpile()'s comm_hook option: None, or (state, hook)."""
        if value is None or isinstance(value, CommHook):
            return value
        if not (isinstance(value, tuple) and len(value) == 2 and callable(value[1])):
            raise TranspileError(
                f"comm_hook must be (state, hook) as DDP's register_comm_hook(state, hook) "
                f"takes them, got {value!r}")
        state, hook = value
        if state is not None and not isinstance(state, dist.ProcessGroup):
            raise TranspileError(
                f"comm_hook's state is a {type(state).__name__}: the hook is traced once into "
                "the program, so its state must be a process group or None (a state whose "
                "values change between steps, as PowerSGD's, would be frozen)")
        return cls(state, hook)

    def refuse_other_group(self, process_group: dist.ProcessGroup | None) -> None:
        """The hook's group must be the step's: DDP's built-in hooks reduce
        over their state, the default group when it is None."""
        if (self.state or dist.group.WORLD) is not (process_group or dist.group.WORLD):
            raise TranspileError(
                "comm_hook's state must be the step's process group: DDP's hooks reduce over "
                "their state (None: the default group); pass comm_hook=(process_group, hook) "
                "with the group given as process_group=, or None without it")

    def __repr__(self) -> str:   # the same on every rank (the settings they agree on)
        name = f"{getattr(self.hook, '__module__', '')}.{getattr(self.hook, '__qualname__', '')}"
        group = None if self.state is None else (
            "world" if self.state is dist.group.WORLD else self.state.group_name)
        return f"CommHook({name}, {group})"


class _Bucket:
    """What the hook sees of DDP's GradBucket."""

    def __init__(self, buffer: torch.Tensor, shapes: list[torch.Size], index: int, last: bool):
        self._buffer, self._shapes, self._index, self._last = buffer, shapes, index, last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        parts = self._buffer.split([s.numel() for s in self._shapes])
        return [p.view(s) for p, s in zip(parts, self._shapes)]

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def parameters(self):
        raise TranspileError("a comm hook traced into the program sees the bucket's gradients "
                             "(bucket.gradients()), not its parameters")


def _traced(hook: CommHook, val: torch.Tensor, shapes, index: int, last: bool) -> fx.GraphModule:
    def run(buffer):
        with traced_collectives():
            result = hook.hook(hook.state, _Bucket(buffer, shapes, index, last))
        if not hasattr(result, "wait"):
            raise TranspileError(f"comm hook {hook!r} returned a {type(result).__name__}, not "
                                 "a future of the bucket's reduced tensor")
        value = result.wait()
        value = value[0] if isinstance(value, (list, tuple)) else value
        if not isinstance(value, torch.Tensor) or value.numel() != val.numel():
            raise TranspileError(f"comm hook {hook!r}: its future must hold a tensor of the "
                                 f"bucket's {val.numel()} elements")
        return value

    example = torch.empty(val.shape, dtype=val.dtype, device=val.device)
    gm = make_fx(torch.func.functionalize(run, remove="mutations_and_views"),
                 tracing_mode="fake")(example)
    gm.graph.eliminate_dead_code()   # what functionalization left unread
    if any(n.op == "get_attr" for n in gm.graph.nodes):
        raise TranspileError(f"comm hook {hook!r} reads a tensor of its own (a closure's, a "
                             "global's): the program would freeze it; compute it from the bucket")
    return gm


def reduce(graph: fx.Graph, hook: CommHook, buffer: fx.Node, grads: list[fx.Node],
           bucket: int, last: bool, comm: CommInfo, ring: str, role: Role) -> fx.Node:
    """At the insertion point: the bucket's `buffer` (this rank's gradients,
    packed) reduced by the hook; returns the node of the reduced buffer. Its
    collectives get `comm` (op and size their own) on `ring`; nodes before the
    first one have the packing's `role`, the rest COMM; all carry the bucket."""
    gm = _traced(hook, buffer.meta["val"], [g.meta["val"].shape for g in grads], bucket, last)
    env: dict[fx.Node, Any] = {}
    issued = False
    result = None
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = buffer
        elif n.op == "output":
            result = env[n.args[0][0] if isinstance(n.args[0], (list, tuple)) else n.args[0]]
        elif n.op == "call_function":
            if n.target is torch.ops.aten.copy_.default and n.args[0].op == "placeholder":
                continue   # the hook's write into the buffer, which nothing reads after
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
            meta = {BUCKET: bucket}
            if n.target in OP_NAMES:
                issued = True
                meta[COMM] = dataclasses.replace(comm, op=OP_NAMES[n.target],
                                                 nbytes=n.args[0].meta["val"].nbytes)
            elif n.target is WAIT:
                meta[COMM] = env[n.args[0]].meta[COMM]
            node = new_node(graph, n.target, args, Role.COMM if issued else role, kwargs,
                            fake_mode=buffer.meta["val"].fake_mode, **meta)
            if n.target in OP_NAMES:
                set_group(node, ring)
            env[n] = node
    return result
