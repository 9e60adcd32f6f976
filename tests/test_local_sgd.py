"""mode="local_sgd" on 2 and 3 gloo ranks against local SGD written in plain
torch (local steps, then an explicit all-reduce average of the parameters every
k steps), the adaptive k against its formula, and a resumed run against an
uninterrupted one."""

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests import models as M
from tests.ranks import RankPool
from transpiler import TranspileError, transpile
from transpiler.runtime.schedule import LR, MEAN_LOSS, LocalSGD
from transpiler.modes import LOCAL_SGD

STEPS = 12
BATCH = 12  # divisible by 2 and 3


def _averaged(model):
    """What local SGD averages: the parameters and the floating-point buffers."""
    return [p for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]


def _optimizer(opt_name, model):
    if opt_name == "plain_sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    return M.make_optimizer(opt_name, model)


def expected_k(loss, lr, loss0, lr0, k0):
    """Adaptive local SGD's next period, as the issue states it."""
    return min(16, max(1, math.ceil(math.sqrt(lr0 * loss / (lr * loss0) * k0))))


def _scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + 0.3 * i))


def _reference(model_name, opt_name, k, begin_step, adaptive=False, steps=STEPS):
    """Plain torch: synchronous steps (buffers broadcast from rank 0 before
    each and after the last, gradients averaged, as under DDP) before begin_step,
    then local steps and every k-th one followed by an average of the model
    (parameters and floating-point buffers). Adaptive: after each average, k
    from the averaged loss and the learning rate."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = M.make(model_name, seed=0)
    opt = _optimizer(opt_name, model)
    scheduler = _scheduler(opt)
    k0, since, ks, first = k, 0, [], None
    for i, batch in enumerate(M.batches(model_name, steps, BATCH)):
        x, y = M.shard(batch, rank, world_size)
        if i <= begin_step and begin_step:
            # the warm-up steps are DDP's: rank 0's buffers first, and the
            # forward after the last one (the first local step's) starts from them
            for b in model.buffers():
                dist.broadcast(b, 0)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if i < begin_step:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world_size
        opt.step()
        if i >= begin_step:
            since += 1
            if since == k:
                since = 0
                with torch.no_grad():
                    for t in _averaged(model):
                        dist.all_reduce(t)
                        t /= world_size
                if adaptive:
                    mean = loss.detach().clone()
                    dist.all_reduce(mean)
                    mean, lr = (mean / world_size).item(), opt.param_groups[0]["lr"]
                    first = first or (mean, lr)
                    k = expected_k(mean, lr, first[0], first[1], k0)
        ks.append(k)
        scheduler.step()
    return M.state_of(model, opt), ks


def _transpiled(model_name, opt_name, steps=STEPS, checkpoint=None, **options):
    """The transpiled run, from step 0 or resumed from a checkpoint file; the
    model starts differently on every rank (seed = rank) so that the startup
    broadcast is what makes them agree. Returns the model, optimizer, step and
    the period k after every step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = M.make(model_name, seed=rank)
    opt = _optimizer(opt_name, model)
    scheduler = _scheduler(opt)
    step = transpile(M.classify_step, mode="local_sgd", **options)
    if checkpoint is not None:
        saved = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        scheduler.load_state_dict(saved["scheduler"])
        step.load_state_dict(saved["step"])
    ks = []
    for batch in M.batches(model_name, steps, BATCH)[step.schedule.step:]:
        step(model, opt, *M.shard(batch, rank, world_size))
        ks.append(step.schedule.k)
        scheduler.step()
    return model, opt, scheduler, step, ks


def rank_vs_reference(model_name, opt_name, k, begin_step, adaptive=False):
    model, opt, _, step, ks = _transpiled(model_name, opt_name, k_steps=k, begin_step=begin_step,
                                          adaptive=adaptive)
    expected, expected_ks = _reference(model_name, opt_name, k, begin_step, adaptive)
    return M.state_of(model, opt), expected, sorted(step.programs), ks, expected_ks


CASES = [(opt, k, begin) for opt in ("sgd", "adamw") for k in (1, 3, 4) for begin in (0, 5)]


