"""The scripts in examples/ on real ranks, with small arguments: each one's
training loop in its transpiled form against the same script under torch DDP
(--ddp) in the same processes, bit for bit, and the nanoGPT script's checkpoint
resumed; one launch of a script by torchrun as its docstring says; and the
diff in docs/nanogpt-diff.md against the example's code. The tests on ranks are
slow (conftest marks them); the diff check is not."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from examples import nanogpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_GPT = ["--batch-size", "2", "--grad-accum", "2", "--block-size", "16", "--vocab-size", "64",
            "--n-embd", "32", "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1",
            "--warmup-iters", "1", "--lr-decay-iters", "4"]


def test_the_nanogpt_diff_is_the_examples_code():
    """docs/nanogpt-diff.md: every added and context line of its diffs is a
    line of examples/nanogpt.py (the removed ones are nanoGPT's)."""
    with open(os.path.join(ROOT, "examples", "nanogpt.py")) as f:
        example = {line.strip() for line in f}
    with open(os.path.join(ROOT, "docs", "nanogpt-diff.md")) as f:
        blocks = re.findall(r"```diff\n(.*?)```", f.read(), flags=re.S)
    shown = [line[1:].strip() for block in blocks for line in block.splitlines()
             if line[:1] in "+ " and line[1:].strip() not in ("", "...")]
    assert len(blocks) == 6 and len(shown) > 25
    assert [line for line in shown if line not in example] == []


def rank_nanogpt(argv: list[str]) -> dict:
    torch.set_num_threads(1)
    return nanogpt.train(nanogpt.parse_args(argv))


def rank_barrier():
    dist.barrier()


def _equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _assert_equal_to_ddp(ours: list, ddp: list, steps: int) -> None:
    """Each rank's losses and final model equal DDP's bit for bit, and the
    ranks trained on batches of their own (their losses differ)."""
    for rank in range(2):
        assert len(ours[rank]["losses"]) == steps
        assert torch.equal(ours[rank]["losses"], ddp[rank]["losses"])
        assert _equal_states(ours[rank]["model"], ddp[rank]["model"])
    assert not torch.equal(ours[0]["losses"], ours[1]["losses"])


def test_nanogpt_equals_ddp(tmp_path, ranks2):
    args = TINY_GPT + ["--out-dir", str(tmp_path), "--max-iters", "4"]
    ours = ranks2.run(rank_nanogpt, args)
    _assert_equal_to_ddp(ours, ranks2.run(rank_nanogpt, args + ["--ddp"]), steps=4)
    tokens = np.memmap(tmp_path / "data" / "train.bin", dtype=np.uint16, mode="r")
    assert tokens.max() < 64 and len(tokens) == 45_000


def test_nanogpt_zero_resumes_from_its_checkpoint_bit_for_bit(tmp_path, ranks2):
    """Mode zero's checkpoint holds the full optimizer state (gathered from the
    shards); the resumed run repeats the uninterrupted one exactly."""
    args = TINY_GPT + ["--out-dir", str(tmp_path), "--mode", "zero", "--max-iters", "4"]
    unbroken = ranks2.run(rank_nanogpt, args)        # checkpoint at iteration 2
    ranks2.run(rank_barrier)
    checkpoint = torch.load(tmp_path / "ckpt.pt")
    assert checkpoint["iter_num"] == 2
    model = checkpoint["model"]
    for group in checkpoint["optimizer"]["param_groups"]:
        for index in group["params"]:
            # full entries, not shards: loadable into torch's AdamW on one process
            shape = checkpoint["optimizer"]["state"][index]["exp_avg"].shape
            assert any(p.shape == shape for p in model.values())
    resumed = ranks2.run(rank_nanogpt, args + ["--init-from", "resume"])
    for rank in range(2):
        assert torch.equal(resumed[rank]["losses"], unbroken[rank]["losses"][2:])
        assert _equal_states(resumed[rank]["model"], unbroken[rank]["model"])


def rank_finetune(argv: list[str]) -> dict:
    from examples import finetune_hf   # needs transformers, skipped without it
    torch.set_num_threads(1)
    return finetune_hf.train(finetune_hf.parse_args(argv))


def test_finetune_hf_equals_ddp(ranks2):
    pytest.importorskip("transformers")
    args = ["--epochs", "2", "--steps-per-epoch", "3", "--batch-size", "4", "--max-length", "16",
            "--vocab-size", "64"]
    ours = ranks2.run(rank_finetune, args)
    _assert_equal_to_ddp(ours, ranks2.run(rank_finetune, args + ["--ddp"]), steps=6)


def test_nanogpt_by_torchrun_prints_the_ddp_losses(tmp_path, ranks2):
    """The docstring's command, shortened: its logged losses (rank 0's, six
    decimals) are those of the DDP run on the rank pool."""
    args = TINY_GPT + ["--max-iters", "3"]
    ddp = ranks2.run(rank_nanogpt, args + ["--out-dir", str(tmp_path / "ddp"), "--ddp"])
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    run = subprocess.run([torchrun, "--nproc-per-node", "2", "examples/nanogpt.py", *args,
                          "--out-dir", str(tmp_path / "ours")], cwd=ROOT, capture_output=True,
                         text=True, timeout=170, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-3000:]
    printed = [float(v) for v in re.findall(r"iter \d+: loss ([0-9.]+)", run.stderr)]
    assert printed == [round(v * 2, 6) for v in ddp[0]["losses"].tolist()]   # * grad_accum
    assert (tmp_path / "ours" / "ckpt.pt").exists()
