"""Mode zero (shard_optimizer): the layout, the golden listing, and training
on 2 and 3 ranks against torch DDP running the same step in the same
processes; the optimizer state held as shards; full state_dicts and resuming."""

import dataclasses
from math import inf

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from passes.shard_optimizer import BucketLayout, plan_layout
from tests import models as M
from tests import test_training_loops as loops
from tests.test_fuse_all_reduce import SMALL
from tests.test_passes import _captured, _check_golden
from tests.test_training_loops import clip, zero_grad_after_step, zero_grad_keep_tensors
from transpiler import TranspileError, run_passes, transpile
from transpiler.modes import MODES
from transpiler.lowering.shards import shard_numel, shard_of

TINY_BUCKETS = dict(bucket_mb=2048 / 2**20, first_bucket_mb=256 / 2**20)
STEPS = 4


# ------------------------------------------------------------------ layout

def test_shards_follow_chunk_boundaries_with_padding():
    x = torch.arange(10.0)
    shards = [shard_of(x, r, 4) for r in range(4)]
    assert shard_numel(10, 4) == 3 and all(s.shape == (3,) for s in shards)
    assert torch.cat(shards)[:10].equal(x)
    assert shards[3].tolist() == [9.0, 0.0, 0.0]   # the rest is padding
    # torch.chunk's boundaries (DTensor's Shard(0)): the same elements per rank.
    for r, chunk in enumerate(x.chunk(4)):
        assert shards[r][:chunk.numel()].equal(chunk)
    # A matrix is cut in its flat order.
    m = torch.arange(6.0).view(2, 3)
    assert shard_of(m, 1, 2).tolist() == [3.0, 4.0, 5.0]


def test_layout_is_a_function_of_the_buckets():
    layout = plan_layout([["w", "b"], ["v"]], {"w": 12, "b": 3, "v": 1}, 2)
    assert layout == [BucketLayout(("w", "b"), (6, 2)), BucketLayout(("v",), (1,))]
    assert [bucket.row for bucket in layout] == [8, 1]


# ------------------------------------------------------------------ golden

def test_golden_zero():
    program = _captured().program
    run_passes(program, MODES["zero"], SMALL)   # two buckets
    _check_golden("zero", str(program))
    ops = [node.meta["comm"].op for node in program.collectives()]
    assert ops.count("reduce_scatter") == ops.count("all_gather") >= 1
    # The state inputs hold shards: ceil(numel / 2) elements of each parameter's.
    for node in program.placeholders:
        spec = node.meta["input"]
        if spec.kind.value == "state":
            full = program.input_node(spec.param).meta["val"]
            assert tuple(node.meta["val"].shape) == (shard_numel(full.numel(), 2),)
    # No gradient is an output: each rank holds only its shard.
    assert not [s for s in program.outputs if s.kind.value == "grad"]


def test_on_gloo_a_bucket_is_all_reduced_and_its_row_viewed():
    program = _captured().program
    mesh = dataclasses.replace(SMALL.mesh, rank=1, reduce_scatter_native=False)
    run_passes(program, MODES["zero"], dataclasses.replace(SMALL, mesh=mesh))
    ops = [node.meta["comm"].op for node in program.collectives()]
    assert ops.count("all_reduce") == ops.count("all_gather") >= 2 and "reduce_scatter" not in ops
    for node in program.collectives():
        if node.meta["comm"].op == "all_reduce":
            (wait,) = node.users
            (rows,) = wait.users
            (row,) = rows.users
            # This rank's row of the [2, L] bucket, a view: no copy.
            assert rows.args[1] == [2, row.meta["val"].numel()]
            assert row.target is torch.ops.aten.select.int and row.args[1:] == (0, 1)


# ------------------------------------------------------------------ against DDP

def _ddp_and_zero(model_name, opt_name, step_fn, steps=STEPS):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, ref = M.make(model_name), M.make(model_name)
    opt, ref_opt = M.make_optimizer(opt_name, model), M.make_optimizer(opt_name, ref)
    ddp = DDP(ref, find_unused_parameters=model_name == "tied")
    step = transpile(step_fn, mode="zero", **TINY_BUCKETS)
    returned = []
    for batch in M.batches(model_name, steps, 12):
        local = M.shard(batch, rank, world_size)
        ours, theirs = step(model, opt, *local), step_fn(ddp, ref_opt, *local)
        returned.append((ours, theirs))
    M.as_next_forward_sees(ddp)
    return model, opt, ref, ref_opt, step, returned


