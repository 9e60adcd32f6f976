"""torch.distributed's collectives called by traced code, as collectives of the program.

A step that logs its loss reduced over the ranks (`dist.all_reduce(loss)`, as
torchvision's and many training scripts' helpers do), and a DDP comm hook
(comm_hooks.py), call torch.distributed's in-place collectives. Traced as they
are, on fake tensors, they issue nothing in the program: the step would return
each rank's own value where eager returns the reduced one. While such code is
traced, all_reduce, all_gather_into_tensor, all_gather (a list),
reduce_scatter_tensor and broadcast are torch's functional collectives, waited
for at once and copied into their output tensors as eager's write them, and
their nodes carry meta["comm"] (over the world, placed on the mesh's
communicators before the passes run: Program.place_collectives). An async_op
returns a work whose future is complete. torch.distributed.nn's all_gather,
which gradients flow back through, is a gather whose backward reduce-scatters
the gradient. Only the step's group is supported
(the default group, or its process_group=; a broadcast's src is a rank of the
default group, as eager's); another group is refused, naming it, and so are
the other collectives (reduce,
all_to_all, the object collectives, send and recv, barrier). A step traced on
its values (a decision on a tensor's value) issues nothing while traced: the
collectives' results have no real values.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

from ..program.collectives import ALL_GATHER, ALL_REDUCE, BROADCAST, OP_NAMES, REDUCE_SCATTER, WAIT
from ..errors import TranspileError
from ..program.program import CommInfo
from ..program.roles import COMM
from ..world import describe, group as step_group

_REDUCE_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min",
               dist.ReduceOp.PRODUCT: "product", dist.ReduceOp.AVG: "avg"}


class Done:
    """A future that is complete: what a collective returns while traced."""

    def __init__(self, value):
        self._value = value

    def value(self):
        return self._value

    def wait(self):
        return self._value

    def done(self) -> bool:
        return True

    def then(self, callback):
        return Done(callback(self))


class _Work:
    def __init__(self, value):
        self._value = value

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> Done:
        return Done(self._value if isinstance(self._value, list) else [self._value])


def _group_name(group) -> str:
    """The name of a collective's group, which must be the step's (eager's
    group=None is the default group, which a step given process_group= does
    not run over)."""
    group = group or dist.group.WORLD
    if group is not step_group():
        step = describe()
        raise TranspileError(
            f"a collective over the process group {group.group_name!r} in traced code: the "
            f"step runs over {step}, and only a collective over that group is traced; pass "
            "group= that group, or issue the collective outside the step")
    return group.group_name


@contextlib.contextmanager
def without_real_values(t: torch.Tensor):
    """Traced on this call's values (capture/decisions.py), each op also runs
    on the fake tensors' real twins: a collective would be issued while
    tracing, by one rank alone where only its decisions changed. Without a
    real twin on its input it is not; what is computed from its result has no
    real value either, so a decision on it stops the trace (refused), and
    what a decision before it took is checked by the program on every run."""
    real = getattr(t, "real_tensor", None)
    if real is not None:
        t.real_tensor = None
    try:
        yield
    finally:
        if real is not None:
            t.real_tensor = real


def issued(collective, *args) -> torch.Tensor:
    """The collective issued and waited for, both nodes tagged when traced."""
    with without_real_values(args[0]):
        issued = collective(*args)
        waited = WAIT(issued)
    mode = get_proxy_mode()
    if mode is not None:
        comm = CommInfo(OP_NAMES[collective], nbytes=max(args[0].nbytes, waited.nbytes))
        for t in (issued, waited):
            slot = get_proxy_slot(t, mode.tracer, None)
            if slot is not None:   # (under functionalization, a comm hook's: tagged by comm_hooks)
                slot.proxy.node.meta[COMM] = comm
    return waited


def forget_real_values(t: torch.Tensor) -> None:
    """`t` was written from a collective's result: it has no real value."""
    if getattr(t, "real_tensor", None) is not None:
        t.real_tensor = None


def _done(value, async_op: bool):
    for t in value if isinstance(value, list) else [value]:
        forget_real_values(t)
    return _Work(value) if async_op else None


def _all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    tensor.copy_(issued(ALL_REDUCE, tensor, _REDUCE_OPS[op], _group_name(group)))
    return _done(tensor, async_op)


def _broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    name = _group_name(group)
    root = group_src if group_src is not None else dist.get_group_rank(step_group(), src)
    tensor.copy_(issued(BROADCAST, tensor, root, name))
    return _done(tensor, async_op)


