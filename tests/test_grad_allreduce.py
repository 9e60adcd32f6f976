"""grad_allreduce on 2 and 3 gloo ranks, each on its shard of the batch, equals
single-process training on the whole batch; BatchNorm equals torch DDP with
its defaults. Parameters and optimizer state after 5 steps."""

import pytest
import torch
import torch.distributed as dist

from tests import models as M
from transpiler import transpile

STEPS = 5
BATCH = 12  # divisible by 2 and 3


def _train(model_name, opt_name, transpiled, rank=0, world_size=1, nrings=2):
    """5 steps with an LR scheduler; the model starts differently on every rank
    (seed = rank) so that the startup broadcast is what makes them agree."""
    model = M.make(model_name, seed=rank)
    opt = M.make_optimizer(opt_name, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
    fn = M.step_fn(model_name)
    step = transpile(fn, mode="grad_allreduce", nrings=nrings) if transpiled else fn
    for batch in M.batches(model_name, STEPS, BATCH):
        step(model, opt, *M.shard(batch, rank, world_size))
        scheduler.step()
    return M.state_of(model, opt), step


def rank_train(model_name, opt_name, nrings):
    state, step = _train(model_name, opt_name, True, dist.get_rank(), dist.get_world_size(), nrings)
    return state, len(step.program.collectives())


def rank_bn_vs_ddp(opt_name):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    state, _ = _train("bn", opt_name, True, rank, world_size)
    model = M.make("bn", seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = M.make_optimizer(opt_name, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
    for batch in M.batches("bn", STEPS, BATCH):
        M.classify_step(ddp, opt, *M.shard(batch, rank, world_size))
        scheduler.step()
    return state, M.state_of(M.as_next_forward_sees(ddp), opt)


CASES = [("mlp", "sgd"), ("mlp", "adamw"), ("tied", "sgd"), ("tied", "adamw")]


@pytest.mark.parametrize("model_name,opt_name", CASES)
@pytest.mark.parametrize("world_size", [2, 3])
def test_equals_single_process_on_global_batch(world_size, model_name, opt_name, ranks2, ranks3):
    pool = ranks2 if world_size == 2 else ranks3
    results = pool.run(rank_train, model_name, opt_name, 2)
    expected, _ = _train(model_name, opt_name, transpiled=False)
    for state, _ in results:
        assert M.max_rel_error(state, expected) <= 1e-5
    # Every rank holds the same model, bit for bit.
    for state, _ in results[1:]:
        assert all(torch.equal(state[k], results[0][0][k]) for k in state)


def test_one_allreduce_per_distinct_gradient(ranks2):
    (_, n_mlp), _ = ranks2.run(rank_train, "mlp", "sgd", 1)
    (_, n_tied), _ = ranks2.run(rank_train, "tied", "sgd", 1)
    assert n_mlp == 6  # 3 weights, 3 biases
    # embed/out share one gradient; hidden weight and bias; none for unused or frozen.
    assert n_tied == 3


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_batchnorm_equals_ddp(opt_name, ranks2):
    for ours, ddp in ranks2.run(rank_bn_vs_ddp, opt_name):
        assert M.max_rel_error(ours, ddp) == 0.0
