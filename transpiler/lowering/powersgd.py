"""torch's powerSGD_hook traced into the program, its state where DDP's hook keeps it.

DDP's PowerSGD (torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook)
all-reduces each bucket plainly for its first `start_powerSGD_iter`
iterations, then compresses the bucket's matrices to rank r (P = M Q and
Q = M^T P all-reduced), with error feedback (what the compression lost is
added to the next step's gradients) and warm start (Q kept from the last
step). Its state changes between steps: an iteration counter, a numpy
RandomState that draws the seed of each bucket's first Q, and per bucket the
tensors error_dict[b], p_memory_dict[b] and q_memory_dict[b].

The hook that runs is torch's own, traced per bucket on a stand-in of the
state (`shadow`) in one of two phases, as the schedule picks by state.iter
(schedule.CommHookPhases):
- plain (programs "main", "first"): the counter below start_powerSGD_iter;
- compress (program "compress"): the counter at start_powerSGD_iter and the
  warm-start path, the bucket's three tensors inputs of the program
  (InputKind.HOOK, read from the state object) and their new values its
  outputs (written back there). Which tensors the hook keeps, their shapes,
  and the shapes it draws Q as are observed on a first trace of its
  first-iteration path (`observe`), not computed here.
What the hook does on Python values the host does, as DDP's hook does it and
in its order (`create`, `after_step`): reading a missing entry creates it (the
error zeros; P zeros, which the program overwrites; Q drawn with torch.randn
after torch.manual_seed(state.rng.randint(1_000_000_000)) under fork_rng,
one seed per bucket in bucket order, as the hook's first iteration does); after
each step the counter and the compression statistics advance, and without warm
start P and Q are dropped. So the state object holds after each step what
DDP's would, and is the checkpoint as under DDP (pickle it).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable
from unittest import mock

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from ..errors import TranspileError
from ..program.program import HookEntry

TABLES = ("error_dict", "p_memory_dict", "q_memory_dict")
_SEED_BOUND = 1_000_000_000   # the hook's state.rng.randint(1_000_000_000)


def is_powersgd(hook) -> bool:
    return hook is torch_powersgd.powerSGD_hook


def refuse(state, hook) -> None:
    """A PowerSGD state with a hook this module does not trace."""
    if hook is torch_powersgd.batched_powerSGD_hook:
        raise TranspileError(
            "batched_powerSGD_hook: torch's own hook fails under DDP from its first compressed "
            "iteration (it orthogonalizes a 2-d Q, which _orthogonalize refuses with an "
            "AssertionError); use powerSGD_hook, with PowerSGDState(..., "
            "batch_tensors_with_same_shape=True) to batch its matrices")
    if not is_powersgd(hook):
        raise TranspileError(
            f"comm_hook's state is a PowerSGDState but its hook is {hook!r}: a PowerSGDState "
            "is traced with torch's powerSGD_hook")
    if state.start_powerSGD_iter < 1:
        raise TranspileError(
            "PowerSGDState(start_powerSGD_iter=0) compresses DDP's first iteration, whose "
            "buckets DDP lays out otherwise and rebuilds after it: pass 1 or more")


def describe(state) -> str:
    """The state's settings (the same on every rank)."""
    return (f"rank={state.matrix_approximation_rank} start={state.start_powerSGD_iter} "
            f"min_rate={state.min_compression_rate} error_feedback={state.use_error_feedback} "
            f"warm_start={state.warm_start} epsilon={state.orthogonalization_epsilon} "
            f"batched={state.batch_tensors_with_same_shape}")


def compressing(state) -> bool:
    """Whether the hook compresses at the next iteration."""
    return state.iter >= state.start_powerSGD_iter


class _NoDraws:
    """A stand-in for state.rng in a trace of the compressed path, which
    draws nothing (its Q is an input)."""

    def randint(self, *args, **kwargs):
        raise TranspileError("internal: PowerSGD drew a seed in a trace of its warm path")


def shadow(state, compress: bool, tables: dict[str, dict] | None = None):
    """A stand-in of `state` for one trace: the same settings, the counter
    of the phase, tables of its own (`tables`), no draws, no logging."""
    copy = object.__new__(type(state))
    for cls in type(state).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            setattr(copy, slot, getattr(state, slot))
    copy.iter = state.start_powerSGD_iter if compress else 0
    copy.rng = _NoDraws()
    for name in TABLES:
        setattr(copy, name, dict((tables or {}).get(name, {})))
    copy.total_numel_before_compression = copy.total_numel_after_compression = 0
    copy.next_stats_report = float("inf")
    if compress:
        copy.warm_start = True   # the program's Q is an input: drawn by the host when due
    return copy


