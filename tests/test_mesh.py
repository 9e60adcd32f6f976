"""Reductions on a mesh: hierarchical all-reduce over simulated nodes (4 gloo
ranks, LOCAL_WORLD_SIZE=2) against the flat all-reduce; parameters reduced over
their own groups against a hand-written reference; the pass lists that would
reduce twice or never, refused at transpile()."""

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from tests import models as M
from tests.test_passes import MAIN, _captured, _check_golden
from transpiler import PassError, TranspileError, run_passes, transpile
from transpiler.program.collectives import REDUCE_SCATTER
from transpiler.program.mesh import Dim, Mesh, UserGroup
from transpiler.modes import MODES
from transpiler.capture import flatten_args, trace_step
from transpiler.lowering.context import PassContext
from transpiler.lowering.reduce_groups import check_program

STEPS, BATCH = 5, 8
MESH_2X2 = Mesh(4, 0, 2, {Dim.WORLD: ("w0", "w1"), Dim.NODE: ("n0", "n1"),
                          Dim.ACROSS: ("a0", "a1")})


# ------------------------------------------------------------- programs

def test_golden_hierarchical_fuse():
    program = _captured().program
    run_passes(program, MODES["fuse_all_reduce"], PassContext(mesh=MESH_2X2, hierarchical=True))
    _check_golden("fuse_hierarchical", str(program))


def test_golden_reduce_group():
    """layers.0.weight over a user's group of 2, the rest over the world."""
    program = _captured().program
    mesh = dataclasses.replace(MESH_2X2, local_size=4, rings={
        Dim.WORLD: ("w0", "w1"), UserGroup(0, 2): ("g0",)})
    ctx = PassContext(mesh=mesh, groups={"layers.0.weight": UserGroup(0, 2)})
    run_passes(program, MAIN, ctx)
    _check_golden("main_reduce_group", str(program))


