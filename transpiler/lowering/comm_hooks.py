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
torch's allreduce_hook, fp16_compress_hook and bf16_compress_hook are; or
torch's powerSGD_hook with its PowerSGDState, whose state changes between
steps: traced per phase, its tensors inputs and outputs of the program
(powersgd.py). Any other state is refused.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from . import powersgd
from ..program.collectives import OP_NAMES, WAIT, set_group
from ..errors import TranspileError
from ..program.program import (CommInfo, HookEntry, InputKind, InputSpec, OutputKind, OutputSpec,
                               Program, new_node)
from ..program.roles import BUCKET, COMM, Role
from ..capture.traced_collectives import traced_collectives

@dataclasses.dataclass(frozen=True)
class CommHook:
    """A hook and its state, as register_comm_hook takes them; `compress`:
    for PowerSGD, the phase traced (powersgd.py)."""

    state: Any
    hook: Callable
    compress: bool = False

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
        if isinstance(state, PowerSGDState) or powersgd.is_powersgd(hook):
            if not isinstance(state, PowerSGDState):
                raise TranspileError("powerSGD_hook takes a PowerSGDState as its state")
            powersgd.refuse(state, hook)
        elif state is not None and not isinstance(state, dist.ProcessGroup):
            raise TranspileError(
                f"comm_hook's state is a {type(state).__name__}: the hook is traced once into "
                "the program, so its state must be a process group or None (a state whose "
                "values change between steps would be frozen; torch's PowerSGDState is "
                "traced as such)")
        return cls(state, hook)

    @property
    def stateful(self) -> bool:
        """Whether the hook's state changes between steps (PowerSGD's)."""
        return isinstance(self.state, PowerSGDState)

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group the hook reduces over (None: the default group)."""
        return self.state.process_group if self.stateful else self.state

    def compresses(self) -> bool:
        """Whether the next step runs the hook's compressed phase."""
        return self.stateful and powersgd.compressing(self.state)

    def after_step(self, program: Program) -> None:
        """After a step that ran `program`: the host's part of the hook."""
        if self.stateful:
            powersgd.after_step(self.state, [spec.hook for spec in program.inputs
                                             if spec.kind is InputKind.HOOK])

    def refuse_other_group(self, process_group: dist.ProcessGroup | None) -> None:
        """The hook's group must be the step's: DDP's built-in hooks reduce
        over their state, the default group when it is None."""
        if (self.group or dist.group.WORLD) is not (process_group or dist.group.WORLD):
            raise TranspileError(
                "comm_hook's state must be the step's process group: DDP's hooks reduce over "
                "their state (None: the default group); pass comm_hook=(process_group, hook) "
                "with the group given as process_group=, or None without it")

    def __repr__(self) -> str:   # the same on every rank (the settings they agree on)
        name = f"{getattr(self.hook, '__module__', '')}.{getattr(self.hook, '__qualname__', '')}"
        group = None if self.group is None else (
            "world" if self.group is dist.group.WORLD else self.group.group_name)
        settings = f", {powersgd.describe(self.state)}" if self.stateful else ""
        return f"CommHook({name}, {group}{settings})"


class _Bucket:
    """What the hook sees of DDP's GradBucket."""

    def __init__(self, buffer: torch.Tensor, shapes: list[torch.Size], index: int, last: bool):
        self._buffer, self._shapes, self._index, self._last = buffer, shapes, index, last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        # A slice per gradient, not one split: functionalization regenerates a
        # view of a written buffer by replaying it, and a split's replay makes
        # every part again (quadratic in the bucket's gradients)
        views, offset = [], 0
        for shape in self._shapes:
            views.append(self._buffer[offset:offset + shape.numel()].view(shape))
            offset += shape.numel()
        return views

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def parameters(self):
        raise TranspileError("a comm hook traced into the program sees the bucket's gradients "
                             "(bucket.gradients()), not its parameters")


def _call(hook: CommHook, state: Any, buffer: torch.Tensor, shapes, index: int,
          last: bool) -> torch.Tensor:
    """The hook run on bucket `index` whose buffer is `buffer`, with `state`:
    the tensor its future holds."""
    with traced_collectives(), powersgd.traceable() if hook.stateful else nullcontext():
        result = hook.hook(state, _Bucket(buffer, shapes, index, last))
    if not hasattr(result, "wait"):
        raise TranspileError(f"comm hook {hook!r} returned a {type(result).__name__}, not "
                             "a future of the bucket's reduced tensor")
    value = result.wait()
    value = value[0] if isinstance(value, (list, tuple)) else value
    if not isinstance(value, torch.Tensor) or value.numel() != buffer.numel():
        raise TranspileError(f"comm hook {hook!r}: its future must hold a tensor of the "
                             f"bucket's {buffer.numel()} elements")
    return value


