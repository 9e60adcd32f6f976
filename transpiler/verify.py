"""verify=N: check the first N steps of a transpiled step against the eager step
under DDP's semantics, on copies, before anything is written back.

The reference deep-copies the step's arguments (model, optimizer, scaler,
batch) and runs the user's step on the copies eagerly, with the gradients of
the copied parameters averaged over the ranks (each times 1 / world_size, then
summed, as DDP's reducer does) when the backward() that precedes the first
optimizer.step() returns, and when each earlier one whose gradients the step
reads returns (transpiler/averaging.py: the capture's rule, so this is not an
independent check of it). LR schedulers of the step's optimizers are not run
(the transpiled step runs them on the host after the call), and the random
number generators are forked, so the program then draws what the reference
drew. The program runs functionally (op by op, nothing written in place) and
every value it would write (parameters, buffers, optimizer state, .grad, the
scaler's state) and every value it returns is compared with the reference's;
the ranks exchange their verdicts, and a difference raises VerificationError on
every rank, naming the first tensor that differs and by how much, with nothing
written back. The cost of a verified step: a deep copy of the model and the
optimizer state, one eager step with one all-reduce per gradient, and the
program run without in-place updates.
"""

from __future__ import annotations

import copy
import pickle

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from .agreement import all_gather_bytes
from .capture import StepArgs, intercepted_schedulers
from .errors import VerificationError
from .rings import world


def reference_step(step_fn, step_args: StepArgs, average_at: tuple[int, ...]) -> tuple[dict, list]:
    """Run the step eagerly on deep copies of its arguments, averaging the
    gradients when each backward() numbered in average_at (from 1) returns
    (transpiler/averaging.py; none: a step without optimizer.step()). Returns
    the deep-copy memo (id of an original object -> its copy) and the step's
    output tensors."""
    memo: dict = {}
    leaves = copy.deepcopy(step_args.leaves, memo)
    for original, copied in zip(step_args.leaves, leaves):
        if isinstance(original, torch.optim.Optimizer):
            # Optimizer.__getstate__ keeps only its state: carry the step's own
            # attributes over, as references, but no method bound to the
            # original (an LR scheduler wraps optimizer.step so).
            for key, value in vars(original).items():
                if not callable(value):
                    vars(copied).setdefault(key, value)
    params = _unique_params(leaves)
    for original, copied in zip(_unique_params(step_args.leaves), params):
        if original.grad is not None:   # Parameter.__deepcopy__ leaves .grad behind
            copied.grad = copy.deepcopy(original.grad, memo)
    world_size = world()[0]
    original = torch.autograd.backward
    calls = 0

    def backward(*args, **kwargs):
        nonlocal calls
        original(*args, **kwargs)
        calls += 1
        if calls in average_at and world_size > 1:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(1 / world_size)
                    dist.all_reduce(p.grad)

    torch.autograd.backward = backward
    try:
        with intercepted_schedulers(step_args.optimizers, lambda scheduler: None):
            result = step_args.call(step_fn, leaves)
    finally:
        torch.autograd.backward = original
    outputs = [o.detach() for o in pytree.tree_leaves(result) if o is not None]
    return memo, outputs


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


def agree_on_verdict(verdict: str | None, step: int) -> None:
    """Raise the same VerificationError on every rank if any rank found a difference."""
    everyone = ([verdict] if world()[0] == 1
                else [pickle.loads(b) for b in all_gather_bytes(pickle.dumps(verdict))])
    for rank, theirs in enumerate(everyone):
        if theirs is not None:
            raise VerificationError(
                f"verify: step {step} of the transpiled program differs from the eager step "
                f"under DDP's semantics on rank {rank}: {theirs}. Nothing was written back. "
                "The step does something the transpiler does not capture faithfully: please "
                "report it with the step's code; until then run it without transpile()")

