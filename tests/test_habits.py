"""The bank of habits of tests/habits.py, each eager against transpiled.

One process: every habit runs for its calls (4 by default) on two setups
built alike, the transpiled step on one and the eager step on the other, the
same seeds for torch, random and numpy before each call (and before each
between-calls action), and compares bit for bit what comes back, what it
prints, every parameter, buffer and .grad, optimizer, scaler and scheduler state, the plain
values the script can read afterwards on the objects it holds, and where
torch's, Python's and numpy's generators are left. A REFUSED habit must raise
TranspileError at its call with everything as it was before that call.

Two ranks (slow): the habits marked `ranks` run the transpiled step against
the same step function with the model wrapped in torch DDP (its defaults), in
the same processes, each rank its own batch and its own seeds.

`python -m tests.test_habits [ids...]` prints one line per habit (the table
of docs/habits.md is made from it); `--ranks` runs the 2-rank part too.
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import pathlib
import random
import sys
import time
import types

import numpy as np
import pytest
import torch
import torch.nn as nn

from tests import models as M
from tests.habits import EQUAL, HABITS, REFUSED, Data, by_id
from transpiler import TranspileError, transpile

# ----------------------------------------------------------------- snapshots

_SKIP_ATTRS = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
               "_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
               "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_post_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks_with_kwargs", "_is_full_backward_hook",
               "_compiled_call_impl", "__wrapped__"}
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


def _is_transpiler(value) -> bool:
    return type(value).__module__.split(".")[0] == "transpiler"


def snapshot(root, ddp_next_forward: bool = False) -> dict:
    """Everything a script can read afterwards on the objects of a setup:
    path -> a clone of a tensor, or a plain value. ddp_next_forward: a DDP
    module's buffers as its next forward starts from them (rank 0's, which it
    broadcasts first; a collective), as the transpiled step leaves them."""
    out: dict = {}
    seen: dict = {}   # id -> the object, kept alive (a freed temporary's id is reused)

    def walk(value, path, depth):
        if isinstance(value, _PLAIN) or isinstance(value, np.generic):
            out[path] = value.item() if isinstance(value, np.generic) else value
            return
        if isinstance(value, torch.Tensor):
            out[path] = value.detach().clone()
            if value.requires_grad and value.is_leaf:
                out[path + ".grad"] = None if value.grad is None else value.grad.detach().clone()
            return
        if isinstance(value, np.ndarray):
            out[path] = value.copy()
            return
        if id(value) in seen or depth > 6 or _is_transpiler(value):
            return
        if isinstance(value, (types.FunctionType, types.MethodType, types.BuiltinFunctionType,
                              types.ModuleType, type, logging.Logger, functools_partial,
                              torch.utils.hooks.RemovableHandle)):
            return
        seen[id(value)] = value
        if isinstance(value, nn.parallel.DistributedDataParallel):
            if ddp_next_forward and value.broadcast_buffers:
                M.as_next_forward_sees(value)
            return walk(value.module, path, depth)
        if isinstance(value, nn.Module):
            for name, p in value.named_parameters(remove_duplicate=False):
                walk(p, f"{path}.{name}", depth + 1)
                out[f"{path}.{name}.requires_grad"] = p.requires_grad
            for name, b in value.named_buffers(remove_duplicate=False):
                walk(b, f"{path}.{name}", depth + 1)
            for name, m in value.named_modules(remove_duplicate=False):
                out[f"{path}.{name}.training" if name else f"{path}.training"] = m.training
                for k, v in vars(m).items():
                    if k not in _SKIP_ATTRS and k != "training" and not isinstance(v, nn.Module):
                        walk(v, f"{path}.{name}.{k}" if name else f"{path}.{k}", depth + 1)
            return
        if isinstance(value, torch.optim.Optimizer):
            state = value.state_dict()
            walk(state["state"], f"{path}.state", depth + 1)
            for j, group in enumerate(state["param_groups"]):
                for k, v in group.items():
                    if not callable(v):
                        walk(v, f"{path}.param_groups[{j}].{k}", depth + 1)
            return
        if isinstance(value, torch.amp.GradScaler):
            walk(value.state_dict(), f"{path}.state", depth + 1)
            walk(getattr(value, "_scale", None), f"{path}._scale", depth + 1)
            walk(getattr(value, "_growth_tracker", None), f"{path}._growth_tracker", depth + 1)
            return
        if isinstance(value, torch.optim.lr_scheduler.LRScheduler):
            walk({k: v for k, v in value.state_dict().items() if not callable(v)},
                 f"{path}.state", depth + 1)
            return
        if isinstance(value, dict):
            labels = [repr(k) if isinstance(k, _PLAIN) else f"#{j}" for j, k in enumerate(value)]
            for label, v in zip(labels, value.values()):
                walk(v, f"{path}[{label}]", depth + 1)
            out[path + ".keys"] = labels
            return
        if isinstance(value, pathlib.Path):   # a file the script reads afterwards
            out[path] = value.read_text() if value.exists() else None
            return
        if isinstance(value, (list, tuple, set, frozenset, collections.deque)):
            items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
            out[path + ".len"] = len(items)
            for j, v in enumerate(items):
                walk(v, f"{path}[{j}]", depth + 1)
            return
        attrs = getattr(value, "__dict__", None)
        if attrs is not None:
            for k, v in list(attrs.items()):
                walk(v, f"{path}.{k}", depth + 1)

    walk(root, "s", 0)
    return out


from functools import partial as functools_partial  # noqa: E402


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {"rng.torch": torch.get_rng_state(), "rng.random": random.getstate(),
            "rng.numpy": (np_state[0], np_state[1].tobytes(), *np_state[2:])}


def _same(a, b) -> tuple[bool, float]:
    """Equal bit for bit (NaN equal to NaN); and the largest difference."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False, float("inf")
        if a.shape != b.shape or a.dtype != b.dtype:
            return False, float("inf")
        if torch.equal(a, b):
            return True, 0.0
        if a.is_floating_point() or a.is_complex():
            both_nan = torch.isnan(a) & torch.isnan(b)
            if bool(((a == b) | both_nan).all()):
                return True, 0.0
            return False, float((a.double() - b.double()).abs().nan_to_num(float("inf")).max())
        return False, float((a.double() - b.double()).abs().max())
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                and a.shape == b.shape and bool((a == b).all())), float("nan")
    if isinstance(a, float) and isinstance(b, float) and a != b:
        if math.isnan(a) and math.isnan(b):
            return True, 0.0
        return False, abs(a - b)
    return a == b, float("nan")