def _on_fake(hook: CommHook, state: Any, val: torch.Tensor, shapes, index: int,
             last: bool) -> None:
    """The hook run once on fake tensors, no graph made: for what it leaves in
    `state` (powersgd.observe)."""
    with FakeTensorMode():
        _call(hook, state, torch.empty(val.shape, dtype=val.dtype, device=val.device), shapes,
              index, last)


def _traced(hook: CommHook, val: torch.Tensor, shapes, index: int, last: bool,
            entries: list[tuple[HookEntry, torch.Size, torch.dtype]] = ()) -> fx.GraphModule:
    """The hook on bucket `index` traced: inputs the buffer, then the state's
    tensors `entries`; outputs the reduced buffer, then their new values. A
    stateful hook runs on a shadow of its state holding the entries."""
    def run(buffer, *kept):
        on = hook.state
        if hook.stateful:
            tables: dict[str, dict] = {}
            for (entry, *_), tensor in zip(entries, kept):
                tables.setdefault(entry.table, {})[index] = tensor
            on = powersgd.shadow(hook.state, hook.compress, tables)
        value = _call(hook, on, buffer, shapes, index, last)
        return (value, *(getattr(on, entry.table)[index] for entry, *_ in entries))

    examples = [torch.empty(val.shape, dtype=val.dtype, device=val.device)] + [
        torch.empty(shape, dtype=dtype, device=val.device) for _, shape, dtype in entries]
    gm = make_fx(torch.func.functionalize(run, remove="mutations"),
                 tracing_mode="fake")(*examples)
    gm.graph.eliminate_dead_code()   # what functionalization left unread
    if any(n.op == "get_attr" and getattr(gm, n.target).numel() for n in gm.graph.nodes):
        raise TranspileError(f"comm hook {hook!r} reads a tensor of its own (a closure's, a "
                             "global's): the program would freeze it; compute it from the bucket")
    return gm   # (an empty one holds no value: PowerSGD's torch.tensor([]), nothing to send)


def reduce(program: Program, hook: CommHook, buffer: fx.Node, grads: list[fx.Node],
           bucket: int, last: bool, comm: CommInfo, ring: str, role: Role) -> fx.Node:
    """At the insertion point: the bucket's `buffer` (this rank's gradients,
    packed) reduced by the hook; returns the node of the reduced buffer. Its
    collectives get `comm` (op and size their own) on `ring`; nodes before the
    first one have the packing's `role`, the rest COMM; all carry the bucket.
    A stateful hook's tensors become inputs (InputKind.HOOK) and their new
    values outputs of `program`."""
    graph, val = program.graph, buffer.meta["val"]
    shapes = [g.meta["val"].shape for g in grads]
    entries = []
    if hook.stateful and hook.compress:
        entries = powersgd.observe(hook.state, bucket, lambda first: _on_fake(
            hook, first, val, shapes, bucket, last))
    gm = _traced(hook, val, shapes, bucket, last, entries)
    placeholders = [buffer]
    for entry, shape, dtype in entries:
        with val.fake_mode:
            like = torch.empty(shape, dtype=dtype, device=val.device)
        placeholders.append(program.add_input(
            InputSpec(InputKind.HOOK, f"{entry.table}[{bucket}]", hook=entry), like,
            f"hook_{entry.table}_{bucket}"))
    env: dict[fx.Node, Any] = {}
    issued = False
    results: list[fx.Node] = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = placeholders[len(env)]
        elif n.op == "output":
            results = [env[v] for v in n.args[0]]
        elif n.op == "get_attr":   # an empty tensor (_traced)
            empty = getattr(gm, n.target)
            env[n] = new_node(graph, torch.ops.aten.empty.memory_format, (list(empty.shape),),
                              role, {"dtype": empty.dtype, "device": val.device},
                              fake_mode=val.fake_mode, **{BUCKET: bucket})
        elif n.op == "call_function":
            if n.target is torch.ops.aten.copy_.default and n.args[0].op == "placeholder":
                continue   # the hook's write into an input, which nothing reads after
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
            meta = {BUCKET: bucket}
            if n.target in OP_NAMES:
                issued = True
                meta[COMM] = dataclasses.replace(comm, op=OP_NAMES[n.target],
                                                 nbytes=n.args[0].meta["val"].nbytes)
            elif n.target is WAIT:
                meta[COMM] = env[n.args[0]].meta[COMM]
            node = new_node(graph, n.target, args, Role.COMM if issued else role, kwargs,
                            fake_mode=val.fake_mode, **meta)
            if n.target in OP_NAMES:
                set_group(node, ring)
            env[n] = node
    for (entry, *_), value in zip(entries, results[1:]):
        program.add_output(OutputSpec(OutputKind.HOOK, f"{entry.table}[{bucket}]"), value)
    return results[0]
