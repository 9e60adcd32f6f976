"""Steps with several update phases: a backward() after an optimizer's step
(GAN training: the discriminator's step, then the generator's loss through the
discriminator just updated), an optimizer stepped several times in one call (a
critic loop), requires_grad toggled inside the step, and a GradScaler whose
skipped step is read by what follows it (the generator's forward, an EMA, a
validation pass).

Each is checked against eager in one process, and on 2 ranks against DDP (its
defaults) running the same step, with `no_sync` on a backward() whose gradients
the next one only accumulates into (what a transpiled step does without being
asked: docs/training-loops.md), and against plain-torch local SGD."""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from tests.habits import DCDiscriminator, DCGenerator
from transpiler import transpile
from transpiler.errors import PassError, TranspileError


def accumulating(model):
    """DDP's no_sync around a forward and backward() whose gradients the next
    backward() accumulates into; nothing for a plain module."""
    return model.no_sync() if isinstance(model, DDP) else contextlib.nullcontext()


def dcgan_step(netD, netG, optimizerD, optimizerG, criterion, real, nz=8):
    """pytorch/examples dcgan/main.py's training loop body."""
    netD.zero_grad()
    label = torch.full((real.size(0),), 1.)
    with accumulating(netD):
        errD_real = criterion(netD(real), label)
        errD_real.backward()
    fake = netG(torch.randn(real.size(0), nz, 1, 1))
    label.fill_(0.)
    errD_fake = criterion(netD(fake.detach()), label)
    errD_fake.backward()
    optimizerD.step()
    netG.zero_grad()
    label.fill_(1.)
    errG = criterion(netD(fake), label)
    errG.backward()
    optimizerG.step()
    return errD_real + errD_fake, errG


def dcgan(seed: int = 0) -> list:
    torch.manual_seed(seed)
    netG, netD = DCGenerator(), DCDiscriminator()
    return [netD, netG, torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999)),
            torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999)), nn.BCELoss()]


def _images(i: int, rank: int = 0) -> torch.Tensor:
    return torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(100 * i + rank))


def _state(*modules) -> dict[str, torch.Tensor]:
    out = {}
    for k, m in enumerate(modules):
        for name, p in m.named_parameters():
            out[f"m{k}.{name}"] = p.detach()
            if p.grad is not None:
                out[f"m{k}.{name}.grad"] = p.grad
        out.update({f"m{k}.{name}": b for name, b in m.named_buffers()})
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN where the other has NaN (an overflowing step's gradients)."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        ((a == b) | (a.isnan() & b.isnan())).all())


def _differ(ours: dict, theirs: dict) -> list[str]:
    assert ours.keys() == theirs.keys()
    return [k for k in ours if not _same(ours[k], theirs[k])]


def _against_eager(build, step_fn, batch, each=lambda i, ours, theirs: None):
    """step_fn transpiled and eager on build()'s objects for 4 calls, torch
    seeded alike before each: what it returns and both models' parameters,
    .grad and buffers bit for bit after every call, then each(i, ours, theirs).
    Returns the transpiled step."""
    ours, theirs = build(), build()
    step = transpile(step_fn)
    for i in range(4):
        torch.manual_seed(i)
        a = step(*ours, batch(i))
        torch.manual_seed(i)
        b = step_fn(*theirs, batch(i))
        assert all(_same(x, y) for x, y in zip(a, b)), f"call {i}"
        assert _differ(_state(*ours[:2]), _state(*theirs[:2])) == [], f"call {i}"
        each(i, ours, theirs)
    return step


def _optimizer_states_equal(i, ours, theirs):
    for k in (0, 1):   # each model with its optimizer's state
        assert _differ(M.state_of(ours[k], ours[k + 2]),
                       M.state_of(theirs[k], theirs[k + 2])) == [], f"call {i}"


def test_a_dcgan_step_trains_as_in_eager():
    step = _against_eager(dcgan, dcgan_step, _images, _optimizer_states_equal)
    # the generator's .grad the call starts with is dropped by its zero_grad()
    # before anything reads it (after the discriminator's backward()): the
    # program does not depend on it, and traces once
    assert step.traces == 1


def critic_step(model, optimizer, xs, ys):
    """One optimizer stepped once per micro-batch, all in one call."""
    for x, y in zip(xs, ys):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


OPTIMIZERS = {
    "SGD momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "AdamW foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "Adam fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "AdamW amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-2),
}


