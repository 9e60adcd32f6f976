"""The step's own raise on a call's values (capture/raised.py): a loss check
that raises (`if not torch.isfinite(loss): raise FloatingPointError`), MAE's
and DeiT's `if not math.isfinite(loss.item()): print(...); sys.exit(1)`,
clip_grad_norm_'s `error_if_nonfinite=True`. On a call that raises, the
program writes what eager wrote before the raise (zero_grad's None, the
batch-norm statistics of the forward, the generator's draws) and raises the
same exception; the script that catches it trains on as eager does. Every
finite loss runs one program (capture/finite_tests.py); a nan the step turns
into text is pinned (decisions.py). On 2 ranks, a raise on every rank equals
DDP's; one rank alone stops every rank with an error, never a hang."""

import copy
import math
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests import models as M
from tests.ranks import RankPool
from transpiler import TranspileError, transpile

CALLS = 5


class BNDrop(M.BNNet):
    """Its forward writes batch-norm statistics and draws a dropout mask."""

    def forward(self, x):
        return self.fc2(F.dropout(torch.relu(self.bn(self.fc1(x))), 0.2))


def loss_checked(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    if not torch.isfinite(loss):
        raise FloatingPointError("loss is not finite")
    loss.backward()
    opt.step()
    return loss.detach()


def mae_exit(model, opt, x, y):
    """facebookresearch/mae engine_pretrain.py train_one_epoch."""
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss_value = loss.item()
    if not math.isfinite(loss_value):
        print("Loss is {}, stopping training".format(loss_value))
        sys.exit(1)
    loss.backward()
    opt.step()
    return loss.detach()


def clip_checked(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    opt.step()
    return loss.detach()


def _batches(bad: set[int], rank: int = 0):
    out = []
    for i, (x, y) in enumerate(M.batches("bn", CALLS, 8, seed=1 + rank)):
        if i in bad:
            x = x.clone()
            x[0, 0] = float("nan")
        out.append((x, y))
    return out


def _call(step, model, opt, x, y):
    """The script's loop body: a raise is caught, and the loop goes on."""
    try:
        return step(model, opt, x, y)
    except (FloatingPointError, RuntimeError, SystemExit) as exc:
        return f"{type(exc).__name__}: {exc}"


def _everything(model, opt) -> dict:
    state = M.state_of(model, opt)
    state.update({f"grad.{n}": p.grad for n, p in model.named_parameters()})
    state["rng"] = torch.get_rng_state()
    return state


def _assert_same(a, b, where):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), (where, a, b)
        # bit for bit, a nan where eager has one (the batch-norm statistics of a nan batch)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=where)
    else:
        assert a == b, (where, a, b)


def _against_eager(step_fn, bad: set[int], **options):
    torch.manual_seed(0)
    ours = BNDrop()
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    step = transpile(step_fn, **options)
    results = []
    for i, (x, y) in enumerate(_batches(bad)):
        torch.manual_seed(100 + i)
        a = _call(step, ours, opts[0], x, y)
        mine = _everything(ours, opts[0])
        torch.manual_seed(100 + i)
        b = _call(step_fn, theirs, opts[1], x, y)
        _assert_same(a, b, f"call {i}")
        reference = _everything(theirs, opts[1])
        assert mine.keys() == reference.keys()
        for k in mine:
            _assert_same(mine[k], reference[k], f"call {i}: {k}")
        results.append(a)
    return step, results


@pytest.mark.parametrize("bad", [{2}, {0}, {1, 2}])
def test_a_raise_writes_what_eager_wrote_and_raises_the_same(bad):
    step, results = _against_eager(loss_checked, bad)
    assert [isinstance(r, str) for r in results] == [i in bad for i in range(CALLS)]
    assert results[min(bad)] == "FloatingPointError: loss is not finite"
    assert step.traces == 2   # the finite calls' program and the raising one


def test_verify_compares_the_raise_with_eagers():
    step, results = _against_eager(loss_checked, {1, 3}, verify=CALLS)
    assert [isinstance(r, str) for r in results] == [False, True, False, True, False]
    assert step.traces == 2


def test_the_raise_is_at_the_users_line():
    torch.manual_seed(0)
    model = BNDrop()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = transpile(loss_checked)
    (x, y), = _batches({0})[:1]
    for _ in range(2):   # traced, then run from the cache
        with pytest.raises(FloatingPointError) as info:
            step(model, opt, x, y)
        frames = [(f.name, f.lineno) for f in info.traceback]
        assert frames[-1][0] == "loss_checked", frames


def test_mae_exits_on_a_nan_loss_and_traces_once_for_every_finite_one(capsys):
    step, results = _against_eager(mae_exit, {2})
    assert results[2] == "SystemExit: 1"
    out = capsys.readouterr().out
    # printed by the program's call and by eager's
    assert out.count("Loss is nan, stopping training") == 2, out
    # a test of the loss's value, not a decision on each loss: one program
    # for the finite ones, one for nan
    assert step.traces == 2


def test_a_library_check_raises_as_eager():
    step, results = _against_eager(clip_checked, {3})
    assert results[3].startswith("RuntimeError: The total norm of order 2.0 for gradients")
    assert step.traces == 2


def printed_first(model, opt, x, y):
    opt.zero_grad()
    print(f"first {x[0, 0].item():.4f}")
    loss = F.cross_entropy(model(x.nan_to_num()), y)
    loss.backward()
    opt.step()
    return loss.detach()


def test_a_nan_turned_into_text_is_checked_on_later_calls(capsys):
    """A float taken as nan keeps no check of torch's own (sympy folds
    `x == nan` to false): the program of the nan call would print nan for
    every later loss."""
    _against_eager(printed_first, {1})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0::2] == lines[1::2], lines   # the program's line, then eager's
    assert [line == "first nan" for line in lines[0::2]] == [False, True, False, False, False]