@pytest.mark.parametrize("opt_name,k,begin_step", CASES)
@pytest.mark.parametrize("world_size", [2, 3])
def test_equals_plain_torch_local_sgd(world_size, opt_name, k, begin_step, ranks2, ranks3):
    pool = ranks2 if world_size == 2 else ranks3
    results = pool.run(rank_vs_reference, "mlp", opt_name, k, begin_step)
    for ours, expected, programs, _, _ in results:
        assert M.max_rel_error(ours, expected) <= 1e-6
        expected_programs = {"sync"} | ({"local"} if k > 1 else set()) \
            | ({"warmup"} if begin_step else set())
        assert set(programs) == expected_programs
    # Every k steps the ranks hold the same model, bit for bit (12 is a multiple
    # of k = 1, 3, 4 when local training starts at 0).
    if begin_step == 0:
        for ours, *_ in results[1:]:
            model = [key for key in ours if key.startswith("model.")]
            assert all(torch.equal(ours[key], results[0][0][key]) for key in model)


def test_batchnorm_statistics_are_averaged(ranks2):
    for ours, expected, *_ in ranks2.run(rank_vs_reference, "bn", "sgd", 3, 2):
        assert M.max_rel_error(ours, expected) <= 1e-6


def rank_k1_vs_grad_allreduce():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    states = []
    for options in ({"mode": "local_sgd", "k_steps": 1}, {"mode": "grad_allreduce"}):
        model = M.make("mlp", seed=rank)
        opt = _optimizer("plain_sgd", model)
        step = transpile(M.classify_step, **options)
        for batch in M.batches("mlp", STEPS, BATCH):
            step(model, opt, *M.shard(batch, rank, world_size))
        states.append(M.state_of(model, opt))
    return states


def test_k1_with_plain_sgd_equals_grad_allreduce(ranks2):
    # The mean of the ranks' p - lr * g_r is p - lr * mean(g): equal up to rounding.
    for local_sgd, grad_allreduce in ranks2.run(rank_k1_vs_grad_allreduce):
        assert M.max_rel_error(local_sgd, grad_allreduce) <= 1e-6


def test_adaptive_k_follows_the_formula_on_a_scripted_loss():
    schedule = LocalSGD(LOCAL_SGD, k_steps=4, begin_step=2, adaptive=True)
    losses = [2.0 * 0.99 ** i for i in range(60)]
    lrs = [0.1 if i < 20 else 0.01 if i < 40 else 0.001 for i in range(60)]
    ran, ks, first = [], [], None
    for i in range(60):
        program = schedule.next_program()
        ran.append(program)
        held = {MEAN_LOSS: torch.tensor(losses[i]), LR: torch.tensor(lrs[i])}
        schedule.advance(program, held)
        if program == "sync":
            loss, lr = held[MEAN_LOSS].item(), held[LR].item()
            first = first or (loss, lr)
            ks.append(expected_k(loss, lr, first[0], first[1], 4))
            assert schedule.k == ks[-1]
    assert ran[:2] == ["warmup", "warmup"]
    # Each period is k - 1 local steps and a sync, with the k chosen at the last sync.
    periods = "".join("s" if p == "sync" else "l" for p in ran[2:]).split("s")[:-1]
    assert [len(p) + 1 for p in periods] == [4] + ks[:len(periods) - 1]
    assert ks[0] == 2          # ratio 1 at the first sync: ceil(sqrt(4))
    assert max(ks) == 16       # the lr drops raise k up to the clamp
    assert len(set(ks)) > 2


def test_adaptive_k_on_ranks_equals_reference(ranks2):
    for ours, expected, _, ks, expected_ks in ranks2.run(rank_vs_reference, "mlp", "sgd", 4, 0,
                                                         adaptive=True):
        assert ks == expected_ks
        assert len(set(ks)) > 1
        assert M.max_rel_error(ours, expected) <= 1e-6


def rank_save(path, steps, **options):
    model, opt, scheduler, step, _ = _transpiled("mlp", "sgd", steps=steps, **options)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "scheduler": scheduler.state_dict(), "step": step.state_dict()},
               f"{path}.{dist.get_rank()}")
    return M.state_of(model, opt)


def rank_resume(path, **options):
    model, opt, *_ = _transpiled("mlp", "sgd", checkpoint=f"{path}.{dist.get_rank()}", **options)
    return M.state_of(model, opt)


@pytest.mark.parametrize("options", [{"k_steps": 4}, {"k_steps": 3, "begin_step": 7},
                                     {"k_steps": 4, "adaptive": True}],
                         ids=["k4", "warmup", "adaptive"])
