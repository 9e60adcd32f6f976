"""Optimizers traced as torch wrote them (RMSprop, Adagrad, Adamax, NAdam,
RAdam, ...) on 2 gloo ranks against torch DDP running the same optimizer:
their step count is read as eager reads it (.item()), their options are the
user's, so each mode that averages gradients equals DDP bit for bit. A
decision on a value of their state (RAdam's rectification) is traced on
values, which mode fsdp cannot do once its parameters are shards: refused on
every rank, no crash. (One process: tests/test_single_process.py.)"""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import TranspileError, transpile


def rank_vs_ddp(name: str, mode: str):
    rank = dist.get_rank()
    runs = []
    for transpiled in (True, False):
        model = M.make("mlp", seed=0)
        opt = getattr(torch.optim, name)(model.parameters(), lr=1e-2)
        step = transpile(M.classify_step, mode=mode) if transpiled else M.classify_step
        net = model if transpiled else DDP(model)
        for batch in M.batches("mlp", 6, 12):
            step(net, opt, *M.shard(batch, rank, 2))
        runs.append({k: v.clone() for k, v in model.state_dict().items()})
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fuse_all_reduce", "zero"])
@pytest.mark.parametrize("name", ["RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam"])
def test_equals_ddp_on_2_ranks(name, mode, ranks2):
    for ours, ddp in ranks2.run(rank_vs_ddp, name, mode):
        assert all(torch.equal(ours[k], ddp[k]) for k in ours)


def rank_fsdp_radam():
    model = M.make("mlp", seed=0)
    opt = torch.optim.RAdam(model.parameters(), lr=1e-2)
    step = transpile(M.classify_step, mode="fsdp")
    batches = M.batches("mlp", 3, 12)
    step(model, opt, *M.shard(batches[0], dist.get_rank(), 2))
    try:
        step(model, opt, *M.shard(batches[1], dist.get_rank(), 2))
    except TranspileError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_a_decision_traced_after_the_first_call_of_mode_fsdp_is_refused_on_every_rank(ranks2):
    for error in ranks2.run(rank_fsdp_radam):
        assert error is not None and "kept as shards between the steps of mode fsdp" in error
