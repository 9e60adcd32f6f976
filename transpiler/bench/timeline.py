"""When each all-reduce of one step is issued, run and waited for: the
transpiler's step against DDP's on one model (`python -m transpiler.bench
--timeline MODEL`), read from torch.profiler on rank 0 after a warm-up.

For each all-reduce, in the order the step issues them: its size, when the
step issued it (`c10d::allreduce_` on the step's thread), when gloo's worker
ran it (`gloo:all_reduce`, matched in order), and for the transpiler's step
when the program waited for it (`wait_tensor`; DDP waits inside autograd's
last callback, which the profiler does not name). Times are milliseconds from
the step's start; the overlap a bucket got is the time between its issue and
the end of the step's computation that does not wait for it. Under load the
numbers move; their order and the gaps between them are what to read.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
import torch.distributed as dist

from transpiler.bench.bench import Job, job_setup
from transpiler.bench.launch import run_ranks
from transpiler.bench.report import Row, Table, text

log = logging.getLogger("transpiler.bench")

WARMUP = 3
_STEP = "transpiler.bench: step"
_ISSUE = "c10d::allreduce_"
_RUN = "gloo:all_reduce"
_WAIT = "_c10d_functional::wait_tensor"


@dataclasses.dataclass(frozen=True)
class Collective:
    mb: float                            # float32 megabytes gloo reduced
    issued_ms: float
    ran_ms: tuple[float, float] | None   # gloo's worker: start, end
    waited_ms: float | None              # the end of the program's wait for it


def _mb(event) -> float:
    """The bytes gloo reduced in a `gloo:all_reduce` event (its input shapes;
    4 bytes an element, as float32)."""
    return sum(4 * math.prod(shape) for shape in event.input_shapes) / 2**20


def one_step(job: Job, rank: int, world_size: int) -> dict:
    """Rank's work: warm the configuration up, profile one step; rank 0's events."""
    _, _, batches, make_step = job_setup(job, rank, world_size, WARMUP + 1)
    step = make_step()
    for batch in batches[:WARMUP]:
        step(*batch)
    dist.barrier()
    with torch.profiler.profile(record_shapes=True) as prof:
        with torch.profiler.record_function(_STEP):
            step(*batches[WARMUP])
    dist.barrier()
    if rank:
        return {}
    events = list(prof.events())
    window = next(e for e in events if e.name == _STEP).time_range
    at = lambda t: (t - window.start) / 1e3   # noqa: E731 - ms from the step's start
    issued = sorted((e for e in events if e.name == _ISSUE), key=lambda e: e.time_range.start)
    ran = sorted((e for e in events if e.name == _RUN), key=lambda e: e.time_range.start)
    waits = sorted((e for e in events if e.name == _WAIT), key=lambda e: e.time_range.start)
    return {"step_ms": at(window.end), "collectives": [dataclasses.asdict(Collective(
        _mb(ran[i]) if i < len(ran) else 0.0, at(e.time_range.start),
        (at(ran[i].time_range.start), at(ran[i].time_range.end)) if i < len(ran) else None,
        at(waits[i].time_range.end) if i < len(waits) else None))
        for i, e in enumerate(issued)]}


def table(model: str, runs: dict[str, dict]) -> Table:
    rows = []
    for config, run in runs.items():
        for i, c in enumerate(run["collectives"]):
            ran = c["ran_ms"]
            rows.append(Row((model, config, str(i), f"{c['mb']:.2f}", f"{c['issued_ms']:.2f}",
                             "-" if ran is None else f"{ran[0]:.2f}",
                             "-" if ran is None else f"{ran[1]:.2f}",
                             "-" if c["waited_ms"] is None else f"{c['waited_ms']:.2f}",
                             f"{run['step_ms']:.2f}")))
    return Table(("model", "config", "#", "mb", "issued_ms", "runs_from_ms", "runs_to_ms",
                  "waited_to_ms", "step_ms"), 3, tuple(rows))


def main(model: str, configs: list[str], world_size: int, optimizer: str) -> int:
    runs = {}
    for config in configs:
        log.info("timeline: %s %s ...", model, config)
        runs[config] = run_ranks(Job(model, config, WARMUP, 1, optimizer), world_size,
                                 one_step)[0]
    print(text(table(model, runs)))
    return 0