def rank_vs_ddp(model_name, opt_name):
    model, opt, ref, ref_opt, step, returned = _ddp_and_zero(
        model_name, opt_name, M.step_fn(model_name))
    world_size = dist.get_world_size()
    shards = {name: {k: tuple(v.shape) for k, v in opt.state[p].items()}
              for name, p in model.named_parameters() if p in opt.state}
    full = step.full_optimizer_state_dict(opt)
    ops = [node.meta["comm"].op for node in step.program.collectives()]
    state_bytes = sum(v.nbytes for st in opt.state.values() for v in st.values() if v.dim())
    ref_bytes = sum(v.nbytes for st in ref_opt.state.values() for v in st.values() if v.dim())
    numel = {name: p.numel() for name, p in model.named_parameters()}
    return {"params": _model_state(model),
            "ref": _model_state(ref),
            "full_state": full["state"], "ref_state": ref_opt.state_dict()["state"],
            "shards": shards, "numel": numel, "world_size": world_size, "ops": ops,
            "grads": [p.grad for p in model.parameters()],
            "losses": [(float(a), float(b)) for a, b in returned],
            "state_bytes": state_bytes, "ref_bytes": ref_bytes}


def rank_native_reduce_scatter():
    """The lowering for communicators with a reduce-scatter of their own
    (nccl), run on gloo's."""
    from transpiler.runtime import step as runtime
    detected = runtime.reduce_scatter_native
    runtime.reduce_scatter_native = lambda device: True
    try:
        return rank_vs_ddp("mlp", "sgd")
    finally:
        runtime.reduce_scatter_native = detected


def test_native_reduce_scatter_trains_as_ddp(ranks2):
    for result in ranks2.run(rank_native_reduce_scatter):
        assert M.max_rel_error(result["params"], result["ref"]) == 0.0
        assert result["ops"].count("reduce_scatter") == result["ops"].count("all_gather") >= 2


def _model_state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _state_error(ours: dict, theirs: dict) -> float:
    assert ours.keys() == theirs.keys()
    return max(M.max_rel_error({k: v for k, v in ours[i].items() if torch.is_tensor(v)},
                               {k: v for k, v in theirs[i].items() if torch.is_tensor(v)})
               for i in theirs)


# On 2 ranks the gradients sum in the same order as DDP's (a + b) and the
# update is torch's default one (AdamW's too): exact. Three ranks: gloo's
# reduce-scatter sums in another order than its all-reduce.
@pytest.mark.parametrize("model_name,opt_name", [("mlp", "sgd"), ("tied", "adamw"),
                                                 ("bn", "sgd"), ("mlp", "nesterov")])
@pytest.mark.parametrize("world_size", [2, 3])
def test_zero_trains_as_ddp(world_size, model_name, opt_name, ranks2, ranks3):
    pool = ranks2 if world_size == 2 else ranks3
    for result in pool.run(rank_vs_ddp, model_name, opt_name):
        exact = world_size == 2
        tol = 0.0 if exact else 1e-5
        assert M.max_rel_error(result["params"], result["ref"]) <= tol
        assert _state_error(result["full_state"], result["ref_state"]) <= tol
        assert all(a == pytest.approx(b, rel=1e-6) for a, b in result["losses"])
        # gloo has no reduce-scatter of its own: each bucket is all-reduced (lowering/reductions.py).
        assert result["ops"].count("all_reduce") == result["ops"].count("all_gather") >= 2
        # Each entry shaped like its parameter holds ceil(numel / N) elements.
        for name, entries in result["shards"].items():
            chunk = shard_numel(result["numel"][name], world_size)
            assert all(shape in ((), (chunk,)) for shape in entries.values()), (name, entries)
        # At most 1/N of the full state, plus the padding (under N elements a tensor).
        padding = 4 * (world_size - 1) * sum(len(e) for e in result["shards"].values())
        assert result["state_bytes"] <= result["ref_bytes"] / world_size + padding
        assert all(g is None for g in result["grads"])


