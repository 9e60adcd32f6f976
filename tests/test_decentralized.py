"""Mode decentralized (mix_params, Decent-DP's gossip): each rank averages its
parameters with its group of the topology at this step, then updates them with
its own gradient. Against a hand-written reference in plain torch on 4 ranks,
for every built-in topology and one of one's own."""

import copy
import dataclasses
import functools
import os
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests import models as M
from tests.test_fuse_all_reduce import SMALL
from tests.test_passes import _captured, _check_golden
from tests.test_training_loops import clip
from transpiler import TranspileError, run_passes, transpile
from transpiler.lowering import topology
from transpiler.program.mesh import Peers
from transpiler.modes import MODES

STEPS = 4
CUSTOM = topology.of("weighted", [([(0, 1), (2, 3)], 0.75), ([(0, 3), (1, 2)], 0.75),
                                  ([(0, 1, 2, 3)], Fraction(1, 2))])


# ---------------------------------------------------------------- topologies

def test_ring_pairs_neighbours_alternately():
    topo = topology.ring(4, 4)
    assert [m.groups for m in topo.mixings] == [((0, 1), (2, 3)), ((1, 2), (0, 3))]
    assert all(m.weight == Fraction(1, 2) for m in topo.mixings)


def test_one_peer_exp_pairs_at_growing_powers_of_two():
    topo = topology.one_peer_exp(8, 8)
    assert [m.groups for m in topo.mixings] == [
        ((0, 1), (2, 3), (4, 5), (6, 7)),
        ((0, 2), (1, 3), (4, 6), (5, 7)),
        ((0, 4), (1, 5), (2, 6), (3, 7))]


