"""The benchmark runs end to end and writes well-formed results. It checks the
shape of the output, never the speed."""

import json
import math
import pathlib
import subprocess
import sys

from transpiler import bench

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_bench_cli_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "transpiler.bench", "--world-size", "2", "--models", "deep",
         "--steps", "2", "--warmup", "1", "--configs", "local,ddp,grad_allreduce,local_sgd",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "grad_allreduce" in proc.stdout and "step_ms" in proc.stdout
    assert "[1/5] deep local" in proc.stderr

    doc = json.loads(out.read_text())
    assert doc["world_size"] == 2
    assert isinstance(doc["torch"], str) and doc["torch"]
    assert list(doc["models"]) == ["deep"]
    # The references of vs_ddp and vs_limit are always run.
    results = doc["models"]["deep"]
    assert set(results) == {"local", "allreduce_only", "ddp", "grad_allreduce", "local_sgd"}
    for config, fields in results.items():
        split = fields.pop("setup_split", None)
        assert set(fields) == set(bench.FIELDS), config
        assert fields.pop("peak_device_mb") is None, config   # measured on CUDA only
        for name, value in fields.items():
            # allreduce_only runs no optimizer: it holds no state; local sends nothing.
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
    assert "setup_s of the transpiler by phase" in proc.stdout


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, caplog, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)    # import matplotlib fails
    code = bench.main(["--models", "deep", "--configs", "local",
                       "--plot", str(tmp_path / "bench.png")])
    assert code != 0
    assert "pip install -e .[bench]" in caplog.text
    assert not (tmp_path / "bench.png").exists()


def test_unknown_config_is_an_error(caplog):
    assert bench.main(["--configs", "local,nope"]) == 2
    assert "nope" in caplog.text
