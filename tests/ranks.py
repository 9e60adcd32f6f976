"""A pool of rank processes (gloo over a file store) that stays up for the whole
test session: spawning ranks costs seconds, so tests share them.

    pool = RankPool(2)
    results = pool.run(fn, *args)     # fn(*args) on every rank, results by rank

`fn` must be a module-level function; an exception on any rank is raised here
with that rank's traceback; a rank that does not answer within the timeout
fails the call, with its threads' stacks, and the pool is torn down (no test
waits forever).
`RankPool(2, pg_timeout_s=5)` gives the process group that timeout.
"""

from __future__ import annotations

import os
import queue
import signal
import tempfile
import time
import traceback
from multiprocessing.reduction import ForkingPickler

import torch.multiprocessing as mp

_TIMEOUT_S = 180


def _stacks_path(store_path: str, rank: int) -> str:
    return f"{store_path}.stacks{rank}"


def _worker(rank, world_size, store_path, tasks, results, pg_timeout_s):
    import datetime
    import faulthandler

    import torch
    import torch.distributed as dist

    # a rank that does not answer is asked for its threads' stacks (RankPool.run)
    stacks = open(_stacks_path(store_path, rank), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)

    torch.set_num_threads(1)
    timeout = None if pg_timeout_s is None else datetime.timedelta(seconds=pg_timeout_s)
    dist.init_process_group("gloo", init_method=f"file://{store_path}",
                            rank=rank, world_size=world_size, timeout=timeout)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            result = fn(*args, **kwargs)
            # pickled here: the queue's feeder thread would drop what cannot be
            # (a tensor that requires grad), leaving the test to wait for it
            ForkingPickler.dumps(result)
            results.put((rank, True, result))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    dist.destroy_process_group()
    faulthandler.unregister(signal.SIGUSR1)
    stacks.close()


class RankFailure(Exception):
    pass


class RankPool:
    def __init__(self, world_size: int, pg_timeout_s: float | None = None):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory()
        store = self._store = os.path.join(self._dir.name, "store")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, world_size, store, self._tasks[r], self._results,
                                         pg_timeout_s))
                       for r in range(world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, timeout: float = _TIMEOUT_S, only: list[int] | None = None,
            **kwargs) -> list:
        """fn on every rank; the results of every rank, or of the ranks in `only`
        (for a test in which the others die)."""
        if not self.alive:
            raise RankFailure("the rank pool was torn down by an earlier failure")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        waited = set(range(self.world_size) if only is None else only)
        got: dict[int, tuple] = {}
        try:
            while not waited <= set(got):
                rank, ok, value = self._results.get(timeout=timeout)
                got[rank] = (ok, value)
        except queue.Empty:
            silent = sorted(waited - set(got))
            stacks = self._stacks(silent)
            self.close(kill=True)
            # a rank that failed first often left the silent ones waiting for it
            failed = "".join(f"\n--- rank {r} failed first ---\n{v}"
                             for r, (ok, v) in sorted(got.items()) if not ok)
            raise RankFailure(f"ranks {silent} did not answer {fn.__name__} within {timeout}s"
                              f"{failed}{stacks}") from None
        errors = {r: v for r, (ok, v) in got.items() if not ok and r in waited}
        if errors:
            rank = min(errors)
            raise RankFailure(f"{fn.__name__} failed on rank {rank}:\n{errors[rank]}")
        return [got[r][1] for r in sorted(waited)]

    def _stacks(self, ranks: list[int]) -> str:
        """The threads' stacks of each rank in `ranks`, as faulthandler dumps them."""
        for r in ranks:
            if self._procs[r].is_alive():
                os.kill(self._procs[r].pid, signal.SIGUSR1)
        time.sleep(2)
        out = ""
        for r in ranks:
            try:
                with open(_stacks_path(self._store, r)) as f:
                    out += f"\n--- rank {r}'s threads ---\n{f.read()}"
            except FileNotFoundError:   # the rank had not started its worker yet
                out += f"\n--- rank {r}: no stacks (its worker had not started) ---"
        return out

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self, kill: bool = False):
        for p, q in zip(self._procs, self._tasks):
            if p.is_alive() and not kill:
                q.put(None)
        for p in self._procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
        self._dir.cleanup()
