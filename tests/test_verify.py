"""verify='s reference is torch DDP with its defaults, whatever capture
concluded: run on its own it equals DDP bit for bit on 2 gloo ranks (SAM,
micro-batches without no_sync, clipping, a BatchNorm model whose buffers DDP
broadcasts before every forward, an evaluating forward that stops the next
broadcast), so verify= judges the program by DDP, not by capture's averaging
rule."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import VerificationError, transpile
from transpiler.capture import flatten_args
from transpiler.runtime.verify import Reference

STEPS = 3
BATCH = 16
RHO = 0.5


class Centered(nn.Module):
    """Subtracts a running mean of its input, updated in every forward: unlike
    BatchNorm's in training, the output depends on the buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(16))
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        with torch.no_grad():
            self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return self.net(x - self.mean)


def _make(model_name: str) -> nn.Module:
    if model_name != "centered":
        return M.make(model_name, seed=0)
    torch.manual_seed(0)
    return Centered()


def textbook(model, opt, x, y):
    return M.classify_step(model, opt, x, y)


sam = M.sam_step(RHO)


def micro_batches(model, opt, x, y):
    """Two micro-batches, no no_sync: DDP averages at each backward()."""
    opt.zero_grad()
    total = 0
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        loss = F.cross_entropy(model(xs), ys) / 2
        loss.backward()
        total = total + loss.detach()
    opt.step()
    return total


def clip(model, opt, x, y):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    opt.step()
    return norm


def evaluates(model, opt, x, y):
    """A forward without grad at the end: DDP's next forward (the next call's)
    broadcasts no buffers."""
    loss = M.classify_step(model, opt, x, y)
    with torch.no_grad():
        return loss, model(x)


STEP_FNS = {f.__name__: f for f in (textbook, sam, micro_batches, clip, evaluates)}


def _snapshot(model, opt) -> dict:
    """Parameters, buffers, optimizer state and each .grad (an empty tensor for None)."""
    state = M.state_of(model, opt)
    for name, p in model.named_parameters():
        state[f"grad.{name}"] = torch.empty(0) if p.grad is None else p.grad.clone()
    return state


def _adopt(model, opt, memo) -> None:
    """Make the reference's copies the state the next step starts from."""
    model_copy, opt_copy = memo[id(model)], memo[id(opt)]
    with torch.no_grad():
        for p, q in zip(model.parameters(), model_copy.parameters()):
            p.copy_(q)
            p.grad = q.grad
        for b, c in zip(model.buffers(), model_copy.buffers()):
            b.copy_(c)
    opt.load_state_dict(opt_copy.state_dict())


def _outputs(out) -> list:
    return [t.detach().clone() for t in torch.utils._pytree.tree_leaves(out)]


def rank_reference_vs_ddp(fn_name, model_name):
    """The reference alone, step after step, against DDP with its defaults."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    fn = STEP_FNS[fn_name]
    batches = [M.shard(b, rank, world_size) for b in M.batches(model_name, STEPS, BATCH)]
    model = _make(model_name)
    opt = M.make_optimizer("sgd", model)
    reference, ours = Reference(), []
    for batch in batches:
        memo, out = reference.run(fn, flatten_args(fn, (model, opt, *batch), {}))
        _adopt(model, opt, memo)
        ours.append(_outputs(out))
    model_ddp = _make(model_name)
    opt_ddp = M.make_optimizer("sgd", model_ddp)
    ddp = DDP(model_ddp)
    theirs = [_outputs(fn(ddp, opt_ddp, *batch)) for batch in batches]
    return _snapshot(model, opt), _snapshot(M.as_next_forward_sees(ddp), opt_ddp), ours, theirs


@pytest.mark.parametrize("model_name", ["mlp", "bn", "centered"])
@pytest.mark.parametrize("fn_name", sorted(STEP_FNS))
def test_reference_equals_ddp_bit_for_bit(fn_name, model_name, ranks2):
    for ours, ddp, our_outputs, ddp_outputs in ranks2.run(rank_reference_vs_ddp, fn_name,
                                                          model_name):
        assert ours.keys() == ddp.keys()
        for k in ours:
            assert torch.equal(ours[k], ddp[k]), k
        for a, b in zip(our_outputs, ddp_outputs, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def rank_verified(fn_name, model_name, verify):
    """The transpiled step, STEPS calls: the message of the VerificationError it
    raised (None) and whether that call left everything as it found it; else
    the state after the last call."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    fn = STEP_FNS[fn_name]
    model = _make(model_name)
    opt = M.make_optimizer("sgd", model)
    step = transpile(fn, verify=verify)
    for batch in M.batches(model_name, STEPS, BATCH):
        before = _snapshot(model, opt)
        try:
            step(model, opt, *M.shard(batch, rank, world_size))
        except VerificationError as exc:
            after = _snapshot(model, opt)
            return str(exc), all(torch.equal(after[k], before[k]) for k in before)
    return None, _snapshot(model, opt)


