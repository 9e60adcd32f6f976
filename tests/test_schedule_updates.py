"""schedule_updates: each bucket's update as soon as its collective is done. It
only splits elementwise foreach ops and reorders, so the results are those of
the mode without it, bit for bit."""

import pytest
import torch
import torch.distributed as dist

from tests import models as M
from tests.test_fuse_all_reduce import SMALL
from tests.test_passes import _captured
from tests.test_training_loops import clip, clip_value
from tests.test_zero import TINY_BUCKETS
from transpiler import PassContext, run_passes, transpile
from transpiler.modes import MODES
from transpiler.program.roles import COMM

STEPS = 3


def _position(program):
    return {n: i for i, n in enumerate(program.graph.nodes)}


def test_mode_zero_all_gathers_a_bucket_before_waiting_for_the_next():
    program = _captured().program
    run_passes(program, MODES["zero"], SMALL)   # two buckets
    gathers = [n for n in program.collectives() if n.meta[COMM].op == "all_gather"]
    waits = [n for n in program.graph.nodes if n.target is torch.ops._c10d_functional.wait_tensor.default
             and n.meta[COMM].op == "reduce_scatter"]
    order = _position(program)
    # The first bucket's parameters are all-gathered before the second bucket's
    # gradients are even waited for.
    assert order[gathers[0]] < order[waits[1]]


def test_updates_are_split_by_bucket_and_follow_their_wait():
    program = _captured().program
    run_passes(program, MODES["fuse_all_reduce"] + ("schedule_updates",), SMALL)
    order = _position(program)
    waits = sorted((n for n in program.graph.nodes
                    if n.target is torch.ops._c10d_functional.wait_tensor.default),
                   key=order.__getitem__)
    addcmuls = [n for n in program.graph.nodes
                if n.target is torch.ops.aten._foreach_addcmul.Scalar]
    # SGD's two foreach updates over 4 parameters, each split in two buckets
    # of two (DDP's ready order: the last layer's bias and weight, then the first's).
    assert len(addcmuls) == 4
    assert sorted(len(n.args[0]) for n in addcmuls) == [2, 2, 2, 2]
    first_bucket = [n for n in addcmuls if order[n] < order[waits[1]]]
    assert len(first_bucket) == 2
    assert all(order[waits[0]] < order[n] < order[waits[1]] for n in first_bucket)


def test_nothing_to_schedule_without_collectives():
    program = _captured().program
    before = program.listing()
    run_passes(program, MODES["fuse_all_reduce"] + ("schedule_updates",), PassContext())  # 1 rank
    assert program.listing() == before


def gradient_noise(model, opt, x, y):
    """Noise drawn for each gradient after the backward pass: schedule_updates
    must keep the draws in the program's order, whatever bucket each waits for."""
    torch.nn.functional.cross_entropy(model(x), y).backward()
    for p in model.parameters():
        p.grad.add_(torch.randn_like(p.grad), alpha=1e-3)
    opt.step()
    opt.zero_grad()


def rank_with_and_without(mode, fn_name, opt_name):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    fn = {"classify": M.classify_step, "clip": clip, "clip_value": clip_value,
          "noise": gradient_noise}[fn_name]
    without = tuple(p for p in MODES[mode] if p != "schedule_updates")
    states = []
    for passes in (without, without + ("schedule_updates",)):
        model = M.make("mlp")
        opt = M.make_optimizer(opt_name, model)
        step = transpile(fn, passes=passes, **TINY_BUCKETS)
        torch.manual_seed(1)
        for batch in M.batches("mlp", STEPS, 12):
            step(model, opt, *M.shard(batch, rank, world_size))
        states.append(M.state_of(model, opt))
    return states


@pytest.mark.parametrize("mode,fn_name,opt_name", [
    ("fuse_all_reduce", "classify", "sgd"), ("fuse_all_reduce", "clip", "adamw"),
    ("zero", "clip_value", "sgd"), ("zero", "clip", "adamw"),
    ("fuse_all_reduce", "noise", "adamw")])   # mode zero refuses noise on the full gradient
def test_results_are_unchanged_bit_for_bit(mode, fn_name, opt_name, ranks2):
    for without, with_ in ranks2.run(rank_with_and_without, mode, fn_name, opt_name):
        assert without.keys() == with_.keys()
        assert all(torch.equal(without[k], with_[k]) for k in without)
