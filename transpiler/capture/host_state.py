"""Host-side Python state the step writes while it is traced: the program runs
without the step's Python, so such a write would happen once, at the trace, and
never again. Every value a guard watches (guards.py: attributes of the modules
and the objects they hold, globals, closure cells), every attribute of a module
the step rebinds (a tensor stored in forward, `self.n += 1`) and the optimizers'
param-group entries are compared before and after the trace; a change is undone
and refused, naming the value. (A buffer or a parameter the step reassigns is
state the program writes back: trace.py turns it into an in-place write.)"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..errors import TranspileError
from .guards import MODULE_BOOKKEEPING, record, show
from .optimizer_state import TRACE_GROUP_OPTIONS
from .user_code import step_name


def _attributes(modules) -> dict[tuple[int, str], tuple[str, torch.nn.Module, Any]]:
    """(id(submodule), attribute) -> (name, submodule, value) of every
    attribute of every submodule but torch's bookkeeping."""
    found = {}
    for mi, module in enumerate(modules):
        root = f"model{mi}" if len(modules) > 1 else "model"
        for prefix, sub in module.named_modules():
            for key, value in vars(sub).items():
                if key not in MODULE_BOOKKEEPING:
                    found[(id(sub), key)] = (f"{root}.{prefix + '.' if prefix else ''}{key}",
                                             sub, value)
    return found


def _group_values(optimizers) -> dict[str, Any]:
    return {f"optimizer {oi} param_groups[{gi}][{key!r}]": value
            for oi, opt in enumerate(optimizers) for gi, group in enumerate(opt.param_groups)
            for key, value in group.items() if key != "params" and key not in TRACE_GROUP_OPTIONS}


@contextlib.contextmanager
def host_state_unchanged(step_fn, modules, optimizers):
    """Yield the step's guards as they stand before the trace; refuse (and undo
    on the modules and globals; the optimizers' groups are restored by
    redirect_optimizer) what the traced step changed on the host."""
    guards = record(step_fn, modules)
    attributes = _attributes(modules)
    groups = _group_values(optimizers)
    yield guards
    changed = []
    for g in guards.guards:
        if not g.unchanged():
            changed.append((g.name, show(g.value), show(g.current())))
            g.restore()
    after = _attributes(modules)
    for key, (name, sub, value) in after.items():
        if key not in attributes:
            changed.append((name, "absent", _text(value)))
            object.__delattr__(sub, key[1])
        elif attributes[key][2] is not value and all(name != c[0] for c in changed):
            changed.append((name, _text(attributes[key][2]), _text(value)))
            object.__setattr__(sub, key[1], attributes[key][2])
    new_groups = _group_values(optimizers)
    changed += [(name, repr(value), repr(new_groups.get(name, "deleted")))
                for name, value in groups.items() if repr(new_groups.get(name)) != repr(value)]
    if not changed:
        return
    first, old, new = changed[0]
    if first.startswith("optimizer"):
        advice = ("set hyperparameters outside the step, or step a torch.optim.lr_scheduler "
                  "after optimizer.step() inside it (the transpiled step runs it on the host "
                  "after every call)")
    else:
        advice = ("call model.train()/eval() and change such values outside the step; keep "
                  "a counter or a value forward computes in a tensor buffer "
                  "(register_buffer) that the step updates, or return it from the step")
    raise TranspileError(
        f"{step_name(step_fn)} changes host-side state: {first} {old} -> {new}"
        + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else "")
        + ". The program runs without the step's Python, so this change would happen once, "
        f"while the step is traced, and never again: {advice}")


def _text(value) -> str:
    """How a rebound attribute's value is shown: a tensor by its layout."""
    if isinstance(value, torch.Tensor):
        return f"a tensor {str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    return repr(value)
