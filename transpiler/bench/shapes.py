"""The bench's --varying-shapes workload: batches whose shapes change from call
to call, as when each batch is padded to its own longest sequence.

    python -m transpiler.bench --varying-shapes [--configs a,b,...] [--world-size 2]
                               [--steps 20] [--warmup 5] [--repeat 1]
                               [--json PATH] [--report PATH]

The workload (WORKLOAD): a 2-layer GPT from torch's own layers (bench.GPT:
token and position embeddings, causal pre-norm nn.TransformerEncoderLayers, an
output layer tied to the embedding; d_model 128, vocab 1000), AdamW (lr 0.01),
the bench's train_step, 12 calls over 10 distinct (batch per rank, length)
shapes (SHAPES). At each call every rank has the same shape and its own
tokens (its shard of a seeded global batch). Every configuration runs in
fresh rank processes of its own with a cold inductor cache of its own.
The configurations (VARYING_CONFIGS, by default; any of the bench's CONFIGS
with --configs; ddp always runs, as the reference):

    ddp                       torch DDP, eager: the reference
    ddp_compiled              torch.compile(DDP(model)): Dynamo's automatic
                              dynamic shapes (a dimension seen with a second
                              size is traced again as a symbol)
    fuse_all_reduce           transpile(step, mode="fuse_all_reduce"), eager
    fuse_all_reduce+inductor  the same, backend="inductor"

What is reported, per configuration:

- traces: how many times the step was traced. The transpiler: its
  TranspiledStep.traces; torch: Dynamo's counters["stats"]["unique_graphs"]
  (graphs it traced: the first, then one per recompile; 0 for eager DDP).
- compiles: how many programs were compiled. The transpiler: its
  TranspiledStep.compiles (the step's programs, each at its first run; under
  eager, made ready to run op by op); torch: counters["aot_autograd"]["total"]
  (graphs AOTAutograd compiled, each a forward and its backward; Dynamo's
  graph of DDP is split into one per gradient bucket: two here, as DDP's first
  bucket is small).
- calls_s: the 12 calls, each between dist.barrier()s, the slowest rank's
  time per call, summed. The first call includes building the step (DDP's
  construction with its broadcast, or transpile()).
- setup_s: the part of calls_s spent in the calls that built something: the
  first call and each call during which traces or compiles grew (on rank 0),
  each counted whole, its step included (a step at these shapes costs about
  step_ms, not subtracted).
- static_setup_s (transpiler only): one build, cold: the same configuration
  in fresh rank processes with a cold inductor cache, called only ever at the
  fixed shape (three calls), setup_s as above (the calls that built its
  static program: traced, and compiled); vs_one_build = setup_s /
  static_setup_s.
- loss_diff: the largest absolute difference of rank 0's 12 losses from
  ddp's: the results, which the parameters below a noise gradient (next) do
  not move.
- max_diff: the largest absolute difference of rank 0's parameters after the
  12 calls from ddp's (0.0: equal bit for bit); max_diff_at: the parameter
  it is in. Adam divides each gradient by its own magnitude, so a gradient that
  is zero but for rounding (attention's key bias: softmax ignores a shift)
  moves by about lr per step in a direction that rounding decides: any
  reordering of the arithmetic (a compiler's) shows there first.
- step_ms: then, at one fixed shape (Workload.fixed_shape, the last call's: no
  configuration builds anything for it), --warmup untimed and --steps timed
  calls, each between barriers: the median of the slowest rank's time.
- static_ms (transpiler only): the same timing of a fresh step of the same
  configuration (its own model, from the same initial weights) that only ever
  saw that shape, its calls interleaved with step_ms's (alternating which goes
  first); vs_static = step_ms / static_ms: what serving every shape costs at one.
- With --repeat R, the whole list of configurations runs R times, each time
  in fresh ranks with cold caches: step_ms, static_ms and vs_static are the
  medians over the rounds (vs_static of each round's own ratio: the two steps
  of a round share their processes); every other field is the first round's.

It reports; it asserts nothing about speed or counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import time

import torch
import torch.nn as nn

from transpiler.bench.bench import (CONFIGS, CUDA_ONLY, GPT, SEED_DATA, SEED_WEIGHTS,
                                    _between_barriers, _cold_inductor_cache, _names, _optimizer,
                                    _tokens, _transpiled_step, check_writable, parse_args, rounds,
                                    run_info, train_step, write_json)
from transpiler.bench.launch import BenchError, failure_text, run_ranks
from transpiler.bench.report import Row, Table, text, write_report
from transpiler.runtime.step import TranspiledStep

log = logging.getLogger("transpiler.bench")

# (batch per rank, sequence length) of each call: 12 calls, 10 distinct shapes.
SHAPES = ((8, 16), (8, 24), (8, 32), (6, 32), (8, 40), (4, 48), (8, 16), (6, 24), (8, 56),
          (4, 64), (8, 32), (6, 40))
VARYING_CONFIGS = ("ddp", "ddp_compiled", "fuse_all_reduce", "fuse_all_reduce+inductor")
REFERENCE = "ddp"
# Ten inductor compiles of the LM: 148 s of setup on 2 shared cores here, 567 s in issue 30.
TIMEOUT_S = 3600
FIXED_BATCHES = 4   # distinct batches the fixed-shape timing cycles through
COLUMNS = (("traces", "d"), ("compiles", "d"), ("calls_s", ".2f"), ("setup_s", ".2f"),
           ("static_setup_s", ".2f"), ("vs_one_build", ".2f"), ("loss_diff", ".2g"),
           ("max_diff", ".2g"), ("step_ms", ".2f"), ("static_ms", ".2f"), ("vs_static", ".3f"),
           ("max_diff_at", "s"))


@dataclasses.dataclass(frozen=True)
class Workload:
    """The language model and the shapes of its calls' batches."""
    shapes: tuple[tuple[int, int], ...]   # (batch per rank, length) of each call
    vocab: int = 1000
    d_model: int = 128
    nhead: int = 4
    layers: int = 2
    name: str = "gpt_2l"

    @property
    def fixed_shape(self) -> tuple[int, int]:
        return self.shapes[-1]

    def build(self) -> nn.Module:
        return GPT(vocab=self.vocab, d_model=self.d_model, nhead=self.nhead, layers=self.layers,
                   context=max(length for _, length in self.shapes))

    def batches(self, shapes, rank: int, world_size: int) -> list[tuple]:
        """This rank's shard of a seeded global batch of each shape."""
        g = torch.Generator().manual_seed(SEED_DATA)
        return [tuple(t.chunk(world_size)[rank]
                      for t in _tokens(self.vocab, length)(g, batch * world_size))
                for batch, length in shapes]


