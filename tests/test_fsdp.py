"""Mode fsdp (ZeRO-3): parameters kept as shards between steps, each bucket
gathered before its first use; against torch DDP with its defaults, same
processes, each rank its own batch."""

from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from tests import test_training_loops as loops
from tests.test_fuse_all_reduce import SMALL
from tests.test_passes import _captured, _check_golden
from transpiler import TranspileError, run_passes, transpile
from transpiler.modes import MODES
from transpiler.program.roles import GATHERED, ROLE, Role
from transpiler.lowering.shards import shard_numel

TINY_BUCKETS = {"bucket_mb": 0.002, "first_bucket_mb": 0.001}   # several buckets
DEEP = [16, 32, 32, 32, 32, 4]     # an MLP whose backward reads three buckets


def rank_vs_ddp(model_name: str, opt_name: str, buckets: dict):
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = M.make(model_name), M.make(model_name)
    opts = [M.make_optimizer(opt_name, m) for m in (model, ref)]
    ddp = DDP(ref, find_unused_parameters=model_name == "tied")
    step, step_fn = transpile(M.step_fn(model_name), mode="fsdp", **buckets), M.step_fn(model_name)
    losses = []
    for batch in M.batches(model_name, 4, 12):
        x, y = M.shard(batch, rank, world)
        losses.append((step(model, opts[0], x, y).item(), step_fn(ddp, opts[1], x, y).item()))
    trained = [p for p in model.parameters() if p.requires_grad and p.grad is None
               and p in opts[0].state]
    between = {"params": sum(p.untyped_storage().nbytes() for p in model.parameters()),
               "untrained": sum(p.numel() * p.element_size() for p in model.parameters()
                                if not any(p is q for q in trained)),
               "shards": sum(t.nbytes for t in step._held.tensors.values()),
               "expected_shards": sum(shard_numel(p.numel(), world) * p.element_size()
                                      for p in trained)}
    gathers = sum(node.meta["comm"].op == "all_gather" for node in step.program.collectives())
    x = M.batches(model_name, 1, 4, seed=7)[0][0]
    with pytest.raises(TranspileError, match="inside `with step.unsharded"):
        model(x)    # released parameters: refused, not read
    # A new batch size traces the step again on the released parameters.
    x, y = M.shard(M.batches(model_name, 1, 5 * world, seed=3)[0], rank, world)
    losses.append((step(model, opts[0], x, y).item(), step_fn(ddp, opts[1], x, y).item()))
    traces = step._cache.builds
    with step.unsharded():
        # an evaluation (DDP's through its wrapper, which broadcasts rank 0's
        # buffers first), then the states as each evaluated
        model.eval(), ddp.eval()
        with torch.no_grad():
            evaluated = (model(x) - ddp(x)).abs().max().item()
        error = M.max_rel_error(M.state_of(model, opts[1].__class__([torch.zeros(1)], lr=0.1)),
                                M.state_of(ref, opts[1].__class__([torch.zeros(1)], lr=0.1)))
    released = sum(p.untyped_storage().nbytes() for p in model.parameters())
    return {"error": error, "losses": losses, "between": between, "gathers": gathers,
            "evaluated": evaluated, "released": released, "traces": traces}


@pytest.mark.parametrize("world_size, model_name, opt_name, buckets", [
    (2, "mlp", "sgd", {}), (2, "mlp", "adamw", TINY_BUCKETS), (3, "mlp", "sgd", TINY_BUCKETS),
    (3, "tied", "adamw", {}), (2, "bn", "sgd", TINY_BUCKETS)])
def test_fsdp_trains_as_ddp_with_parameters_sharded_between_steps(
        world_size, model_name, opt_name, buckets, ranks2, ranks3):
    pool = ranks2 if world_size == 2 else ranks3
    for result in pool.run(rank_vs_ddp, model_name, opt_name, buckets):
        # SGD and AdamW to float32 rounding (bit for bit on 2 ranks: the
        # average's 1/N is exact; on 3 ranks it rounds before the sum).
        bound = 0.0 if world_size == 2 else 1e-6
        assert result["error"] <= bound
        assert all(abs(a - b) <= bound * max(1.0, abs(b)) for a, b in result["losses"])
        between = result["between"]
        # Between steps a rank holds its shards (1/N, padded) and only the
        # parameters the step does not train (frozen, unused) in full.
        assert between["params"] == between["untrained"]
        assert between["shards"] == between["expected_shards"]
        assert result["gathers"] >= 1
        assert result["evaluated"] <= bound * 10 and result["released"] == between["untrained"]
        assert result["traces"] == 2


