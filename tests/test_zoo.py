"""The architecture zoo (tests/zoo.py) on 2 gloo ranks against torch DDP with
its defaults, running the same step in the same processes: each rank its own
batches and its own dropout seeds, AdamW, 3 steps, then an evaluation forward
with the model (DDP's through its wrapper). A run's verdict:

- bit for bit: every loss (the evaluation's too), parameter and buffer equal
  to DDP's (eager);
- within 1e-5: the largest relative difference at most 1e-5 (inductor);
- as accurate: (inductor) further than 1e-5 from DDP, but as close to the
  exact result as DDP is: torch.compile's own accuracy rule
  (torch._dynamo.utils.same) against the same DDP run in float64;
- as torch.compile: (inductor) less accurate than DDP by that rule, and no
  further from DDP than torch.compile of the same DDP model (the peer whose
  kernels inductor generates too) trained in the same processes;
- refused: a TranspileError on the first call on both ranks, naming the user's
  line, with the model untouched (expected only where the entry says so);
- DIFFERS, CRASH, HANG: a silent difference, another exception, a rank that
  did not answer. Each fails the run.

`pytest tests/test_zoo.py` runs a sample of the catalogue (SAMPLE, marked slow);
`python -m tests.test_zoo [names...] [--report docs/zoo.md]` (`make zoo`) runs
every run of every architecture and writes the pass table.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import re
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import same
from torch.utils._python_dispatch import TorchDispatchMode
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import zoo
from transpiler import transpile
from transpiler.errors import TranspileError

STEPS = 3
# What a mode refuses by its contract (docs/contract.md): fsdp gathers the
# parameters with collectives before the forward, and a decision on a tensor
# value after a collective cannot be taken again by one rank alone.
# What a mode refuses by its contract: in fsdp, a decision after the first
# parameter gather; in both sharded modes, an update that reads a parameter the
# step wrote in full before it (docs/mode-zero.md)
_WRITTEN_PARAM = r"cannot run on shards of the gradients and parameters: it reads \w+, a full tensor"
LIMITS = {"fsdp": r"decides on a tensor value.* after program '\w+' has issued a collective|"
                  + _WRITTEN_PARAM,
          "zero": _WRITTEN_PARAM}
INDUCTOR_TOLERANCE = 1e-5
# A float64 run is a reference only if its first loss is this close to
# float32's (float64 draws other numbers than float32 from torch.randn).
REFERENCE_AGREES = 1e-4
aten = torch.ops.aten
EXACT, CLOSE, ACCURATE, REFUSED = "bit for bit", "within 1e-5", "as accurate", "refused"
AS_PEER = "as torch.compile"
DIFFERS, CRASH, HANG = "DIFFERS", "CRASH", "HANG"


@dataclasses.dataclass
class Outcome:
    verdict: str
    detail: str = ""
    first_call_s: float | None = None
    # torch.compile of the DDP model: its largest difference from eager DDP
    # (inductor runs further than 1e-5 from DDP)
    peer: float | None = None

    def expected(self, run: zoo.Run) -> bool:
        refused = run.arch.refused or LIMITS.get(run.mode)
        if refused is not None and self.verdict == REFUSED:
            return re.search(refused, self.detail) is not None
        if run.arch.refused is not None:
            return False
        return self.verdict in ((EXACT,) if run.backend == "eager" else
                                (EXACT, CLOSE, ACCURATE, AS_PEER))


def _train(arch: zoo.Arch, step, model, opt, rank: int,
           dtype=torch.float32) -> tuple[list[torch.Tensor], float]:
    """STEPS steps on this rank's batches (their floating tensors in dtype);
    the losses and the first call's time."""
    g = torch.Generator().manual_seed(1 + rank)
    losses, first_call_s = [], 0.0
    for i in range(STEPS):
        batch = _cast(arch.batch(g), dtype)
        torch.manual_seed(10 * i + rank)
        t0 = time.perf_counter()
        try:
            losses.append(step(model, opt, batch))
        except TranspileError as e:
            if i == 0:
                raise
            raise RuntimeError(f"refused at call {i}, after calls that trained: {e}") from e
        if i == 0:
            first_call_s = time.perf_counter() - t0
    return losses, first_call_s