def rank_clip():
    model, opt, ref, ref_opt, step, returned = _ddp_and_zero("mlp", "sgd", clip)
    return (_model_state(model),
            _model_state(ref),
            [(float(a[1]), float(b[1])) for a, b in returned])


@pytest.mark.parametrize("world_size", [2, 3])
def test_clipping_by_the_global_norm_sums_the_shards_norms(world_size, ranks2, ranks3):
    pool = ranks2 if world_size == 2 else ranks3
    for ours, theirs, norms in pool.run(rank_clip):
        assert M.max_rel_error(ours, theirs) <= 1e-5
        # The norm the step returns is over every rank's shards.
        assert all(a == pytest.approx(b, rel=1e-5) for a, b in norms)
        assert all(b > 0.05 for _, b in norms)   # the clipping did act


def rank_resume():
    """Two steps, a full state_dict, a fresh model and optimizer loading it,
    two more steps: equal to four steps without a break, bit for bit."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = [M.shard(b, rank, world_size) for b in M.batches("mlp", 4, 12)]
    model = M.make("mlp")
    opt = M.make_optimizer("adamw", model)
    step = transpile(zero_grad_after_step, mode="zero", **TINY_BUCKETS)
    for b in batches:
        step(model, opt, *b)
    model2 = M.make("mlp")
    opt2 = M.make_optimizer("adamw", model2)
    step2 = transpile(zero_grad_after_step, mode="zero", **TINY_BUCKETS)
    for b in batches[:2]:
        step2(model2, opt2, *b)
    saved_model = {k: v.clone() for k, v in model2.state_dict().items()}
    saved_opt = step2.full_optimizer_state_dict(opt2)
    model3 = M.make("mlp", seed=5)
    model3.load_state_dict(saved_model)
    opt3 = M.make_optimizer("adamw", model3)
    opt3.load_state_dict(saved_opt)         # full entries: the next step shards them
    step3 = transpile(zero_grad_after_step, mode="zero", **TINY_BUCKETS)
    for b in batches[2:]:
        step3(model3, opt3, *b)
    single = M.make_optimizer("adamw", M.make("mlp"))
    single.load_state_dict(saved_opt)       # and a single-process optimizer takes it
    return (_model_state(model),
            _model_state(model3),
            _state_error(step.full_optimizer_state_dict(opt)["state"],
                         step3.full_optimizer_state_dict(opt3)["state"]),
            {k: tuple(v.shape) for k, v in single.state[next(iter(single.state))].items()})


def test_resuming_from_a_full_state_dict_equals_an_unbroken_run(ranks2):
    for unbroken, resumed, state_error, single_shapes in ranks2.run(rank_resume):
        assert M.max_rel_error(resumed, unbroken) == 0.0
        assert state_error == 0.0
        assert single_shapes["exp_avg"] == (32, 16)   # full entries


def rank_dcp_save(path):
    """Four steps without a break; and two steps, then model and sharded
    optimizer state saved by torch.distributed.checkpoint (each rank its part)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = [M.shard(b, rank, world_size) for b in M.batches("mlp", 4, 12)]
    model = M.make("mlp")
    opt = M.make_optimizer("adamw", model)
    step = transpile(zero_grad_after_step, mode="zero", **TINY_BUCKETS)
    for b in batches[:2]:
        step(model, opt, *b)
    dcp.save({"model": model.state_dict(), "optim": step.sharded_optimizer_state_dict(opt)},
             checkpoint_id=path)
    saved = step.full_optimizer_state_dict(opt)["state"]
    for b in batches[2:]:
        step(model, opt, *b)
    return saved, _model_state(model), step.full_optimizer_state_dict(opt)["state"]


