"""The ambient state a call is made under (autocast, grad mode, the default
dtype, deterministic algorithms, torch function and dispatch modes) is part of
its signature: a call under another traces again, the log names the change,
and every call gives the eager step's numbers, bit for bit; a program runs
as it was traced, never cast again by the caller's autocast. On one process
against the eager step, and on 2 ranks against torch DDP with its defaults."""

import contextlib
import copy
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from tests import models as M
from tests.ranks import RankPool
from transpiler import TranspileError, transpile
from transpiler.capture import flatten_args
from transpiler.capture.ambient import as_traced, snapshot

BF16 = "ambient autocast(cpu): off -> bfloat16"


def autocast(on: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()


class Scaled(TorchFunctionMode):
    """Multiplies every linear layer's output by `factor`."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * self.factor if func is F.linear else out


def literal_step(model, opt, x, y):
    """Makes a tensor from a literal: its dtype is the default dtype."""
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y) * torch.tensor(0.5)
    loss.backward()
    opt.step()
    return loss


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _against_eager(contexts, step_fn=M.classify_step, backend="eager"):
    """The transpiled and the eager step from identical starts, call i under
    contexts[i]() for both: per call, the returned values and the models."""
    model = M.make("mlp")
    reference = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    step = transpile(step_fn, backend=backend)
    results = []
    for context, (x, y) in zip(contexts, M.batches("mlp", len(contexts), 8)):
        with context():
            ours = step(model, opts[0], x, y)
        with context():
            theirs = step_fn(reference, opts[1], x, y)
        results.append((ours, theirs, _equal(model, reference)))
    return step, results


def _traced(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("transpiler: traced")]


def test_calls_alternating_autocast_equal_eager_and_trace_once_each(caplog):
    contexts = [lambda on=bool(i % 2): autocast(on) for i in range(5)]
    with caplog.at_level(logging.INFO, logger="transpiler"):
        step, results = _against_eager(contexts)
    for ours, theirs, same in results:
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs) and same
    traced = _traced(caplog)
    assert step.traces == 2 and len(traced) == 2
    assert BF16 in traced[1]


@pytest.mark.compiles
def test_calls_alternating_autocast_compiled_equal_eager(caplog):
    contexts = [lambda on=bool(i % 2): autocast(on) for i in range(4)]
    step, results = _against_eager(contexts, backend="inductor")
    for ours, theirs, _ in results:
        assert ours.dtype == theirs.dtype
        assert torch.allclose(ours, theirs, rtol=1e-2 if ours.dtype == torch.bfloat16 else 1e-5)
    assert step.traces == 2 and step.compiled_backend == "inductor"


def test_a_program_runs_as_traced_under_the_callers_autocast():
    # The program traced without autocast, run (and compiled) under it, and the
    # one traced under it, run without: each computes what it computed as
    # traced (autocast would cast the first program's matmuls to bfloat16).
    model = M.make("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = transpile(M.classify_step)
    x, y = M.batches("mlp", 1, 8)[0]
    programs = {}
    for on in (False, True):
        with autocast(on):
            step(model, opt, x, y)
        programs[on] = step._last_built().programs["main"]
    leaves = flatten_args(M.classify_step, (model, opt, x, y), {}).leaves
    for traced_under, runnable in programs.items():
        as_traced_outputs = step._executor.run_uncommitted(runnable, leaves)
        with autocast(not traced_under):
            outputs = step._executor.run_uncommitted(runnable, leaves)
        assert all(torch.equal(a, b) for a, b in zip(as_traced_outputs, outputs))


def test_as_traced_sets_aside_autocast_grad_mode_and_function_modes():
    a, b = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)
    with autocast(True), Scaled(2.0) as mode:
        with as_traced():
            product = torch.mm(a, b)
            assert product.dtype == torch.float32 and not product.requires_grad
            assert torch.equal(F.linear(a, b), a @ b.T)   # not scaled
        assert torch.mm(a, b).dtype == torch.bfloat16
        assert torch.overrides._get_current_function_mode_stack() == [mode]
        assert torch.is_grad_enabled()


def test_default_dtype_change_traces_again_and_equals_eager(caplog):
    def default(dtype):
        @contextlib.contextmanager
        def context():
            before = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                yield
            finally:
                torch.set_default_dtype(before)
        return context
    contexts = [default(torch.float32), default(torch.float64), default(torch.float32)]
    with caplog.at_level(logging.INFO, logger="transpiler"):
        step, results = _against_eager(contexts, literal_step)
    for ours, theirs, same in results:
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs) and same
    assert results[1][0].dtype == torch.float64
    assert "ambient default dtype: float32 -> float64" in _traced(caplog)[1]
    assert step.traces == 2


def test_deterministic_algorithms_toggled_trace_again(caplog):
    @contextlib.contextmanager
    def deterministic():
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(False)
    contexts = [contextlib.nullcontext, deterministic, contextlib.nullcontext, deterministic]
    with caplog.at_level(logging.INFO, logger="transpiler"):
        step, results = _against_eager(contexts)
    assert all(torch.equal(ours, theirs) and same for ours, theirs, same in results)
    assert "ambient deterministic algorithms: off -> on" in _traced(caplog)[1]
    assert step.traces == 2


def test_torch_function_modes_are_traced_and_not_applied_again(caplog):
    contexts = [lambda: Scaled(2.0), lambda: Scaled(2.0), lambda: Scaled(3.0),
                contextlib.nullcontext]
    with caplog.at_level(logging.INFO, logger="transpiler"):
        step, results = _against_eager(contexts)
    assert all(torch.equal(ours, theirs) and same for ours, theirs, same in results)
    traced = _traced(caplog)
    assert step.traces == 3
    assert "ambient torch function modes: [test_ambient.Scaled(factor=2.0)] -> " \
           "[test_ambient.Scaled(factor=3.0)]" in traced[1].replace("tests.", "")


def test_a_dispatch_mode_is_refused_and_changes_nothing():
    model = M.make("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = transpile(M.classify_step)
    x, y = M.batches("mlp", 1, 8)[0]
    step(model, opt, x, y)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TranspileError, match="called under a torch dispatch mode"), \
            FlopCounterMode(display=False):
        step(model, opt, x, y)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_grad_mode_off_fails_as_eager_does():
    model = M.make("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = transpile(M.classify_step)
    x, y = M.batches("mlp", 1, 8)[0]
    with torch.no_grad():
        with pytest.raises(RuntimeError) as eager:
            M.classify_step(copy.deepcopy(model), opt, x, y)
        with pytest.raises(TranspileError, match=r"loss\.backward\(\)") as ours:
            step(model, opt, x, y)
    assert str(eager.value) in str(ours.value)
    assert snapshot().grad   # the refusal left grad mode as it was


def enabling_step(model, opt, x, y):
    """Trains under a caller's no_grad, as eager does."""
    with torch.enable_grad():
        return M.classify_step(model, opt, x, y)


def test_a_step_that_enables_grad_trains_under_no_grad():
    _, results = _against_eager([torch.no_grad, contextlib.nullcontext, torch.no_grad],
                                enabling_step)
    assert all(torch.equal(ours, theirs) and same for ours, theirs, same in results)


def _state(model, opt, mode: str) -> dict:
    """Mode zero keeps shards of the optimizer's state: its parameters stand for it."""
    return {k: v for k, v in M.state_of(model, opt).items()
            if mode != "zero" or k.startswith("model.")}


def rank_autocast_vs_ddp(mode: str, on_rank) -> dict:
    """Calls alternating autocast (on every rank, or on the ranks `on_rank`
    names alone), transpiled and under DDP, same processes, each rank its
    batch; the state each leaves."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = M.make("mlp")
    reference = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    step, ddp = transpile(M.classify_step, mode=mode), DDP(reference)
    for i, batch in enumerate(M.batches("mlp", 5, 16)):
        x, y = M.shard(batch, rank, world)
        on = bool(i % 2) and (on_rank is None or rank in on_rank)
        with autocast(on):
            step(model, opts[0], x, y)
        with autocast(on):
            M.classify_step(ddp, opts[1], x, y)
    return {"ours": _state(model, opts[0], mode), "ddp": _state(reference, opts[1], mode),
            "traces": step.traces}


@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce", "zero"])
def test_alternating_autocast_equals_ddp(mode, ranks2):
    for result in ranks2.run(rank_autocast_vs_ddp, mode, None):
        assert result["traces"] == 2
        tolerance = 1e-6 if mode == "zero" else 0.0
        assert M.max_rel_error(result["ours"], result["ddp"]) <= tolerance


def test_autocast_toggled_keeps_ddps_buckets_on_3_ranks(ranks3):
    """Under autocast the engine accumulates a weight's gradient before its
    bias's; DDP keeps the buckets it rebuilt after its first iteration, and so
    does the step traced again: bit for bit where the layout decides the sum."""
    for result in ranks3.run(rank_autocast_vs_ddp, "fuse_all_reduce", None):
        assert result["traces"] == 2
        assert M.max_rel_error(result["ours"], result["ddp"]) == 0.0


def test_autocast_on_one_rank_alone_trains_as_ddp(ranks2):
    # DDP lets each rank compute in its own precision, the gradients' all-reduce
    # being the same: so does the transpiled step, with no exchange.
    results = ranks2.run(rank_autocast_vs_ddp, "fuse_all_reduce", [0])
    assert [r["traces"] for r in results] == [2, 1]
    assert all(M.max_rel_error(r["ours"], r["ddp"]) == 0.0 for r in results)


def rank_grad_off_alone(at_call: int):
    """Rank 1 alone calls the step under no_grad at call `at_call`: what each
    rank raises, and whether its state was left as it was."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = M.make("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = transpile(M.classify_step, mode="fuse_all_reduce")
    for i, batch in enumerate(M.batches("mlp", at_call + 1, 16)):
        before = M.state_of(model, opt)
        with torch.no_grad() if i == at_call and rank == 1 else contextlib.nullcontext():
            try:
                step(model, opt, *M.shard(batch, rank, world))
            except TranspileError as exc:
                after = M.state_of(model, opt)
                return str(exc), all(torch.equal(v, after[k]) for k, v in before.items())
    return None


@pytest.mark.slow
@pytest.mark.parametrize("at_call", [0, 2])
def test_grad_off_on_one_rank_raises_on_every_rank(at_call):
    # At the first call the ranks agree on their builds; later, rank 1's
    # failed rebuild meets rank 0 waiting in the previous program's
    # collectives, and the job is abandoned within the grace period.
    pool = RankPool(2, pg_timeout_s=60)
    try:
        results = pool.run(rank_grad_off_alone, at_call, timeout=300)
    finally:
        pool.close(kill=True)
    for rank, outcome in enumerate(results):
        assert outcome is not None, f"rank {rank} finished its steps"
        message, untouched = outcome
        assert untouched
        assert "does not require grad" in message
        if at_call == 0 and rank == 0:
            assert message.startswith("rank 1 could not build the step, so no rank runs it")
        if at_call:
            assert message.startswith("rank 1 could not build the step again "
                                      "(ambient grad mode: on -> off")
            assert "this job cannot go on; restart it" in message


def twice_under_autocast(model, opt, x1, x2):
    """A module applied twice in one autocast region (MoCo's two views, a
    siamese network): eager casts each parameter to bfloat16 once (autocast's
    cache), so both uses' gradients add up in bfloat16."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x1).float().pow(2).sum() + model(x2).float().pow(2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def test_a_module_used_twice_under_autocast_equals_eager():
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                               torch.nn.Linear(32, 8))
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (ours, theirs)]
    step = transpile(twice_under_autocast)
    for _ in range(3):
        x1, x2 = torch.randn(8, 16), torch.randn(8, 16)
        assert torch.equal(step(ours, opts[0], x1, x2), twice_under_autocast(theirs, opts[1], x1, x2))
        assert all(torch.equal(p, q) and torch.equal(p.grad, q.grad)
                   for p, q in zip(ours.parameters(), theirs.parameters()))