WORKLOAD = Workload(SHAPES)


@dataclasses.dataclass(frozen=True)
class ShapesJob:
    config: str
    workload: Workload
    warmup: int
    steps: int
    device: str = "cpu"   # bench._rank_main reads it
    static_only: bool = False   # only the calls at the fixed shape: one cold build


def transpiled(step) -> TranspiledStep | None:
    """The TranspiledStep a configuration's step calls; None for torch's."""
    inner = _transpiled_step(step)
    return inner if isinstance(inner, TranspiledStep) else None


def counts(step) -> tuple[int, int]:
    """(traces, compiles) so far: the transpiled step's own, else Dynamo's
    (process-wide: each configuration runs in processes of its own)."""
    ours = transpiled(step)
    if ours is not None:
        return ours.traces, ours.compiles
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"], counters["aot_autograd"]["total"]


def measure_shapes(job: ShapesJob, rank: int, world_size: int) -> dict:
    """One configuration on this rank: the calls over the workload's shapes,
    then the timing at its fixed shape; this rank's times, not yet combined."""
    workload, build = job.workload, CONFIGS[job.config]
    torch.manual_seed(SEED_WEIGHTS)
    model = workload.build()
    optimizer = _optimizer("adamw", model)
    step = None

    def call(batch):
        nonlocal step
        if step is None:   # building the step is part of the first call
            step = build(train_step, model, optimizer)
        return step(*batch)

    calls_s, built, losses = [], [], []
    shapes = [workload.fixed_shape] * 3 if job.static_only else workload.shapes
    for batch in workload.batches(shapes, rank, world_size):
        before = counts(step) if step is not None else None
        loss, seconds = _between_barriers(call, batch)
        calls_s.append(seconds)
        losses.append(float(loss.detach()))
        built.append(before is None or counts(step) != before)
    if job.static_only:
        return {"calls_s": calls_s, "built": built}
    traces, compiles = counts(step)
    params = ({name: p.detach().clone() for name, p in model.named_parameters()}
              if rank == 0 else None)

    fixed = workload.batches([workload.fixed_shape] * FIXED_BATCHES, rank, world_size)
    static = None
    if transpiled(step) is not None:
        torch.manual_seed(SEED_WEIGHTS)
        other = workload.build()
        static = build(train_step, other, _optimizer("adamw", other))
        static(*fixed[0])   # its trace and compile, untimed
    times: dict[str, list[float]] = {"step": [], "static": []}
    for i in range(job.warmup + job.steps):
        batch = fixed[i % len(fixed)]
        order = [("step", step), ("static", static)][::1 if i % 2 == 0 else -1]
        for name, fn in order:
            if fn is not None:
                elapsed = _between_barriers(fn, *batch)[1]
                if i >= job.warmup:
                    times[name].append(elapsed)
    return {"calls_s": calls_s, "built": built, "traces": traces, "compiles": compiles,
            "params": params, "losses": losses, "step_s": times["step"],
            "static_s": times["static"]}