def _cast(batch: dict, dtype: torch.dtype) -> dict:
    """The batch with its floating tensors in dtype."""
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in batch.items()}


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _largest_difference(ours: dict, theirs: dict) -> tuple[float, str]:
    """The largest relative difference and where it is."""
    worst, where = 0.0, ""
    for k, y in theirs.items():
        x = ours[k]
        if x.shape != y.shape:
            return float("inf"), f"{k}: shape {tuple(x.shape)} != {tuple(y.shape)}"
        if torch.equal(x, y):
            continue
        x, y = x.double(), y.double()
        d = ((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item()
        if not d <= worst:   # NaN counts as the largest
            worst, where = d, k
    return worst, where


def _with_losses(state: dict, losses: list[torch.Tensor]) -> dict:
    return {**state, **{f"loss {i}": l for i, l in enumerate(losses)}}


def _evaluated(arch: zoo.Arch, model, rank: int, dtype=torch.float32) -> dict:
    """The loss of an evaluation forward after the steps (eval mode, no
    gradient, a batch of this rank's; DDP's through its wrapper, which first
    broadcasts rank 0's buffers), then the model's state."""
    batch = _cast(arch.batch(torch.Generator().manual_seed(100 + rank)), dtype)
    model.eval()
    with torch.no_grad():
        loss = arch.loss_of(model, batch)
    model.train()
    module = model.module if isinstance(model, DDP) else model
    return {**_state(module), "evaluation loss": loss}


def rank_run(name: str, mode: str, backend: str) -> dict:
    """One run on this rank: the transpiled step, then DDP from the same start
    (and, for a compiler, DDP in float64: the reference of its accuracy)."""
    arch, rank = zoo.by_name(name), dist.get_rank()
    step = zoo.step_of(arch)

    torch.manual_seed(0)
    ours = arch.build()
    theirs, peer = copy.deepcopy(ours), copy.deepcopy(ours)
    exact = copy.deepcopy(ours).double()
    before = _state(ours)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, theirs, exact)]
    unused = arch.find_unused and mode in ("grad_allreduce", "fuse_all_reduce")
    transpiled = transpile(step, mode=mode, backend=backend, find_unused_parameters=unused)
    try:
        losses, first_call_s = _train(arch, transpiled, ours, opts[0], rank)
    except TranspileError as e:
        untouched, where = _largest_difference(_state(ours), before)
        return dict(refused=str(e), untouched=untouched == 0.0, where=where)
    with transpiled.unsharded() if mode == "fsdp" else contextlib.nullcontext():
        mine = _evaluated(arch, ours, rank)
    ddp = DDP(theirs, find_unused_parameters=arch.find_unused)
    ddp_losses, _ = _train(arch, step, ddp, opts[1], rank)
    mine, reference = _with_losses(mine, losses), _with_losses(_evaluated(arch, ddp, rank),
                                                               ddp_losses)
    worst, where = _largest_difference(mine, reference)
    answer = dict(worst=worst, where=where, first_call_s=first_call_s, accurate=None, peer=None)
    if backend != "eager" and worst > INDUCTOR_TOLERANCE:
        answer["accurate"] = _as_accurate(arch, exact, opts[2], rank, mine, reference)
        answer["peer"] = _compiled_worst(arch, peer, rank, reference)
    return answer