def array_on_a_decision(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    if loss > 0:
        loss = loss * float(np.asarray(loss.detach()))
    loss.backward()
    opt.step()
    return loss.detach()


def test_an_op_failing_on_what_the_trace_gave_it_is_the_traces_failure():
    """`np.asarray` of a traced tensor fails where eager's does not: a
    TranspileError at its line with nothing written, not a program that raises."""
    torch.manual_seed(0)
    model = BNDrop()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (x, y), = _batches(set())[:1]
    model(x).sum().backward()   # a .grad the step's zero_grad would drop
    before = _everything(model, opt)
    with pytest.raises(TranspileError, match=r"test_raised\.py:\d+ \(loss = loss \* float\(np\.asarray"):
        transpile(array_on_a_decision)(model, opt, x, y)
    after = _everything(model, opt)
    for k in before:
        _assert_same(after[k], before[k], k)


# ------------------------------------------------------------------- ranks

def rank_raise_vs_ddp(mode, nan_ranks):
    rank = dist.get_rank()
    ours, theirs, opts, step = M.against_ddp(BNDrop, mae_exit, mode)
    results = []
    for i, (x, y) in enumerate(_batches({2} if rank in nan_ranks else set(), rank)):
        torch.manual_seed(100 + i + rank)
        try:
            a = _call(step, ours, opts[0], x, y)
        except TranspileError as exc:
            return str(exc)
        torch.manual_seed(100 + i + rank)
        b = _call(mae_exit, theirs, opts[1], x, y)
        results.append((a if isinstance(a, str) else None, b if isinstance(b, str) else None))
    reference = M.as_next_forward_sees(theirs).state_dict()
    for name, value in ours.state_dict().items():
        _assert_same(value, reference[name], name)
    return results


@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce"])
def test_a_raise_on_every_rank_equals_ddp(mode, ranks2):
    for results in ranks2.run(rank_raise_vs_ddp, mode, (0, 1)):
        assert results[2] == ("SystemExit: 1", "SystemExit: 1")
        assert all(a == b is None for a, b in results[:2] + results[3:])


@pytest.mark.slow
def test_a_raise_on_one_rank_stops_every_rank():
    """DDP's other rank would pair its all-reduce with the raising rank's next
    step; here every rank raises, naming the rank, the decision and the raise."""
    pool = RankPool(2, pg_timeout_s=30)   # its communicators are shut down
    try:
        messages = pool.run(rank_raise_vs_ddp, "grad_allreduce", (1,), timeout=300)
    finally:
        pool.close(kill=True)
    for message in messages:
        assert isinstance(message, str), message
        assert message.startswith("rank 1 traced the step again (the decision"), message
        assert "where the step raises SystemExit: 1" in message
        assert "this job cannot go on; restart it" in message


def rank_raise_after_backward():
    torch.manual_seed(0)
    model = BNDrop()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = transpile(clip_checked)
    (x, y), = _batches({0}, dist.get_rank())[:1]
    before = _everything(model, opt)
    try:
        step(model, opt, x, y)
    except TranspileError as exc:
        after = _everything(model, opt)
        return str(exc), all((after[k] is None and before[k] is None)
                             or torch.equal(after[k], before[k]) for k in before)
    return None, None


def test_a_raise_after_backward_on_ranks_is_refused_with_nothing_written(ranks2):
    """DDP has averaged the gradients by the time clip_grad_norm_ raises; a
    program that ends there, before its first collective, cannot."""
    for message, untouched in ranks2.run(rank_raise_after_backward):
        assert message is not None and "raises RuntimeError: The total norm" in message
        assert "after backward() on this call's values" in message, message
        assert untouched
