"""What a step returns besides tensors, and what its own Python reads of its
optimizers' param groups.

- Python numbers the step computes from tensors (`loss.item()`, `.tolist()`,
  an int count, a bool) are returned as eager returns them, read after the
  program ran; strings and sizes as traced.
- A tensor's `.numpy()` is returned as eager's (the program's output, read
  with .numpy() after it ran) and printed as eager prints it; numpy computing
  with its values inside the step is refused at the user's line.
- A param-group value the step reads (`optimizer.param_groups[0]["lr"]`) that
  an LR scheduler changes between calls is read from an input on every call,
  not baked in.
- A value an LR scheduler stepped inside the step sets is returned as the
  scheduler leaves it after the call, and refused at the user's line for any
  other use.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import TranspileError, transpile
from transpiler.program.program import InputKind


def logging_step(model, opt, x, y):
    """Returns what a training loop logs, as Python values."""
    opt.zero_grad()
    out = model(x)
    losses = F.cross_entropy(out, y, reduction="none")
    loss = losses.mean()
    loss.backward()
    opt.step()
    correct = (out.argmax(1) == y).sum().item()
    return {"loss": loss.item(), "per_sample": losses.detach().tolist(), "correct": correct,
            "accuracy": correct / y.shape[0], "finite": bool(torch.isfinite(loss).item()),
            "batch": len(y), "phase": "train", "twice": loss.item() * 2 + 1}


def _same(a, b) -> bool:
    """Equal in value and in Python type, leaf by leaf."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return type(a) is type(b) and a == b


def _against_eager(fn, calls=4, scheduled=None, optimizer="sgd", backend="eager"):
    """fn transpiled and eager on twin models; scheduled(opt) makes an LR
    scheduler stepped after every call, outside the step. Returns the step
    and, per call, (transpiled result, eager result)."""
    model = M.make("mlp")
    reference = copy.deepcopy(model)
    opts = [M.make_optimizer(optimizer, m) for m in (model, reference)]
    schedulers = [scheduled(o) for o in opts] if scheduled else []
    step = transpile(fn, backend=backend)
    results = []
    for x, y in M.batches("mlp", calls, 8):
        results.append((step(model, opts[0], x, y), fn(reference, opts[1], x, y)))
        for scheduler in schedulers:
            scheduler.step()
    error = M.max_rel_error(M.state_of(model, opts[0]), M.state_of(reference, opts[1]))
    assert error == 0.0 if backend == "eager" else error < 1e-5
    return step, results


def test_python_numbers_are_returned_as_eager_returns_them():
    step, results = _against_eager(logging_step)
    for ours, theirs in results:
        assert _same(ours, theirs), (ours, theirs)
    assert isinstance(results[0][0]["correct"], int) and isinstance(results[0][0]["loss"], float)
    assert step._cache.builds == 1


def _halving(opt):
    return torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)


def decaying_step(model, opt, x, y):
    """A decoupled weight decay from the group's lr (fast.ai's helper), and
    the lr returned."""
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    lr = opt.param_groups[0]["lr"]
    for p in model.parameters():
        p.data.add_(p.data, alpha=-0.01 * lr)
    opt.step()
    return loss, lr


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_group_value_the_step_reads_follows_its_scheduler(optimizer):
    step, results = _against_eager(decaying_step, scheduled=_halving, optimizer=optimizer)
    for ours, theirs in results:
        assert torch.equal(ours[0], theirs[0]) and ours[1] == theirs[1]
    assert len({theirs[1] for _, theirs in results}) == 4   # halved every call
    assert step._cache.builds == 1
    read = [spec.name for spec in step.program.inputs if spec.kind is InputKind.NUMBER]
    assert read == ["optimizer.param_groups[0]['lr']"]


def test_unread_group_values_are_no_inputs():
    step, _ = _against_eager(M.classify_step, calls=2)
    assert not [spec for spec in step.program.inputs if spec.kind is InputKind.NUMBER]


def deciding_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    if opt.param_groups[0]["lr"] < 0.02:
        loss = loss * 2
    loss.backward()
    opt.step()
    return loss


def test_a_decision_on_a_group_value_keeps_a_program_per_outcome():
    # lr 0.05, 0.025 (the first branch), 0.0125, 0.00625 (the other)
    step, results = _against_eager(deciding_step, scheduled=_halving)
    assert all(torch.equal(ours, theirs) for ours, theirs in results)
    assert step._cache.builds == 2


