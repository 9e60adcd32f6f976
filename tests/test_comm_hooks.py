"""DDP's comm hooks traced into the program (transpiler/lowering/comm_hooks.py):
`transpile(..., mode="fuse_all_reduce", comm_hook=(state, hook))` against torch
DDP with `register_comm_hook(state, hook)`, running the same step in the same
processes on 2 gloo ranks, bit for bit: torch's allreduce_hook,
fp16_compress_hook and bf16_compress_hook, and hooks of a user's written with
tensor ops and collectives, eager and under inductor; torch's powerSGD_hook
with its state (the model and every table of the state after every step,
on 2 and 3 ranks; resumed from its pickled state)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import TranspileError, transpile

STEPS = 4


def clamped_mean_hook(group, bucket):
    """The mean, clamped, in a callback of the all-reduce's future."""
    t = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(t, async_op=True).get_future().then(
        lambda fut: fut.value()[0].clamp(-0.02, 0.02))


def gathered_mean_hook(group, bucket):
    """Every rank's buffer gathered, the mean taken in float64, its own future."""
    buf, world = bucket.buffer(), dist.get_world_size()
    out = torch.empty(world * buf.numel(), dtype=buf.dtype)
    dist.all_gather_into_tensor(out, buf)
    fut = torch.futures.Future()
    fut.set_result(out.view(world, -1).double().mean(0).to(buf.dtype))
    return fut


def per_gradient_hook(group, bucket):
    """Each gradient of the bucket scaled by its own norm's share before the sum."""
    for g in bucket.gradients():
        g.mul_(1 / (1 + g.norm()))
    t = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(t, async_op=True).get_future().then(lambda fut: fut.value()[0])


HOOKS = {"allreduce_hook": default_hooks.allreduce_hook,
         "fp16_compress_hook": default_hooks.fp16_compress_hook,
         "bf16_compress_hook": default_hooks.bf16_compress_hook,
         "clamped_mean_hook": clamped_mean_hook,
         "gathered_mean_hook": gathered_mean_hook,
         "per_gradient_hook": per_gradient_hook}


def rank_hook_vs_ddp(hook_name: str, backend: str, model_name: str = "mlp"):
    rank, world = dist.get_rank(), dist.get_world_size()
    hook = HOOKS[hook_name]
    batches = [M.shard(b, rank, world) for b in M.batches(model_name, STEPS, 8)]
    model = M.make(model_name, seed=rank)
    opt = M.make_optimizer("adamw", model)
    step = transpile(M.classify_step, mode="fuse_all_reduce", backend=backend,
                     comm_hook=(None, hook))
    losses = torch.stack([step(model, opt, *b).detach() for b in batches])
    ops = [n.meta["comm"].op for n in step.program.collectives()]

    reference = M.make(model_name, seed=0)
    ref_opt = M.make_optimizer("adamw", reference)
    ddp = DDP(reference)
    # DDP refuses bf16_compress_hook off CUDA by its name; the same hook under another runs
    ddp.register_comm_hook(None, hook if hook is not default_hooks.bf16_compress_hook
                           else lambda state, bucket: hook(state, bucket))
    ref_losses = torch.stack([M.classify_step(ddp, ref_opt, *b).detach() for b in batches])
    return M.state_of(model, opt), M.state_of(reference, ref_opt), losses, ref_losses, ops


def _equal(results, tolerance: float = 0.0):
    for ours, theirs, losses, ref_losses, _ in results:
        assert ours.keys() == theirs.keys()
        for k in ours:
            assert torch.allclose(ours[k], theirs[k], rtol=0, atol=tolerance), \
                (k, (ours[k] - theirs[k]).abs().max())
        assert torch.allclose(losses, ref_losses, rtol=0, atol=tolerance)


