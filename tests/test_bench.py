"""The benchmark runs end to end and writes well-formed results. It checks the
shape of the output, never the speed."""

import dataclasses
import importlib.util
import json
import math
import os
import re
import signal
import statistics
import pathlib
import subprocess
import sys

import pytest
import torch

from transpiler import TranspileError
from transpiler.bench import bench, cli, launch, shapes as bench_shapes, timeline
from transpiler.bench.report import Row, Table, markdown, text

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One run of the bench's command line on 2 ranks, with every output: the
    tests below read its JSON, report, plot and printout."""
    d = tmp_path_factory.mktemp("bench")
    report, out, png = (d / f"performance.{ext}" for ext in ("md", "json", "png"))
    proc = subprocess.run(
        [sys.executable, "-m", "transpiler.bench", "--world-size", "2", "--models", "deep",
         "--steps", "2", "--warmup", "1", "--configs",
         "local,ddp,fsdp2,grad_allreduce,local_sgd",
         "--json", str(out), "--report", str(report), "--plot", str(png)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, report, out, png


def test_bench_cli_writes_json(cli_run):
    proc, _, out, _ = cli_run
    assert "grad_allreduce" in proc.stdout and "step_ms" in proc.stdout
    assert "[1/6] deep local" in proc.stderr

    doc = json.loads(out.read_text())
    assert doc["world_size"] == 2
    assert isinstance(doc["torch"], str) and doc["torch"]
    assert list(doc["models"]) == ["deep"]
    # The references of vs_ddp and vs_limit are always run.
    results = doc["models"]["deep"]
    assert set(results) == {"local", "allreduce_only", "ddp", "fsdp2", "grad_allreduce",
                            "local_sgd"}
    for config, fields in results.items():
        split = fields.pop("setup_split", None)
        by_program = fields.pop("program_ms", None)
        # a schedule of several programs (local SGD's) is timed by program too
        assert (by_program is not None) == (config in bench.PERIOD), config
        assert by_program is None or set(by_program) == {"local", "sync"}, config
        assert set(fields) == set(bench.FIELDS), config
        assert fields.pop("peak_device_mb") is None, config   # measured on CUDA only
        for name, value in fields.items():
            # allreduce_only runs no optimizer: it holds no state; local sends nothing;
            # fsdp2's sent bytes are not counted.
            if (name, config) == ("sent_mb", "fsdp2"):
                assert value is None
                continue
            positive = value > 0 or (name, config) in (("opt_state_mb", "allreduce_only"),
                                                       ("sent_mb", "local"))
            assert isinstance(value, float) and math.isfinite(value) and positive, \
                (config, name, value)
        # The transpiler's setup by phase, which adds up to its setup_s.
        assert (split is not None) == (config in ("grad_allreduce", "local_sgd")), config
        if split:
            assert set(split) == set(bench.SETUP_PHASES), config
            assert split["trace"] > 0 and split["passes"] > 0 and split["agreement"] > 0
            assert sum(split.values()) <= fields["setup_s"] * 1.01, (config, split)
    assert results["ddp"]["vs_ddp"] == 1.0
    # Counted from the programs' collectives, the gradients all-reduced send what
    # DDP's all-reduce of every gradient does; local SGD, once per period of 8.
    sent = results["ddp"]["sent_mb"]
    assert math.isclose(results["grad_allreduce"]["sent_mb"], sent, rel_tol=1e-9)
    assert math.isclose(results["local_sgd"]["sent_mb"], sent / bench.LOCAL_SGD_K, rel_tol=1e-9)
    # Every rank holds all the parameters and the momentum (64 x 64 + 64 weights and biases,
    # then 10 x 64 + 10), but FSDP2 half of each: deep's rows split evenly, no padding.
    full = (64 * (64 * 64 + 64) + 10 * 64 + 10) * 4 / 2**20
    for config in ("local", "ddp", "grad_allreduce", "local_sgd"):
        assert results[config]["param_mb"] == full, config
        assert results[config]["opt_state_mb"] == full, config
    assert results["fsdp2"]["param_mb"] == results["fsdp2"]["opt_state_mb"] == full / 2
    assert "setup_s of the transpiler by phase" in proc.stdout


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, caplog, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)    # import matplotlib fails
    code = cli.main(["--models", "deep", "--configs", "local",
                       "--plot", str(tmp_path / "bench.png")])
    assert code != 0
    assert "pip install -e .[bench]" in caplog.text
    assert not (tmp_path / "bench.png").exists()


def test_unknown_config_is_an_error(caplog):
    assert cli.main(["--configs", "local,nope"]) == 2
    assert "nope" in caplog.text


def test_report_into_a_missing_directory_is_an_error_before_the_run(caplog, tmp_path):
    report = tmp_path / "nowhere" / "performance.md"
    assert cli.main(["--models", "deep", "--configs", "local", "--report", str(report)]) == 2
    assert "its directory does not exist" in caplog.text
    assert "deep local" not in caplog.text       # no configuration ran


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_bench_report_is_the_run_it_printed(cli_run):
    proc, report, out, png = cli_run
    doc = json.loads(out.read_text())
    lines = report.read_text().splitlines()
    assert lines[0].startswith("<!-- Generated by") and "do not edit by hand" in lines[0]

    # The run, as the JSON of the same run recorded it.
    run = doc["run"]
    assert run["command"].startswith("python -m transpiler.bench --world-size 2 --models deep ")
    assert f"- Command: `{run['command']}`" in lines
    assert (f"- Machine: {run['platform']} ({run['machine']}, {run['cpus']} CPUs, "
            f"load average {run['load']:.2f} at start)") in lines
    assert f"- torch {torch.__version__}" in lines and run["torch"] == torch.__version__
    assert "- Device: cpu; gloo, CPU, 1 thread/rank" in lines
    assert any(line.startswith(f"- Date: {run['date']}") for line in lines)

    # The tables: the JSON's values rounded as printed, and the printed rows themselves.
    results = doc["models"]["deep"]
    rows = [_cells(line) for line in lines if line.startswith("| deep |")]
    steps = {r[1]: r for r in rows if len(r) == 2 + len(bench.STEP_COLUMNS)}
    assert list(steps) == ["local", "allreduce_only", "ddp", "fsdp2", "grad_allreduce",
                           "local_sgd"]
    assert set(steps) == set(results)
    for config, fields in results.items():
        assert steps[config][2] == f"{fields['step_ms']:.2f}", config
        assert steps[config][3] == f"{fields['vs_ddp']:.2f}", config
        assert steps[config][-1] == f"{fields['setup_s']:.2f}", config
    setup = [r for r in rows if len(r) == 3 + len(bench.SETUP_PHASES)]
    assert setup == [["deep", config, f"{results[config]['setup_s']:.2f}"]
                     + [f"{results[config]['setup_split'][p]:.2f}" for p in bench.SETUP_PHASES]
                     for config in ("grad_allreduce", "local_sgd")]
    printed = [line.split() for line in proc.stdout.splitlines() if line.startswith("deep ")]
    assert printed == rows

    # The plot, or why there is none; the definitions the bench printed above its table.
    if importlib.util.find_spec("matplotlib") is None:
        assert "No plot: matplotlib is not installed (pip install -e .[bench])." in lines
        assert not png.exists()
    else:
        assert "![step time of each configuration](performance.png)" in lines
        assert png.exists()
    definitions = lines[lines.index("## Fields") + 2:]
    header = [line for line in proc.stdout.splitlines() if line.startswith("# ")][1:6]
    assert definitions == ["- " + h[2:] for h in header]
    assert definitions[0].startswith("- step_ms: median over 2 timed steps (after 1 warm-up)")


def test_report_tables_show_failures():
    table = Table(("model", "config", "step_ms"), 2,
                  (Row(("deep", "ddp", "5.00")), Row(("deep", "zero"), "FAILED: rank 1 failed: a | b")))
    assert markdown(table).splitlines() == [
        "| model | config | step_ms |", "| --- | --- | --: |", "| deep | ddp | 5.00 |",
        "| deep | zero | FAILED: rank 1 failed: a \\| b |"]
    assert text(table).splitlines() == [
        "model config step_ms", "deep  ddp       5.00", "deep  zero   FAILED: rank 1 failed: a | b"]


def test_default_configs_and_all():
    assert bench._configs(bench.parse_args([])) == list(bench.DEFAULT_CONFIGS)
    cpu = bench._configs(bench.parse_args(["--configs", "all"]))
    assert cpu == [c for c in bench.CONFIGS if c not in bench.CUDA_ONLY]
    assert set(bench.DEFAULT_CONFIGS) < set(cpu)
    # The report's set shows torch's ways, the limits and every mode side by side.
    assert {"local", "allreduce_only", "ddp", "ddp_compiled", "ddp_zero_redundancy", "fsdp2"} \
        <= set(bench.DEFAULT_CONFIGS)
    assert set(bench.MODES) <= set(bench.DEFAULT_CONFIGS)


def test_fsdp2_blocks_leave_tied_parameters_to_the_root():
    lm = bench.TransformerLM()
    assert bench.fsdp2_blocks(lm) == list(lm.blocks)      # embed and out share a weight
    gpt = bench.GPT(layers=2)
    assert bench.fsdp2_blocks(gpt) == [gpt.position, *gpt.blocks, gpt.norm]
    mlp = bench.MLP([4, 3, 2])
    assert bench.fsdp2_blocks(mlp) == list(mlp.layers)


# Rows 7 and 5 are odd: on 2 ranks FSDP2 pads each to an even count.
SMALL = bench.ModelSpec(lambda: bench.MLP([9, 7, 5]), bench._features(9, 5), 4)


def rank_fsdp2_and_ddp(steps):
    """The bench's ddp and fsdp2 configs, each from the same seeded weights on
    the same batches: the full parameters after `steps` steps, the bytes of
    parameters and optimizer state this rank holds."""
    import torch.distributed as dist
    out = {}
    batches = bench.rank_batches(SMALL, steps, dist.get_rank(), dist.get_world_size())
    for config in ("ddp", "fsdp2"):
        torch.manual_seed(bench.SEED_WEIGHTS)
        model = SMALL.build()
        step = bench.CONFIGS[config](bench.train_step, model, bench._optimizer("sgd", model))
        for batch in batches:
            step(*batch)
        params = [p.detach().full_tensor() if isinstance(p, bench.DTensor)
                  else p.detach().clone() for p in model.parameters()]
        out[config] = (params, bench.param_bytes(model), bench._state_bytes(step.args[-1]))
    return out


def test_fsdp2_trains_as_ddp_and_holds_half_the_parameters(ranks2):
    results = ranks2.run(rank_fsdp2_and_ddp, 3)
    shapes = [(7, 9), (7,), (5, 7), (5,)]
    full = sum(math.prod(s) for s in shapes) * 4
    # FSDP2's shard of each parameter is ceil(rows / 2) rows on every rank (padded).
    shard = sum(math.ceil(s[0] / 2) * math.prod(s[1:]) for s in shapes) * 4
    assert full / 2 < shard <= full / 2 + sum(math.prod(s[1:]) for s in shapes) * 4
    for out in results:
        ddp, fsdp2 = out["ddp"], out["fsdp2"]
        assert [tuple(p.shape) for p in ddp[0]] == shapes
        for ours, ref in zip(fsdp2[0], ddp[0]):
            torch.testing.assert_close(ours, ref)            # float rounding: fp32 defaults
        assert ddp[1:] == (full, full)
        assert fsdp2[1] == shard
    # Momentum: rank 0 holds the ceil(rows / 2) rows, rank 1 the rest (no padding).
    assert [out["fsdp2"][2] for out in results] == [shard, full - shard]
    torch.manual_seed(bench.SEED_WEIGHTS)
    initial = list(SMALL.build().parameters())
    assert all(not torch.equal(p, q) for p, q in zip(results[0]["ddp"][0], initial))  # trained


def test_a_transpiler_config_is_listed_only_with_its_mode(monkeypatch):
    assert ("fsdp" in bench.CONFIGS) == ("fsdp" in bench.MODES)
    # (transpiler.MODES itself is left as it is: its order is the modes' order)
    monkeypatch.setattr(bench, "MODES", {k: v for k, v in bench.MODES.items() if k != "zero"})
    assert bench._transpiled("zero") is None


def test_micro_batched_step_takes_the_whole_batch_step():
    """--micro-batches k: backward() on each k-th of the batch, one update,
    which for equal parts is the one-batch step up to rounding."""
    torch.manual_seed(0)
    spec = bench.MODELS["wide"]
    models = [spec.build() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    before = [p.detach().clone() for p in models[0].parameters()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    inputs, targets = spec.make_batch(torch.Generator().manual_seed(1), 8)
    whole = bench.train_step(models[0], opts[0], inputs, targets)
    parts = bench.accumulating(4, "cpu")(models[1], opts[1], inputs, targets)
    assert torch.allclose(whole, parts, rtol=1e-5)
    for p, q, old in zip(models[0].parameters(), models[1].parameters(), before):
        assert not torch.equal(p, old)      # one update was taken ...
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)   # ... the same one


# 4 calls over 3 shapes of a 1-layer LM: the --varying-shapes workload, small.
TINY_SHAPES = bench_shapes.Workload(((2, 4), (2, 6), (3, 6), (2, 4)), vocab=32, d_model=16,
                                    nhead=2, layers=1, name="tiny")


def test_varying_shapes_counts_builds_and_checks_against_ddp(tmp_path, capsys, monkeypatch):
    out, report = tmp_path / "shapes.json", tmp_path / "shapes.md"
    argv = ["--varying-shapes", "--configs", "fuse_all_reduce", "--steps", "2", "--warmup", "1",
            "--repeat", "2", "--json", str(out), "--report", str(report)]
    rounds = []   # each round's fields, as combine() returns them
    combine = bench_shapes.combine
    monkeypatch.setattr(bench_shapes, "combine",
                        lambda per_rank: rounds.append(combine(per_rank)) or rounds[-1])
    assert bench_shapes.main(bench.parse_args(argv), argv, TINY_SHAPES) == 0
    results = json.loads(out.read_text())["models"]["tiny"]
    assert list(results) == ["ddp", "fuse_all_reduce"]     # the reference always runs first
    ddp, ours = results["ddp"], results["fuse_all_reduce"]
    assert set(ours) == {name for name, _ in bench_shapes.COLUMNS}
    assert (ddp["traces"], ddp["compiles"]) == (0, 0)       # eager DDP compiles nothing
    # Traced at the first call, then once with symbolic dimensions at the first change.
    assert (ours["traces"], ours["compiles"]) == (2, 2), ours
    # The transpiled eager step trains exactly as DDP, bit for bit, whatever the shapes.
    assert ours["max_diff"] == 0.0 and ddp["max_diff"] == 0.0
    assert ours["loss_diff"] == 0.0 and ddp["loss_diff"] == 0.0
    assert ours["static_setup_s"] > 0 and ddp["static_setup_s"] is None
    assert math.isclose(ours["vs_one_build"], ours["setup_s"] / ours["static_setup_s"])
    assert ours["max_diff_at"] is None and ddp["max_diff_at"] is None
    for fields in results.values():
        assert 0 < fields["setup_s"] <= fields["calls_s"] and fields["step_ms"] > 0
    # Only the transpiler's configurations are timed against a step built for one shape.
    assert ddp["static_ms"] is None and ddp["vs_static"] is None
    # Rounds: ddp, fuse_all_reduce, ddp, fuse_all_reduce. Times are the medians
    # of the rounds, vs_static the median of each round's own ratio.
    assert len(rounds) == 4
    for name in ("step_ms", "static_ms"):
        assert math.isclose(ours[name], statistics.median(r[0][name] for r in rounds[1::2]))
    assert math.isclose(ours["vs_static"], statistics.median(
        r[0]["step_ms"] / r[0]["static_ms"] for r in rounds[1::2]))
    # The report's table is the printed one.
    rows = [_cells(line) for line in report.read_text().splitlines()
            if line.startswith("| tiny |")]
    printed = [line.split() for line in capsys.readouterr().out.splitlines()
               if line.startswith("tiny ")]
    assert rows == printed and [r[1] for r in rows] == ["ddp", "fuse_all_reduce"]
    assert rows[1][2:4] == [str(ours["traces"]), str(ours["compiles"])]


def test_varying_shapes_refuses_the_options_of_the_other_workloads(caplog):
    assert cli.main(["--varying-shapes", "--micro-batches", "2", "--models", "deep"]) == 2
    assert "--models, --micro-batches do not apply" in caplog.text
    assert "varying shapes" not in caplog.text     # nothing ran


def test_max_difference_names_the_parameter_it_is_in():
    reference = {"a": torch.zeros(3), "b": torch.zeros(2)}
    ours = {"a": torch.tensor([0.0, 1e-3, 0.0]), "b": torch.tensor([0.0, -0.5])}
    assert bench_shapes.max_difference(ours, reference) == (0.5, "b")
    assert bench_shapes.max_difference(reference, reference) == (0.0, None)


def test_rounds_run_the_whole_list_each_round_without_what_failed():
    failed = set()
    seen = []
    for r, item, tag in bench.rounds(["a", "b", "c"], 2, str.upper, failed.__contains__):
        seen.append((r, item, tag))
        if item == "b":
            failed.add("b")     # fails in round 1: not run again
    assert seen == [(1, "a", "[1/3] round 1/2 A"), (1, "b", "[2/3] round 1/2 B"),
                    (1, "c", "[3/3] round 1/2 C"), (2, "a", "[1/3] round 2/2 A"),
                    (2, "c", "[3/3] round 2/2 C")]
    assert [tag for _, _, tag in bench.rounds(["a"], 1, str, lambda _: False)] == ["[1/1] a"]


def test_failure_text_is_the_first_and_last_line_once():
    assert launch.failure_text(launch.BenchError("rank 1 failed:\n  trace\nValueError: x")) == \
        "FAILED: rank 1 failed: ValueError: x"
    assert launch.failure_text(launch.BenchError("one line")) == "FAILED: one line"
    assert launch.failure_text(launch.Refused("by the transpiler on rank 0:\n  trace\n"
                                              "TranspileError: use x")) == \
        "refused: by the transpiler on rank 0: TranspileError: use x"


@dataclasses.dataclass(frozen=True)
class _Job:
    device: str = "cpu"
    how: str = "ok"


def _fails(job, rank, world_size):
    """Rank 0 fails as `job.how` says; rank 1 then waits on it in a collective."""
    if rank == 0:
        if job.how == "dies":
            os.kill(os.getpid(), signal.SIGKILL)
        if job.how == "refused":
            raise TranspileError("mode m refuses this step: use mode n")
        if job.how == "raises":
            raise ValueError("the cause")
    torch.distributed.barrier()
    return {"rank": rank, "t": torch.ones(2) * rank}


@pytest.mark.slow
@pytest.mark.parametrize("how, cell", [
    ("dies", r"FAILED: rank 0 died \(killed by SIGKILL\) without an error"),
    ("raises", r"FAILED: rank 0 failed: .*ValueError: the cause"),
    ("refused", r"refused: by the transpiler on rank 0: .*use mode n")])
def test_a_failure_is_reported_by_its_cause_not_by_the_peer_left_waiting(how, cell):
    """Rank 1 fails too (a lost connection, or a barrier never met); the cell
    names what happened on rank 0."""
    with pytest.raises(launch.BenchError) as caught:
        launch.run_ranks(_Job(how=how), 2, _fails, timeout_s=60)
    assert re.match(cell, launch.failure_text(caught.value)), launch.failure_text(caught.value)


def test_ranks_return_their_results_by_rank():
    out = launch.run_ranks(_Job(), 2, _fails, timeout_s=60)
    assert [r["rank"] for r in out] == [0, 1]
    assert torch.equal(out[1]["t"], torch.ones(2))


@pytest.mark.slow
def test_the_timeline_finds_each_all_reduce_of_one_step():
    """deep's 1.02 MB of gradients in DDP's two buckets, and in the
    transpiler's, each matched with gloo's run of it (and the program's wait)."""
    for config in ("ddp", "fuse_all_reduce"):
        run = launch.run_ranks(bench.Job("deep", config, 0, 1), 2, timeline.one_step,
                               timeout_s=300)[0]
        sizes = [c["mb"] for c in run["collectives"]]
        assert len(sizes) == 2 and sum(sizes) == pytest.approx(1.02, abs=0.01), (config, sizes)
        assert all(c["ran_ms"] is not None for c in run["collectives"])
        waited = [c["waited_ms"] is not None for c in run["collectives"]]
        assert all(waited) if config == "fuse_all_reduce" else not any(waited)
