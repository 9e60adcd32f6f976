"""A tensor's value printed or logged inside the step (capture/value_text.py):
each call prints and logs what eager does, and a trace stopped at such a
value on fake tensors prints nothing of its own."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from transpiler import transpile

log = logging.getLogger("tests.value_text")


def _report(how: str, loss: torch.Tensor, correct: torch.Tensor, i: int) -> None:
    if how == "print":
        print("loss", loss.item())
    elif how == "f-string":
        print(f"loss {loss.item():.4f} correct {correct.item()}")
    elif how == "format":
        print("{:.6f}".format(loss.item()))   # pytorch/examples' MNIST
    elif how == "percent":
        print("loss %.4f" % loss.item())
    elif how == "str":
        print("loss " + str(loss.item()) + " / " + repr(correct.item()))
    elif how == "round":
        print("loss", round(loss.item(), 3))
    elif how == "logging":
        log.info("step %d loss %.4f correct %s", i, loss.item(), correct.item())
    elif how == "every other call":
        if i % 2 == 0:
            print(f"step {i}: {loss.item():.5f}")
    elif how == "caught":   # a formatting stop caught by the step itself
        try:
            text = str(loss.item())
        except Exception:   # noqa: BLE001
            text = "?"
        print("loss", text)


def step(model, opt, x, y, i, how):
    opt.zero_grad()
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    opt.step()
    _report(how, loss.detach(), (logits.argmax(1) == y).sum(), i)
    return loss.detach()


def _run(fn, how, capsys, caplog) -> tuple[list[str], list[str], dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    capsys.readouterr()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tests.value_text"):
        for i in range(5):
            fn(model, opt, torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g),
               i, how)
    printed = capsys.readouterr()
    lines = [r.getMessage() for r in caplog.records if r.name == "tests.value_text"]
    return printed.out.splitlines() + lines, printed.err.splitlines(), model.state_dict()


@pytest.mark.parametrize("how", ["print", "f-string", "format", "percent", "str", "round",
                                 "logging", "every other call", "caught"])
def test_each_call_prints_and_logs_what_eager_does(how, capsys, caplog):
    expected, _, state = _run(step, how, capsys, caplog)
    got, errors, state_t = _run(transpile(step), how, capsys, caplog)
    assert got == expected
    assert len(expected) == (3 if how == "every other call" else 5)
    assert not any("Logging error" in line or "Traceback" in line for line in errors), errors
    assert all(torch.equal(state[k], state_t[k]) for k in state)


def _rank_prints(rank_zero_only: bool, transpiled: bool) -> str:
    """What this rank prints over 4 steps of fuse_all_reduce (or of DDP), each
    rank on its own batches: the losses differ between ranks."""
    import contextlib
    import io

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def ddp_step(model, opt, x, y, i):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if not rank_zero_only or dist.get_rank() == 0:
            print(f"step {i} loss {loss.item():.5f}")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fn = transpile(ddp_step, mode="fuse_all_reduce") if transpiled else ddp_step
    wrapped = model if transpiled else DDP(model)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for i in range(4):
            fn(wrapped, opt, torch.randn(6, 8, generator=g),
               torch.randint(0, 3, (6,), generator=g), i)
    return out.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("rank_zero_only", [False, True])
def test_each_rank_prints_what_it_prints_under_ddp(ranks2, rank_zero_only):
    """Each rank decides on its own loss (a rank traces again alone, before the
    program's collectives): every rank prints what it prints under DDP."""
    expected = ranks2.run(_rank_prints, rank_zero_only, False)
    assert ranks2.run(_rank_prints, rank_zero_only, True) == expected
    assert expected[0].count("\n") == 4 and (expected[1] == "") == rank_zero_only


def _shown(how: str, model, opt, x, y) -> None:
    """What a step shows besides a number: text that is the same on every
    call, host values, sizes, whole tensors."""
    out = model(x)
    if how == "constant":
        print("step done")
        log.info("optimizer stepped")
    elif how == "host values":   # an lr a scheduler changes between calls
        print(f"lr {opt.param_groups[0]['lr']} momentum {opt.param_groups[0]['momentum']}")
    elif how == "sizes":   # the batch's size changes: a symbolic dimension
        print("batch", tuple(x.shape), x.size(0), x.shape)
    elif how == "tensors":
        print(out.argmax(1), (out > 0)[:2], out[:0])
        print(f"preds {out.argmax(1)}")
    elif how == "summarized":   # more values than torch shows (the same each call: one program)
        print(torch.arange(2000.0).view(20, 100) / 7 + x.shape[0])
    elif how == "logged tensors":
        log.info("preds %s of %r", out.argmax(1), y)
    elif how == "after a lazy initialization":   # traced again to see it converge: shown once
        if getattr(model, "problem_type", None) is None:
            model.problem_type = "single_label"
        print("problem", model.problem_type)


def _show_step(model, opt, x, y, how):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    with torch.no_grad():
        _shown(how, model, opt, x, y)
    return loss.detach()


@pytest.mark.parametrize("how", ["constant", "host values", "sizes", "tensors", "summarized",
                                 "logged tensors", "after a lazy initialization"])
def test_each_call_shows_what_eager_shows(how, capsys, caplog):
    """The program runs without the step's Python: what the trace printed and
    logged is shown again after every later run (capture/printed.py); it
    showed once. A size printed read as the symbol's name (`batch (s17, 8)`)
    and a tensor as `FakeTensor(..., size=(6,))`: each is now its value (a
    decision, or a guard on the size), as eager prints it."""
    shown = []
    for transpiled in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(8, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
        fn = transpile(_show_step) if transpiled else _show_step
        g = torch.Generator().manual_seed(1)
        capsys.readouterr()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tests.value_text"):
            for i in range(6):
                n = 6 if i < 3 else 4 + i % 2
                fn(model, opt, torch.randn(n, 8, generator=g),
                   torch.randint(0, 3, (n,), generator=g), how)
                scheduler.step()
        printed = capsys.readouterr().out.splitlines()
        shown.append(printed + [r.getMessage() for r in caplog.records
                                if r.name == "tests.value_text"])
    assert shown[1] == shown[0]
    assert len(shown[0]) >= 6


@pytest.mark.parametrize("how", ["print", "f-string", "format", "str", "round", "caught",
                                 "logging"])
def test_a_printed_value_is_filled_in_after_each_run_of_one_program(how, capsys, caplog):
    """Printed or logged by the step's own code (logging's %-conversions each
    rendered from the value), a tensor's value is an output of the
    program and each run's text is filled in with it (capture/text_values.py):
    the same programs for every loss, where each new value traced again. (Two
    traces: the step's argument i changes at the second call, and is an input
    from then on.)"""
    expected, _, _ = _run(step, how, capsys, caplog)
    transpiled = transpile(step)
    got, _, _ = _run(transpiled, how, capsys, caplog)
    assert got == expected and len(set(expected)) == 5
    assert transpiled.traces == 2


@pytest.mark.parametrize("how", ["percent"])
def test_a_value_formatted_by_percent_is_a_decision(how, capsys, caplog):
    """`"%.4f" % x` in the step's code reads the value as a Python float
    (float(x)): a decision on it, traced again for each call whose value
    differs, as before."""
    expected, _, _ = _run(step, how, capsys, caplog)
    transpiled = transpile(step)
    got, _, _ = _run(transpiled, how, capsys, caplog)
    assert got == expected
    assert transpiled.traces == 5


def tensors_step(model, opt, x, y):
    opt.zero_grad()
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    opt.step()
    print("loss", loss, f"{loss:.5f}", f"preds {logits.argmax(1)}")
    print(model[0].bias[:3])
    print(model[2].bias)   # "Parameter containing:", as nn.Parameter shows itself
    print(logits[:2])   # then written in place: shown as it was when printed
    logits.mul_(0)
    return loss.detach()


def keyed_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    seen = {f"{loss.item():.1f}": loss.item()}
    print("buckets", list(seen))
    return loss.detach()


def _printed_both(fn, capsys, calls: int, extra=lambda i: (), model=None, **options):
    """What `fn` prints over `calls` calls in eager, then transpiled (with
    `options`), each from the same model and batches; and the transpiled step."""
    printed = []
    for transpiled in (False, True):
        torch.manual_seed(0)
        net = model() if model else nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        step_fn = transpile(fn, **options) if transpiled else fn
        g = torch.Generator().manual_seed(1)
        capsys.readouterr()
        for i in range(calls):
            step_fn(net, opt, torch.randn(6, 8, generator=g),
                    torch.randint(0, 3, (6,), generator=g), *extra(i))
        printed.append(capsys.readouterr().out)
    return printed, step_fn


@pytest.mark.parametrize("fn,traces", [(tensors_step, 1), (keyed_step, 5)])
def test_printed_tensors_fill_in_and_text_used_otherwise_is_a_decision(fn, traces, capsys):
    """Tensors printed (repr, a 0-d tensor's format) are filled in as numbers
    are; text used otherwise than printed (a dict's key) falls back to a
    decision on the value, as eager prints either."""
    printed, step_fn = _printed_both(fn, capsys, 5)
    assert printed[1] == printed[0] and printed[0].count("\n") == (30 if fn is tensors_step else 5)
    assert fn is keyed_step or ("grad_fn=<NllLossBackward0>" in printed[0]
                                and "Parameter containing:" in printed[0])
    assert step_fn.traces == traces


@pytest.mark.compiles
def test_printed_values_under_inductor(capsys):
    """A compiled program outputs the values printed: one compile, each call's
    text within inductor's rounding of eager's."""
    texts, step_fn = _printed_both(step, capsys, 4, lambda i: (i, "print"), backend="inductor")
    printed = [[float(line.split()[1]) for line in text.splitlines()] for text in texts]
    assert step_fn.traces == 2 and len(printed[1]) == 4   # (i is an input from the second call)
    assert printed[1] == pytest.approx(printed[0], rel=1e-5)


def logged_step(model, opt, x, y):
    opt.zero_grad()
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    opt.step()
    log.info("loss %(loss).3f of %(n)d (100%%)", {"loss": loss.item(), "n": 6})
    log.info("loss %r accuracy %s %6.2f", loss, (logits.argmax(1) == y).float().mean(),
             loss.detach())
    return loss.detach()


def test_logged_values_by_name_and_logged_tensors_fill_in(caplog):
    """logging's conversions by name, and a tensor logged by %r, %s or a number
    conversion: each rendered from the run's value, one program."""
    logged = []
    for transpiled in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step_fn = transpile(logged_step) if transpiled else logged_step
        g = torch.Generator().manual_seed(1)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tests.value_text"):
            for _ in range(4):
                step_fn(model, opt, torch.randn(6, 8, generator=g),
                        torch.randint(0, 3, (6,), generator=g))
        logged.append([r.getMessage() for r in caplog.records if r.name == "tests.value_text"])
    assert logged[1] == logged[0] and len(set(logged[0])) == 8
    assert step_fn.traces == 1


def mnist_log_step(model, optimizer, data, target, epoch, batch_idx, n_data, n_batches):
    """pytorch/examples mnist/main.py train(): the log line every log_interval batches."""
    optimizer.zero_grad()
    loss = F.nll_loss(F.log_softmax(model(data), dim=1), target)
    loss.backward()
    optimizer.step()
    if batch_idx % 2 == 0:
        print('Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}'.format(
            epoch, batch_idx * len(data), n_data, 100. * batch_idx / n_batches, loss.item()))
    return loss


def nanogpt_log_step(model, optimizer, x, y, iter_num, dt, running_mfu):
    """karpathy/nanoGPT train.py: the iteration's log line (dt measured by the loop)."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lossf = loss.item()
    print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%")
    return loss


@pytest.mark.parametrize("fn,extra,traces", [
    (mnist_log_step, lambda i: (1, i, 60, 10), 3),   # first, then i lifted: odd and even calls
    (nanogpt_log_step, lambda i: (i, 0.01 + i / 1000, 0.1 * i), 2)])
def test_real_scripts_log_lines_print_as_eager_from_few_programs(fn, extra, traces, capsys):
    """Log lines of real scripts, with the loop's counters and timings as
    arguments: each call's text as eager's, and the programs do not grow with
    the number of calls."""
    printed, step_fn = _printed_both(fn, capsys, 8, extra, model=lambda: nn.Linear(8, 3))
    assert printed[1] == printed[0] and len(set(printed[0].splitlines())) >= 4
    assert step_fn.traces == traces
