"""skip_nonfinite: a step whose summed gradients hold a NaN (from one rank's
batch) changes nothing on any rank and is counted; the run then equals one that
never saw that batch."""

import pytest
import torch
import torch.distributed as dist

from tests import models as M
from transpiler import transpile

BAD_STEP = 2


def _train(mode, poison, options):
    rank = dist.get_rank()
    model = M.make("bn", seed=rank)
    opt = M.make_optimizer("adamw", model)
    step = transpile(M.classify_step, mode=mode, skip_nonfinite=True, **options)
    for i, batch in enumerate(M.batches("bn", 6, 12)):
        x, y = M.shard(batch, rank, 2)
        if i == BAD_STEP:
            if not poison:
                continue
            if rank == 1:
                x = x.clone()
                x[0, 0] = float("nan")
        step(model, opt, x, y)
    return M.state_of(model, opt), step.skipped_steps


def rank_skip(mode, options):
    return _train(mode, True, options), _train(mode, False, options)


@pytest.mark.parametrize("mode,options", [("grad_allreduce", {}), ("fuse_all_reduce", {}),
                                          ("local_sgd", {"k_steps": 1})])
def test_nonfinite_step_is_skipped_on_every_rank(mode, options, ranks2):
    results = ranks2.run(rank_skip, mode, options)
    for (poisoned, skipped), (clean, none_skipped) in results:
        assert (skipped, none_skipped) == (1, 0)
        assert all(torch.isfinite(v.float()).all() for v in poisoned.values())
        # Skipping left no trace: as if the bad batch had never been seen.
        assert all(torch.equal(poisoned[k], clean[k]) for k in clean)
    (rank0, _), _ = results[0]
    (rank1, _), _ = results[1]
    params = [k for k in rank0 if k.startswith("model.") and "running" not in k
              and "num_batches" not in k]
    assert all(torch.equal(rank0[k], rank1[k]) for k in params)


def test_one_process_and_compiled():
    # With one process the check reads the local gradients; inductor compiles
    # the where/isfinite selection like any other op.
    states = []
    for backend in ("inductor", "eager"):
        model = M.make("bn")
        opt = M.make_optimizer("adamw", model)
        step = transpile(M.classify_step, backend=backend, skip_nonfinite=True)
        for i, (x, y) in enumerate(M.batches("bn", 5, 12)):
            if i == BAD_STEP:
                x = x.clone()
                x[0, 0] = float("nan")
            step(model, opt, x, y)
        assert step.skipped_steps == 1
        states.append(M.state_of(model, opt))
    assert M.max_rel_error(*states) <= 1e-5
    assert all(torch.isfinite(v.float()).all() for v in states[0].values())