@contextlib.contextmanager
def traceable():
    """Around a trace of the hook: its QR (rank above 2) written into its
    input with out=, which functionalization cannot trace with the views the
    hook's other ops keep, computed out of place and copied in, the same
    values (test_comm_hooks: bit for bit with DDP's at rank 4)."""
    qr = torch.linalg.qr

    def copied(a, mode="reduced", *, out=None):
        if out is None:
            return qr(a, mode)
        q, r = qr(a, mode)
        out[0].copy_(q)
        out[1].copy_(r)
        return out

    with mock.patch.object(torch.linalg, "qr", copied):
        yield


class _FirstDraws:
    def randint(self, *args, **kwargs):
        return 0


def observe(state, bucket: int, trace: Callable) -> list[tuple[HookEntry, torch.Size,
                                                               torch.dtype]]:
    """The tensors the hook keeps for `bucket`, with their shapes and dtypes:
    observed while `trace(copy)` traces the
    hook's first compressed iteration on `copy`, a shadow with empty tables.
    No seed is set on torch's generators meanwhile (torch.manual_seed would
    queue one for CUDA); the shapes of the matrices the hook orthogonalizes
    are recorded (its Qs, then as many Ps)."""
    copy = shadow(state, compress=True)
    copy.rng = _FirstDraws()
    shapes: list[tuple[int, ...]] = []
    original = torch_powersgd._orthogonalize

    def recorded(matrices, epsilon=0):
        shapes.append(tuple(matrices.shape))
        return original(matrices, epsilon)

    with mock.patch.object(torch_powersgd, "_orthogonalize", recorded), \
            mock.patch.object(torch, "manual_seed", lambda seed: None):
        trace(copy)
    counted = (copy.total_numel_before_compression, copy.total_numel_after_compression)
    q = {"projections": tuple(shapes[:len(shapes) // 2]), "counted": counted}
    kept = [(name, getattr(copy, name)[bucket]) for name in TABLES
            if bucket in getattr(copy, name)]
    return [(HookEntry(name, bucket, **(q if name == "q_memory_dict" else {})), t.shape, t.dtype)
            for name, t in kept]


def create(state, entry: HookEntry, like: torch.Tensor) -> torch.Tensor:
    """state.<table>[bucket], created as the hook's first iteration creates
    it where it is missing; `like` gives its shape, dtype and device."""
    table = getattr(state, entry.table)
    if entry.bucket not in table:
        if entry.table == "q_memory_dict":
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(state.rng.randint(_SEED_BOUND))
                drawn = [torch.randn(*shape, device="cpu", dtype=like.dtype).view(-1)
                         for shape in entry.projections]
            table[entry.bucket] = (torch.cat(drawn) if drawn else like.new_empty(0)).to(like.device)
        else:
            table[entry.bucket] = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    return table[entry.bucket]


@dataclasses.dataclass(frozen=True)
class StateSlot:
    """Where a HOOK input is read and its output written: state.<table>[bucket]
    (created on its first read, as the hook creates it), shaped `shape`."""

    state: object
    entry: HookEntry
    shape: tuple
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, state, entry: HookEntry, val: torch.Tensor) -> "StateSlot":
        """The slot of a placeholder whose value is `val`."""
        return cls(state, entry, tuple(val.shape), val.dtype, val.device)

    def read(self, leaves):
        return create(self.state, self.entry,
                      torch.empty(self.shape, dtype=self.dtype, device=self.device))

    def misfit(self, value) -> str | None:
        return None if isinstance(value, torch.Tensor) and tuple(value.shape) == self.shape \
            else f"a {type(value).__name__} of shape {getattr(value, 'shape', None)}"

    def write(self, value):
        table = getattr(self.state, self.entry.table)
        old = table.get(self.entry.bucket)
        if old is not None and old.shape == value.shape and old.dtype == value.dtype:
            old.copy_(value)
        else:   # the program's own tensor may be reused by its next run (a CUDA graph's)
            table[self.entry.bucket] = value.clone()

    def mirror(self, memo: dict):
        return None   # verify= is refused with a PowerSGDState


def after_step(state, entries: list[HookEntry]) -> None:
    """After a step that ran the hook on every bucket: the counter (and in
    the compressed phase the statistics, logged as the hook logs them) as
    the hook advances them; without warm start P and Q dropped."""
    counted = [e for e in entries if e.table == "q_memory_dict"]
    if counted:
        for entry in counted:
            state.total_numel_before_compression += entry.counted[0]
            state.total_numel_after_compression += entry.counted[1]
        torch_powersgd._report_compression_stats(_LastBucket(), state)
        if not state.warm_start:
            state.p_memory_dict.clear()
            state.q_memory_dict.clear()
    state.maybe_increase_iter(_LastBucket())


class _LastBucket:
    def is_last(self) -> bool:
        return True
