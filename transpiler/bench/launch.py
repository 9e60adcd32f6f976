"""Fresh rank processes for one measurement, and what went wrong in them.

run_ranks spawns the ranks, each joining a gloo (or nccl) group through a file
store, and collects what each returns. When a rank fails, the others usually
fail after it with a lost connection, so the error reported is the cause: a
rank that died without a word (killed, a crash in native code) first, then an
error that is not a lost peer, then the lowest rank's. A refusal by the
transpiler (a TranspileError on every rank that failed of its own) is reported
as one, not as a crash.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import tempfile
import time
import traceback
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils._pytree as pytree

from transpiler.errors import TranspileError

CONFIG_TIMEOUT_S = 600      # one configuration on one model, all ranks
# After a rank's failure, how long the others have to report their own: the
# cause is often on another rank than the first to report.
GRACE_S = 10
# What a rank reports when a peer went away: a consequence, not a cause.
_LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "Socket Timeout", "Connection refused")


REFUSED, FAILED = "refused: ", "FAILED: "   # how a configuration's cell starts


class BenchError(Exception):
    """A usage or environment error: reported in one line, no traceback."""


class Refused(BenchError):
    """The transpiler refused the configuration (TranspileError on the ranks)."""


@dataclasses.dataclass(frozen=True)
class _Failure:
    refused: bool
    text: str   # the traceback


def _rank_main(rank: int, world_size: int, store: str, job, results, work: Callable) -> None:
    """One rank: join the process group and put work(job, rank, world_size),
    or its failure, on `results`."""
    torch.set_num_threads(1)
    backend = "gloo"
    if job.device == "cuda":
        # nccl needs a GPU per rank; ranks sharing a GPU reduce through gloo
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "nccl" if world_size <= torch.cuda.device_count() else "gloo"
    try:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                                world_size=world_size)
        try:
            results.put((rank, None, _by_value(work(job, rank, world_size))))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - sent to the parent, which reports it
        results.put((rank, _Failure(isinstance(exc, TranspileError), traceback.format_exc()),
                     None))


def _by_value(result):
    """The result with its tensors as numpy arrays: a tensor put on a queue is
    shared through a file descriptor that dies with the rank, which exits
    right after (the parent could read it too late)."""
    return pytree.tree_map(lambda v: ("tensor", v.detach().cpu().numpy())
                           if isinstance(v, torch.Tensor) else v, result)


def _tensors(result):
    return pytree.tree_map(lambda v: torch.from_numpy(v[1])
                           if isinstance(v, tuple) and len(v) == 2 and v[0] == "tensor" else v,
                           result, is_leaf=lambda v: isinstance(v, tuple) and len(v) == 2
                           and v[0] == "tensor")


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def cause(failures: dict[int, _Failure], died: dict[int, int]) -> BenchError:
    """The error to report for ranks that failed (`failures`, by rank) or died
    without a report (`died`: rank -> exit code)."""
    if died:
        rank, code = min(died.items())
        also = "".join(f"\nrank {r} then: {f.text.strip().splitlines()[-1]}"
                       for r, f in sorted(failures.items()))
        return BenchError(f"rank {rank} died ({_exit_text(code)}) without an error{also}")
    own = {r: f for r, f in failures.items() if not any(s in f.text for s in _LOST_PEER)}
    rank, failure = min((own or failures).items())
    if own and all(f.refused for f in own.values()):
        return Refused(f"by the transpiler on rank {rank}:\n{failure.text}")
    return BenchError(f"rank {rank} failed:\n{failure.text}")


def _collect(results, procs, timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    got: dict[int, dict] = {}
    failures: dict[int, _Failure] = {}
    while len(got) + len(failures) < len(procs):
        try:
            rank, failure, value = results.get(timeout=min(1.0, max(0.0, deadline -
                                                                    time.monotonic())))
        except queue.Empty:
            reported = set(got) | set(failures)
            # a rank's report is on the queue before its process ends
            died = {r: p.exitcode for r, p in enumerate(procs)
                    if r not in reported and p.exitcode not in (None, 0)}
            if died:
                raise cause(failures, died) from None
            if time.monotonic() < deadline:
                continue
            if failures:
                break
            missing = sorted(set(range(len(procs))) - reported)
            raise BenchError(f"ranks {missing} did not finish within {timeout_s:.0f}s") from None
        if failure is not None:
            failures[rank] = failure
            deadline = min(deadline, time.monotonic() + GRACE_S)
        else:
            got[rank] = _tensors(value)
    if failures:
        raise cause(failures, {})
    return [got[r] for r in range(len(procs))]


def run_ranks(job, world_size: int, work: Callable,
              timeout_s: float = CONFIG_TIMEOUT_S) -> list[dict]:
    """Run work(job, rank, world_size) (a module-level function) in
    `world_size` fresh spawned ranks; their results, by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="transpiler-bench-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, store, job, results, work))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        ok = False
        try:
            out = _collect(results, procs, timeout_s)
            ok = True
            return out
        finally:
            for p in procs:
                p.join(timeout=30 if ok else 0)
                if p.is_alive():
                    p.kill()
                    p.join()


def failure_text(exc: BenchError) -> str:
    """A failed configuration's cell: what happened, and the first and the
    last line of its error."""
    lines = str(exc).strip().splitlines()
    return (REFUSED if isinstance(exc, Refused) else FAILED) + \
        " ".join(dict.fromkeys((lines[0], lines[-1])))
