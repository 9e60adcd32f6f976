"""No rank waits alone: a rank that meets a new signature when the others do
not (a short last batch on one rank) traces again and runs on with no
exchange, as DDP does, when its new program's collectives were agreed before;
when they differ (a parameter frozen on one rank), every rank raises a
TranspileError naming the rank and the change, far within the process group's
timeout, with nothing written. On 2 gloo ranks with a short timeout."""

import logging
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from tests.ranks import RankPool
from transpiler import TranspileError, transpile

PG_TIMEOUT_S = 30   # a hang would fail the step within it (and the test); grace 3 s
STEPS = 6
SHORT_ALONE = 3     # rank 1 alone gets a short batch
SHORT_BOTH = 5      # both ranks do, of different sizes (the epoch's last)


@pytest.fixture(scope="module")
def short_timeout_pool():
    pool = RankPool(2, pg_timeout_s=PG_TIMEOUT_S)
    yield pool
    pool.close(kill=True)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _per_rank_batches(rank):
    """This rank's shard of each step's batch, cut short where a test says."""
    out = []
    for i, batch in enumerate(M.batches("mlp", STEPS, 12)):
        x, y = M.shard(batch, rank, 2)
        keep = {SHORT_ALONE: (6, 4), SHORT_BOTH: (5, 3)}.get(i, (6, 6))[rank]
        out.append((x[:keep], y[:keep]))
    return out


def _state(model, opt, with_optimizer):
    state = M.state_of(model, opt)
    return state if with_optimizer else {k: v for k, v in state.items() if k.startswith("model.")}


def rank_short_batch_vs_ddp(mode, backend):
    rank = dist.get_rank()
    log = logging.getLogger("transpiler")
    lines = _Lines()
    log.addHandler(lines)
    old_level = log.level
    log.setLevel(logging.INFO)
    try:
        model = M.make("mlp", seed=rank)   # the startup broadcast makes the ranks agree
        opt = M.make_optimizer("sgd", model)
        # one program per shape: the rebuilds on one rank alone (symbolic shapes:
        # tests/test_symbolic_shapes.py)
        step = transpile(M.classify_step, mode=mode, backend=backend, dynamic=False)
        for x, y in _per_rank_batches(rank):
            step(model, opt, x, y)
    finally:
        log.removeHandler(lines)
        log.setLevel(old_level)
    ours = _state(model, opt, mode != "zero")   # zero keeps shards of the state

    model = M.make("mlp", seed=0)
    opt = M.make_optimizer("sgd", model)
    ddp = DDP(model)
    for x, y in _per_rank_batches(rank):
        M.classify_step(ddp, opt, x, y)
    return ours, _state(model, opt, mode != "zero"), lines.lines


@pytest.mark.slow
@pytest.mark.parametrize("mode,backend", [("grad_allreduce", "eager"),
                                          ("fuse_all_reduce", "eager"),
                                          ("zero", "eager"),
                                          ("fuse_all_reduce", "inductor")])
def test_a_short_batch_on_one_rank_trains_on_as_ddp(mode, backend, short_timeout_pool):
    results = short_timeout_pool.run(rank_short_batch_vs_ddp, mode, backend, timeout=300)
    for ours, ddp, _ in results:
        if backend == "eager":
            assert ours.keys() == ddp.keys()
            assert all(torch.equal(ours[name], ddp[name]) for name in ours)
        else:   # inductor's kernels round differently from eager's (test_training_loops)
            assert M.max_rel_error(ours, ddp) <= 1e-5
    traced = [[line for line in lines if line.startswith("transpiler: traced")]
              for _, _, lines in results]
    # rank 0: the first call and the last batch; rank 1 also its short batch
    # alone (and not again when its full batch came back)
    assert len(traced[0]) == 2 and len(traced[1]) == 3, traced
    assert "input x: float32[6, 16] on cpu -> float32[4, 16] on cpu" in traced[1][1]
    ran_on = [sum("running on without an exchange" in line for line in lines)
              for _, _, lines in results]
    assert ran_on == [1, 2]


def rank_changes_alone(mode, change):
    """Rank 1 alone, at one step: freezes a parameter (new collectives) or
    passes targets of the wrong dtype (its rebuild fails)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = M.make("mlp")
    opt = M.make_optimizer("sgd", model)
    step = transpile(M.classify_step, mode=mode)
    for i, (x, y) in enumerate(M.batches("mlp", STEPS, 12)):
        x, y = M.shard((x, y), rank, world_size)
        if i == SHORT_ALONE and rank == 1:
            if change == "freeze":
                model.layers[0].bias.requires_grad_(False)
            else:
                y = y.float()
        before = M.state_of(model, opt)
        start = time.monotonic()
        try:
            step(model, opt, x, y)
        except TranspileError as exc:
            after = M.state_of(model, opt)
            untouched = all(torch.equal(v, after[k]) for k, v in before.items())
            return i, time.monotonic() - start, str(exc), untouched
    return None


@pytest.mark.slow
@pytest.mark.parametrize("mode,change,world_size", [("grad_allreduce", "freeze", 2),
                                                    ("fuse_all_reduce", "freeze", 2),
                                                    ("fuse_all_reduce", "bad_batch", 2),
                                                    ("fuse_all_reduce", "freeze", 3)])
def test_a_change_on_one_rank_raises_on_every_rank(mode, change, world_size):
    pool = RankPool(world_size, pg_timeout_s=PG_TIMEOUT_S)   # its communicators are shut down
    try:
        results = pool.run(rank_changes_alone, mode, change, timeout=300)
    finally:
        pool.close(kill=True)
    others = "rank 0" if world_size == 2 else "ranks 0, 2"
    for outcome in results:
        assert outcome is not None, "a rank finished its steps"
        step, seconds, message, untouched = outcome
        assert step == SHORT_ALONE
        assert seconds < PG_TIMEOUT_S / 2, seconds   # the grace: a tenth of the timeout
        if change == "freeze":
            assert message.startswith("rank 1 traced the step again (module 0 layers.0.bias"), \
                message
            assert "collectives differ from those the ranks agreed on" in message
        else:
            assert message.startswith("rank 1 could not build the step again (input y: int64[")
            assert "Expected dtype int32/int64 for index" in message
        assert f"{others} ran on with the previous program" in message
        assert "this job cannot go on; restart it" in message
        assert untouched, "the failed step changed the model or the optimizer"
    assert len({message for _, _, message, _ in results}) == 1


def rank_freezes_together():
    rank = dist.get_rank()
    model = M.make("mlp")
    opt = M.make_optimizer("sgd", model)
    step = transpile(M.classify_step, mode="fuse_all_reduce")
    for i, (x, y) in enumerate(M.batches("mlp", STEPS, 12)):
        if i == SHORT_ALONE:
            model.layers[0].bias.requires_grad_(False)   # on every rank
            frozen = model.layers[0].bias.detach().clone()
        step(model, opt, *M.shard((x, y), rank, 2))
    return (torch.equal(frozen, model.layers[0].bias),
            {k: v.clone() for k, v in model.state_dict().items()})


def test_collectives_changed_on_every_rank_agree_and_train_on(short_timeout_pool):
    (kept0, state0), (kept1, state1) = short_timeout_pool.run(rank_freezes_together)
    assert kept0 and kept1
    assert all(torch.equal(v, state1[k]) for k, v in state0.items())