def _slowest_median_ms(per_rank: list[list[float]]) -> float | None:
    slowest = [max(ts) for ts in zip(*per_rank)]
    return statistics.median(slowest) * 1e3 if slowest else None


def setup_seconds(per_rank: list[dict]) -> tuple[list[float], float]:
    """The slowest rank's time of each call, and the sum of those that built."""
    slowest = [max(ts) for ts in zip(*(r["calls_s"] for r in per_rank))]
    return slowest, sum(t for t, b in zip(slowest, per_rank[0]["built"]) if b)


def combine(per_rank: list[dict]) -> tuple[dict, dict[str, torch.Tensor]]:
    """The configuration's fields (max_diff, static_setup_s still None) and
    rank 0's parameters."""
    slowest, setup_s = setup_seconds(per_rank)
    step_ms = _slowest_median_ms([r["step_s"] for r in per_rank])
    static_ms = _slowest_median_ms([r["static_s"] for r in per_rank])
    first = per_rank[0]
    return {"traces": first["traces"], "compiles": first["compiles"],
            "calls_s": sum(slowest), "setup_s": setup_s, "static_setup_s": None,
            "vs_one_build": None, "loss_diff": None,
            "max_diff": None, "step_ms": step_ms, "static_ms": static_ms,
            "vs_static": step_ms / static_ms if static_ms else None,
            "max_diff_at": None, "losses": first["losses"]}, first["params"]