@pytest.mark.slow
@pytest.mark.parametrize("hook_name", sorted(HOOKS))
def test_comm_hook_equals_ddp_with_it(hook_name, ranks2):
    results = ranks2.run(rank_hook_vs_ddp, hook_name, "eager")
    _equal(results)
    ops = results[0][4]
    assert ops.count("all_gather" if hook_name == "gathered_mean_hook" else "all_reduce") >= 1


@pytest.mark.slow
def test_a_hook_changes_what_is_reduced(ranks2):
    """Not vacuous: the clamped hook's result is not plain averaging's."""
    clamped = ranks2.run(rank_hook_vs_ddp, "clamped_mean_hook", "eager")
    plain = ranks2.run(rank_hook_vs_ddp, "allreduce_hook", "eager")
    diff = max((clamped[0][0][k] - plain[0][0][k]).abs().max().item() for k in clamped[0][0])
    assert diff > 1e-4


@pytest.mark.slow
def test_fp16_compress_hook_under_inductor(ranks2):
    """Inductor rounds the model's own ops otherwise than eager (1e-5, as
    test_training_loops bounds it); the hook's cast and division are exact."""
    _equal(ranks2.run(rank_hook_vs_ddp, "fp16_compress_hook", "inductor"), tolerance=1e-5)


@pytest.mark.parametrize("option,match", [
    ((None,), "comm_hook must be"),
    (default_hooks.allreduce_hook, "comm_hook must be"),
    ((powerSGD_hook.PowerSGDState(None), powerSGD_hook.batched_powerSGD_hook),
     "batched_powerSGD_hook: torch's own hook fails under DDP"),
    ((powerSGD_hook.PowerSGDState(None, start_powerSGD_iter=0, use_error_feedback=False,
                                  warm_start=False), powerSGD_hook.powerSGD_hook),
     "start_powerSGD_iter=0"),
    ((powerSGD_hook.PowerSGDState(None), default_hooks.allreduce_hook), "traced with torch's"),
    ((None, powerSGD_hook.powerSGD_hook), "takes a PowerSGDState"),
    ((object(), default_hooks.allreduce_hook), "must be a process group or None"),
])
def test_bad_comm_hooks_are_refused_at_transpile(option, match):
    with pytest.raises(TranspileError, match=match):
        transpile(M.classify_step, mode="fuse_all_reduce", comm_hook=option)


def test_comm_hook_and_fuse_dtype_are_one_choice():
    with pytest.raises(TranspileError, match="give one"):
        transpile(M.classify_step, mode="fuse_all_reduce", fuse_dtype=torch.float16,
                  comm_hook=(None, default_hooks.allreduce_hook))


@pytest.mark.parametrize("mode", ["grad_allreduce", "zero", "fsdp", "local_sgd"])
def test_other_modes_refuse_a_comm_hook(mode):
    with pytest.raises(TranspileError, match="comm_hook"):
        transpile(M.classify_step, mode=mode, comm_hook=(None, default_hooks.allreduce_hook))


@pytest.mark.parametrize("option", [{"hierarchical": True}])
def test_a_hook_reduces_over_the_world_only(option):
    with pytest.raises(TranspileError, match="not with reduce_groups or hierarchical"):
        transpile(M.classify_step, mode="fuse_all_reduce",
                  comm_hook=(None, default_hooks.allreduce_hook), **option)


@pytest.mark.slow
@pytest.mark.parametrize("hook_name", ["allreduce_hook", "fp16_compress_hook", "gathered_mean_hook"])
def test_comm_hook_equals_ddp_with_it_on_3_ranks(hook_name, ranks3):
    """Over 3 ranks a bucket's sum rounds by its layout: the hook sees DDP's
    buckets (one in the parameters' order at the first step, then the
    rebuilt ones), so it is bit for bit here too."""
    _equal(ranks3.run(rank_hook_vs_ddp, hook_name, "eager"))


# ------------------------------------------------------------------ PowerSGD

POWERSGD_STEPS = 6


def _powersgd_state(options: dict) -> powerSGD_hook.PowerSGDState:
    return powerSGD_hook.PowerSGDState(None, **{"start_powerSGD_iter": 2, **options})