def _updates_as_in_eager(step_fn, name, dtype, dead_feature=False):
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(dtype)
        return model, OPTIMIZERS[name](model.parameters())

    ours, theirs = build(), build()
    step = transpile(step_fn)
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        xs, ys = torch.randn(3, 8, 4, generator=g).to(dtype), torch.randint(0, 2, (3, 8), generator=g)
        if dead_feature:   # no gradient ever for the weights that read it
            xs[..., 0] = 0
        step(*ours, xs, ys)
        step_fn(*theirs, xs, ys)
        assert M.state_of(*ours).keys() == M.state_of(*theirs).keys()
        assert _differ(M.state_of(*ours), M.state_of(*theirs)) == [], f"call {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_an_optimizer_stepped_three_times_in_a_call_trains_as_in_eager(name, dtype):
    # Adam's bias corrections of the second and third update are inputs of
    # their own (Hyper.ahead): read as the first's, they came out 3e-3 off
    _updates_as_in_eager(critic_step, name, dtype)


def validated_critic_step(model, optimizer, xs, ys):
    """cleanrl's PPO update loop: a Categorical over each minibatch's logits,
    which checks them (a decision on their values) after earlier updates."""
    for x, y in zip(xs, ys):
        optimizer.zero_grad()
        (-torch.distributions.Categorical(logits=model(x)).log_prob(y).mean()).backward()
        optimizer.step()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_decision_on_values_after_an_update_in_the_call_reads_the_updated_values(name):
    # the trace on this call's values computes the later updates with their
    # bias corrections of this call: with zeros for them, Adam's second update
    # made the weights without a gradient 0/0 = NaN, and the Categorical's
    # check refused the step
    _updates_as_in_eager(validated_critic_step, name, torch.float32, dead_feature=True)


def test_a_scheduler_stepped_between_two_updates_of_its_optimizer_is_refused():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step_fn(model, optimizer, xs, ys):
        for x, y in zip(xs, ys):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            scheduler.step()

    before = copy.deepcopy((model.state_dict(), opt.state_dict(), scheduler.state_dict()))
    with pytest.raises(TranspileError, match=r"runs again after its LR scheduler's step\(\)"):
        transpile(step_fn)(model, opt, torch.randn(2, 3, 4), torch.randint(0, 2, (2, 3)))
    assert _differ(model.state_dict(), before[0]) == []
    assert opt.state_dict() == before[1] and scheduler.state_dict() == before[2]


def freeze_step(model, optimizer, x, y):
    """A fine-tuning step that freezes the first layer before its loss."""
    for p in model[0].parameters():
        p.requires_grad = False
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def test_requires_grad_set_in_the_step_is_left_as_eager_leaves_it():
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    ours, theirs = build(), build()
    step = transpile(freeze_step)
    for i in range(3):
        x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
        step(*ours, x, y)
        freeze_step(*theirs, x, y)
        assert [p.requires_grad for p in ours[0].parameters()] == [False, False, True, True]
        assert _differ(_state(ours[0]), _state(theirs[0])) == []
    # unfrozen between calls, as a script does after some epochs: traced again
    for model in (ours[0], theirs[0]):
        model[0].requires_grad_(True)
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    step(*ours, x, y)
    freeze_step(*theirs, x, y)
    assert _differ(_state(ours[0]), _state(theirs[0])) == []


def amp_gan():
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6))
    D = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    return [D, G, torch.optim.Adam(D.parameters(), 1e-3, betas=(0.5, 0.999)),
            torch.optim.Adam(G.parameters(), 1e-3, betas=(0.5, 0.999)),
            torch.amp.GradScaler("cpu", init_scale=2. ** 8)]


def amp_gan_step(D, G, optD, optG, scaler, real):
    """Non-saturating GAN loss under bf16 autocast, one GradScaler for both."""
    z = torch.randn(real.size(0), 4)
    optD.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fake = G(z)
        lossD = F.softplus(-D(real)).mean() + F.softplus(D(fake.detach())).mean()
    scaler.scale(lossD).backward()
    scaler.step(optD)
    optG.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lossG = F.softplus(-D(fake)).mean()
    scaler.scale(lossG).backward()
    scaler.step(optG)
    scaler.update()
    return lossD, lossG