def rank_dcp_resume(path):
    """A fresh process's model, optimizer and step load the checkpoint, then
    take the last two steps."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = [M.shard(b, rank, world_size) for b in M.batches("mlp", 4, 12)]
    model = M.make("mlp", seed=5)
    opt = M.make_optimizer("adamw", model)
    opt.param_groups[0]["lr"] = 0.5           # the checkpoint's param_groups replace it
    step = transpile(zero_grad_after_step, mode="zero", **TINY_BUCKETS)
    state = {"model": model.state_dict(), "optim": step.sharded_optimizer_state_dict(opt)}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    step.load_sharded_optimizer_state_dict(opt, state["optim"])
    loaded = step.full_optimizer_state_dict(opt)["state"]
    sharded = all(tuple(v.shape) in ((), (shard_numel(p.numel(), world_size),))
                  for p, st in opt.state.items() for v in st.values())
    for b in batches[2:]:
        step(model, opt, *b)
    return loaded, sharded, _model_state(model), step.full_optimizer_state_dict(opt)["state"]


def test_dcp_checkpoint_resumes_bit_for_bit_and_reshards(tmp_path, ranks2, ranks3):
    path = str(tmp_path / "ckpt")
    saved, unbroken, unbroken_state = ranks2.run(rank_dcp_save, path)[0]
    assert any(f.name.endswith(".distcp") for f in (tmp_path / "ckpt").iterdir())
    # The same world size: equal to the unbroken run, bit for bit.
    for loaded, sharded, params, state in ranks2.run(rank_dcp_resume, path):
        assert _state_error(loaded, saved) == 0.0 and sharded
        assert M.max_rel_error(params, unbroken) == 0.0
        assert _state_error(state, unbroken_state) == 0.0
    # Three ranks read the two ranks' parts into their own shards.
    for loaded, sharded, params, state in ranks3.run(rank_dcp_resume, path):
        assert _state_error(loaded, saved) == 0.0 and sharded
        assert M.max_rel_error(params, unbroken) <= 1e-5


def rank_idiom_vs_ddp(fn_name):
    """An idiom of test_training_loops under mode zero and under DDP."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    fn = loops.STEP_FNS[fn_name]
    runs = []
    for zero in (True, False):
        model = M.make("mlp")
        opt = loops._with_scheduler(M.make_optimizer("sgd", model))
        step = transpile(fn, mode="zero", **TINY_BUCKETS) if zero else fn
        outputs = loops._run(step, model if zero else DDP(model), opt, world_size, rank)
        state = step.full_optimizer_state_dict(opt) if zero else opt.state_dict()
        runs.append((_model_state(model), state["state"], outputs, opt.param_groups[0]["lr"]))
    return runs


# Every idiom but those that read the .grad a step starts with (refused above).
@pytest.mark.parametrize("fn_name", ["clip_value", "zero_grad_after_step", "scheduler_inside",
                                     "accumulate", "everything", "scaled"])
def test_training_loop_idioms_equal_ddp(fn_name, ranks2):
    for (params, state, outputs, lr), (ref, ref_state, ref_outputs, ref_lr) in \
            ranks2.run(rank_idiom_vs_ddp, fn_name):
        assert M.max_rel_error(params, ref) <= 1e-6
        assert _state_error(state, ref_state) <= 1e-6
        assert lr == ref_lr
        for ours, theirs in zip(outputs, ref_outputs):
            assert all(torch.allclose(a, b, rtol=1e-6, atol=0, equal_nan=True)
                       for a, b in zip(ours, theirs))


# ------------------------------------------------------------------ options

def poisonable_step(model, optimizer, x, y, poison):
    """classify_step whose first weight's [0, 0] gradient is `poison` more:
    an infinity there lands in rank 0's shard only."""
    optimizer.zero_grad()
    first = next(model.parameters())
    loss = F.cross_entropy(model(x), y) + first[0, 0] * poison
    loss.backward()
    optimizer.step()
    return loss


def rank_skip_nonfinite(poison: bool):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = M.make("mlp")
    opt = M.make_optimizer("adamw", model)
    step = transpile(poisonable_step, mode="zero", skip_nonfinite=True, **TINY_BUCKETS)
    for i, batch in enumerate(M.batches("mlp", 5, 12)):
        if i == 2 and not poison:
            continue
        bad = i == 2 and rank == world_size - 1
        step(model, opt, *M.shard(batch, rank, world_size), torch.tensor(inf if bad else 0.0))
    return _model_state(model), step.full_optimizer_state_dict(opt)["state"], step.skipped_steps


@pytest.mark.parametrize("world_size", [2, 3])
def test_skip_nonfinite_agrees_when_one_ranks_shard_overflows(world_size, ranks2, ranks3):
    pool = ranks2 if world_size == 2 else ranks3
    poisoned, clean = pool.run(rank_skip_nonfinite, True), pool.run(rank_skip_nonfinite, False)
    for (params, state, skipped), (clean_params, clean_state, none) in zip(poisoned, clean):
        assert (skipped, none) == (1, 0)
        # As if the bad batch had never been seen, on every rank.
        assert M.max_rel_error(params, clean_params) == 0.0
        assert _state_error(state, clean_state) == 0.0
    assert M.max_rel_error(poisoned[0][0], poisoned[-1][0]) == 0.0