def _tables(state) -> dict[str, torch.Tensor]:
    return {f"{table}[{b}]": t.clone() for table in ("error_dict", "p_memory_dict", "q_memory_dict")
            for b, t in getattr(state, table).items()}


def _workload(model_name: str):
    """(a model made alike on every call, the rank's batches, the step)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if model_name in ("mlp", "mlp_without_bias"):   # the latter: nothing left uncompressed
        batches = [M.shard(b, rank, world) for b in M.batches("mlp", POWERSGD_STEPS, 8)]

        def make():
            torch.manual_seed(0)
            return M.make("mlp") if model_name == "mlp" else torch.nn.Sequential(
                torch.nn.Linear(16, 32, bias=False), torch.nn.ReLU(),
                torch.nn.Linear(32, 4, bias=False))
        return make, batches, M.classify_step
    from tests import test_ddp_layout as layout
    batches = layout._batches(model_name, rank)[:POWERSGD_STEPS]
    return (lambda: layout._make(model_name, "sgd")[0]), batches, layout.step


def rank_powersgd_vs_ddp(options: dict, model_name: str = "mlp", backend: str = "eager"):
    """PowerSGD traced against DDP's powerSGD_hook: each with a state of its
    own, the same settings and seed; the model, the optimizer, the losses,
    and the hook's state (counter, statistics, tables) after every step."""
    make, batches, step_fn = _workload(model_name)
    model = make()
    opt = M.make_optimizer("adamw", model)
    state = _powersgd_state(options)
    step = transpile(step_fn, mode="fuse_all_reduce", backend=backend,
                     comm_hook=(state, powerSGD_hook.powerSGD_hook))
    losses, states = [], []
    for b in batches:
        losses.append(step(model, opt, *b).detach())
        states.append((state.iter, state.compression_stats(), _tables(state)))

    reference = make()
    ref_opt = M.make_optimizer("adamw", reference)
    ddp = DDP(reference)
    ref_state = _powersgd_state(options)
    ddp.register_comm_hook(ref_state, powerSGD_hook.powerSGD_hook)
    ref_losses, ref_states = [], []
    for b in batches:
        ref_losses.append(step_fn(ddp, ref_opt, *b).detach())
        ref_states.append((ref_state.iter, ref_state.compression_stats(), _tables(ref_state)))
    return (M.state_of(model, opt), M.state_of(reference, ref_opt), torch.stack(losses),
            torch.stack(ref_losses), states, ref_states)


def _powersgd_equal(results):
    _equal([r[:4] + (None,) for r in results])
    for *_, states, ref_states in results:
        assert [(i, c) for i, c, _ in states] == [(i, c) for i, c, _ in ref_states]
        for (_, _, tables), (_, _, ref_tables) in zip(states, ref_states):
            assert tables.keys() == ref_tables.keys()
            for k in tables:
                assert torch.equal(tables[k], ref_tables[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    {},                                                  # error feedback, warm start, rank 1
    {"matrix_approximation_rank": 2, "warm_start": False},
    {"matrix_approximation_rank": 4, "min_compression_rate": 1},   # QR, not Gram-Schmidt
    {"batch_tensors_with_same_shape": True, "use_error_feedback": False},
    {"orthogonalization_epsilon": 1e-8, "start_powerSGD_iter": 3},
], ids=["defaults", "rank2-cold", "rank4-qr", "batched-no-feedback", "epsilon"])
def test_powersgd_equals_ddp_with_it(options, ranks2):
    """Bit for bit: the model, AdamW's state, each loss, and after every step
    the hook's counter, statistics and tables (the same random projections,
    the same P, Q and error)."""
    results = ranks2.run(rank_powersgd_vs_ddp, options)
    _powersgd_equal(results)
    rate, before, after = results[0][4][-1][1]   # the steps compressed
    assert before > after > 0 and rate > 1


