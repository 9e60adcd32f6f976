"""Faults: a rank that dies or fails mid-run makes the others raise within the
process-group timeout the user configured (rings included), with the model of
the survivors as it was before the step that failed."""

import copy
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests import models as M
from tests.ranks import RankPool
from transpiler import transpile

PG_TIMEOUT_S = 5
FAIL_AT = 3


def rank_fails_mid_run(mode, how):
    rank = dist.get_rank()
    model = M.make("mlp")
    opt = M.make_optimizer("sgd", model)
    step = transpile(M.classify_step, mode=mode)
    for i, batch in enumerate(M.batches("mlp", 8, 12)):
        if rank == 1 and i == FAIL_AT:
            if how == "killed":
                os._exit(1)
            raise RuntimeError("rank 1 fails in its own code and never calls the step")
        before = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        start = time.monotonic()
        try:
            step(model, opt, *M.shard(batch, rank, 2))
        except Exception as exc:  # noqa: BLE001 - what the survivor sees is the result
            untouched = all(torch.equal(v, model.state_dict()[k]) for k, v in before[0].items())
            state = opt.state_dict()["state"]
            untouched &= all(torch.equal(v, state[p][k]) for p, st in before[1]["state"].items()
                             for k, v in st.items())
            return i, time.monotonic() - start, f"{type(exc).__name__}: {exc}", untouched
    return None


@pytest.mark.parametrize("how", ["killed", "raising"])
@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce"])
def test_survivor_raises_within_the_timeout(mode, how):
    pool = RankPool(2, pg_timeout_s=PG_TIMEOUT_S)
    try:
        [outcome] = pool.run(rank_fails_mid_run, mode, how, only=[0], timeout=60)
    finally:
        pool.close(kill=True)
    assert outcome is not None, "rank 0 finished its steps although rank 1 was gone"
    step, seconds, error, untouched = outcome
    assert step == FAIL_AT
    assert seconds < PG_TIMEOUT_S + 10, error
    assert untouched, "the failed step changed rank 0's model or optimizer"
