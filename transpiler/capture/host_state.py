"""Host-side Python state the step could change while it is traced: refused,
since the program runs without the step's Python."""

from __future__ import annotations

import contextlib
from typing import Any

from ..errors import TranspileError
from .optimizer_state import TRACE_GROUP_OPTIONS
from .user_code import step_name

_PLAIN = (bool, int, float, str, tuple, type(None))


def _host_values(modules, optimizers) -> dict[str, Any]:
    """The host-side values a step could change: each submodule's public
    attributes of plain types (a counter, the training flag) and the values of
    each optimizer's param groups."""
    values = {}
    for mi, module in enumerate(modules):
        root = f"model{mi}" if len(modules) > 1 else "model"
        for name, sub in module.named_modules():
            for key, value in vars(sub).items():
                if not key.startswith("_") and isinstance(value, _PLAIN):
                    values[f"{root}.{name + '.' if name else ''}{key}"] = (sub, key, value)
    for oi, opt in enumerate(optimizers):
        for gi, group in enumerate(opt.param_groups):
            for key, value in group.items():
                if key != "params" and key not in TRACE_GROUP_OPTIONS:
                    values[f"optimizer {oi} param_groups[{gi}][{key!r}]"] = (None, key, value)
    return values


@contextlib.contextmanager
def host_state_unchanged(step_fn, modules, optimizers):
    """Python state the step changes would change once, while it is traced, and
    never again when the program runs: refuse it (and undo it on the modules;
    the optimizers' groups are restored by redirect_optimizer)."""
    before = _host_values(modules, optimizers)
    yield
    after = _host_values(modules, optimizers)
    changed = [k for k in before if k not in after or repr(after[k][2]) != repr(before[k][2])]
    if not changed:
        return
    for key in changed:
        owner, attr, value = before[key]
        if owner is not None:
            object.__setattr__(owner, attr, value)
    first = changed[0]
    new = repr(after[first][2]) if first in after else "deleted"
    if first.startswith("optimizer"):
        advice = ("set hyperparameters outside the step, or step a torch.optim.lr_scheduler "
                  "after optimizer.step() inside it (the transpiled step runs it on the host "
                  "after every call)")
    else:
        advice = ("call model.train()/eval() and change such attributes outside the step, or "
                  "keep a counter in a tensor buffer (register_buffer) that the step updates")
    raise TranspileError(
        f"{step_name(step_fn)} changes host-side state: {first} {before[first][2]!r} -> {new}"
        + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else "")
        + ". The program runs without the step's Python, so this change would happen once, "
        f"while the step is traced, and never again: {advice}")

