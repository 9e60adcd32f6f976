"""torch.save inside the step: refused at the first call, before anything is
written.

The program runs without the step's Python: a checkpoint saved inside the
step (`if step % 1000 == 0: torch.save(model.state_dict(), path)`) would be
saved once, while the step is traced, and of traced stand-ins that hold no
values (pickling one fails deep inside torch's serialization). Only the
tracing thread's saves are the step's: another thread (a checkpoint writer)
saves as it would.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from ..errors import TranspileError
from .user_code import step_name, user_line

_SAVE = torch.serialization.save


@contextlib.contextmanager
def saving_refused(step_fn):
    tracing = threading.get_ident()

    def save(obj, f, *args, **kwargs):
        if threading.get_ident() != tracing:
            return _SAVE(obj, f, *args, **kwargs)
        raise TranspileError(
            f"{step_name(step_fn)} calls torch.save{user_line(step_fn)}: the program runs "
            "without the step's Python, so a file saved inside the step would be saved once, "
            "while the step is traced, and of stand-ins that hold no values. Save between calls, "
            "after the step returns (the model and optimizer then hold the step's results)")
    torch.save = torch.serialization.save = save
    try:
        yield
    finally:
        torch.save = torch.serialization.save = _SAVE