def _real(i: int, rank: int = 0) -> torch.Tensor:
    """Call 2's batch overflows the discriminator's gradients (its step is
    skipped, the generator's is not)."""
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(100 * i + rank))
    return x * 1e38 if i == 2 else x


def test_a_gan_whose_discriminator_step_a_gradscaler_skips_trains_as_in_eager():
    # the generator's loss reads the discriminator as the skipped step left it:
    # read before its select, it was NaN, and the generator's step was skipped too
    scales = []

    def same_scale(i, ours, theirs):
        assert ours[4].get_scale() == theirs[4].get_scale(), f"call {i}"
        scales.append(theirs[4].get_scale())

    _against_eager(amp_gan, amp_gan_step, _real, same_scale)
    assert scales[-1] == 128.   # the overflow was found


def ema_step(model, ema, optimizer, scaler, x, y):
    """An EMA of the parameters and an evaluation after scaler.step()."""
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.lerp_(p, 0.1)
        evaluated = model(x).sum()
    return loss, evaluated


def ema_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    return [model, copy.deepcopy(model).requires_grad_(False),
            torch.optim.SGD(model.parameters(), 0.1, momentum=0.9),
            torch.amp.GradScaler("cpu", init_scale=2. ** 8)]


def test_what_reads_the_parameters_after_a_skipped_step_reads_them_unchanged():
    # an overflow left the EMA inf and the evaluation NaN: they read the
    # update's values before the select that skips it
    build = ema_model
    ours, theirs = build(), build()
    step = transpile(ema_step)
    for i in range(4):
        y = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(i))
        a, b = step(*ours, _real(i), y), ema_step(*theirs, _real(i), y)
        assert all(_same(u, v) for u, v in zip(a, b)), f"call {i}"
        assert _differ(_state(*ours[:2]), _state(*theirs[:2])) == [], f"call {i}"


def rank_ema_vs_ddp(mode: str) -> list[str]:
    """ema_step transpiled and under DDP, call 2 overflowing: what differs."""
    rank = dist.get_rank()
    ours, theirs = ema_model(), ema_model()
    ddp = DDP(theirs[0])
    step = transpile(ema_step, mode=mode)
    differ = []
    for i in range(4):
        y = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(10 * i + rank))
        a, b = step(*ours, _real(i, rank), y), ema_step(ddp, *theirs[1:], _real(i, rank), y)
        differ += [f"call {i}: returned"] * (not all(_same(u, v) for u, v in zip(a, b)))
        differ += [f"call {i}: {k}" for k in _differ(
            {k: v for k, v in _state(*ours[:2]).items() if not k.endswith(".grad")},
            {k: v for k, v in _state(*theirs[:2]).items() if not k.endswith(".grad")})]
    return differ


@pytest.mark.parametrize("mode", ["fuse_all_reduce", "zero"])
def test_what_reads_the_parameters_after_a_skipped_step_equals_ddp_on_2_ranks(mode, ranks2):
    assert ranks2.run(rank_ema_vs_ddp, mode) == [[], []]


def test_a_gradscaler_stepping_one_optimizer_twice_in_a_call_is_refused():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def step_fn(model, opt, scaler, xs, ys):
        for x, y in zip(xs, ys):
            opt.zero_grad()
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()

    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TranspileError, match="through a GradScaler twice in one call"):
        transpile(step_fn)(model, opt, scaler, torch.randn(2, 3, 4), torch.randint(0, 2, (2, 3)))
    assert _differ(model.state_dict(), before) == [] and scaler.get_scale() == 65536.


# On 2 ranks

def rank_gan_vs_ddp(mode: str, amp: bool, option: str | None = None) -> list[str]:
    """The GAN transpiled and under DDP in the same processes, each rank its
    own batches and noise: what differs after each call (the buffers as DDP's
    next forward sees them: rank 0's). `option`: one of OPTIONS, given to both."""
    rank = dist.get_rank()
    build, step_fn, batch = (amp_gan, amp_gan_step, _real) if amp else (dcgan, dcgan_step, _images)
    ours, theirs = build(), build()
    ddp_options, options, hook = OPTIONS[option]
    theirs[0], theirs[1] = DDP(theirs[0], **ddp_options), DDP(theirs[1], **ddp_options)
    if hook is not None:
        for model in theirs[:2]:
            model.register_comm_hook(None, hook)
        options = dict(options, comm_hook=(None, hook))
    step = transpile(step_fn, mode=mode, **options)
    differ = []
    for i in range(4):
        torch.manual_seed(10 * i + rank)
        a = step(*ours, batch(i, rank))
        torch.manual_seed(10 * i + rank)
        b = step_fn(*theirs, batch(i, rank))
        mods = [M.as_next_forward_sees(t) for t in theirs[:2]]
        differ += [f"call {i}: returned"] * (not all(_same(x, y) for x, y in zip(a, b)))
        differ += [f"call {i}: {k}" for k in _differ(_state(*ours[:2]), _state(*mods))]
    return differ