def rank_ddp(fn_name, model_name):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _make(model_name)
    opt = M.make_optimizer("sgd", model)
    ddp = DDP(model)
    for batch in M.batches(model_name, STEPS, BATCH):
        STEP_FNS[fn_name](ddp, opt, *M.shard(batch, rank, world_size))
    return _snapshot(M.as_next_forward_sees(ddp), opt)


def rank_verdict(fn_name, model_name):
    """The transpiled step without verify=, DDP, and the transpiled step with
    verify=STEPS, from the same start."""
    unverified = rank_verified(fn_name, model_name, 0)[1]
    return unverified, rank_ddp(fn_name, model_name), rank_verified(fn_name, model_name, STEPS)


def _verdict(results) -> tuple[bool, str | None]:
    """Whether the program left alone ended more than verify's tolerance away
    from DDP on some rank, and verify's message (the same on every rank; when
    it raised, it wrote nothing back; when not, it changed nothing)."""
    differs = any(M.max_rel_error(ours, ddp) > 1e-3 for ours, ddp, _ in results)
    messages = {message for _, _, (message, _) in results}
    assert len(messages) == 1
    message = messages.pop()
    for ours, _, (raised, left) in results:
        if raised is None:
            assert all(torch.equal(ours[k], left[k]) for k in ours)
        else:
            assert left is True     # everything as the failing call found it
    return differs, message


@pytest.mark.parametrize("fn_name", ["textbook", "clip", "micro_batches"])
def test_verify_accepts_what_equals_ddp(fn_name, ranks2):
    """Micro-batches are averaged once by the program and at each backward()
    by DDP (and the reference): equal up to rounding, within the tolerance."""
    differs, message = _verdict(ranks2.run(rank_verdict, fn_name, "mlp"))
    assert not differs and message is None


@pytest.mark.parametrize("fn_name,model_name", [("sam", "mlp"), ("textbook", "bn"),
                                                ("evaluates", "centered")])
def test_verify_raises_exactly_where_the_program_differs_from_ddp(fn_name, model_name, ranks2):
    """verify= judges by DDP, not by capture's averaging rule: SAM (capture
    averaged its first gradient only with the second, DDP before the ascent)
    and buffers DDP broadcasts from rank 0 before each forward. On whichever
    program the transpiler builds for them, verify= raises exactly where that
    program, left alone, ends away from DDP."""
    differs, message = _verdict(ranks2.run(rank_verdict, fn_name, model_name))
    if differs:
        assert message is not None and "differs from the eager step under DDP's semantics" in message
    else:
        assert message is None


def scaled(model, opt, x, y, scaler):
    opt.zero_grad()
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    return scaler._scale.clone()   # get_scale() would read it with .item()


def rank_overflowing_step():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _make("mlp")
    opt = M.make_optimizer("sgd", model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    x, y = M.shard(M.batches("mlp", 1, BATCH)[0], rank, world_size)
    if rank == 1:
        x = x * 1e36    # the weights' gradients overflow, the biases' do not
    before = _snapshot(model, opt)
    scale = transpile(scaled, verify=1)(model, opt, x, y, scaler)
    after = _snapshot(model, opt)
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return (scale.item(), all(torch.equal(before[k], after[k]) for k in before if "grad" not in k),
            bool(grads.isinf().any()), bool(grads.isfinite().any()))


def test_verify_counts_a_skipped_scaler_step_as_a_step(ranks2):
    """GradScaler skips optimizer.step() where the gradients overflowed; the
    call steps all the same (DDP averages its gradients), unlike gradient
    merge's accumulating call, which verify= checks as under no_sync."""
    for scale, unchanged, some_inf, some_finite in ranks2.run(rank_overflowing_step):
        assert scale == 2.0 ** 15 and unchanged and some_inf and some_finite


def test_verify_without_a_process_group_is_the_eager_step():
    states = []
    for transpiled in (True, False):
        model = _make("bn")
        opt = M.make_optimizer("sgd", model)
        step = transpile(sam, verify=STEPS) if transpiled else sam
        for batch in M.batches("bn", STEPS, BATCH):
            step(model, opt, *batch)
        states.append(_snapshot(model, opt))
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[1])
