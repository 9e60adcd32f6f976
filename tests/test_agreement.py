"""Ranks that would run different programs, or a rank that cannot build its
program, make every rank raise a clear error instead of hanging; ranks whose
parameters diverged are found by check_consistency."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests import models as M
from transpiler import DivergenceError, TranspileError, transpile


def _outcome(fn):
    try:
        fn()
        return "ran"
    except TranspileError as exc:
        return str(exc)


def rank_different_batch_shapes():
    rank = dist.get_rank()
    model = M.make("mlp")
    opt = M.make_optimizer("sgd", model)
    x, y = M.batches("mlp", 1, 12)[0]
    n = 6 if rank == 0 else 4  # rank 1 gets a smaller shard
    step = transpile(M.classify_step, mode="fuse_all_reduce")
    return _outcome(lambda: step(model, opt, x[:n], y[:n]))


def rank_different_models():
    rank = dist.get_rank()
    model = M.make("mlp" if rank == 0 else "bn")
    opt = M.make_optimizer("sgd", model)
    x, y = M.batches("mlp", 1, 12)[0]
    return _outcome(lambda: transpile(M.classify_step)(model, opt, x[:6], y[:6]))


def _fails_on_rank_1(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return model if dist.get_rank() == 1 else loss   # rank 1 cannot build it


def rank_one_rank_cannot_build():
    model = M.make("mlp")
    opt = M.make_optimizer("sgd", model)
    x, y = M.batches("mlp", 1, 12)[0]
    return _outcome(lambda: transpile(_fails_on_rank_1)(model, opt, x[:6], y[:6]))


def test_different_batch_shapes_run_as_under_ddp(ranks2):
    # as DDP: the collectives are the same (test_lone_rebuild compares the result)
    assert ranks2.run(rank_different_batch_shapes, timeout=60) == ["ran", "ran"]


def test_different_models_raise_on_every_rank(ranks2):
    for message in ranks2.run(rank_different_models, timeout=60):
        assert "rank 1 built a different program than rank 0" in message


def test_a_rank_that_cannot_build_stops_every_rank(ranks2):
    rank0, rank1 = ranks2.run(rank_one_rank_cannot_build, timeout=60)
    assert rank0.startswith("rank 1 could not build the step, so no rank runs it")
    assert "returned a MLP" in rank0
    assert "returned a MLP" in rank1


def rank_consistency():
    rank = dist.get_rank()
    model = M.make("mlp", seed=rank)
    opt = M.make_optimizer("sgd", model)
    step = transpile(M.classify_step, mode="fuse_all_reduce")
    batches = M.batches("mlp", 3, 12)
    for batch in batches:
        step(model, opt, *M.shard(batch, rank, 2))
    agreed = step.check_consistency()
    if rank == 1:
        with torch.no_grad():
            model.layers[1].bias[0] += 1e-7   # one value, by about one ulp
    return agreed, step.check_consistency()


def test_check_consistency_names_the_parameter_and_rank(ranks2):
    for agreed, diverged in ranks2.run(rank_consistency):
        assert agreed == []
        assert diverged == ["layers.1.bias: ranks 1 differ from rank 0"]


def rank_check_every(mode, options):
    rank = dist.get_rank()
    model = M.make("mlp", seed=rank)
    opt = M.make_optimizer("sgd", model)
    step = transpile(M.classify_step, mode=mode, check_every=2, **options)
    for i, batch in enumerate(M.batches("mlp", 6, 12)):
        if i == 3 and rank == 1 and mode != "local_sgd":
            with torch.no_grad():
                model.layers[0].weight.mul_(1.5)
        try:
            step(model, opt, *M.shard(batch, rank, 2))
        except DivergenceError as exc:
            return i, str(exc)
    return None


def test_check_every_raises_on_every_rank(ranks2):
    for outcome in ranks2.run(rank_check_every, "grad_allreduce", {}):
        assert outcome is not None
        i, message = outcome
        assert i == 3   # the edit before step 3 is seen after it (step count 4)
        assert "differ after step 4: layers.0.weight: ranks 1 differ from rank 0" in message


def test_check_every_waits_for_local_sgd_syncs(ranks2):
    # Between syncs the ranks differ by design; the checks run after syncs only.
    assert ranks2.run(rank_check_every, "local_sgd", {"k_steps": 3}) == [None, None]


def rank_different_options(options_by_rank):
    rank = dist.get_rank()
    model = M.make("mlp")
    opt = M.make_optimizer("sgd", model)
    x, y = M.batches("mlp", 1, 12)[0]
    step = transpile(M.classify_step, **options_by_rank[rank])
    return _outcome(lambda: step(model, opt, x[6 * rank:6 * rank + 6], y[6 * rank:6 * rank + 6]))


@pytest.mark.parametrize("options,what", [
    ([{"mode": "grad_allreduce"}, {"mode": "fuse_all_reduce"}], "programs"),
    ([{"nrings": 1}, {"nrings": 3}], "nrings 3 where rank 0 has 1"),
    ([{"mode": "local_sgd", "k_steps": 4}, {"mode": "local_sgd", "k_steps": 2}], "schedule"),
    # A warm-up is a program of its own.
    ([{"mode": "local_sgd", "begin_step": 0}, {"mode": "local_sgd", "begin_step": 3}], "programs"),
])
def test_ranks_with_different_modes_or_options_raise(options, what, ranks2):
    # Before any ring is created: rings are groups every rank must create alike.
    for outcome in ranks2.run(rank_different_options, options):
        assert f"rank 1 transpiled the step with {what}" in outcome, outcome