def _gathered(input: torch.Tensor, group) -> torch.Tensor:
    """The ranks' inputs concatenated along dim 0; a 0-d input (a loss) as a
    vector of one (gloo gathers each rank's part as a tensor of the input's
    shape, and a 0-d part does not fit its slot)."""
    size = dist.get_world_size(group)
    part = input.reshape(1) if input.dim() == 0 else input.contiguous()
    return issued(ALL_GATHER, part, size, _group_name(group))


def _all_gather_into_tensor(output, input, group=None, async_op=False):
    output.copy_(_gathered(input, group).view_as(output))
    return _done(output, async_op)


def _all_gather(tensor_list, tensor, group=None, async_op=False):
    size = dist.get_world_size(group)
    rows = _gathered(tensor, group).view(size, *tensor.shape)
    for out, row in zip(tensor_list, rows.unbind(0)):
        out.copy_(row)
    return _done(tensor_list, async_op)


def _reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    name, size = _group_name(group), dist.get_world_size(group)
    scattered = issued(REDUCE_SCATTER, input.contiguous(), _REDUCE_OPS[op], size, name)
    output.copy_(scattered.view_as(output))
    return _done(output, async_op)


_TRACED = {"all_reduce": _all_reduce, "broadcast": _broadcast,
           "all_gather_into_tensor": _all_gather_into_tensor, "all_gather": _all_gather,
           "reduce_scatter_tensor": _reduce_scatter_tensor}
ISSUED = tuple(OP_NAMES)


class _GatheredWithGrad(torch.autograd.Function):
    """torch.distributed.nn's all_gather, which gradients flow back through
    (CLIP's and SimCLR's losses over every rank's features), traced: the
    ranks' tensors, and in backward each rank's part of every rank's gradient,
    summed over the ranks (a reduce-scatter: eager's NCCL path; its gloo path
    scatters, refused in a program, then sums: the same sum, two ranks' in the
    same bits)."""

    @staticmethod
    def forward(ctx, group, tensor):
        ctx.group, ctx.shape = group, tensor.shape
        return _gathered(tensor, group).view(dist.get_world_size(group), *tensor.shape)

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        part = issued(REDUCE_SCATTER, grad.contiguous(), _REDUCE_OPS[dist.ReduceOp.SUM], size,
                      _group_name(ctx.group))
        return None, part.view(ctx.shape)


def _all_gather_with_grad(tensor, group=None):
    return _GatheredWithGrad.apply(group, tensor).unbind(0)

# The others, refused where traced code calls them (traced as they are, they
# would run once on fake tensors, or not at all, and the program without them).
_REFUSED = ("reduce", "gather", "scatter", "reduce_scatter", "all_to_all", "all_to_all_single",
            "all_reduce_coalesced", "all_gather_coalesced", "all_gather_object",
            "gather_object", "broadcast_object_list", "scatter_object_list", "send", "recv",
            "isend", "irecv", "batch_isend_irecv", "barrier", "monitored_barrier")


def _refusing(name: str):
    def refused(*args, **kwargs):
        raise TranspileError(
            f"torch.distributed.{name} in traced code: a program issues all_reduce, "
            "all_gather(_into_tensor), reduce_scatter_tensor and broadcast; call "
            f"{name} outside the step" + (" (the program's collectives already keep the "
                                          "ranks in step)" if "barrier" in name else ""))
    return refused


@contextlib.contextmanager
def traced_collectives():
    """While traced code runs: torch.distributed's collectives as above."""
    if not dist.is_available():
        yield
        return
    c10d = dist.distributed_c10d
    replaced = {**_TRACED, **{name: _refusing(name) for name in _REFUSED if hasattr(c10d, name)}}
    saved = {name: getattr(c10d, name) for name in replaced}
    for name, fn in replaced.items():
        setattr(dist, name, fn)
        setattr(c10d, name, fn)
    # torch.distributed.nn's all_gather, where the step's code has imported it
    differentiable = {m: m.all_gather for m in (sys.modules.get("torch.distributed.nn"),
                                                sys.modules.get("torch.distributed.nn.functional"))
                      if m is not None and hasattr(m, "all_gather")}
    for module in differentiable:
        module.all_gather = _all_gather_with_grad
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
            setattr(c10d, name, fn)
        for module, fn in differentiable.items():
            module.all_gather = fn