def _compiled_worst(arch: zoo.Arch, model, rank: int,
                    reference: dict) -> tuple[float, str] | None:
    """torch.compile of the DDP model (inductor), trained and evaluated as the
    others: its largest relative difference from eager DDP, and where (None
    where torch.compile fails on the model)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ddp = DDP(model, find_unused_parameters=arch.find_unused)
    # the rank processes serve every run: without a reset, dynamo's recompile
    # limit, reached by earlier architectures, would run this one eagerly
    torch._dynamo.reset()
    try:
        losses, _ = _train(arch, zoo.step_of(arch), torch.compile(ddp), opt, rank)
    except Exception:  # noqa: BLE001 - no peer to compare with
        return None
    return _largest_difference(_with_losses(_evaluated(arch, ddp, rank), losses), reference)


def _as_accurate(arch: zoo.Arch, exact, opt, rank: int, mine: dict, reference: dict) -> str:
    """Whether every loss, parameter and buffer of ours is as close to the
    float64 run's as DDP's float32 one is, by torch.compile's own accuracy rule
    (torch._dynamo.utils.same: RMSE from float64 at most 2-3x DDP's, plus
    1e-6); the first that is not, or why there is no reference."""
    try:
        with Float32Draws():
            ddp = DDP(exact, find_unused_parameters=arch.find_unused)
            losses, _ = _train(arch, zoo.step_of(arch), ddp, opt, rank, torch.float64)
            exact_state = _with_losses(_evaluated(arch, ddp, rank, torch.float64), losses)
    except Exception as e:  # noqa: BLE001 - a model that cannot run in float64
        return f"no float64 reference ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
    first = abs(exact_state["loss 0"].item() - reference["loss 0"].item())
    if not first <= REFERENCE_AGREES * abs(reference["loss 0"].item()):
        return f"no float64 reference (its first loss is {first:.1e} off float32's)"
    for k, y in reference.items():
        if torch.is_floating_point(y) and not same(y, mine[k], exact_state[k],
                                                   tol=INDUCTOR_TOLERANCE, log_error=_quiet):
            return f"less accurate than DDP at {k}"
    return ""


def _quiet(*args) -> None:
    pass


# Random ops whose float64 numbers are not float32's (a drop path's torch.rand,
# a noise's randn): the float64 run draws them in float32, exactly representable.
_DRAWS = {aten.rand.default, aten.rand.generator, aten.rand_like.default, aten.randn.default,
          aten.randn.generator, aten.randn_like.default, aten.uniform_.default,
          aten.normal_.default, aten.exponential_.default}


class Float32Draws(TorchDispatchMode):
    """The float64 reference draws the float32 run's random numbers."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        wide = [a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.float64]
        if func not in _DRAWS or not (wide or kwargs.get("dtype") == torch.float64):
            return func(*args, **kwargs)
        if kwargs.get("dtype") == torch.float64:
            kwargs["dtype"] = torch.float32
        narrow = [a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.float64 else a
                  for a in args]
        out = func(*narrow, **kwargs)
        if func._schema.is_mutable:   # an in-place fill: into the float64 tensor
            return args[0].copy_(narrow[0])
        return out.double()


def outcome_of(run: zoo.Run, got: list[dict]) -> Outcome:
    """The verdict from every rank's answer."""
    refused = [g for g in got if "refused" in g]
    if refused:
        if len(refused) < len(got):
            return Outcome(CRASH, f"refused on {len(refused)} of {len(got)} ranks: "
                                  f"{refused[0]['refused']}")
        touched = [g["where"] for g in refused if not g["untouched"]]
        if touched:
            return Outcome(CRASH, f"refused after writing {touched[0]}: {refused[0]['refused']}")
        return Outcome(REFUSED, refused[0]["refused"])
    worst, where = max(((g["worst"], g["where"]) for g in got),
                       key=lambda w: float("inf") if w[0] != w[0] else w[0])   # NaN largest
    first_call_s = max(g["first_call_s"] for g in got)
    if worst == 0.0:
        return Outcome(EXACT, first_call_s=first_call_s)
    if run.backend != "eager" and worst <= INDUCTOR_TOLERANCE:
        return Outcome(CLOSE, f"{worst:.1e} at {where}", first_call_s)
    inaccurate = [g["accurate"] for g in got if g["accurate"] != ""]
    peers = [g["peer"] for g in got if g["peer"] is not None]
    peer = max(peers) if peers else None
    versus = f"{worst:.1e} from DDP at {where}" + \
        (f"; torch.compile's {peer[0]:.1e} at {peer[1]}" if peer is not None else "")
    if run.backend != "eager" and not inaccurate:
        return Outcome(ACCURATE, versus, first_call_s, peer=peer and peer[0])
    if run.backend != "eager" and peer is not None and worst <= peer[0]:
        return Outcome(AS_PEER, versus, first_call_s, peer=peer[0])
    why = f"; {inaccurate[0]}" if inaccurate and inaccurate[0] else ""
    return Outcome(DIFFERS, f"{worst:.3g} at {where}{why}", first_call_s)


