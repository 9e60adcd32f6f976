"""A call that fails leaves the model and the optimizer as they were: a
program writes state in place only once nothing that can raise is left, and
the write-back is all or nothing. Failures injected at each point of the step
(an op of the forward pass, one between backward() and optimizer.step(), one
after it, a value that does not fit its target, a collective) leave the
parameters, buffers and optimizer state bit for bit unchanged, and .grad
unchanged but where the step drops it (zero_grad() before backward()): that
one is dropped when the program starts, as eager's zero_grad() drops it."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests import models as M
from transpiler import TranspileError, transpile
from transpiler.backends.compile import Executable

FAIL_AT: list[str | None] = [None]   # where fails_at raises; set per test and per rank


@torch.library.custom_op("transpiler_test::fails_at", mutates_args=())
def fails_at(x: torch.Tensor, point: str) -> torch.Tensor:
    """A copy of x, or an error where the test injects one (`point`)."""
    if FAIL_AT[0] == point:
        raise RuntimeError(f"injected failure at {point}")
    return x.clone()


@fails_at.register_fake
def _(x, point):
    return torch.empty_like(x)


def checked_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(fails_at(x, "forward")), y)
    loss.backward()
    between = fails_at(loss.detach(), "before optimizer.step()")
    opt.step()
    return loss, between, fails_at(loss.detach(), "after optimizer.step()")


def snapshot(model, opt) -> list:
    """Copies of every parameter, buffer and optimizer state entry, and
    whether each parameter has a .grad."""
    return ([t.clone() for t in model.state_dict().values()]
            + [p.grad is not None for p in model.parameters()]
            + [v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
               for state in opt.state.values() for v in state.values()])


def dropped(before: list, model) -> list:
    """`before` with no .grad on any parameter: the state a failed call of a
    step that starts with zero_grad() leaves, as eager's does."""
    n = len(model.state_dict())
    grads = len(list(model.parameters()))
    return before[:n] + [False] * grads + before[n + grads:]


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                                    for x, y in zip(a, b))


def _failing_calls(backend: str, point: str, mode: str = "grad_allreduce") -> bool:
    """Two good calls (the program in its steady state), then one that fails at
    `point`: whether the failure left everything as it was, and a good call
    after it still trains."""
    model = M.make("bn")
    opt = M.make_optimizer("adamw", model)
    step = transpile(checked_step, mode=mode, backend=backend)
    batches = M.batches("mlp", 3, 8)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    for x, y in batches[:2]:
        step(model, opt, *M.shard((x, y), rank, world))
    before = snapshot(model, opt)
    FAIL_AT[0] = point
    try:
        with pytest.raises(Exception, match=f"injected failure at {point}"):
            step(model, opt, *M.shard(batches[2], rank, world))
    finally:
        FAIL_AT[0] = None
    unchanged = same(dropped(before, model), snapshot(model, opt))
    step(model, opt, *M.shard(batches[2], rank, world))
    return unchanged and not same(before, snapshot(model, opt))


POINTS = ["forward", "before optimizer.step()", "after optimizer.step()"]


@pytest.mark.parametrize("point", POINTS)
def test_a_failure_in_the_program_changes_nothing(point):
    assert _failing_calls("eager", point)


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS)
def test_a_failure_in_a_compiled_program_changes_nothing(point):
    assert _failing_calls("inductor", point)


def accumulating_step(model, opt, x, y):
    """Adds to the gradients the call finds (zero_grad() is the loop's)."""
    loss = F.cross_entropy(model(fails_at(x, "forward")), y)
    loss.backward()
    return loss


def test_a_failure_keeps_the_gradients_the_step_reads():
    # Only a .grad the step drops before reading is released early; those it
    # adds to stay as they were, bit for bit.
    model = M.make("mlp")
    opt = M.make_optimizer("adamw", model)
    step = transpile(accumulating_step)
    batches = M.batches("mlp", 3, 8)
    for batch in batches[:2]:
        step(model, opt, *batch)
    grads = [p.grad.clone() for p in model.parameters()]
    FAIL_AT[0] = "forward"
    try:
        with pytest.raises(Exception, match="injected failure at forward"):
            step(model, opt, *batches[2])
    finally:
        FAIL_AT[0] = None
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_a_value_that_does_not_fit_its_target_writes_nothing():
    # A program whose last gradient comes back in another dtype (as autocast
    # re-casting the program's ops made it): no output is written, though
    # the parameters' and optimizer state's come first.
    model = M.make("mlp")
    opt = M.make_optimizer("adamw", model)
    step = transpile(M.classify_step)
    batches = M.batches("mlp", 2, 8)
    step(model, opt, *batches[0])
    runnable = step._last_built().programs["main"]
    program = runnable.program
    last_grad = max(i for i, spec in enumerate(program.outputs) if spec.kind.value == "grad")

    def run(inputs):   # functional (nothing in place), one gradient in bfloat16
        outputs = list(program.gm(*inputs))
        outputs[last_grad] = outputs[last_grad].to(torch.bfloat16)
        return outputs
    runnable.executable = Executable(run, [False] * len(program.outputs))
    before = snapshot(model, opt)
    with pytest.raises(TranspileError, match="computed bfloat16.* as the new grad"):
        step(model, opt, *batches[1])
    assert same(dropped(before, model), snapshot(model, opt))


def rank_collective_fails(mode: str, op: str) -> bool:
    """Every rank's `op` collective fails at the third call (as it does when a
    rank's communicators were shut down): nothing changed on any rank."""
    packet = getattr(torch.ops._c10d_functional, op)
    real = packet.default

    def fail(*args, **kwargs):
        raise RuntimeError(f"injected failure at {op}")
    model = M.make("bn")
    opt = M.make_optimizer("adamw", model)
    step = transpile(M.classify_step, mode=mode)
    batches = M.batches("mlp", 3, 8)
    rank, world = dist.get_rank(), dist.get_world_size()
    for batch in batches[:2]:
        step(model, opt, *M.shard(batch, rank, world))
    before = snapshot(model, opt)
    packet.default = fail
    try:
        step(model, opt, *M.shard(batches[2], rank, world))
        return False
    except RuntimeError as exc:
        assert f"injected failure at {op}" in str(exc)
    finally:
        packet.default = real
    return same(dropped(before, model), snapshot(model, opt))


@pytest.mark.parametrize("mode,op", [("grad_allreduce", "wait_tensor"),
                                     ("zero", "all_gather_into_tensor")])
def test_a_failed_collective_changes_nothing(mode, op, ranks2):
    assert ranks2.run(rank_collective_fails, mode, op) == [True, True]
