"""mode="local_sgd" on 2 and 3 gloo ranks against local SGD written in plain
torch (local steps, then an explicit all-reduce average of the parameters every
k steps), the adaptive k against its formula, and a resumed run against an
uninterrupted one."""

import contextlib
import io
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests import models as M
from transpiler import TranspileError, transpile
from transpiler.capture import _compiling_flag
from transpiler.schedule import LR, MEAN_LOSS, LocalSGD
from transpiler.modes import LOCAL_SGD

STEPS = 12
BATCH = 12  # divisible by 2 and 3


def _averaged(model):
    """What local SGD averages: the parameters and the floating-point buffers."""
    return [p for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]


def _reference_optimizer(opt_name, model):
    """The optimizer as the transpiler traces it. Adam's default formulation
    (bias corrections in Python floats) and the tensor formulation it traces
    (capturable) differ by rounding that Adam amplifies to about 1e-5 in 12 steps
    (test_single_process bounds that); to compare local SGD itself at 1e-6, the
    reference runs torch's capturable AdamW, eagerly."""
    if opt_name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True,
                                 capturable=True), _compiling_flag
    return M.make_optimizer(opt_name, model), contextlib.nullcontext


def _reference(model_name, opt_name, k, begin_step, steps=STEPS):
    """Plain torch: synchronous steps (gradients averaged) before begin_step,
    then local steps and every k-th one followed by an average of the model."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = M.make(model_name, seed=0)
    opt, formulation = _reference_optimizer(opt_name, model)
    for i, batch in enumerate(M.batches(model_name, steps, BATCH)):
        x, y = M.shard(batch, rank, world_size)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if i < begin_step:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world_size
        with formulation():
            opt.step()
        if i >= begin_step and (i - begin_step + 1) % k == 0:
            with torch.no_grad():
                for t in _averaged(model):
                    dist.all_reduce(t)
                    t /= world_size
    return M.state_of(model, opt)


def _transpiled(model_name, opt_name, steps=STEPS, state=None, **options):
    """The transpiled run; the model starts differently on every rank (seed =
    rank) so that the startup broadcast is what makes them agree."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = M.make(model_name, seed=rank)
    opt = M.make_optimizer(opt_name, model)
    step = transpile(M.classify_step, mode="local_sgd", **options)
    batches = M.batches(model_name, STEPS, BATCH)
    start = 0
    if state is not None:
        saved = torch.load(io.BytesIO(state), weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        step.load_state_dict(saved["step"])
        start = saved["step"]["schedule"]["step"]
    ks = []
    for batch in batches[start:steps]:
        step(model, opt, *M.shard(batch, rank, world_size))
        ks.append(step.schedule.k)
    return M.state_of(model, opt), step, ks


def rank_vs_reference(model_name, opt_name, k, begin_step):
    ours, step, _ = _transpiled(model_name, opt_name, k_steps=k, begin_step=begin_step)
    return ours, _reference(model_name, opt_name, k, begin_step), sorted(step.programs)


CASES = [(opt, k, begin) for opt in ("sgd", "adamw") for k in (1, 3, 4) for begin in (0, 5)]


@pytest.mark.parametrize("opt_name,k,begin_step", CASES)
@pytest.mark.parametrize("world_size", [2, 3])
def test_equals_plain_torch_local_sgd(world_size, opt_name, k, begin_step, ranks2, ranks3):
    pool = ranks2 if world_size == 2 else ranks3
    for ours, expected, programs in pool.run(rank_vs_reference, "mlp", opt_name, k, begin_step):
        assert M.max_rel_error(ours, expected) <= 1e-6
        expected_programs = {"sync"} | ({"local"} if k > 1 else set()) \
            | ({"warmup"} if begin_step else set())
        assert set(programs) == expected_programs