def run_on(pool, run: zoo.Run, timeout: float) -> Outcome:
    try:
        got = pool.run(rank_run, run.arch.name, run.mode, run.backend, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - a verdict, reported
        text = str(e)
        if "did not answer" in text:
            return Outcome(HANG, text.splitlines()[0])
        return Outcome(CRASH, _last_error_line(text))
    return outcome_of(run, got)


def _last_error_line(text: str) -> str:
    """The exception's own line from a rank's traceback."""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else text


# ----------------------------------------------------------------- the sample

# (seq2seq_gru, whose inductor run compiled for 40 s, runs in `make zoo`; the
# recurrent layers under inductor are tests/test_recurrent.py's)
# olmoe: experts of fp32 aten._grouped_mm, whose meta function refuses what the
# CPU kernel computes (inductor's compile crashed on 2 ranks)
SAMPLE = ["gpt2", "whisper", "wav2vec2", "qwen2_moe", "olmoe", "word_language_model",
          "lstm_classifier"]


def _sample_runs() -> list[zoo.Run]:
    return [r for r in zoo.runs_of(zoo.catalogue()) if r.arch.name in SAMPLE]


@pytest.mark.skipif(zoo.T is None, reason="transformers is not installed")
@pytest.mark.parametrize("run", _sample_runs(), ids=lambda r: f"{r.arch.name}-{r.mode}-{r.backend}")
def test_zoo_sample_equals_ddp(run, ranks2):
    outcome = run_on(ranks2, run, timeout=300)
    assert outcome.expected(run), f"{outcome.verdict}: {outcome.detail}"


# ----------------------------------------------------------------- the report

def main(argv: list[str]) -> int:
    """Every run of the named architectures (all by default), one line each;
    --report FILE writes the pass table. Exits 1 if any run is not as expected."""
    logging.basicConfig(level=logging.WARNING)
    report = argv[argv.index("--report") + 1] if "--report" in argv else None
    names = [a for a in argv if not a.startswith("--") and a != report]
    archs = [a for a in zoo.catalogue() if not names or a.name in names]
    from tests.ranks import RankPool
    pool = RankPool(2)
    results: list[tuple[zoo.Run, Outcome]] = []
    total = time.perf_counter()
    try:
        for run in [r for r in zoo.runs_of(zoo.catalogue()) if not names or r.arch.name in names]:
            t0 = time.perf_counter()
            outcome = run_on(pool, run, timeout=600)
            if not pool.alive or outcome.verdict == CRASH:
                # a crash can abandon the job (runtime/rebuild.py): its communicators
                # are shut down and every later step in those processes would raise
                pool.close(kill=True)
                pool = RankPool(2)
            results.append((run, outcome))
            mark = "ok" if outcome.expected(run) else "FAIL"
            print(f"{mark}\t{run.arch.name}\t{run.mode}\t{run.backend}\t{outcome.verdict}\t"
                  f"{time.perf_counter() - t0:.1f}s\t{outcome.detail[:200]}", flush=True)
    finally:
        pool.close()
    elapsed = time.perf_counter() - total
    if report:
        with open(report, "w") as out:
            out.write(_report(archs, results, elapsed))
    return 0 if all(o.expected(r) for r, o in results) else 1


_INTRO = """# The architecture zoo

`tests/zoo.py` holds {n} architectures: real model code from transformers{extra}
(small configs, random weights, dropout on, train mode), each computing its own
loss. `tests/test_zoo.py` runs each on 2 gloo ranks against torch DDP with its
defaults (`find_unused_parameters=True` where an expert can go without tokens),
running the same step in the same processes: each rank its own batches and
dropout seeds, AdamW, {steps} steps. fuse_all_reduce in eager runs for every
architecture, zero and fsdp for every third, fuse_all_reduce under inductor for
every third.

- **bit for bit**: every loss, parameter and buffer equal to DDP's.
- **within 1e-5**: inductor's kernels round differently; the largest relative
  difference from DDP at most 1e-5.
- **as accurate**: further from DDP than 1e-5, but as close to the exact
  result as DDP is, by torch.compile's own accuracy rule
  (`torch._dynamo.utils.same`): each loss, parameter and buffer at most 2-3x
  DDP's RMSE from the same DDP run in float64, plus 1e-6. AdamW turns a
  gradient that is rounding noise (an attention key's bias, which softmax
  cancels; a bias before a BatchNorm) into a step of about lr whose sign the
  rounding decides, in float64 too. The note gives the largest difference,
  and torch.compile's of the same DDP model.
- **as torch.compile**: less accurate than that, and no further from DDP than
  `torch.compile` of the same DDP model, trained in the same processes: what
  inductor's own kernels do to the model (a BatchNorm over two values per
  channel: eager's bias gradient is exactly 0, inductor's 1e-10, which AdamW
  makes a step of lr / 100).
- **refused**: a `TranspileError` at the first call on both ranks, naming the
  user's line, nothing written; the entry says why, or the mode refuses it by
  its contract (fsdp: a decision on a tensor value after its first all-gather).
- **DIFFERS**, **CRASH**, **HANG**: a silent difference, another exception, a
  rank that did not answer.

The first call's time is the trace, the passes and (inductor) the compile, on
this machine's CPU, slowest rank. This page is written by `make zoo`
(`python -m tests.test_zoo --report docs/zoo.md`); `make test` runs a sample.

"""


def _report(archs: list[zoo.Arch], results: list[tuple[zoo.Run, Outcome]],
            elapsed: float) -> str:
    extra = "" if all(a.source.startswith("transformers") for a in archs) else \
        ", diffusers and torch's own layers"
    text = _INTRO.format(n=len(archs), extra=extra, steps=STEPS)
    text += "## Today's result\n\n| backend | runs | bit for bit | within 1e-5 | as accurate | " \
            "as torch.compile | refused | not as expected |\n|---|---|---|---|---|---|---|---|\n"
    for backend in ("eager", "inductor"):
        mine = [(r, o) for r, o in results if r.backend == backend]
        if not mine:
            continue
        count = {v: sum(o.verdict == v for _, o in mine)
                 for v in (EXACT, CLOSE, ACCURATE, AS_PEER, REFUSED)}
        bad = sum(not o.expected(r) for r, o in mine)
        text += (f"| {backend} | {len(mine)} | {count[EXACT]} ({count[EXACT] / len(mine):.0%}) | "
                 f"{count[CLOSE]} | {count[ACCURATE]} | {count[AS_PEER]} | {count[REFUSED]} | "
                 f"{bad} |\n")
    far = [o for r, o in results if r.backend != "eager" and o.peer is not None]
    if far:
        text += (f"\nOf the {len(far)} inductor runs further than 1e-5 from DDP, "
                 f"torch.compile of the same DDP model, trained in the same processes, is "
                 f"further than 1e-5 from DDP in {sum(o.peer > INDUCTOR_TOLERANCE for o in far)} "
                 f"(the notes give both distances).\n")
    text += f"\n{len(results)} runs in {elapsed / 60:.0f} min.\n\n"
    text += ("## Every run\n\n| architecture | kind | mode | backend | verdict | first call | "
             "features | note |\n|---|---|---|---|---|---|---|---|\n")
    for run, o in results:
        note = (run.arch.why or o.detail) if o.verdict == REFUSED and o.expected(run) \
            else o.detail
        note = note.splitlines()[0][:160].replace("|", "\\|") if note else ""
        verdict = o.verdict if o.expected(run) else f"**{o.verdict}**"
        first = f"{o.first_call_s:.1f} s" if o.first_call_s is not None else "–"
        text += (f"| `{run.arch.name}` | {run.arch.kind.value} | {run.mode} | {run.backend} | "
                 f"{verdict} | {first} | {', '.join(run.arch.features)} | {note} |\n")
    return text


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
