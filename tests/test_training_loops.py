"""The training steps people really write, against torch DDP running the same
step function in the same processes: clipping between backward() and step(),
zero_grad anywhere, an LR scheduler stepped inside the step, several
micro-batches accumulated in one step, gradients accumulated across calls, and
all of them at once. Parameters, optimizer state and every parameter's .grad
after several steps, on 2 and 3 gloo ranks; and without a process group,
against the eager step."""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import TranspileError, transpile

STEPS = 6
BATCH = 24     # divisible by 2 and 3 ranks times 2 micro-batches
MICRO = 2


def _no_sync(model, last: bool):
    """DDP reduces only the last micro-batch's backward (nanoGPT's loop); a
    transpiled step does so by itself."""
    return model.no_sync() if isinstance(model, DDP) and not last else contextlib.nullcontext()


def _with_scheduler(opt):
    """The scheduler the step finds on its optimizer (made outside the step)."""
    opt.test_scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
    return opt


def clip(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    opt.step()
    return loss, norm


def clip_value(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
    for p in model.parameters():
        p.grad.mul_(0.5)
    opt.step()
    return loss


def zero_grad_after_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def zero_grad_keep_tensors(model, opt, x, y):
    model.zero_grad(set_to_none=False)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def scheduler_inside(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.test_scheduler.step()
    return loss


def accumulate(model, opt, x, y):
    opt.zero_grad()
    chunks = list(zip(x.chunk(MICRO), y.chunk(MICRO)))
    total = 0
    for i, (xs, ys) in enumerate(chunks):
        with _no_sync(model, i == len(chunks) - 1):
            loss = F.cross_entropy(model(xs), ys) / MICRO
            loss.backward()
        total = total + loss.detach()
    opt.step()
    return total


def everything(model, opt, x, y):
    """Micro-batches, clipping, the scheduler, zero_grad after the step."""
    chunks = list(zip(x.chunk(MICRO), y.chunk(MICRO)))
    for i, (xs, ys) in enumerate(chunks):
        with _no_sync(model, i == len(chunks) - 1):
            (F.cross_entropy(model(xs), ys) / MICRO).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    opt.step()
    opt.test_scheduler.step()
    opt.zero_grad(set_to_none=True)
    return norm


def across_calls(model, opt, x, y, sync: bool):
    """Paddle's gradient merge: step every other call. The bool selects one of
    two programs; the gradients in between live in .grad."""
    with _no_sync(model, sync):
        loss = F.cross_entropy(model(x), y) / 2
        loss.backward()
    if sync:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    return loss


def scaled(model, opt, x, y, scaler):
    """torch.amp's loss scaling, unscaled before clipping: the first steps
    overflow (the scale starts at 2**127) and are skipped while it backs off."""
    opt.zero_grad()
    chunks = list(zip(x.chunk(MICRO), y.chunk(MICRO)))
    for i, (xs, ys) in enumerate(chunks):
        with _no_sync(model, i == len(chunks) - 1):
            scaler.scale(F.cross_entropy(model(xs), ys) * 4 / MICRO).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    scaler.step(opt)
    scaler.update()
    opt.test_scheduler.step()
    if not scaler.is_enabled():
        return norm
    return norm, scaler._scale.clone()   # get_scale() would read it with .item()


def random_draws(model, opt, x, y):
    """Dropout in the forward, a number drawn that nothing differentiates (a
    sampled logging decision), noise added to each gradient: the generator's
    draws in eager's order, whatever the schedule moves."""
    opt.zero_grad()
    sampled = torch.rand(())
    loss = F.cross_entropy(F.dropout(model(x), 0.2), y)
    loss.backward()
    for p in model.parameters():
        p.grad.add_(torch.randn_like(p.grad), alpha=1e-3)
    opt.step()
    return loss, sampled


STEP_FNS = {f.__name__: f for f in (clip, clip_value, zero_grad_after_step,
                                     zero_grad_keep_tensors, scheduler_inside, accumulate,
                                     everything, across_calls, scaled, random_draws)}


def _extra_args(fn, i: int, opt) -> tuple:
    if fn is across_calls:
        return ((i + 1) % 2 == 0,)
    if fn is scaled:
        if not hasattr(opt, "test_scaler"):
            opt.test_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127,
                                                   growth_interval=2)
        return (opt.test_scaler,)
    return ()


def _run(step, model, opt, world_size, rank):
    torch.manual_seed(100)   # the same draws for the transpiled step and the reference
    outputs = []
    for i, batch in enumerate(M.batches("mlp", STEPS, BATCH)):
        extra = _extra_args(getattr(step, "step_fn", step), i, opt)
        out = step(model, opt, *M.shard(batch, rank, world_size), *extra)
        outputs.append([t.detach().clone() for t in torch.utils._pytree.tree_leaves(out)])
    return outputs


def _state(model, opt):
    """Parameters, buffers, optimizer state, and each parameter's .grad (an
    empty tensor for None)."""
    state = M.state_of(model, opt)
    for name, p in model.named_parameters():
        state[f"grad.{name}"] = torch.empty(0) if p.grad is None else p.grad.clone()
    return state


def _max_rel_error(ours: dict, theirs: dict) -> float:
    """M.max_rel_error, and the same .grad left None on both sides."""
    nones = {k for k, v in theirs.items() if v.numel() == 0}
    assert nones == {k for k, v in ours.items() if v.numel() == 0}
    return M.max_rel_error(*({k: v for k, v in s.items() if k not in nones} for s in (ours, theirs)))


def rank_vs_ddp(fn_name, opt_name, mode, backend, verify=0, **options):
    """The transpiled step and DDP on the same step function, same processes."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    fn = STEP_FNS[fn_name]
    model = M.make("mlp", seed=rank)     # the startup broadcast makes the ranks agree
    opt = _with_scheduler(M.make_optimizer(opt_name, model))
    step = transpile(fn, mode=mode, backend=backend, verify=verify, **options)
    ours = _run(step, model, opt, world_size, rank)
    ours_state = _state(model, opt)
    lr = opt.param_groups[0]["lr"]

    model = M.make("mlp", seed=0)
    opt = _with_scheduler(M.make_optimizer(opt_name, model))
    ddp = DDP(model)
    theirs = _run(fn, ddp, opt, world_size, rank)
    return ours_state, _state(model, opt), ours, theirs, (lr, opt.param_groups[0]["lr"])


def _compare(results, tolerance):
    for ours, ddp, our_outputs, ddp_outputs, (our_lr, ddp_lr) in results:
        assert _max_rel_error(ours, ddp) <= tolerance
        assert our_lr == ddp_lr
        for a, b in zip(our_outputs, ddp_outputs):
            for x, y in zip(a, b):    # the loss, the global norm clipping returns
                # (a step that overflowed under loss scaling has a NaN norm)
                assert torch.allclose(x, y, rtol=max(tolerance, 1e-6), atol=0,
                                      equal_nan=True), (x, y)
    first = results[0][0]
    for ours, *_ in results[1:]:
        assert all(torch.equal(ours[k], first[k]) for k in first)


@pytest.mark.parametrize("fn_name", sorted(STEP_FNS))
@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce"])
def test_sgd_equals_ddp_bit_for_bit(fn_name, mode, ranks2):
    _compare(ranks2.run(rank_vs_ddp, fn_name, "sgd", mode, "eager"), 0.0)


@pytest.mark.parametrize("fn_name", ["everything", "scaled", "across_calls"])
def test_local_sgd_warmup_equals_ddp(fn_name, ranks2):
    """local_sgd's warm-up steps average the gradients every step: DDP's
    semantics, for every idiom (its local steps process local gradients, as
    local SGD means to; test_local_sgd checks them against plain torch)."""
    _compare(ranks2.run(rank_vs_ddp, fn_name, "sgd", "local_sgd", "eager", begin_step=STEPS,
                        k_steps=2), 0.0)


@pytest.mark.parametrize("fn_name", ["clip", "accumulate", "everything", "scaled"])
def test_three_ranks(fn_name, ranks3):
    # With three ranks gloo's ring sums an element in an order that depends on
    # where it sits in its bucket: fuse_all_reduce lays its buckets out as DDP
    # does (tests/test_ddp_layout.py), so it is bit for bit here too.
    _compare(ranks3.run(rank_vs_ddp, fn_name, "sgd", "fuse_all_reduce", "eager"), 0.0)


@pytest.mark.parametrize("fn_name", ["everything", "scaled"])
def test_adamw_equals_ddp_bit_for_bit(fn_name, ranks2):
    # The transpiled AdamW is torch's default formulation, DDP's optimizer's;
    # under loss scaling the skipped steps do not count in either.
    _compare(ranks2.run(rank_vs_ddp, fn_name, "adamw", "fuse_all_reduce", "eager"), 0.0)


@pytest.mark.parametrize("fn_name", ["everything", "scaled", "random_draws"])
def test_inductor(fn_name, ranks2):
    _compare(ranks2.run(rank_vs_ddp, fn_name, "sgd", "fuse_all_reduce", "inductor"), 1e-5)


def rank_stale_gradients():
    """A step that does not zero the gradients first accumulates into whatever
    .grad holds when it is called, as the eager step does under DDP."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    states = []
    for transpiled in (True, False):
        model = M.make("mlp", seed=0)
        opt = M.make_optimizer("sgd", model)
        net = model if transpiled else DDP(model)
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.01 * (rank + 1))    # differs across ranks
        step = transpile(zero_grad_after_step) if transpiled else zero_grad_after_step
        _run(step, net, opt, world_size, rank)
        states.append(_state(model, opt))
    return states


def test_stale_gradients_equal_ddp(ranks2):
    for ours, ddp in ranks2.run(rank_stale_gradients):
        assert _max_rel_error(ours, ddp) == 0.0


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_step_ending_in_zero_grad_after_one_that_leaves_grad(optimizer):
    """Two transpiled steps take turns on one model: the one that ends with
    zero_grad() (the HF Trainer's order) was traced with no .grad and later
    finds the other's: it accumulates onto it, as eager does (a program of
    its own)."""
    model = M.make("mlp", seed=0)
    reference = M.make("mlp", seed=0)
    opts = [M.make_optimizer(optimizer, m) for m in (model, reference)]
    fns = (zero_grad_after_step, M.classify_step)
    steps = [transpile(fn) for fn in fns]
    for i, (x, y) in enumerate(M.batches("mlp", 6, 8)):
        fn = fns[i % 2]
        assert torch.equal(steps[i % 2](model, opts[0], x, y), fn(reference, opts[1], x, y))
        assert M.max_rel_error(M.state_of(model, opts[0]), M.state_of(reference, opts[1])) == 0.0
    assert [step._cache.builds for step in steps] == [2, 1]


@pytest.mark.parametrize("fn_name", sorted(STEP_FNS))
def test_single_process_equals_eager(fn_name):
    """Without a process group every idiom is the eager step, .grad included."""
    states = []
    for transpiled in (True, False):
        model = M.make("mlp", seed=0)
        opt = _with_scheduler(M.make_optimizer("sgd", model))
        fn = STEP_FNS[fn_name]
        step = transpile(fn) if transpiled else fn
        outputs = _run(step, model, opt, 1, 0)
        states.append((_state(model, opt), outputs))
    (ours, our_outputs), (eager, eager_outputs) = states
    assert ours.keys() == eager.keys()
    for k in ours:
        assert torch.equal(ours[k], eager[k]), k
    for a, b in zip(our_outputs, eager_outputs):
        assert all(torch.allclose(x, y, rtol=0, atol=0, equal_nan=True) for x, y in zip(a, b))


def test_gradient_merge_builds_two_programs(caplog):
    """Accumulating calls and stepping calls: after the optimizer's state exists,
    no call traces again."""
    model = M.make("mlp", seed=0)
    opt = M.make_optimizer("sgd", model)
    step = transpile(across_calls)
    with caplog.at_level("INFO", logger="transpiler"):
        _run(step, model, opt, 1, 0)
        # The accumulating program, the stepping one (its optimizer state made
        # before its trace), and the accumulating one again: the state it does
        # not read is part of its signature now.
        assert caplog.text.count("traced") == 3
        caplog.clear()
        _run(step, model, opt, 1, 0)
    assert "traced" not in caplog.text


def test_step_that_returns_nothing():
    def no_return(model, opt, x, y):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    model, eager = M.make("mlp", seed=0), M.make("mlp", seed=0)
    opt, eager_opt = M.make_optimizer("sgd", model), M.make_optimizer("sgd", eager)
    step = transpile(no_return)
    for batch in M.batches("mlp", 3, 8):
        assert step(model, opt, *batch) is None
        no_return(eager, eager_opt, *batch)
    assert M.max_rel_error(_state(model, opt), _state(eager, eager_opt)) == 0.0


def test_many_micro_batches_warn(caplog):
    def many(model, opt, x, y):
        opt.zero_grad()
        for xs, ys in zip(x.chunk(9), y.chunk(9)):
            F.cross_entropy(model(xs), ys).backward()
        opt.step()

    model = M.make("mlp", seed=0)
    x, y = M.batches("mlp", 1, 18)[0]
    with caplog.at_level("WARNING", logger="transpiler"):
        transpile(many)(model, M.make_optimizer("sgd", model), x, y)
    assert "calls backward() 9 times: the program unrolls every micro-batch" in caplog.text


def test_loss_scaling_skips_and_backs_off():
    """The scaler's scale after each step, and that overflowing steps changed
    nothing the optimizer writes (against eager in test_single_process_equals_eager)."""
    model = M.make("mlp", seed=0)
    opt = _with_scheduler(M.make_optimizer("sgd", model))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = transpile(scaled)
    x, y = M.batches("mlp", 1, BATCH)[0]
    _, scale = step(model, opt, x * 50, y, _extra_args(scaled, 0, opt)[0])
    assert scale.item() == 2.0 ** 126    # overflowed: backed off, and skipped
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    scales = [step(model, opt, x, y, opt.test_scaler)[1].item() for _ in range(12)]
    assert any(b > a for a, b in zip(scales, scales[1:]))   # grew after 2 good steps
    assert any(b < a for a, b in zip(scales, scales[1:]))   # and backed off again


def test_a_scaler_in_a_closure_is_the_steps_own():
    """A GradScaler the step reaches through its closure (found.py) is state
    of the program, as one passed as an argument: equal to the eager step."""
    results = []
    for transpiled in (True, False):
        scaler = torch.amp.GradScaler("cpu")

        def hidden(model, opt, x, y):
            return scaled(model, opt, x, y, scaler)

        model = M.make("mlp", seed=0)
        opt = _with_scheduler(M.make_optimizer("sgd", model))
        step = transpile(hidden) if transpiled else hidden
        x, y = M.batches("mlp", 1, BATCH)[0]
        results.append([step(model, opt, x * s, y)[1].item() for s in (50, 1, 1, 1)]
                       + [p.detach().clone() for p in model.parameters()])
    assert results[0][:4] == results[1][:4]
    assert all(torch.equal(a, b) for a, b in zip(results[0][4:], results[1][4:]))


def test_disabled_scaler_passes_through():
    states = []
    for transpiled in (True, False):
        model = M.make("mlp", seed=0)
        opt = _with_scheduler(M.make_optimizer("sgd", model))
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        step = transpile(scaled) if transpiled else scaled
        for batch in M.batches("mlp", 3, BATCH):
            step(model, opt, *batch, scaler)
        states.append(_state(model, opt))
    assert _max_rel_error(*states) == 0.0


@pytest.mark.parametrize("fn_name", ["everything", "scaled", "across_calls"])
def test_verify_accepts_what_equals_ddp(fn_name, ranks2):
    """verify=STEPS checks every step against the eager step under DDP's
    semantics, finds nothing, and changes nothing: still DDP bit for bit."""
    _compare(ranks2.run(rank_vs_ddp, fn_name, "sgd", "fuse_all_reduce", "eager", STEPS), 0.0)


FACTOR = [1.0]


def reads_a_global(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y) * FACTOR[0]   # a host value, guarded
    loss.backward()
    opt.step()
    return loss


def rank_global_changed_under_verify():
    """A global the step reads, changed between calls on every rank: the guard
    traces again, and the program verify checks equals DDP's step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = M.make("mlp", seed=0)
    opt = M.make_optimizer("sgd", model)
    step = transpile(reads_a_global, verify=3)
    reference, ref_opt = M.make("mlp", seed=0), None
    ref_opt = M.make_optimizer("sgd", reference)
    ddp = DDP(reference)
    losses = []
    for i, batch in enumerate(M.batches("mlp", 3, BATCH)):
        FACTOR[0] = 3.0 if i == 2 else 1.0
        losses.append((step(model, opt, *M.shard(batch, rank, world_size)),
                       reads_a_global(ddp, ref_opt, *M.shard(batch, rank, world_size))))
    FACTOR[0] = 1.0
    return [torch.equal(a, b) for a, b in losses], _max_rel_error(_state(model, opt),
                                                                   _state(reference, ref_opt))


def test_a_global_changed_between_calls_is_guarded_under_verify(ranks2):
    for equal, error in ranks2.run(rank_global_changed_under_verify):
        assert equal == [True, True, True] and error == 0.0


def test_verify_bad_options():
    with pytest.raises(TranspileError, match="verify must be an integer >= 0"):
        transpile(clip, verify=-1)
    with pytest.raises(TranspileError, match="verify compares with the eager step"):
        transpile(clip, mode="local_sgd", verify=2)


def test_verify_compares_non_finite_values_as_equal_where_they_are():
    from transpiler.runtime.verify import first_difference
    inf, nan = float("inf"), float("nan")
    a = torch.tensor([1.0, inf, nan, 2.0])
    assert first_difference(["t"], [a], [a.clone()], 1e-3) is None
    assert first_difference(["t"], [a], [torch.tensor([1.0, inf, 0.0, 2.0])], 1e-3).startswith(
        "t: max abs difference inf")
    assert first_difference(["t"], [a], [torch.tensor([1.0, inf, nan, 2.1])], 1e-3).startswith(
        "t: max abs difference 0.1")
    assert first_difference(["g"], [None], [a], 1e-3) == "g: the program leaves None, the eager step a tensor"


def accumulate_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def zero_grads_in_place_step(model, optimizer, x, y):
    optimizer.zero_grad(set_to_none=False)
    return accumulate_step(model, optimizer, x, y)


@pytest.mark.parametrize("fn", [zero_grads_in_place_step, accumulate_step])
def test_a_grad_the_step_starts_with_keeps_its_tensor_as_in_eager(fn):
    """Where the step zeroes .grad in place or accumulates into it, eager's
    backward() writes into the tensor the call started with: a reference held
    to it (a flat gradient buffer whose views the grads are, zeroed between
    calls) sees each call's gradients."""
    views = []
    for transpiled in (True, False):
        model = M.make("mlp", seed=0)
        opt = M.make_optimizer("sgd", model)
        params = list(model.parameters())
        flat = torch.zeros(sum(p.numel() for p in params))
        offsets = [0]
        for p in params:
            p.grad = flat[offsets[-1]:offsets[-1] + p.numel()].view_as(p)
            offsets.append(offsets[-1] + p.numel())
        held = params[0].grad
        step = transpile(fn) if transpiled else fn
        seen = []
        for x, y in M.batches("mlp", 4, 8):
            step(model, opt, x, y)
            seen.append(flat.clone())
            opt.zero_grad(set_to_none=False)   # between calls, as a flat-buffer loop does
        assert params[0].grad is held
        views.append((seen, _state(model, opt)))
    (ours, our_state), (eager, eager_state) = views
    assert all(torch.equal(a, b) for a, b in zip(ours, eager)) and ours[-1].abs().sum() > 0
    assert all(torch.equal(our_state[k], eager_state[k]) for k in eager_state)