def max_difference(params: dict[str, torch.Tensor],
                   reference: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest absolute difference and the parameter it is in (None: all equal)."""
    diff, name = max((float((p - reference[name]).abs().max()), name)
                     for name, p in params.items())
    return diff, name if diff else None


def run_varying(workload: Workload, configs: list[str], *, world_size: int, steps: int,
                warmup: int, repeat: int = 1) -> dict[str, dict | str]:
    """Every configuration (the reference first) in fresh ranks, `repeat`
    rounds of the whole list: its fields (the first round's, but step_ms,
    static_ms and vs_static: their medians over the rounds), or the error
    text of its failure."""
    configs = [REFERENCE] + [c for c in configs if c != REFERENCE]
    out: dict[str, dict | str] = {}
    params: dict[str, dict[str, torch.Tensor]] = {}
    measured: dict[str, list[dict]] = {c: [] for c in configs}
    for r, config, tag in rounds(configs, repeat, lambda c: f"{workload.name} varying shapes {c}",
                                 lambda c: isinstance(out.get(c), str)):
        log.info("%s ...", tag)
        start = time.perf_counter()
        try:
            with _cold_inductor_cache():   # each run compiles cold
                fields, final = combine(run_ranks(
                    ShapesJob(config, workload, warmup, steps), world_size, measure_shapes,
                    TIMEOUT_S))
        except BenchError as exc:
            out[config] = failure_text(exc)
            log.error("%s %s", tag, out[config])
            continue
        measured[config].append(fields)
        if r == 1:
            out[config], params[config] = dict(fields), final
            if fields["static_ms"] is not None:   # the transpiler's: one cold build
                with _cold_inductor_cache():
                    _, one = setup_seconds(run_ranks(
                        ShapesJob(config, workload, warmup, steps, static_only=True),
                        world_size, measure_shapes, TIMEOUT_S))
                out[config].update(static_setup_s=one, vs_one_build=fields["setup_s"] / one)
        log.info("%s: %d traces, %d compiles, setup %.2fs, step %.2f ms%s (%.1fs in all)",
                 tag, fields["traces"], fields["compiles"], fields["setup_s"],
                 fields["step_ms"], "" if fields["vs_static"] is None
                 else f" ({fields['vs_static']:.3f}x static)", time.perf_counter() - start)
    for config, rounds_of in measured.items():
        if isinstance(out.get(config), dict):
            out[config].update({name: statistics.median(m[name] for m in rounds_of)
                                if rounds_of[0][name] is not None else None
                                for name in ("step_ms", "static_ms", "vs_static")})
    if REFERENCE in params:
        for config, p in params.items():
            out[config]["max_diff"], out[config]["max_diff_at"] = max_difference(
                p, params[REFERENCE])
            out[config]["loss_diff"] = max(abs(a - b) for a, b in zip(
                out[config]["losses"], out[REFERENCE]["losses"]))
    for fields in out.values():
        if isinstance(fields, dict):
            fields.pop("losses")
    return out


def table(workload: Workload, results: dict[str, dict | str]) -> Table:
    rows = tuple(Row((workload.name, config) + tuple(
                     "-" if r[name] is None else format(r[name], fmt) for name, fmt in COLUMNS))
                 if isinstance(r, dict) else Row((workload.name, config), r)
                 for config, r in results.items())
    return Table(("model", "config") + tuple(name for name, _ in COLUMNS), 2, rows)


def definitions(workload: Workload, world_size: int, steps: int, warmup: int,
                repeat: int = 1) -> list[str]:
    """What the fields are (printed above the table, listed in the report)."""
    return [
        f"workload: {workload.name}, AdamW, {world_size} ranks (gloo, CPU, 1 thread/rank), "
        f"{len(workload.shapes)} calls over {len(set(workload.shapes))} (batch per rank, "
        f"length) shapes: {' '.join(f'{b}x{n}' for b, n in workload.shapes)}",
        "traces, compiles: the transpiler's step.traces and step.compiles; torch: Dynamo's "
        "unique_graphs and AOTAutograd's compiled graphs (0: nothing compiled)",
        "calls_s: the calls, each between dist.barrier()s, slowest rank per call, summed (the "
        "first builds the step); setup_s: those of them that traced or compiled (the first "
        "included), each whole, its step included",
        "static_setup_s: one cold build: setup_s of the same config in fresh ranks with a cold "
        "inductor cache, called only at the fixed shape; vs_one_build = setup_s / "
        "static_setup_s",
        f"loss_diff: largest absolute difference of rank 0's losses over the calls from "
        f"{REFERENCE}'s; max_diff: of its parameters after the calls (0: bit for bit), in "
        "parameter max_diff_at (Adam moves a parameter whose gradient is rounding noise, such "
        "as attention's key bias, by about lr in a direction rounding decides)",
        f"step_ms: then at {'x'.join(map(str, workload.fixed_shape))} (the last call's shape), "
        f"median over {steps} timed steps (after {warmup} warm-up) of the slowest rank's time; "
        "static_ms: a fresh step of the same config that only saw that shape, interleaved; "
        "vs_static = step_ms / static_ms"
        + (f"; each the median of {repeat} rounds (fresh ranks, cold caches; the other fields "
           "from the first)" if repeat > 1 else ""),
    ]


NOT_APPLICABLE = ("models", "optimizer", "micro_batches", "nodes", "device", "plot")


def main(args: argparse.Namespace, argv: list[str], workload: Workload = WORKLOAD) -> int:
    """python -m transpiler.bench --varying-shapes: run, print, write --json and --report."""
    defaults = parse_args([])
    try:
        given = [f"--{n.replace('_', '-')}" for n in NOT_APPLICABLE
                 if getattr(args, n) != getattr(defaults, n)]
        if given:
            raise BenchError(f"--varying-shapes runs its own workload (AdamW, CPU): "
                             f"{', '.join(given)} do not apply to it")
        configs = (_names(args.configs, [c for c in CONFIGS if c not in CUDA_ONLY], "config")
                   if args.configs else list(VARYING_CONFIGS))
        if args.world_size < 1 or args.steps < 1 or args.warmup < 0 or args.repeat < 1:
            raise BenchError("need --world-size >= 1, --steps >= 1, --warmup >= 0 and "
                             "--repeat >= 1")
        check_writable(args.json, args.report)
    except BenchError as exc:
        log.error("error: %s", exc)
        return 2
    start = time.perf_counter()
    info = run_info(argv, args.world_size, 1, "adamw", "cpu")
    results = run_varying(workload, configs, world_size=args.world_size, steps=args.steps,
                          warmup=args.warmup, repeat=args.repeat)
    elapsed_s = time.perf_counter() - start
    lines = definitions(workload, args.world_size, args.steps, args.warmup, args.repeat)
    shown = table(workload, results)
    print("\n".join([f"# transpiler.bench --varying-shapes  {info.date}  torch {info.torch}  "
                     f"{info.machine_text()}"] + [f"# {line}" for line in lines]
                    + [text(shown)]), flush=True)
    log.info("bench finished in %.1fs", elapsed_s)
    if args.json:
        write_json(args.json, info, {workload.name: {c: r for c, r in results.items()
                                                     if isinstance(r, dict)}})
    if args.report:
        write_report(args.report, info, lines, [("Varying shapes", shown)], None,
                     "No plot: --varying-shapes draws none.", elapsed_s,
                     title="Performance with varying shapes")
    return 0 if all(isinstance(r, dict) for r in results.values()) else 1