# DDP's options, transpile()'s, and a comm hook registered on both
OPTIONS = {
    None: ({}, {}, None),
    "find_unused_parameters": ({"find_unused_parameters": True},
                               {"find_unused_parameters": True}, None),
    "fp16_compress_hook": ({}, {}, default_hooks.fp16_compress_hook),
    "nrings=1, verify=2, skip_nonfinite": ({}, {"nrings": 1, "verify": 2,
                                                "skip_nonfinite": True}, None),
}


@pytest.mark.parametrize("mode,amp,option", [
    ("grad_allreduce", False, None), ("fuse_all_reduce", False, None),
    ("fuse_all_reduce", True, None),
    # the reductions of each backward() issued before the next one's (they
    # were ordered by parameter alone: a wait came after the step that reads it)
    ("grad_allreduce", False, "find_unused_parameters"),
    ("fuse_all_reduce", False, "fp16_compress_hook"),
    ("fuse_all_reduce", False, "nrings=1, verify=2, skip_nonfinite")])
def test_a_gan_trains_as_under_ddp_on_2_ranks(mode, amp, option, ranks2):
    """The discriminator's gradients are averaged where the backward() its step
    reads ends; the generator's backward() accumulates onto those averages and
    DDP averages them again where it ends, as the program does."""
    assert ranks2.run(rank_gan_vs_ddp, mode, amp, option) == [[], []]


def rank_gan_local_sgd(k: int) -> list[str]:
    """Plain-torch local SGD: the step on each rank, and every k-th call the
    parameters averaged as the program averages them (from the snapshot of the
    last average: s - mean(s - p)) and the floating-point buffers."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ours, theirs = dcgan(), dcgan()
    step = transpile(dcgan_step, mode="local_sgd", k_steps=k)
    params = [p for m in theirs[:2] for p in m.parameters()]
    snapshot = [p.detach().clone() for p in params]
    differ = []
    for i in range(2 * k + 1):
        torch.manual_seed(10 * i + rank)
        step(*ours, _images(i, rank))
        torch.manual_seed(10 * i + rank)
        dcgan_step(*theirs, _images(i, rank))
        if (i + 1) % k == 0:
            with torch.no_grad():
                for s, p in zip(snapshot, params):
                    delta = s - p
                    dist.all_reduce(delta)
                    p.copy_(s - delta / world)
                    s.copy_(p)
                for b in [b for m in theirs[:2] for b in m.buffers() if b.is_floating_point()]:
                    dist.all_reduce(b)
                    b /= world
        differ += [f"call {i}: {k}" for k in _differ(_state(*ours[:2]), _state(*theirs[:2]))
                   if not k.endswith(".grad")]
    return differ


def test_a_gan_in_local_sgd_equals_plain_torch_local_sgd(ranks2):
    assert ranks2.run(rank_gan_local_sgd, 2) == [[], []]


def rank_refused(mode: str) -> bool:
    ours = dcgan(seed=dist.get_rank())
    options = {"outer_optimizer": torch.optim.SGD(
        [p for m in ours[:2] for p in m.parameters()], lr=0.7)} if mode == "diloco" else {}
    before = copy.deepcopy(_state(*ours[:2]))
    with pytest.raises(PassError, match=r"GAN.*use mode 'fuse_all_reduce'"):
        transpile(dcgan_step, mode=mode, **options)(*ours, _images(0))
    return _differ(_state(*ours[:2]), before) == []


@pytest.mark.parametrize("mode", ["zero", "fsdp", "all_gather", "decentralized", "diloco"])
def test_the_modes_that_assume_one_update_refuse_a_gan_before_anything_changes(mode, ranks2):
    assert ranks2.run(rank_refused, mode) == [True, True]
