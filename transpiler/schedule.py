"""Schedules: which program runs at each step, chosen on the host.

A schedule names its programs and the passes that build each from the traced
step; the runtime asks it which one to run next and tells it when a step has
succeeded. The choice depends only on the step counter and on values every
rank holds identically (an all-reduced loss), so every rank runs the same
program at the same step and no program has a data-dependent branch.
"""

from __future__ import annotations

import logging
import math
from typing import Mapping, Sequence

import torch

from .pipeline import PassLike
from .program import Held, held_name

log = logging.getLogger("transpiler")

# Held values the sync program of adaptive local SGD outputs (passes/local_sgd.py).
MEAN_LOSS = held_name(Held.MEAN_LOSS)
LR = held_name(Held.LR)
MAX_K = 16
# Held value a program outputs with skip_nonfinite: whether it skipped its update.
NONFINITE = held_name(Held.SKIPPED)


class Schedule:
    """Counts the steps taken and the updates skip_nonfinite skipped."""

    programs: dict[str, tuple[PassLike, ...]]

    def __init__(self):
        self.step = 0
        self.skipped = 0

    def next_program(self) -> str:
        raise NotImplementedError

    def advance(self, program: str, held: Mapping[str, torch.Tensor]) -> None:
        self.step += 1
        if NONFINITE in held:
            self.skipped += int(held[NONFINITE])

    def state_dict(self) -> dict:
        return {"step": self.step, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.skipped = int(state["step"]), int(state.get("skipped", 0))


class EveryStep(Schedule):
    """One program, "main", at every step."""

    def __init__(self, passes: Sequence[PassLike]):
        super().__init__()
        self.programs = {"main": tuple(passes)}

    def next_program(self) -> str:
        return "main"


class LocalSGD(Schedule):
    """Steps before `begin_step` run "warmup" (gradients averaged every step).
    Then each period of k steps runs "local" k-1 times and ends with "sync",
    which averages the parameters. With `adaptive`, k is recomputed after each
    sync from the all-reduced mean loss and the learning rate (Paddle's adaptive
    local SGD): ceil(sqrt(lr0 * loss / (lr * loss0) * k_steps)) clamped to
    [1, 16], where loss0 and lr0 are the values at the first sync."""

    def __init__(self, programs: Mapping[str, Sequence[PassLike]], k_steps: int,
                 begin_step: int, adaptive: bool):
        super().__init__()
        runs = {"warmup": begin_step > 0, "local": k_steps > 1 or adaptive, "sync": True}
        self.programs = {name: tuple(p) for name, p in programs.items() if runs[name]}
        self.k_steps, self.begin_step, self.adaptive = k_steps, begin_step, adaptive
        self.since_sync = 0           # local steps since the last sync
        self.k = k_steps
        self.loss0: float | None = None
        self.lr0: float | None = None

    def next_program(self) -> str:
        if self.step < self.begin_step:
            return "warmup"
        return "sync" if self.since_sync + 1 >= self.k else "local"

    def advance(self, program: str, held: Mapping[str, torch.Tensor]) -> None:
        super().advance(program, held)
        if program == "local":
            self.since_sync += 1
        elif program == "sync":
            self.since_sync = 0
            if self.adaptive:
                self.k = self.next_k(held[MEAN_LOSS].item(), held[LR].item())

    def next_k(self, loss: float, lr: float) -> int:
        """The period after a sync with this mean loss and learning rate."""
        if self.loss0 is None:
            self.loss0, self.lr0 = loss, lr
        ratio = (self.lr0 * loss) / (lr * self.loss0) if lr * self.loss0 != 0 else math.nan
        if not math.isfinite(ratio) or ratio < 0:
            log.warning("transpiler: adaptive local SGD keeps k=%d: loss %g, lr %g against "
                        "loss0 %g, lr0 %g give no usable ratio", self.k, loss, lr,
                        self.loss0, self.lr0)
            return self.k
        return min(MAX_K, max(1, math.ceil(math.sqrt(ratio * self.k_steps))))

    def state_dict(self) -> dict:
        return {**super().state_dict(), "since_sync": self.since_sync, "k": self.k,
                "loss0": self.loss0, "lr0": self.lr0}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.since_sync, self.k = int(state["since_sync"]), int(state["k"])
        self.loss0, self.lr0 = state["loss0"], state["lr0"]
