"""verify=N: check the first N steps of a transpiled step against the eager step
under torch DDP's defaults, on copies, before anything is written back.

The reference (Reference) deep-copies the step's arguments (model, optimizer,
scaler, batch) and runs the user's step on the copies eagerly, as if each module
among them were wrapped in torch's DistributedDataParallel with its defaults,
and independently of what capture concluded about the step:
- every backward() averages the gradients it accumulated, as DDP's reducer
  does: each parameter's .grad is copied into a bucket times 1 / world_size
  (at::mul_out with the wrapped scalar), the bucket is summed over the ranks and
  copied back when the backward pass ends. Micro-batches are so averaged at each
  backward(): equal to averaging once, as the program does, up to rounding.
- broadcast_buffers=True: before a module's forward, rank 0's buffers are
  broadcast, unless its previous forward ran without grad (DDP's
  require_forward_param_sync, kept across calls as on a DDP wrapper); and
  after the step, where DDP's next forward will broadcast them, they are: the
  buffers compared are those that forward (an evaluation, the next step)
  starts from, which the program leaves.
- A call that makes no optimizer.step() (the accumulating call of gradient
  merge) runs as under DDP's no_sync, as the README documents it: it is run
  again without averaging.
LR schedulers of the step's optimizers are not run (the transpiled step runs
them on the host after the call), and each run of the reference forks the
random number generators, so the program then draws what the reference drew.
The program runs functionally (op by op, nothing written in place) and every
value it would write (parameters, buffers, optimizer state, .grad, the scaler's
state) and every value it returns is compared with the reference's; the ranks
exchange their verdicts, and a difference raises VerificationError on every
rank, naming the first tensor that differs and by how much, with nothing
written back. The cost of a verified step: a deep copy of the model and the
optimizer state, one eager step with one all-reduce per backward() and dtype of
the gradients (a call without optimizer.step(): two eager steps), and the
program run without in-place updates.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from ..capture import StepArgs, intercepted_schedulers
from .control_plane import all_gather_values
from ..errors import VerificationError
from ..world import group as step_group, world


class Reference:
    """The user's step under torch DDP's defaults, on copies of its arguments."""

    def __init__(self):
        # DDP's require_forward_param_sync per module argument (by id of the
        # original): whether its next forward first broadcasts rank 0's buffers.
        self._forward_sync: dict[int, bool] = {}

    def run(self, step_fn, step_args: StepArgs) -> tuple[dict, Any]:
        """Returns the deep-copy memo (id of an original object -> its copy)
        and what the step returned."""
        world_size = world()[0]
        forward_sync = dict(self._forward_sync)
        run = _Run(step_args, world_size, forward_sync, sync=True)
        memo, result = run(step_fn)
        if not run.stepped and world_size > 1:
            # Gradient merge's accumulating call: DDP users run it under no_sync.
            forward_sync = dict(self._forward_sync)
            memo, result = _Run(step_args, world_size, forward_sync, sync=False)(step_fn)
        self._forward_sync = forward_sync
        return memo, result


class _Run:
    """One eager run of the step on fresh copies, with DDP's collectives
    (sync) or under no_sync (not sync)."""

    def __init__(self, step_args: StepArgs, world_size: int, forward_sync: dict[int, bool],
                 sync: bool):
        self.step_args, self.world_size, self.sync = step_args, world_size, sync
        self.forward_sync = forward_sync
        self.stepped = False      # an optimizer.step() or scaler.step() was called
        self._params: list[torch.Tensor] = []    # the copies' parameters, in a fixed order
        self._pending: set[int] = set()   # id of each parameter this backward() accumulated into
        self._modules: list[tuple[torch.nn.Module, int]] = []   # the copied modules, by key

    def __call__(self, step_fn) -> tuple[dict, Any]:
        memo: dict = {}
        leaves = _copies(self.step_args, memo)
        handles = self._hook(leaves) if self.world_size > 1 else []
        cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        try:
            with torch.random.fork_rng(devices=cuda), \
                    intercepted_schedulers(self.step_args.optimizers, lambda scheduler: None):
                result = self.step_args.call(step_fn, leaves)
        finally:
            for handle in handles:
                handle.remove()
        for module, key in self._modules:   # what DDP's next forward starts from
            self._before_forward(module, key)
        return memo, result

    def _hook(self, leaves) -> list:
        handles, seen = [], set()
        for original, copied in zip(self.step_args.leaves, leaves):
            if id(copied) in seen:
                continue
            seen.add(id(copied))
            if isinstance(copied, torch.optim.Optimizer):
                handles.append(copied.register_step_pre_hook(self._on_step))
            elif isinstance(copied, torch.amp.GradScaler):
                # Its step() skips optimizer.step() where the gradients overflowed.
                copied.step = self._stepping(copied.step)
            elif isinstance(copied, torch.nn.Module):
                key = id(original)
                self.forward_sync.setdefault(key, True)   # as DDP's constructor leaves it
                self._modules.append((copied, key))
                handles.append(copied.register_forward_pre_hook(
                    lambda module, args, key=key: self._before_forward(module, key)))
                handles.append(copied.register_forward_hook(
                    lambda module, args, out, key=key: self._after_forward(key)))
        if self.sync:
            self._params = _unique_params(leaves)
            for p in self._params:
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(self._accumulated))
        return handles

    def _on_step(self, *_):
        self.stepped = True

    def _stepping(self, method):
        def step(*args, **kwargs):
            self.stepped = True
            return method(*args, **kwargs)
        return step

    def _before_forward(self, module: torch.nn.Module, key: int) -> None:
        """DDP's _pre_forward: rank 0's buffers, where its last forward synced."""
        buffers = list(module.buffers())
        if self.forward_sync[key] and buffers:
            # DDP's own guard: a buffer saved for an earlier backward stays usable.
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
                _coalesced(buffers, _concatenate, lambda flat: dist.broadcast(flat, group=step_group(), group_src=0))

    def _after_forward(self, key: int) -> None:
        """DDP's _post_forward: the next forward syncs only after one with grad, not under no_sync."""
        self.forward_sync[key] = torch.is_grad_enabled() and self.sync

    def _accumulated(self, param: torch.Tensor) -> None:
        """DDP's autograd hook: the first gradient of a backward pass queues
        the reduction for when the pass ends (the reducer's finalize_backward)."""
        if not self._pending:
            torch.autograd.Variable._execution_engine.queue_callback(self._average)
        self._pending.add(id(param))

    def _average(self) -> None:
        grads = [p.grad for p in self._params if id(p) in self._pending and p.grad is not None]
        self._pending = set()
        scale = 1 / self.world_size

        def fill(flat, tensors):   # the reducer's mark_variable_ready_dense
            offset = 0
            for t in tensors:
                torch.mul(t, scale, out=flat[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()

        with torch.no_grad():
            _coalesced(grads, fill, lambda flat: dist.all_reduce(flat, group=step_group()))


def _copies(step_args: StepArgs, memo: dict) -> list:
    """Deep copies of the step's leaves, the parameters' .grad included."""
    leaves = copy.deepcopy(step_args.leaves, memo)
    for original, copied in zip(step_args.leaves, leaves):
        if isinstance(original, torch.optim.Optimizer):
            # Optimizer.__getstate__ keeps only its state: carry the step's own
            # attributes over, as references, but no method bound to the
            # original (an LR scheduler wraps optimizer.step so).
            for key, value in vars(original).items():
                if not callable(value):
                    vars(copied).setdefault(key, value)
    for original, copied in zip(_unique_params(step_args.leaves), _unique_params(leaves)):
        if original.grad is not None:   # Parameter.__deepcopy__ leaves .grad behind
            copied.grad = copy.deepcopy(original.grad, memo)
    return leaves


def _concatenate(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    torch.cat([t.reshape(-1) for t in tensors], out=flat)


def _coalesced(tensors: list[torch.Tensor], fill, collective) -> None:
    """For each dtype and device in turn (the order of first appearance, the
    same on every rank): fill(flat, tensors) one flat buffer, run
    collective(flat) on it, and copy it back into the tensors."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, device), group in groups.items():
        flat = torch.empty(sum(t.numel() for t in group), dtype=dtype, device=device)
        fill(flat, group)
        collective(flat)
        offset = 0
        for t in group:
            t.copy_(flat[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()


def _unique_params(leaves) -> list[torch.Tensor]:
    seen, params = set(), []
    for leaf in leaves:
        if isinstance(leaf, torch.nn.Module):
            found = leaf.parameters()
        elif isinstance(leaf, torch.optim.Optimizer):
            found = (p for g in leaf.param_groups for p in g["params"])
        else:
            continue
        for p in found:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def first_difference(names: list[str], ours: list, theirs: list, tolerance: float) -> str | None:
    """The first pair that differs by more than `tolerance` relative to the
    reference's largest magnitude (or in shape, or None against a tensor), as
    one line; None when all agree."""
    for name, a, b in zip(names, ours, theirs):
        if a is None or b is None:
            if (a is None) != (b is None):
                return (f"{name}: the program leaves {'None' if a is None else 'a tensor'}, "
                        f"the eager step {'None' if b is None else 'a tensor'}")
            continue
        if a.shape != b.shape:
            return f"{name}: shape {tuple(a.shape)} against {tuple(b.shape)}"
        x, y = a.detach().double(), b.detach().double()
        same = (x == y) | (x.isnan() & y.isnan())   # equal infinities, NaN in the same place
        if same.all():
            continue
        diff = torch.where(same, 0.0, (x - y).abs()).nan_to_num(nan=float("inf")).max().item()
        scale = y.abs().nan_to_num(nan=0.0, posinf=0.0).max().item()
        if diff > tolerance * max(scale, 1e-30):
            return (f"{name}: max abs difference {diff:.3g} ({diff / max(scale, 1e-30):.3g} "
                    f"relative to its largest value {scale:.3g})")
    return None


def raised_alike(ours, eager: BaseException | None) -> str | None:
    """Whether the program's raise (capture/raised.Raised, or None) is the
    eager step's (an exception, or None), as one line when not."""
    mine = None if ours is None else ours.exception
    if (type(mine), str(mine)) == (type(eager), str(eager)):
        return None
    return f"the program {_outcome(mine)}, the eager step {_outcome(eager)}"


def _outcome(exc: BaseException | None) -> str:
    return "returns" if exc is None else f"raises {type(exc).__name__}: {exc}"


def agree_on_verdict(verdict: str | None, step: int) -> None:
    """Raise the same VerificationError on every rank if any rank found a difference."""
    everyone = all_gather_values(verdict)
    for rank, theirs in enumerate(everyone):
        if theirs is not None:
            raise VerificationError(
                f"verify: step {step} of the transpiled program differs from the eager step "
                f"under DDP's semantics on rank {rank}: {theirs}. Nothing was written back. "
                "The step does something the transpiler does not capture faithfully: please "
                "report it with the step's code; until then run it without transpile()")