def test_fsdp_refuses_what_it_does_not_combine_with():
    with pytest.raises(TranspileError, match="verify"):
        transpile(M.classify_step, mode="fsdp", verify=True)


# What scripts do with the parameters between steps; each reads their values.
READS = {
    "p.sum()": lambda model, opt, ema: next(model.parameters()).sum(),
    "EMA update": lambda model, opt, ema: ema.update_parameters(model),
    "torch.save(p)": lambda model, opt, ema: torch.save(next(model.parameters()), io.BytesIO()),
    "copy.deepcopy(model)": lambda model, opt, ema: copy.deepcopy(model),
    "model.state_dict()": lambda model, opt, ema: model.state_dict(),
    "p.data": lambda model, opt, ema: next(model.parameters()).data.clone(),
    "in-place write": lambda model, opt, ema: next(model.parameters()).mul_(0.5),
    # (torch's load_state_dict gathers each parameter's error into a RuntimeError)
    "load_state_dict": lambda model, opt, ema: model.load_state_dict(
        {k: torch.zeros(v.shape) for k, v in model.state_dict(keep_vars=True).items()}),
}


def rank_reads_released(read: str):
    """Two steps, then a read of the released parameters: a TranspileError
    naming the parameter and step.unsharded(), nothing written; training
    goes on as DDP's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = M.make("mlp"), M.make("mlp")
    opts = [M.make_optimizer("adamw", m) for m in (model, ref)]
    ema = torch.optim.swa_utils.AveragedModel(M.make("mlp"))
    step, ddp = transpile(M.classify_step, mode="fsdp"), DDP(ref)
    batches = [M.shard(b, rank, world) for b in M.batches("mlp", 3, 12)]
    for x, y in batches[:2]:
        step(model, opts[0], x, y), M.classify_step(ddp, opts[1], x, y)
    with pytest.raises(RuntimeError if read == "load_state_dict" else TranspileError,
                       match=r"\S+ is kept as shards .* step\.unsharded\(\)"):
        READS[read](model, opts[0], ema)
    step(model, opts[0], *batches[2]), M.classify_step(ddp, opts[1], *batches[2])
    with step.unsharded():
        return M.max_rel_error(dict(model.state_dict()), dict(ref.state_dict()))


@pytest.mark.parametrize("read", READS)
def test_a_read_of_released_parameters_raises_and_nothing_changes(read, ranks2):
    assert ranks2.run(rank_reads_released, read) == [0.0, 0.0]


def _encoder_step(model, opt, x):
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss


def rank_evaluates_as_ddp():
    """Steps in mode fsdp, then an evaluation inside step.unsharded(): the
    model's own code takes DDP's path. (A forward hook on a module turns off
    torch's fast path of nn.TransformerEncoderLayer in eval mode, which rounds
    otherwise: the transpiler registers none.)"""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    ref = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    step, ddp = transpile(_encoder_step, mode="fsdp"), DDP(ref)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x = torch.randn(3, 5, 16, generator=g)
        step(model, opts[0], x), _encoder_step(ddp, opts[1], x)
    hooked = [n for n, m in model.named_modules() if m._forward_pre_hooks or m._forward_hooks]
    x = torch.randn(3, 5, 16, generator=g)
    with torch.no_grad(), step.unsharded():
        ours = model.eval()(x)
    with torch.no_grad():
        theirs = ref.eval()(x)
    return hooked, torch.equal(ours, theirs)


def test_an_evaluation_after_steps_takes_ddps_path(ranks2):
    assert ranks2.run(rank_evaluates_as_ddp) == [([], True)] * 2


# ------------------------------------------------------------------ resharding

def _gathered_reads(program) -> list[tuple[str, str]]:
    """For each gathered parameter value in graph order: its name and which
    passes read it or a view of it ("forward", "backward" or "both")."""
    reads = []
    for node in program.graph.nodes:
        if GATHERED in node.meta:
            roles, todo = set(), [node]
            while todo:
                for user in todo.pop().users:
                    roles.add("backward" if user.meta[ROLE] & Role.BACKWARD else "forward")
                    if getattr(user.target, "is_view", False):
                        todo.append(user)
            reads.append((node.meta[GATHERED], "both" if len(roles) == 2 else roles.pop()))
    assert all(passes for _, passes in reads)
    return reads


@pytest.mark.parametrize("reshard", [True, False])
def test_golden_fsdp(reshard):
    """Where each bucket is gathered, freed and reduce-scattered: with
    reshard_after_forward a gathered value is read by one pass only, but
    for the bucket read last in the forward pass, which the backward pass
    reads next."""
    program = _captured("mlp").program
    run_passes(program, MODES["fsdp"], dataclasses.replace(SMALL, reshard_after_forward=reshard))
    if reshard:
        _check_golden("fsdp", str(program))
    gathers = [n.meta["comm"] for n in program.collectives() if n.meta["comm"].op == "all_gather"]
    reads = _gathered_reads(program)
    kept = {name for name, passes in reads if passes == "both"}
    buckets = {b.bucket: b.params for b in gathers}
    if reshard:
        first_backward = next(n for n in program.graph.nodes
                              if n.meta.get(ROLE, Role(0)) & Role.BACKWARD)
        last_forward_gather = [n for n in program.collectives() if n.meta["comm"].op == "all_gather"
                               and next(iter(n.users)) < first_backward][-1]
        # Only the bucket gathered last for the forward pass spans both.
        assert kept and kept <= set(last_forward_gather.meta["comm"].params)
        regathered = [b.params for b in gathers if gathers.count(b) == 2]
        assert len(gathers) > len(buckets) and regathered
        # A bucket is gathered again for the values the backward pass reads.
        assert all(any((p, "backward") in reads for p in b) for b in regathered)
    else:
        assert len(gathers) == len(buckets)
        assert kept and all(passes != "backward" for _, passes in reads)


def rank_deep_vs_ddp(fn_name: str, reshard: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, ref = M.MLP(DEEP), M.MLP(DEEP)
    ref.load_state_dict(model.state_dict())
    opts = [M.make_optimizer("adamw", m) for m in (model, ref)]
    fn = loops.STEP_FNS[fn_name] if fn_name in loops.STEP_FNS else M.step_fn("mlp")
    step = transpile(fn, mode="fsdp", reshard_after_forward=reshard, **TINY_BUCKETS)
    ddp = DDP(ref)
    losses = []
    for batch in M.batches("mlp", 3, 24):
        x, y = M.shard(batch, rank, world)
        losses.append(torch.equal(step(model, opts[0], x, y), fn(ddp, opts[1], x, y)))
    gathers = [n.meta["comm"].bucket for n in step.program.collectives()
               if n.meta["comm"].op == "all_gather"]
    with step.unsharded():
        error = M.max_rel_error(dict(model.named_parameters()), dict(ref.named_parameters()))
    full = step.full_optimizer_state_dict(opts[0])["state"]
    error = max([error] + [M.max_rel_error(full[i], s) for i, s in opts[1].state_dict()["state"].items()])
    return error, losses, gathers


@pytest.mark.parametrize("fn_name", ["classify", "accumulate"])
def test_resharding_trains_as_ddp_bit_for_bit(fn_name, ranks2):
    """Gathering again for the backward pass (and for each micro-batch's)
    changes no value: AdamW equals DDP bit for bit with and without it."""
    counts = {}
    for reshard in (True, False):
        for error, losses, gathers in ranks2.run(rank_deep_vs_ddp, fn_name, reshard):
            assert error == 0.0 and all(losses)
        counts[reshard] = len(gathers), len(set(gathers))
        assert len(set(gathers)) >= 4    # several buckets
    # Without resharding each bucket is gathered once a step; with it again
    # for each pass that reads it (two micro-batches: four passes).
    assert counts[False][0] == counts[False][1] and counts[True][0] > counts[False][0]


# ------------------------------------------------------------------ FSDP2

def rank_vs_fsdp2(opt_name: str):
    """The same step under torch's FSDP2 (fully_shard per block, then the
    root: the bench's configuration) and under mode fsdp, same processes."""
    from transpiler.bench.bench import CONFIGS
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = M.make("mlp"), M.make("mlp")
    opts = [M.make_optimizer(opt_name, m) for m in (model, ref)]
    theirs = CONFIGS["fsdp2"](M.classify_step, ref, opts[1])
    step = transpile(M.classify_step, mode="fsdp", **TINY_BUCKETS)
    losses = []
    for batch in M.batches("mlp", 4, 12):
        x, y = M.shard(batch, rank, world)
        losses.append((step(model, opts[0], x, y).item(), theirs(x, y).item()))
    with step.unsharded():
        error = max(M.max_rel_error({"p": p.detach()}, {"p": q.full_tensor()})
                    for p, q in zip(model.parameters(), ref.parameters()))
    return error, losses


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_fsdp_trains_as_torch_fsdp2(opt_name, ranks2):
    for error, losses in ranks2.run(rank_vs_fsdp2, opt_name):
        # FSDP2 divides the gradients before and after its reduce-scatter
        # (a different rounding of the same average).
        assert error <= 1e-6
        assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in losses)