def floating_decision_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    if opt.param_groups[0]["lr"] * 3 - 0.01 < 0.06:   # restated by torch: replayed
        loss = loss * 2
    loss.backward()
    opt.step()
    return loss


def test_a_decision_on_a_group_value_in_floating_point_keeps_a_program_per_outcome():
    # lr 0.05, 0.025 (not taken), 0.0125, 0.00625 (taken), decided as Python does
    step, results = _against_eager(floating_decision_step, scheduled=_halving)
    assert all(torch.equal(ours, theirs) for ours, theirs in results)
    assert step._cache.builds == 2


def scheduled_step(model, opt, scheduler, x, y):
    """HF Trainer's order: step, scheduler step, zero_grad; then the logs."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    scheduler.step()
    opt.zero_grad()
    return {"loss": loss.item(), "last_lr": scheduler.get_last_lr(),
            "group_lr": opt.param_groups[0]["lr"], "epoch": scheduler.last_epoch}


def _warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 3))


def _scheduled_against_eager(fn):
    """fn(model, opt, scheduler, x, y), which steps the scheduler, transpiled
    and eager on twins: what each call returns and the state equal, one program."""
    model = M.make("mlp")
    reference = copy.deepcopy(model)
    opts = [M.make_optimizer("adamw", m) for m in (model, reference)]
    schedulers = [_warmup(o) for o in opts]
    step = transpile(fn)
    for x, y in M.batches("mlp", 4, 8):
        ours = step(model, opts[0], schedulers[0], x, y)
        theirs = fn(reference, opts[1], schedulers[1], x, y)
        assert _same(ours, theirs), (ours, theirs)
    assert M.max_rel_error(M.state_of(model, opts[0]), M.state_of(reference, opts[1])) == 0.0
    assert step._cache.builds == 1


def test_values_a_scheduler_stepped_inside_sets_are_returned_after_the_call():
    _scheduled_against_eager(scheduled_step)


def using_the_next_lr(model, opt, scheduler, x, y):
    logs = scheduled_step(model, opt, scheduler, x, y)
    return logs["last_lr"][0] * 2


def test_a_value_a_scheduler_stepped_inside_sets_is_refused_for_other_uses():
    model = M.make("mlp")
    opt = M.make_optimizer("adamw", model)
    scheduler = _warmup(opt)
    before = M.state_of(model, opt), scheduler.state_dict(), copy.deepcopy(opt.param_groups[0])
    x, y = M.batches("mlp", 1, 8)[0]
    with pytest.raises(TranspileError, match=r"(?s)LambdaLR.get_last_lr\(\)\[0\] is read after "
                                             r"LambdaLR.step\(\) inside using_the_next_lr at "
                                             r".*test_returned.py:\d+ \(return logs\[.last_lr.\]"):
        transpile(using_the_next_lr)(model, opt, scheduler, x, y)
    assert M.max_rel_error(M.state_of(model, opt), before[0]) == 0.0
    assert scheduler.state_dict() == before[1]
    assert {k: v for k, v in opt.param_groups[0].items() if k != "params"} == \
        {k: v for k, v in before[2].items() if k != "params"}


def numpy_step(model, opt, x, y, shown=False):
    """Returns (and, shown, prints) numpy arrays of what it computed, as older
    scripts log."""
    opt.zero_grad()
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    opt.step()
    probs = out.softmax(1).numpy(force=True)
    if shown:
        print(f"loss {loss.detach().numpy():.4f}", probs)
    return {"loss": loss.detach().cpu().numpy(), "pred": out.argmax(1).numpy(), "probs": probs}


@pytest.mark.parametrize("shown", [False, True])
def test_numpy_arrays_are_returned_and_printed_as_eager_does(shown, capsys):
    model = M.make("mlp")
    reference = copy.deepcopy(model)
    opts = [M.make_optimizer("sgd", m) for m in (model, reference)]
    step = transpile(numpy_step)
    for x, y in M.batches("mlp", 4, 8):
        ours, ours_printed = step(model, opts[0], x, y, shown), capsys.readouterr().out
        theirs, their_printed = numpy_step(reference, opts[1], x, y, shown), capsys.readouterr().out
        assert ours_printed == their_printed and ("[[" in ours_printed) == shown
        for key in theirs:
            assert type(ours[key]) is np.ndarray and ours[key].dtype == theirs[key].dtype
            assert np.array_equal(ours[key], theirs[key]), key
    assert M.max_rel_error(M.state_of(model, opts[0]), M.state_of(reference, opts[1])) == 0.0
    # values printed are decisions (as .item()): a program per call's values
    assert step._cache.builds == (4 if shown else 1)


def test_numpy_computing_with_traced_values_is_refused_with_nothing_changed():
    def numpy_mean(model, opt, x, y):
        loss = M.classify_step(model, opt, x, y)
        return float(np.mean(loss.detach().numpy()))
    model = M.make("mlp")
    opt = M.make_optimizer("sgd", model)
    before = copy.deepcopy(model.state_dict())
    x, y = M.batches("mlp", 1, 8)[0]
    with pytest.raises(TranspileError, match=r"values of a tensor's \.numpy\(\) at .*test_returned"):
        transpile(numpy_mean)(model, opt, x, y)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_an_object_returned_is_refused():
    def returns_model(model, opt, x, y):
        M.classify_step(model, opt, x, y)
        return model
    model = M.make("mlp")
    opt = M.make_optimizer("sgd", model)
    x, y = M.batches("mlp", 1, 8)[0]
    with pytest.raises(TranspileError, match="returned a MLP"):
        transpile(returns_model)(model, opt, x, y)


@pytest.mark.slow
def test_returned_numbers_and_group_reads_under_inductor():
    _, results = _against_eager(decaying_step, scheduled=_halving, backend="inductor")
    assert all(ours[1] == theirs[1] for ours, theirs in results)
    _, results = _against_eager(logging_step, calls=2, backend="inductor")
    for ours, theirs in results:
        assert type(ours["correct"]) is int and ours["correct"] == theirs["correct"]
        assert abs(ours["loss"] - theirs["loss"]) < 1e-6
    _, results = _against_eager(numpy_step, calls=2, backend="inductor")
    for ours, theirs in results:
        assert all(type(ours[k]) is np.ndarray and np.allclose(ours[k], theirs[k], atol=1e-6)
                   for k in theirs)


def returned_vs_ddp(mode: str):
    """The Trainer's step and logs, transpiled and under DDP, same processes,
    each rank its own batch (fast.ai's weight decay on 2 ranks: the habit
    fastai_weight_decay_reads_group_lr)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = M.make("mlp")
    reference = copy.deepcopy(model)
    opts = [M.make_optimizer("adamw", m) for m in (model, reference)]
    schedulers = [_warmup(o) for o in opts]
    step, ddp = transpile(scheduled_step, mode=mode), DDP(reference)
    for x, y in (M.shard(batch, rank, world) for batch in M.batches("mlp", 4, 16)):
        ours = step(model, opts[0], schedulers[0], x, y)
        theirs = scheduled_step(ddp, opts[1], schedulers[1], x, y)
        assert _same(ours, theirs), (ours, theirs)
    states = M.states_compared(zip((model, reference), opts), sharded=mode == "zero")
    return step._cache.builds, M.max_rel_error(*states)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fuse_all_reduce", "zero"])