import math  # noqa: E402


def compare(ours: dict, theirs: dict) -> list[str]:
    """Differences between two snapshots, one line each."""
    lines = []
    for key in sorted(set(ours) | set(theirs)):
        if key not in ours:
            lines.append(f"{key}: missing in the transpiled run (eager: {_show(theirs[key])})")
        elif key not in theirs:
            lines.append(f"{key}: only in the transpiled run ({_show(ours[key])})")
        else:
            try:
                same, delta = _same(ours[key], theirs[key])
            except Exception as e:  # noqa: BLE001 - e.g. a traced tensor left on the host
                same, delta = False, float("nan")
                lines.append(f"{key}: cannot be read after the call ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})")
                continue
            if not same:
                lines.append(f"{key}: transpiled {_show(ours[key])} != eager {_show(theirs[key])}"
                             + (f" (max |diff| {delta:.3g})" if delta == delta else ""))
    return lines


def _show(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor {str(v.dtype).replace('torch.', '')}{list(v.shape)}"
    text = repr(v)
    return text if len(text) < 60 else text[:57] + "..."


def flatten(result, path="out") -> dict:
    if isinstance(result, (list, tuple)):
        d = {f"{path}.len": len(result)}
        for j, v in enumerate(result):
            d.update(flatten(v, f"{path}[{j}]"))
        return d
    if isinstance(result, dict):
        d = {f"{path}.keys": list(result)}
        for k, v in result.items():
            d.update(flatten(v, f"{path}[{k!r}]"))
        return d
    if hasattr(result, "to_tuple") and not isinstance(result, torch.Tensor):
        return flatten(result.to_tuple(), path)
    if isinstance(result, torch.Tensor):
        return {path: result.detach().clone()}
    return {path: result}


# ----------------------------------------------------------------- one process


def seed(i: int, rank: int = 0) -> None:
    n = 1000 + i + 100 * rank
    torch.manual_seed(n)
    random.seed(n)
    np.random.seed(n)


def summarize(problems: list[str], limit: int = 6) -> str:
    head = problems[:limit]
    more = len(problems) - len(head)
    return "\n".join(head + ([f"... and {more} more"] if more > 0 else []))


def run_habit(h, rank: int | None = None, mode: str | None = None) -> list[str]:
    """The habit's calls, transpiled against eager (or DDP when rank is given);
    the problems found, first the call and how it failed."""
    ranked = rank is not None
    r = rank or 0
    seed(0)
    ours = h.setup()
    seed(0)
    theirs = h.setup()
    if ranked and h.ddp is not False:
        (h.ddp or _wrap_model)(theirs)
    start = compare(snapshot(ours), snapshot(theirs))
    if start and not ranked:
        return ["setup is not deterministic: " + start[0]]
    options = dict(h.options)
    if mode is not None:
        options["mode"] = mode
    step = transpile(h.step_for(ours), **options)
    eager = h.step_for(theirs)
    for i in range(h.calls):
        if h.between is not None:
            seed(i, r)
            h.between(ours, i)
            seed(i, r)
            h.between(theirs, i)
        if h.expect == REFUSED and i == h.refused_at:
            before = snapshot(ours)
            seed(i, r)
            try:
                result = h.call(step, ours, i, Data(i, r))
            except TranspileError as e:
                problems = []
                import re
                if h.match and not re.search(h.match, str(e), re.S):
                    problems.append(f"call {i}: refused, but the message does not match "
                                    f"{h.match!r}: {str(e).splitlines()[0]}")
                changed = compare(snapshot(ours), before)
                if changed:
                    problems.append(f"call {i}: refused but changed state: " + changed[0])
                    problems += changed[1:]
                return problems
            except Exception as e:  # noqa: BLE001
                problems = [] if h.gap else [f"call {i}: crash instead of a refusal: "
                                             f"{type(e).__name__}: "
                                             f"{str(e).splitlines()[0] if str(e) else ''}"]
                import re
                if h.gap and h.match and not re.search(h.match, str(e), re.S):
                    problems.append(f"call {i}: failed, but not as the gap says "
                                    f"({h.match!r}): {str(e).splitlines()[0]}")
                changed = compare(snapshot(ours), before)
                if changed:
                    problems.append(f"call {i}: failed and changed state: " + changed[0])
                return problems
            seed(i, r)
            try:
                expected = h.call(eager, theirs, i, Data(i, r))
            except Exception:  # noqa: BLE001
                expected = None
            silent = compare({**flatten(result), **snapshot(ours), **rng_state()},
                             {**flatten(expected), **snapshot(theirs, ranked), **rng_state()})
            not_refused = [f"call {i}: not refused (expected a refusal here); "
                           + (f"{len(silent)} values differ from eager: {silent[0]}" if silent
                              else "it equals eager on this call")]
            if silent:
                return not_refused + silent
            later = _later_calls(h, step, eager, ours, theirs, i + 1, r, ranked)
            return not_refused + (later or [f"calls {i + 1}-{h.calls - 1}: equal to eager"])
        problems = _one_call(h, step, eager, ours, theirs, i, r, ranked)
        if _stop(problems, ranked):
            return problems
    return []


def _stop(problems: list[str], ranked: bool) -> bool:
    """Whether to stop after a call: on ranks, when any rank found a problem,
    every rank stops together (one that went on would wait in a collective)."""
    if not ranked:
        return bool(problems)
    flags = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(flags, bool(problems))
    return any(flags)


def _later_calls(h, step, eager, ours, theirs, first, r, ranked) -> list[str]:
    for i in range(first, h.calls):
        if h.between is not None:
            seed(i, r)
            h.between(ours, i)
            seed(i, r)
            h.between(theirs, i)
        problems = _one_call(h, step, eager, ours, theirs, i, r, ranked)
        if _stop(problems, ranked):
            return problems
    return []


def _one_call(h, step, eager, ours, theirs, i, r, ranked) -> list[str]:
    if True:
        seed(i, r)
        printed = io.StringIO()   # what the call prints: eager's text, on every call
        try:
            with contextlib.redirect_stdout(printed):
                result = h.call(step, ours, i, Data(i, r))
        except TranspileError as e:
            return [f"call {i}: wrong refusal: {str(e).splitlines()[0]}"]
        except Exception as e:  # noqa: BLE001
            text = str(e).strip().splitlines()
            return [f"call {i}: crash: {type(e).__name__}: {text[0] if text else ''}"[:400]]
        mine = {**flatten(result), **snapshot(ours), **rng_state(), "printed": printed.getvalue()}
        seed(i, r)
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                expected = h.call(eager, theirs, i, Data(i, r))
        except Exception as e:  # noqa: BLE001 - the reference itself failed
            return [f"call {i}: the {'DDP' if ranked else 'eager'} reference failed: "
                    f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]
        reference = {**flatten(expected), **snapshot(theirs, ranked), **rng_state(),
                     "printed": printed.getvalue()}
        diff = compare(mine, reference)
        if diff:
            return [f"call {i}: silent difference, {len(diff)} values differ from "
                    f"{'DDP' if ranked else 'eager'}:"] + diff
    return []


def _wrap_model(s):
    s.model = nn.parallel.DistributedDataParallel(s.model)


@pytest.mark.parametrize("h", HABITS, ids=[h.id for h in HABITS])
def test_habit(h):
    problems = run_habit(h)
    assert not problems, f"{h.id} ({h.expect}): " + summarize(problems)


RANKED = [h for h in HABITS if h.ranks]


def rank_habit(habit_id: str, mode: str):
    """On every rank: the habit transpiled against DDP; its problems."""
    torch.set_num_threads(1)
    return run_habit(by_id(habit_id), rank=torch.distributed.get_rank(), mode=mode)


@pytest.mark.parametrize("h", RANKED, ids=[h.id for h in RANKED])
def test_habit_on_2_ranks_equals_ddp(h, ranks2):
    if h.rank_gap:
        pytest.skip(f"gap: {h.rank_gap}")
    results = ranks2.run(rank_habit, h.id, "grad_allreduce")
    problems = [f"rank {r}: {p}" for r, ps in enumerate(results) for p in ps]
    assert not problems, f"{h.id} ({h.expect}) on 2 ranks: " + summarize(problems)


# ----------------------------------------------------------------- report

def main(argv: list[str]) -> None:
    """`python -m tests.test_habits [ids...] [--ranks | --only-ranks] [--report FILE]`:
    one line per habit; --report writes the bank's page (docs/habits.md) from the run."""
    logging.basicConfig(level=logging.WARNING)
    with_ranks = "--ranks" in argv
    only_ranks = "--only-ranks" in argv
    report = argv[argv.index("--report") + 1] if "--report" in argv else None
    timeout = 120.0
    ids = [a for a in argv if not a.startswith("--") and a != report]
    chosen = [h for h in HABITS if not ids or h.id in ids]
    results: dict[str, list[str]] = {}
    total = time.perf_counter()
    for h in ([] if only_ranks else chosen):
        t0 = time.perf_counter()
        try:
            problems = run_habit(h)
        except Exception as e:  # noqa: BLE001
            problems = [f"driver error: {type(e).__name__}: {e}"]
        dt = time.perf_counter() - t0
        results[h.id] = ["pass" if not problems else "FAIL: " + summarize(problems)]
        status = "pass" if not problems else "FAIL"
        print(f"{status}\t{h.id}\t{h.expect}\t{dt:.1f}s\t" + " | ".join(problems[:3]), flush=True)
    one = time.perf_counter() - total
    print(f"single process: {len(chosen)} habits in {one:.1f}s", flush=True)
    two = None
    if with_ranks or only_ranks:
        from tests.ranks import RankPool
        pool = RankPool(2)
        t1 = time.perf_counter()
        try:
            for h in chosen:
                if not h.ranks:
                    continue
                t0 = time.perf_counter()
                try:
                    got = pool.run(rank_habit, h.id, "grad_allreduce", timeout=timeout)
                    problems = [f"rank {r}: {p}" for r, ps in enumerate(got) for p in ps]
                except Exception as e:  # noqa: BLE001
                    problems = [f"driver error: {type(e).__name__}: {str(e)[:300]}"]
                    if not pool.alive:
                        pool = RankPool(2)
                results.setdefault(h.id, []).append(
                    "2 ranks: " + ("pass" if not problems else "FAIL: " + summarize(problems)))
                status = "pass" if not problems else "FAIL"
                print(f"{status}\t{h.id}@2ranks\t{h.expect}\t{time.perf_counter() - t0:.1f}s\t"
                      + " | ".join(problems[:3]), flush=True)
        finally:
            pool.close()
        two = time.perf_counter() - t1
        print(f"2 ranks: {sum(h.ranks for h in chosen)} habits in {two:.1f}s", flush=True)
    if report:
        with open(report, "w") as out:
            out.write(_report(chosen, results, one, two))


_INTRO = """# A bank of habits from real training scripts

`tests/habits.py` holds {n} habits taken from {sources} public repositories: what
a real training script does inside or around its step that a static program
could get wrong. Each is re-created in a few lines with a tiny model (the
`source` column names the repository, file and function or line; where the
package is not installed here, its lines are re-written faithfully;
transformers' models and helpers are used as they are). `tests/test_habits.py`
runs each for 4 calls: the transpiled step against the eager step in one
process, and the {ranked} marked for ranks also on 2 gloo ranks against the same
step with the model in torch DDP (its defaults). Before each call and each
between-calls action, torch, random and numpy are seeded alike for both runs.
What must be equal, bit for bit: what the step returns, every parameter, buffer
and `.grad`, `requires_grad` and `training` flags, optimizer, scaler and
scheduler state, the plain values and tensors on every object the script holds
(configs, EMA objects, caches, meters), and where torch's, Python's and numpy's
generators are left.

- **EQUAL**: trains bit for bit as eager (or DDP).
- **REFUSED**: `TranspileError` at the first call, naming the reason, with
  everything as it was before the call (a static program cannot be exact: a
  decision on a random value and a tensor's, a host counter the step uses as an
  index, a batch pulled inside the step).
- A **gap** is a habit that should train and does not yet: it must fail at its
  first call with nothing changed, and the gap names the missing piece.

The rule column is the mechanism of [the contract](contract.md) that covers the
habit. This page is written by `python -m tests.test_habits --ranks --report
docs/habits.md`; `pytest tests/test_habits.py` runs the same checks (the 2-rank
ones are marked slow).

"""


def _report(chosen, results, one: float, two: float | None) -> str:
    sources = {h.source.split()[0] for h in chosen}
    passed = sum(r[0] == "pass" for r in results.values() if r)
    text = _INTRO.format(n=len(chosen), sources=len(sources),
                         ranked=sum(h.ranks for h in chosen))
    text += (f"## Today's result\n\nOne process: {passed} of {len(chosen)} as expected "
             f"({one:.0f} s)")
    if two is not None:
        ranked = [r for rs in results.values() for r in rs[1:]]
        text += (f"; 2 ranks against DDP: {sum(r.endswith('pass') for r in ranked)} of "
                 f"{len(ranked)} ({two:.0f} s)")
    gaps = [(h.id, "one process", h.gap) for h in chosen if h.gap]
    gaps += [(h.id, "2 ranks", h.rank_gap) for h in chosen if h.ranks and h.rank_gap]
    text += (f". Gaps: {len(gaps)}.\n\n| habit | where | gap |\n|---|---|---|\n"
             + "".join(f"| `{i}` | {where} | {gap} |\n" for i, where, gap in gaps))
    text += ("\n## The bank\n\n| id | source | what it does | expectation | rule | today |\n"
             "|---|---|---|---|---|---|\n")
    for h in chosen:
        today = "<br>".join(results.get(h.id, ["not run"])).replace("|", "\\|")
        text += (f"| `{h.id}` | {h.source} | {h.what} | {h.expect}"
                 f"{' (gap)' if h.gap else ''}{' (gap on 2 ranks)' if h.rank_gap else ''}"
                 f" | {h.rule} | {today} |\n")
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