def test_alternating_exp_ring_staggers_node_pairs_as_decent_dp_does():
    topo = topology.alternating_exp_ring(8, 2)   # 4 nodes of 2 ranks
    inside = [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [m.groups for m in topo.mixings] == [
        ((0, 1), (2, 3), (4, 5, 6, 7)), ((0, 1, 2, 3), (4, 5), (6, 7)),    # nodes 1 apart
        ((0, 1), (4, 5), (2, 3, 6, 7)), ((0, 1, 4, 5), (2, 3), (6, 7))]    # nodes 2 apart
    assert all(m.weight is None for m in topo.mixings)
    assert topology.alternating_exp_ring(4, 2).mixings[0].groups == tuple(inside[:2])


def test_complete_is_the_mean_of_the_world():
    (mixing,) = topology.complete(3, 3).mixings
    assert mixing.groups == ((0, 1, 2),) and mixing.coefficients(1) is None


def test_coefficients_are_exact():
    # x <- 3/4 x + 1/4 x_j  ==  1/2 x + 1/4 (x + x_j)
    assert CUSTOM.mixings[0].coefficients(0) == (Fraction(1, 2), Fraction(1, 4))
    # w = 1/2 over 4 ranks: 1/2 x + 1/6 (the others) == 1/3 x + 1/6 (sum)
    assert CUSTOM.mixings[2].coefficients(3) == (Fraction(1, 3), Fraction(1, 6))


@pytest.mark.parametrize("make,world,local,match", [
    (topology.ring, 3, 3, "even number"),
    (topology.one_peer_exp, 6, 6, "power of 2"),
    (topology.alternating_exp_ring, 6, 2, "power of 2 number of nodes"),
    (topology.alternating_exp_ring, 4, 1, "one-peer-exp"),
])
def test_topologies_refuse_worlds_they_do_not_fit(make, world, local, match):
    with pytest.raises(TranspileError, match=match):
        make(world, local)


@pytest.mark.parametrize("steps,match", [
    ([([(0, 1)], None)], "exactly once"),
    ([([(0, 1), (1, 2, 3)], None)], "exactly once"),
    ([([(0,), (1, 2, 3)], None)], "two ranks or more"),
    ([([(0, 1), (2, 3)], 1.5)], r"\[0, 1\]"),
    ([], "no mixing"),
])
def test_a_topology_of_ones_own_is_checked(steps, match):
    with pytest.raises(TranspileError, match=match):
        topology.resolve(topology.of("mine", steps), 4, 4)


def test_topology_options_are_checked_at_transpile():
    with pytest.raises(TranspileError, match="one of complete, ring"):
        transpile(M.classify_step, mode="decentralized", topology="star")
    with pytest.raises(TranspileError, match="only to mode='decentralized'"):
        transpile(M.classify_step, mode="fuse_all_reduce", topology="ring")
    for option in (dict(check_every=1), dict(verify=1), dict(skip_nonfinite=True),
                   dict(fuse_dtype=torch.bfloat16), dict(hierarchical=True)):
        with pytest.raises(TranspileError, match="decentralized"):
            transpile(M.classify_step, mode="decentralized", **option)


# ---------------------------------------------------------------- program

def ring_context(ctx):
    """`ctx` (of rank 0 of 2) at the first step of the ring topology."""
    mesh = dataclasses.replace(ctx.mesh, rings={**ctx.mesh.rings,
                                                Peers(0, 2): ("peers0a", "peers0b")})
    return dataclasses.replace(ctx, mesh=mesh, gossip=topology.ring(2, 2).gossip(0, 0))


def test_golden_decentralized():
    program = _captured().program
    run_passes(program, MODES["decentralized"], ring_context(SMALL))
    _check_golden("decentralized", str(program))
    collectives = program.collectives()
    assert [n.meta["comm"].over for n in collectives] == [Peers(0, 2)] * len(collectives)
    # Issued before the forward pass, waited for right before the update.
    first_forward = next(n for n in program.graph.nodes if n.op == "call_function"
                         and n.meta["role"] & 1)
    order = {n: i for i, n in enumerate(program.graph.nodes)}
    assert all(order[n] < order[first_forward] for n in collectives)


def test_mix_params_needs_the_mixing():
    with pytest.raises(Exception, match="topology's mixing"):
        run_passes(_captured().program, MODES["decentralized"], SMALL)


# ---------------------------------------------------------------- on 4 ranks

def _groups(topo):
    """Plain torch's groups of every partition, created alike on every rank."""
    return {p: dist.new_subgroups_by_enumeration([list(g) for g in p])[0]
            for p in topo.partitions}


@torch.no_grad()
def _mix(p, mixing, group, rank):
    """x_i <- w x_i + (1 - w) / (|R| - 1) * sum(x_j, j in R, j != i), literally."""
    members = mixing.group_of(rank)
    everyone = [torch.empty_like(p) for _ in members]
    dist.all_gather(everyone, p.detach().clone(), group=group)
    others = functools.reduce(torch.add, [x for r, x in zip(members, everyone) if r != rank])
    w = 1 / len(members) if mixing.weight is None else float(mixing.weight)
    p.copy_(p * w + others * ((1 - w) / (len(members) - 1)))


def reference(model_name, opt_name, topo, steps=STEPS, clipped=False):
    """Each rank: forward and backward at its parameters, mix them with its group
    of this step, then its optimizer's update with its own gradient."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = M.make(model_name)
    opt = M.make_optimizer(opt_name, model)
    groups = _groups(topo)
    for t, batch in enumerate(M.batches(model_name, steps, 16)):
        mixing = topo.mixings[t % len(topo.mixings)]
        opt.zero_grad()
        x, y = M.shard(batch, rank, world_size)
        out = model(x)
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        if clipped:   # the rank's own gradient, before the mixing
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        for p in model.parameters():
            if p.grad is not None:   # what the optimizer updates
                _mix(p, mixing, groups[mixing.groups], rank)
        opt.step()
    return M.state_of(model, opt)


def rank_decentralized(model_name, opt_name, topo, backend="eager", steps=STEPS,
                       clipped=False):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if topo == "alternating-exp-ring":
        os.environ["LOCAL_WORLD_SIZE"] = "2"   # 2 nodes of 2 ranks
    try:
        model = M.make(model_name)
        opt = M.make_optimizer(opt_name, model)
        step = transpile(clip if clipped else M.step_fn(model_name), mode="decentralized",
                         topology=topo, backend=backend)
        for batch in M.batches(model_name, steps, 16):
            step(model, opt, *M.shard(batch, rank, world_size))
        resolved = step.schedule.resolved
        ops = {n.meta["comm"].over for p in step.programs.values() for n in p.collectives()}
        return (M.state_of(model, opt), reference(model_name, opt_name, resolved, steps, clipped),
                sorted(map(str, ops)), step.consensus_distance())
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)


TOPOLOGIES = ["complete", "ring", "one-peer-exp", "alternating-exp-ring", CUSTOM]


# Groups of two ranks with w = 1/2 mix bit for bit as the reference writes it;
# larger groups and other weights sum in another order (rounding).
@pytest.mark.parametrize("topo", TOPOLOGIES, ids=lambda t: getattr(t, "name", t))
@pytest.mark.parametrize("model_name,opt_name", [("mlp", "sgd"), ("tied", "adamw")])
def test_decentralized_equals_the_reference(topo, model_name, opt_name, ranks4):
    results = ranks4.run(rank_decentralized, model_name, opt_name, topo)
    tol = 0.0 if topo in ("ring", "one-peer-exp") else 1e-6
    for ours, ref, groups, distance in results:
        assert M.max_rel_error(ours, ref) <= tol
        assert groups and all(g.startswith("peers") for g in groups)
        assert distance > 0   # the ranks' parameters differ by design
    # every rank measured the same distance
    assert len({r[3] for r in results}) == 1


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_clipping_reads_the_ranks_own_gradient(opt_name, ranks4):
    for ours, ref, _, _ in ranks4.run(rank_decentralized, "mlp", opt_name, "ring",
                                      clipped=True):
        assert M.max_rel_error(ours, ref) == 0.0


def scaled_step(model, opt, x, y, scaler):
    opt.zero_grad()
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    return scaler._scale.clone()


def rank_loss_scaling():
    """GradScaler under gossip: rank 0's first two steps overflow. Its scaler
    skips its own update and backs off; the mixing of its parameters with its
    neighbour's stays, as in the reference (mix, then scaler.step)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    topo = topology.ring(world_size, world_size)
    groups = _groups(topo)
    results = []
    for transpiled in (True, False):
        model = M.make("mlp")
        opt = M.make_optimizer("sgd", model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20, growth_interval=2)
        step = transpile(scaled_step, mode="decentralized", topology=topo)
        scales = []
        for t, batch in enumerate(M.batches("mlp", STEPS, 16)):
            x, y = M.shard(batch, rank, world_size)
            if rank == 0 and t < 2:
                x = x * 1e36
            if transpiled:
                scales.append(step(model, opt, x, y, scaler).item())
                continue
            mixing = topo.mixings[t % len(topo.mixings)]
            opt.zero_grad()
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            scaler.unscale_(opt)
            for p in model.parameters():
                _mix(p, mixing, groups[mixing.groups], rank)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        results.append((M.state_of(model, opt), scales))
    return results


def test_loss_scaling_skips_a_ranks_own_update_and_keeps_its_mixing(ranks4):
    for rank, ((ours, scales), (ref, ref_scales)) in enumerate(ranks4.run(rank_loss_scaling)):
        assert M.max_rel_error(ours, ref) == 0.0
        assert scales == ref_scales
        skipped_twice, grew_twice = [2.0 ** 19, 2.0 ** 18, 2.0 ** 18, 2.0 ** 19], \
            [2.0 ** 20, 2.0 ** 21, 2.0 ** 21, 2.0 ** 22]
        assert scales == (skipped_twice if rank == 0 else grew_twice)


def test_inductor_compiles_every_phase(ranks4):
    for ours, ref, groups, _ in ranks4.run(rank_decentralized, "mlp", "adamw", "ring",
                                           "inductor"):
        assert M.max_rel_error(ours, ref) <= 1e-5
        assert groups == ["peers0", "peers1"]


def rank_complete_first_step():
    """One step of `complete` against DDP: the average of the ranks' new
    parameters is DDP's (mean gradient at equal parameters)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = M.make("mlp")
    opt = M.make_optimizer("sgd", model)
    ddp_model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ddp_opt = M.make_optimizer("sgd", ddp_model.module)
    step = transpile(M.classify_step, mode="decentralized", topology="complete")
    batch = M.shard(M.batches("mlp", 1, 16)[0], rank, world_size)
    step(model, opt, *batch)
    M.classify_step(ddp_model, ddp_opt, *batch)
    before = step.consensus_distance()
    step.global_average()
    after = step.consensus_distance()
    return M.state_of(model, opt), M.state_of(ddp_model.module, ddp_opt), before, after


def test_complete_averages_to_ddp_after_one_step(ranks4):
    for ours, ddp, before, after in ranks4.run(rank_complete_first_step):
        params = {k: v for k, v in ours.items() if k.startswith("model.")}
        assert M.max_rel_error(params, {k: ddp[k] for k in params}) <= 1e-6
        assert before > 0 and after == 0.0


def rank_global_average_of_buffers():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = M.make("bn")
    opt = M.make_optimizer("sgd", model)
    step = transpile(M.classify_step, mode="decentralized", topology="ring")
    for batch in M.batches("bn", 3, 16):
        step(model, opt, *M.shard(batch, rank, world_size))
    mean_before = model.bn.running_mean.clone()
    params_only = copy.deepcopy(model.state_dict())
    step.global_average()
    untouched = torch.equal(model.bn.running_mean, mean_before)
    step.global_average(buffers=True)
    everyone = [torch.empty_like(mean_before) for _ in range(world_size)]
    dist.all_gather(everyone, mean_before)
    return (untouched, model.state_dict(), params_only,
            torch.allclose(model.bn.running_mean, sum(everyone) / world_size, atol=1e-7))


def test_global_average_makes_the_ranks_equal(ranks4):
    results = ranks4.run(rank_global_average_of_buffers)
    first = results[0][1]
    for untouched, state, before, buffers_are_the_mean in results:
        assert untouched and buffers_are_the_mean
        assert all(torch.equal(first[k], v) for k, v in state.items())
    # before the average the ranks differed
    assert any(not torch.equal(results[0][2][k], results[1][2][k]) for k in results[0][2])


def _train(model, opt, step, batches, rank, world_size):
    for batch in batches:
        step(model, opt, *M.shard(batch, rank, world_size))


def rank_resume(steps_before):
    """Stop after `steps_before` steps (the topology's phase then odd or even),
    resume fresh objects from the state_dicts: equal to the unbroken run."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = M.batches("mlp", 6, 16)

    def fresh():
        model = M.make("mlp", seed=3)
        return (model, M.make_optimizer("adamw", model),
                transpile(M.classify_step, mode="decentralized", topology="one-peer-exp"))

    model, opt, step = fresh()
    _train(model, opt, step, batches, rank, world_size)
    unbroken = M.state_of(model, opt)
    model, opt, step = fresh()
    _train(model, opt, step, batches[:steps_before], rank, world_size)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                           "step": step.state_dict()})
    model, opt, step = fresh()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    step.load_state_dict(saved["step"])
    _train(model, opt, step, batches[steps_before:], rank, world_size)
    return unbroken, M.state_of(model, opt)


def test_resume_equals_the_unbroken_run(ranks4):
    for unbroken, resumed in ranks4.run(rank_resume, 3):
        assert M.max_rel_error(resumed, unbroken) == 0.0


def rank_ring_on_three():
    model = M.make("mlp")
    step = transpile(M.classify_step, mode="decentralized", topology="ring")
    try:
        step(model, M.make_optimizer("sgd", model),
             *M.shard(M.batches("mlp", 1, 12)[0], dist.get_rank(), 3))
    except TranspileError as exc:
        return str(exc)
    return None


def test_a_topology_that_does_not_fit_the_world_raises_on_every_rank(ranks3):
    assert all("even number of ranks" in msg for msg in ranks3.run(rank_ring_on_three))