@pytest.mark.slow
def test_powersgd_equals_ddp_on_3_ranks(ranks3):
    _powersgd_equal(ranks3.run(rank_powersgd_vs_ddp, {"matrix_approximation_rank": 2}))


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["gpt2", "mlp_without_bias"])
def test_powersgd_on_other_models(model_name, ranks2):
    _powersgd_equal(ranks2.run(rank_powersgd_vs_ddp, {}, model_name))


@pytest.mark.slow
def test_powersgd_is_not_plain_averaging(ranks2):
    """Not vacuous: compressed, the model leaves plain averaging's."""
    compressed = ranks2.run(rank_powersgd_vs_ddp, {})
    plain = ranks2.run(rank_powersgd_vs_ddp, {"start_powerSGD_iter": POWERSGD_STEPS + 1})
    assert max((compressed[0][0][k] - plain[0][0][k]).abs().max().item()
               for k in compressed[0][0]) > 1e-4


@pytest.mark.slow
def test_powersgd_under_inductor(ranks2):
    """Inductor rounds the model's ops otherwise than eager; the hook's
    state follows DDP's within that rounding, its counter and statistics
    exactly."""
    results = ranks2.run(rank_powersgd_vs_ddp, {}, "mlp", "inductor")
    _equal([r[:4] + (None,) for r in results], tolerance=1e-4)
    for *_, states, ref_states in results:
        assert [(i, c) for i, c, _ in states] == [(i, c) for i, c, _ in ref_states]


def rank_powersgd_resumed(path: str):
    """Stopped after 4 steps (the model, the optimizer and the pickled
    PowerSGDState saved, as a DDP user saves them), resumed in a new step
    for 2 more: the same as 6 steps in one go."""
    make, batches, step_fn = _workload("mlp")

    def run(model, opt, state, steps):
        step = transpile(step_fn, mode="fuse_all_reduce",
                         comm_hook=(state, powerSGD_hook.powerSGD_hook))
        for b in steps:
            step(model, opt, *b)

    model = make()
    opt = M.make_optimizer("adamw", model)
    state = _powersgd_state({})
    run(model, opt, state, batches)
    whole = M.state_of(model, opt), _tables(state), state.iter

    model = make()
    opt = M.make_optimizer("adamw", model)
    state = _powersgd_state({})
    run(model, opt, state, batches[:4])
    file = f"{path}/rank{dist.get_rank()}.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state}, file)
    saved = torch.load(file, weights_only=False)
    model = make()
    model.load_state_dict(saved["model"])
    opt = M.make_optimizer("adamw", model)
    opt.load_state_dict(saved["opt"])
    run(model, opt, saved["hook"], batches[4:])
    return whole, (M.state_of(model, opt), _tables(saved["hook"]), saved["hook"].iter)


@pytest.mark.slow
def test_powersgd_resumes_from_its_pickled_state(ranks2, tmp_path):
    for (ours, tables, it), (resumed, resumed_tables, resumed_it) in \
            ranks2.run(rank_powersgd_resumed, str(tmp_path)):
        assert it == resumed_it == POWERSGD_STEPS
        assert tables.keys() == resumed_tables.keys()
        assert all(torch.equal(tables[k], resumed_tables[k]) for k in tables)
        assert all(torch.equal(ours[k], resumed[k]) for k in ours)


@pytest.mark.parametrize("options,match", [
    ({"verify": 1}, "verify="),
])
def test_powersgd_refuses_what_would_advance_its_state_twice(options, match):
    state = _powersgd_state({})
    with pytest.raises(TranspileError, match=match):
        transpile(M.classify_step, mode="fuse_all_reduce",
                  comm_hook=(state, powerSGD_hook.powerSGD_hook), **options)


def test_powersgd_refuses_join():
    state = _powersgd_state({})
    step = transpile(M.classify_step, mode="fuse_all_reduce",
                     comm_hook=(state, powerSGD_hook.powerSGD_hook))
    with pytest.raises(TranspileError, match="join"):
        step.join()