def test_resume_in_fresh_processes_continues_exactly(options, ranks2, tmp_path):
    uninterrupted = ranks2.run(rank_save, str(tmp_path / "full"), STEPS, **options)
    at_7 = ranks2.run(rank_save, str(tmp_path / "ckpt"), 7, **options)
    assert not all(torch.equal(at_7[0][k], at_7[1][k]) for k in at_7[0]) or "begin_step" in options
    fresh = RankPool(2)
    try:
        resumed = fresh.run(rank_resume, str(tmp_path / "ckpt"), **options)
    finally:
        fresh.close()
    for ours, expected in zip(resumed, uninterrupted):
        assert all(torch.equal(ours[k], expected[k]) for k in expected)


def test_options_are_checked():
    for bad, message in [({"k_steps": 0}, "k_steps must be an integer >= 1"),
                         ({"k_steps": 2.5}, "k_steps must be"),
                         ({"begin_step": -1}, "begin_step must be an integer >= 0"),
                         ({"adaptive": 1}, "adaptive must be True or False")]:
        with pytest.raises(TranspileError, match=message):
            transpile(M.classify_step, mode="local_sgd", **bad)
    with pytest.raises(TranspileError, match="k_steps, adaptive apply only to mode='local_sgd'"):
        transpile(M.classify_step, mode="fuse_all_reduce", k_steps=4, adaptive=True)


def rank_adaptive_without_lifted_lr():
    model = M.make("mlp", seed=dist.get_rank())
    opt = torch.optim.RMSprop(model.parameters(), lr=0.01)
    before = copy.deepcopy(model.state_dict())
    step = transpile(M.classify_step, mode="local_sgd", adaptive=True)
    x, y = M.shard(M.batches("mlp", 1, BATCH)[0], dist.get_rank(), 2)
    with pytest.raises(TranspileError, match="needs the learning rate as a program input"):
        step(model, opt, x, y)
    return all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_adaptive_needs_a_lifted_lr_and_says_so_before_any_step(ranks2):
    # The sync program would run only at step 4: its passes run on the first call.
    assert ranks2.run(rank_adaptive_without_lifted_lr) == [True, True]


def test_one_process_trains_locally():
    model, opt = M.make("mlp"), _optimizer("sgd", M.make("mlp"))
    model = M.make("mlp")
    opt = _optimizer("sgd", model)
    step = transpile(M.classify_step, mode="local_sgd", k_steps=2)
    expected_model = M.make("mlp")
    expected_opt = _optimizer("sgd", expected_model)
    for batch in M.batches("mlp", 4, BATCH):
        step(model, opt, *batch)
        M.classify_step(expected_model, expected_opt, *batch)
    assert M.max_rel_error(M.state_of(model, opt), M.state_of(expected_model, expected_opt)) <= 1e-6
    assert all(p.collectives() == [] for p in step.programs.values())


def rank_composed_passes():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    states = []
    for options in ({"passes": ["snapshot_params", "local_sgd", "insert_allreduce",
                                "ring_round_robin"]},
                    {"mode": "local_sgd", "k_steps": 1}):
        model = M.make("mlp", seed=rank)
        opt = _optimizer("sgd", model)
        step = transpile(M.classify_step, **options)
        for batch in M.batches("mlp", 6, BATCH):
            step(model, opt, *M.shard(batch, rank, world_size))
        states.append(M.state_of(model, opt))
    return states, len(step.programs["sync"].collectives())


def test_local_sgd_composes_with_the_other_reduction_pass(ranks2):
    # The same averaging, reduced one parameter at a time instead of in buckets:
    # with two ranks a sum is a sum, bit for bit.
    for (composed, mode), n_buckets in ranks2.run(rank_composed_passes):
        assert all(torch.equal(composed[k], mode[k]) for k in mode)
        assert n_buckets < 6


def rank_checked_every_step_with_skip_nonfinite():
    rank = dist.get_rank()
    model = M.make("mlp", seed=rank)
    opt = _optimizer("sgd", model)
    step = transpile(M.classify_step, mode="local_sgd", k_steps=3, skip_nonfinite=True,
                     check_every=1)
    for batch in M.batches("mlp", 6, BATCH):
        step(model, opt, *M.shard(batch, rank, 2))
    return step.schedule.step


def test_consistency_checks_skip_local_steps_with_skip_nonfinite(ranks2):
    # skip_nonfinite gives the local program a held output of its own; the ranks
    # differ after a local step by design, so a check due then waits for the sync.
    assert ranks2.run(rank_checked_every_step_with_skip_nonfinite) == [6, 6]