def rank_bf16_wire(mode):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = M.make("mlp")
    opt = M.make_optimizer("sgd", model)
    step = transpile(M.classify_step, mode=mode, fuse_dtype=torch.bfloat16, **TINY_BUCKETS)
    for batch in M.batches("mlp", STEPS, 12):
        step(model, opt, *M.shard(batch, rank, world_size))
    wire = {node.meta["comm"].op: node.meta["val"].dtype for node in step.program.collectives()}
    return _model_state(model), wire


def test_bf16_on_the_wire_rounds_as_fuse_all_reduce_does(ranks2):
    zero, fused = ranks2.run(rank_bf16_wire, "zero"), ranks2.run(rank_bf16_wire, "fuse_all_reduce")
    for (params, wire), (fused_params, _) in zip(zero, fused):
        assert wire == {"all_reduce": torch.bfloat16, "all_gather": torch.float32}   # gloo
        # The same bf16 sums (a + b on 2 ranks), so the same parameters.
        assert M.max_rel_error(params, fused_params) == 0.0


def rank_backends(opt_name):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    states = []
    for backend in ("eager", "inductor"):
        model = M.make("mlp")
        opt = M.make_optimizer(opt_name, model)
        step = transpile(clip, mode="zero", backend=backend, **TINY_BUCKETS)
        for batch in M.batches("mlp", STEPS, 12):
            step(model, opt, *M.shard(batch, rank, world_size))
        states.append((_model_state(model), step.full_optimizer_state_dict(opt)["state"]))
    (params, state), (compiled, compiled_state) = states
    return M.max_rel_error(compiled, params), _state_error(compiled_state, state)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_inductor_compiles_the_zero_program(opt_name, ranks2):
    # The reduce-scatters, the partial norm's all-reduce and the all-gathers
    # compiled with the update on shards: equal to eager to inductor's rounding.
    for params_error, state_error in ranks2.run(rank_backends, opt_name):
        assert params_error <= 1e-5 and state_error <= 1e-5


# ------------------------------------------------------------------ refused

def rank_refused(which):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = M.make("mlp")
    if which == "reads_grads":
        opt, fn = M.make_optimizer("sgd", model), zero_grad_keep_tensors
    else:   # a parameter with a gradient that no optimizer updates
        opt, fn = torch.optim.SGD(list(model.parameters())[:2], lr=0.1), M.classify_step
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = transpile(fn, mode="zero")
    try:
        step(model, opt, *M.shard(M.batches("mlp", 1, 8)[0], rank, world_size))
    except TranspileError as exc:
        return str(exc), all(v.equal(before[k]) for k, v in model.state_dict().items())
    return None, False


@pytest.mark.parametrize("which,says", [("reads_grads", "zero_grad"),
                                        ("no_optimizer", "does not update it")])
def test_refused_on_every_rank_before_anything_runs(which, says, ranks2):
    for message, untouched in ranks2.run(rank_refused, which):
        assert message is not None and says in message
        assert untouched


def test_options_zero_does_not_combine_with_are_refused_up_front():
    with pytest.raises(TranspileError, match="zero"):
        transpile(M.classify_step, mode="zero", verify=1)


def rank_zero_redundancy_optimizer_refused():
    from torch.distributed.optim import ZeroRedundancyOptimizer
    model = M.make("mlp", seed=0)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = M.batches("mlp", 1, 8)[0]
    with pytest.raises(TranspileError, match="mode='zero'") as info:
        transpile(M.classify_step, mode="grad_allreduce")(model, opt, x, y)
    unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    return "SGD(model.parameters(), ...)" in str(info.value) and unchanged


def test_torchs_zero_redundancy_optimizer_in_the_step_points_to_mode_zero(ranks2):
    # it broadcasts the parameters on the host each step: refused, naming the
    # optimizer it wraps and the mode that shards its state
    assert ranks2.run(rank_zero_redundancy_optimizer_refused) == [True, True]