def test_returned_numbers_and_group_reads_equal_ddp(mode, ranks2):
    assert ranks2.run(returned_vs_ddp, mode) == [(1, 0.0), (1, 0.0)]


def last_lr_step(model, opt, scheduler, x, y):
    """The lr the scheduler left at the start of the call, read before its
    step() inside the step and used in the loss."""
    lr = scheduler.get_last_lr()[0]
    loss = F.cross_entropy(model(x), y) * (1 + lr)
    loss.backward()
    opt.step()
    scheduler.step()
    opt.zero_grad()
    return loss, lr


def test_get_last_lr_before_the_scheduler_steps_is_read_every_call():
    _scheduled_against_eager(last_lr_step)


def twice_then_used(model, opt, scheduler, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    scheduler.step()
    scheduler.step()
    return loss * scheduler.get_last_lr()[0]


def test_a_refused_step_leaves_a_scheduler_it_stepped_twice_as_it_was():
    model = M.make("mlp")
    opt = M.make_optimizer("adamw", model)
    scheduler = _warmup(opt)
    before = scheduler.state_dict()
    x, y = M.batches("mlp", 1, 8)[0]
    with pytest.raises(TranspileError, match=r"LambdaLR.get_last_lr\(\)\[0\] is read after"):
        transpile(twice_then_used)(model, opt, scheduler, x, y)
    assert scheduler.state_dict() == before
    assert all(type(lr) is float for lr in scheduler._last_lr)
