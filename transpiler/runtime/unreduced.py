"""Gradients a call left unreduced, and an optimizer stepped outside the step.

A call whose step runs backward() but not optimizer.step() accumulates: its
program leaves each rank's own gradients in `.grad`, to be reduced by the call
that steps (as under DDP's no_sync; the contract's accumulation across calls).
A script that calls optimizer.step() itself, after the transpiled step returns
(the step zeroes and runs backward, the loop steps), would then update every
rank with its own gradients: the ranks drift apart, silently. So after such a
call its optimizers are marked, and torch's global step pre-hook refuses a
step of a marked optimizer outside a transpiled step, before it writes
anything; a call that steps it clears the mark.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import TranspileError
from ..capture.signature import OWN_HOOK
from ..capture.user_code import user_line

# optimizer -> the name of the step that left its gradients unreduced
_MARKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_INSIDE = [0]   # transpiled steps running (they step optimizers themselves)
_HOOK: list = []


def _refuse(opt: torch.optim.Optimizer, args, kwargs) -> None:
    step = _MARKED.get(opt)
    if step is None or _INSIDE[0]:
        return
    raise TranspileError(
        f"{type(opt).__name__}.step() is called{user_line(None)} outside the transpiled step "
        f"{step}, whose last call left each rank's own gradients unreduced: a call that does "
        "not step its optimizer accumulates for a later call that does. Call "
        "optimizer.step() inside the step (on the calls that update); nothing was updated")


setattr(_refuse, OWN_HOOK, True)   # not the step's: no program runs it


def leave_unreduced(step: str, optimizers) -> None:
    """After a call of `step` that ran no optimizer.step() on several ranks."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse))
    for opt in optimizers:
        _MARKED[opt] = step


def reduced(optimizers) -> None:
    """After a call that stepped them: their gradients are the reduced ones."""
    for opt in optimizers:
        _MARKED.pop(opt, None)


@contextlib.contextmanager
def inside_a_step():
    _INSIDE[0] += 1
    try:
        yield
    finally:
        _INSIDE[0] -= 1