def _clipping_step(per_group: bool):
    def step(model, opt, x, y):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        experts = list(model.layers[0].parameters())
        if per_group:
            torch.nn.utils.clip_grad_norm_(experts, 1.0)
            torch.nn.utils.clip_grad_norm_(model.layers[1].parameters(), 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return step


@pytest.mark.parametrize("per_group", [False, True])
def test_values_from_a_group_must_not_reach_the_worlds_state(per_group):
    """A norm over every gradient mixes the group's sums into the world's update."""
    torch.manual_seed(0)
    model = M.MLP([4, 8, 3])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _clipping_step(per_group)
    args = (model, opt, torch.randn(4, 4), torch.randint(0, 3, (4,)))
    program = trace_step(step, flatten_args(step, args, {})).program
    group = UserGroup(0, 2)
    mesh = dataclasses.replace(MESH_2X2, local_size=4,
                               rings={Dim.WORLD: ("w0",), group: ("g0",)})
    ctx = PassContext(mesh=mesh, groups={"layers.0.weight": group, "layers.0.bias": group})
    run_passes(program, MAIN, ctx)
    if per_group:
        check_program(program, ctx.groups)
    else:
        with pytest.raises(TranspileError, match="from gradients reduced over a group"):
            check_program(program, ctx.groups)


@pytest.mark.parametrize("passes, match", [
    (["average_grads", "insert_allreduce", "coalesce_tensors"],
     "coalesce_tensors acts on the values marked to reduce.*insert_allreduce already acted"),
    (["average_grads", "coalesce_tensors", "insert_allreduce"],
     "insert_allreduce acts on .*coalesce_tensors already acted"),
    (["average_grads"], "average_grads leaves values marked to reduce.*no pass after it"),
    (["insert_allreduce"], "no pass before it leaves them"),
])
def test_pass_lists_that_reduce_twice_or_never_are_refused(passes, match):
    with pytest.raises(PassError, match=match):
        transpile(M.classify_step, passes=passes)


def test_reduce_groups_are_checked():
    model = M.make("mlp")
    with pytest.raises(TranspileError, match="not a process group.*nor Dim.NODE or Dim.ACROSS"):
        transpile(M.classify_step, reduce_groups=[(Dim.WORLD, model.parameters())])
    with pytest.raises(TranspileError, match="must be a pair"):
        transpile(M.classify_step, reduce_groups=[model.parameters()])


# ---------------------------------------------------------------- ranks

def _train(mode, options, model, opt_name="adamw", steps=STEPS):
    """`steps` steps of the transpiled step on this rank's shard; the state after."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    opt = M.make_optimizer(opt_name, model)
    step = transpile(M.classify_step, mode=mode, **options)
    for batch in M.batches("mlp", steps, BATCH):
        step(model, opt, *M.shard(batch, rank, world_size))
    return M.state_of(model, opt), step


def rank_hierarchical_equals_flat(mode, backend):
    """The flat eager step against the hierarchical one run by `backend`."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        extra = {"k_steps": 2} if mode == "local_sgd" else {}
        flat, _ = _train(mode, extra, M.make("mlp"))
        hier, step = _train(mode, {"hierarchical": True, "backend": backend, **extra},
                            M.make("mlp"))
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    ops = [n.target for p in step.programs.values() for n in p.collectives()]
    return M.max_rel_error(hier, flat), ops.count(REDUCE_SCATTER)


@pytest.mark.parametrize("mode, backend", [("grad_allreduce", "eager"),
                                           ("fuse_all_reduce", "eager"),
                                           ("local_sgd", "eager"),
                                           pytest.param("fuse_all_reduce", "inductor",
                                                        marks=pytest.mark.slow)])
def test_hierarchical_equals_flat_on_two_nodes_of_two(ranks4, mode, backend):
    for error, reduce_scatters in ranks4.run(rank_hierarchical_equals_flat, mode, backend):
        assert reduce_scatters > 0   # the hierarchy ran: a reduce-scatter inside the node
        assert error < 1e-6          # the sums differ only in the order of their terms


def _expert_groups():
    """Ranks {0, 2} and {1, 3}: each pair holds the same "experts"."""
    group, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    return group


def _reference(mode, steps=STEPS):
    """Plain torch: every rank starts from rank 0's model except the experts
    (layer 2), which start from their group's first rank; each step averages the
    experts' gradients over the group (times 1 / 2, summed) and the rest over
    the world, as DDP would, before the optimizer steps."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = _expert_groups()
    model, experts = _experts_model(rank)
    for p in model.parameters():
        if any(p is e for e in experts):
            dist.broadcast(p.data, group_src=0, group=group)
        else:
            dist.broadcast(p.data, src=0)
    opt = M.make_optimizer("sgd", model)
    for batch in M.batches("mlp", steps, BATCH):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(M.shard(batch, rank, world_size)[0]),
                                                 M.shard(batch, rank, world_size)[1])
        loss.backward()
        for p in model.parameters():
            mine = any(p is e for e in experts)
            p.grad.mul_(1 / (2 if mine else world_size))
            dist.all_reduce(p.grad, group=group if mine else None)
        opt.step()
    return M.state_of(model, opt)


def _experts_model(rank):
    """The MLP with its last layer initialized per expert group (rank % 2)."""
    model = M.make("mlp", seed=rank)
    experts = list(model.layers[-1].parameters())
    return model, experts


def rank_reduce_groups(mode, given_as):
    rank = dist.get_rank()
    expected = _reference(mode)
    model, experts = _experts_model(rank)
    # With 2 ranks per node, the ranks across nodes are the same pairs.
    group = _expert_groups() if given_as == "process group" else Dim.ACROSS
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        got, _ = _train(mode, {"reduce_groups": [(group, experts)]}, model, "sgd")
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    weight = got["model.layers.2.weight"]
    everyone = [torch.empty_like(weight) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, weight)
    return M.max_rel_error(got, expected), [(w - everyone[0]).abs().max().item() for w in everyone]


@pytest.mark.parametrize("mode, given_as", [("grad_allreduce", "process group"),
                                            ("fuse_all_reduce", "mesh dimension")])
def test_reduce_groups_equal_a_hand_written_reference(ranks4, mode, given_as):
    results = ranks4.run(rank_reduce_groups, mode, given_as)
    for error, _ in results:
        assert error < 1e-6
    experts_vs_rank0 = results[0][1]
    assert experts_vs_rank0[2] == 0 and experts_vs_rank0[1] > 1e-3   # groups {0, 2} and {1, 3}
