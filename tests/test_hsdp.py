"""Hybrid sharding (mode zero and mode fsdp with hierarchical=True): the
shards spread over each node's ranks, replicated across the nodes. The
program's collectives on a 2 x 2 mesh, and training on 4 gloo ranks as 2
simulated nodes (LOCAL_WORLD_SIZE=2) against torch DDP with its defaults
running the same step in the same processes. On two torchrun agents:
tests/test_multinode.py."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from tests import test_training_loops as loops
from tests.test_mesh import MESH_2X2
from tests.test_passes import _captured
from transpiler import TranspileError, run_passes, transpile
from transpiler.program.collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from transpiler.program.mesh import Dim
from transpiler.modes import MODES
from transpiler.lowering.context import PassContext
from transpiler.program.program import InputKind
from transpiler.lowering.shards import shard_numel

TINY_BUCKETS = dict(bucket_mb=2048 / 2**20, first_bucket_mb=256 / 2**20)   # several buckets
STEPS, BATCH = 4, 16


# ------------------------------------------------------------------ programs

def _program(mode: str, rank: int = 0, native: bool = True):
    program = _captured().program
    mesh = dataclasses.replace(MESH_2X2, rank=rank, reduce_scatter_native=native)
    run_passes(program, MODES[mode], PassContext(mesh=mesh, hierarchical=True, **TINY_BUCKETS))
    return program


def _overs(program, target) -> list[Dim]:
    return [n.meta["comm"].over for n in program.collectives() if n.target is target]


@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_gradients_scattered_in_the_node_and_all_reduced_across(mode):
    program = _program(mode)
    scatters = _overs(program, REDUCE_SCATTER)
    assert scatters and set(scatters) == {Dim.NODE}
    # each reduce-scattered bucket's shard all-reduced across the nodes, and nothing over the world
    assert _overs(program, ALL_REDUCE) == [Dim.ACROSS] * len(scatters)
    gathers = [n for n in program.collectives() if n.target is ALL_GATHER]
    assert len(gathers) == len(scatters)
    # over the node's 2 ranks, on its rings
    assert all(g.args[1] == 2 and g.args[2] in MESH_2X2.rings[Dim.NODE] for g in gathers)
    # The state (and in fsdp the held parameter shards) hold ceil(n / 2) elements.
    for node in program.placeholders:
        spec = node.meta["input"]
        if spec.kind is InputKind.STATE or spec.kind is InputKind.HELD:
            full = _captured().program.input_node(spec.param).meta["val"]
            assert tuple(node.meta["val"].shape) == (shard_numel(full.numel(), 2),)


def test_on_gloo_the_node_all_reduces_and_each_rank_views_its_local_row():
    program = _program("zero", rank=3, native=False)
    ops = [(n.target, n.meta["comm"].over) for n in program.collectives()]
    assert REDUCE_SCATTER not in {t for t, _ in ops}
    node_sums = [n for n in program.collectives()
                 if n.target is ALL_REDUCE and n.meta["comm"].over is Dim.NODE]
    assert node_sums
    for node in node_sums:
        (wait,) = node.users
        (rows,) = wait.users
        (row,) = [u for u in rows.users if u.target is torch.ops.aten.select.int]
        assert rows.args[1][0] == 2 and row.args[1:] == (0, 1)   # rank 3: local rank 1


# ------------------------------------------------------------------ against DDP

STEPS_FNS = {"classify": M.classify_step, "clip": loops.clip}   # clip: the norm over shards


def _floats(returned) -> list[float]:
    return [float(t) for t in (returned if isinstance(returned, tuple) else (returned,))]


def rank_vs_ddp(mode: str, opt_name: str, step_name: str = "classify"):
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        return _vs_ddp(mode, opt_name, STEPS_FNS[step_name])
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


def _vs_ddp(mode: str, opt_name: str, step_fn):
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = M.make("mlp"), M.make("mlp")
    opt, ref_opt = M.make_optimizer(opt_name, model), M.make_optimizer(opt_name, ref)
    ddp = DDP(ref)
    step = transpile(step_fn, mode=mode, hierarchical=True, **TINY_BUCKETS)
    losses = []
    for batch in M.batches("mlp", STEPS, BATCH):
        x, y = M.shard(batch, rank, world)
        losses += zip(_floats(step(model, opt, x, y)), _floats(step_fn(ddp, ref_opt, x, y)))
    numel = {name: p.numel() for name, p in model.named_parameters()}
    state_shapes = {name: {k: tuple(v.shape) for k, v in opt.state[p].items() if v.dim()}
                    for name, p in model.named_parameters()}
    shards = torch.cat([v.reshape(-1) for st in opt.state.values() for v in st.values()
                        if v.dim()])
    full_state = step.full_optimizer_state_dict(opt)["state"]
    ref_state = ref_opt.state_dict()["state"]
    state_error = max(M.max_rel_error({k: v for k, v in full_state[i].items() if v.dim()},
                                      {k: v for k, v in ref_state[i].items() if v.dim()})
                      for i in ref_state)
    out = {"losses": losses, "numel": numel, "state_shapes": state_shapes,
           "state_error": state_error, "shards": shards}
    if mode == "fsdp":
        out["param_shard_bytes"] = step.parameter_shard_bytes
        out["held"] = {name: tuple(t.shape) for name, t in step._held.tensors.items()}
        out["between"] = sum(p.untyped_storage().nbytes() for p in model.parameters())
        with step.unsharded():
            out["param_error"] = M.max_rel_error(dict(model.named_parameters()),
                                                 dict(ref.named_parameters()))
    else:
        out["param_error"] = M.max_rel_error(dict(model.named_parameters()),
                                             dict(ref.named_parameters()))
    # torch.distributed.checkpoint of node-sharded state is refused, the state untouched.
    before = [v.clone() for st in opt.state.values() for v in st.values()]
    try:
        step.sharded_optimizer_state_dict(opt)
        out["dcp"] = None
    except TranspileError as exc:
        out["dcp"] = str(exc)
    out["untouched"] = all(a.equal(b) for a, b in zip(
        before, [v for st in opt.state.values() for v in st.values()]))
    return out


@pytest.mark.parametrize("mode, opt_name, step_name", [
    ("zero", "sgd", "classify"), ("zero", "adamw", "classify"), ("fsdp", "sgd", "classify"),
    ("fsdp", "adamw", "classify"), ("fsdp", "sgd", "clip")])
def test_hybrid_sharding_trains_as_ddp_on_two_nodes_of_two(ranks4, mode, opt_name, step_name):
    results = ranks4.run(rank_vs_ddp, mode, opt_name, step_name)
    for rank, result in enumerate(results):
        # The gradient's four terms are summed as (node 0) + (node 1), DDP's
        # gloo all-reduce in its ring's order: equal up to float32 rounding.
        assert result["param_error"] <= 1e-6 and result["state_error"] <= 1e-6
        assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in result["losses"])
        for name, shapes in result["state_shapes"].items():
            assert set(shapes.values()) == {(shard_numel(result["numel"][name], 2),)}
        if mode == "fsdp":
            assert result["between"] == 0   # the parameters hold no storage between steps
            assert result["param_shard_bytes"] == sum(shard_numel(n, 2) * 4
                                                      for n in result["numel"].values())
        assert "torch.distributed.checkpoint" in result["dcp"] and result["untouched"]
    # Local rank r of each node holds the same shards: replicated across the nodes.
    assert results[0]["shards"].equal(results[2]["shards"])
    assert results[1]["shards"].equal(results[3]["shards"])
    assert not results[0]["shards"].equal(results[1]["shards"])
