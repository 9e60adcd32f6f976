"""Soak: 500 steps in each mode on 2 ranks. Resident memory at step 500 is
within 10% of step 50 (nothing accumulates per step) and the ranks end with the
same parameters, bit for bit."""

import os

import pytest
import torch
import torch.distributed as dist

from tests import models as M
from transpiler import transpile

STEPS = 500


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rank_soak(mode, options):
    rank = dist.get_rank()
    model = M.make("mlp", seed=rank)
    opt = M.make_optimizer("adamw", model)
    step = transpile(M.classify_step, mode=mode, **options)
    batches = M.batches("mlp", 10, 12)
    rss = {}
    for i in range(1, STEPS + 1):
        step(model, opt, *M.shard(batches[i % len(batches)], rank, 2))
        if i in (50, STEPS):
            rss[i] = _rss_bytes()
    return rss, [p.detach().clone() for p in model.parameters()]


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
@pytest.mark.parametrize("mode,options", [("grad_allreduce", {}), ("fuse_all_reduce", {}),
                                          ("local_sgd", {"k_steps": 4})])
def test_500_steps_do_not_grow_memory_and_ranks_agree(mode, options, ranks2):
    results = ranks2.run(rank_soak, mode, options)
    for rss, _ in results:
        assert rss[STEPS] <= 1.10 * rss[50], rss
    (_, params0), (_, params1) = results
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))
