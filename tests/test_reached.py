"""Tensors the step reads outside its arguments, through a host path (a
global, a closure cell, an object's attribute, a loss module's buffer, a
teacher model, a list, a numpy table): program inputs read through that path
on every call, their layout guarded. Changed between calls, in place or
rebound, the step uses the new values as the eager step does, without tracing
again. A tensor the step writes in place, or gives a gradient, is refused."""

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import TranspileError, transpile


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values()))


def test_class_weights_in_a_closure_and_a_loss_module():
    weights = torch.tensor([1.0, 2.0, 0.5, 1.0])
    criterion = nn.CrossEntropyLoss(weight=weights.clone(), label_smoothing=0.1)

    def weighted(model, opt, x, y):
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y, weight=weights) + criterion(out, y)
        loss.backward()
        opt.step()
        return loss

    def between(i, models):
        if i == 2:
            weights.mul_(2.0)
            criterion.weight.fill_(0.5)
    step = M.against_eager(weighted, between)
    assert step.traces == 1


class NoiseSchedule:
    """What diffusers' DDPMScheduler keeps and add_noise reads: a table of
    cumulative alphas on a plain object, indexed by each sample's timestep."""

    def __init__(self, steps: int = 10):
        betas = torch.linspace(1e-4, 0.02, steps)
        self.alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)

    def add_noise(self, original, noise, timesteps):
        alphas = self.alphas_cumprod.to(original.device)[timesteps]
        sqrt_alpha = alphas.sqrt().flatten()
        while sqrt_alpha.ndim < original.ndim:
            sqrt_alpha = sqrt_alpha.unsqueeze(-1)
        sqrt_one_minus = (1 - alphas).sqrt().flatten()
        while sqrt_one_minus.ndim < original.ndim:
            sqrt_one_minus = sqrt_one_minus.unsqueeze(-1)
        return sqrt_alpha * original + sqrt_one_minus * noise


SCHEDULE = NoiseSchedule()


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(17, 32), nn.SiLU(), nn.Linear(32, 16))

    def forward(self, x, t):
        return self.net(torch.cat([x, t[:, None].float() / 10], dim=1))


def ddpm_step(model, opt, clean, noise, timesteps):
    """diffusers' examples/unconditional_image_generation/train_unconditional.py:
    noise the batch with the scheduler, predict the noise, MSE."""
    opt.zero_grad()
    noisy = SCHEDULE.add_noise(clean, noise, timesteps)
    loss = F.mse_loss(model(noisy, timesteps), noise)
    loss.backward()
    opt.step()
    return loss


def _ddpm_batches(n, size, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 16, generator=g), torch.randn(size, 16, generator=g),
             torch.randint(0, 10, (size,), generator=g)) for _ in range(n)]


def test_a_noise_schedule_held_in_a_global():
    torch.manual_seed(0)
    ours = Denoiser()
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, theirs)]
    step = transpile(ddpm_step)
    original = SCHEDULE.alphas_cumprod
    try:
        for i, batch in enumerate(_ddpm_batches(4, 8)):
            if i == 2:   # another schedule of the same length
                SCHEDULE.alphas_cumprod = torch.cumprod(1 - torch.linspace(1e-3, 0.05, 10), 0)
            assert torch.equal(step(ours, opts[0], *batch), ddpm_step(theirs, opts[1], *batch))
            assert _equal(ours, theirs)
    finally:
        SCHEDULE.alphas_cumprod = original
    assert step.traces == 1 and "r_SCHEDULE_alphas_cumprod" in str(step.program)


TEACHER = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
ANCHORS = [torch.randn(4), torch.randn(4)]
TABLE = np.linspace(0.5, 1.5, 4).astype(np.float32)


def distill_step(model, opt, x, y):
    """Knowledge distillation with a frozen teacher held in a global, a
    list of tensors and a numpy table."""
    opt.zero_grad()
    with torch.no_grad():
        soft = F.softmax(TEACHER(x), dim=-1)
    out = model(x) + ANCHORS[0] * ANCHORS[1]
    loss = F.cross_entropy(out * torch.from_numpy(TABLE), y) \
        + F.kl_div(F.log_softmax(out, dim=-1), soft, reduction="batchmean")
    loss.backward()
    opt.step()
    return loss


def test_a_teacher_model_a_list_of_tensors_and_a_numpy_table_in_globals():
    def between(i, models):
        if i == 1:   # the teacher updated between calls, as an EMA teacher is
            with torch.no_grad():
                for p in TEACHER.parameters():
                    p.mul_(0.5)
        if i == 2:
            ANCHORS[1] = torch.ones(4)
            TABLE[0] = 3.0
    state = copy.deepcopy(TEACHER.state_dict())
    anchors, table = list(ANCHORS), TABLE.copy()
    try:
        step = M.against_eager(distill_step, between)
    finally:
        TEACHER.load_state_dict(state)
        ANCHORS[:] = anchors
        TABLE[:] = table
    assert step.traces == 1


class Masked(nn.Module):
    """A plain tensor attribute (not a registered buffer) read in forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.mask = torch.tensor([1.0, 0.0, 1.0, 1.0])

    def forward(self, x):
        return self.fc(x) * self.mask


def test_a_plain_tensor_attribute_of_a_module():
    def between(i, models):
        if i == 2:
            for m in models:
                m.mask = torch.tensor([0.0, 1.0, 1.0, 0.5])
    step = M.against_eager(M.classify_step, between, build=Masked)
    assert step.traces == 1


LOOKUP = torch.zeros(4)
GRID = torch.zeros(4)
ROWS = GRID[:2]   # a view of GRID


def scaled_by_a_global_tensor(model, opt, x, y):
    LOOKUP.add_(1.0)   # in place: the program's update, written back into LOOKUP
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y) * LOOKUP[0]
    loss.backward()
    opt.step()
    return loss


def test_a_reached_tensor_changed_in_place_is_written_back_as_eager_changes_it():
    ours = M.make("mlp")
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    step = transpile(scaled_by_a_global_tensor)
    held = LOOKUP   # the same tensor object stays at the path
    for i, (x, y) in enumerate(M.batches("mlp", 4, 8)):
        LOOKUP.fill_(0.5 * i)
        loss = step(ours, opts[0], x, y)
        after = LOOKUP.clone()
        LOOKUP.fill_(0.5 * i)
        assert torch.equal(loss, scaled_by_a_global_tensor(theirs, opts[1], x, y)), i
        assert torch.equal(after, LOOKUP) and LOOKUP is held, i
        assert _equal(ours, theirs), i
    assert step.traces == 1


def writes_a_view_of_a_tensor_it_reads(model, opt, x, y):
    ROWS.add_(1.0)
    return M.classify_step(model, opt, x * GRID.sum(), y)


class Heads:
    """A config object an argument holds, with a module in it."""

    def __init__(self):
        self.head = nn.Linear(16, 4)


HEADS = Heads()


def trains_a_module_it_was_not_given(model, opt, x, y, heads=HEADS):
    opt.zero_grad()
    loss = F.cross_entropy(model(x) + heads.head(x), y)
    loss.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("fn,match", [
    (writes_a_view_of_a_tensor_it_reads, r"modifies 'ROWS' in place, a tensor it reads outside "
                                         r"its arguments that shares memory with GRID"),
    (trains_a_module_it_was_not_given, r"computes a gradient for heads.head.weight, a tensor "
                                       r"it reads outside its arguments"),
])
def test_a_reached_tensor_aliased_and_written_or_given_a_gradient_is_refused(fn, match):
    model = M.make("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = copy.deepcopy(model.state_dict())
    grid, free = GRID.clone(), copy.deepcopy(HEADS.head.state_dict())
    with pytest.raises(TranspileError, match=match):
        transpile(fn)(model, opt, *M.batches("mlp", 1, 8)[0])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not opt.state and torch.equal(GRID, grid) and HEADS.head.weight.grad is None
    assert all(torch.equal(free[k], v) for k, v in HEADS.head.state_dict().items())


def _flat_views(model, of_grads: bool) -> torch.Tensor:
    """One flat buffer whose views are the model's parameters (Megatron's and
    apex's flat parameters) or their .grad (a flat gradient buffer)."""
    params = list(model.parameters())
    flat = torch.cat([p.detach().flatten() for p in params])
    if of_grads:
        flat.zero_()
    offset = 0
    for p in params:
        view = flat[offset:offset + p.numel()].view_as(p)
        if of_grads:
            p.grad = view
        else:
            p.data = view
        offset += p.numel()
    return flat


def test_a_flat_buffer_of_the_parameters_or_their_grads_read_in_the_step_is_refused():
    """The program reads a tensor outside its arguments as the call starts;
    eager reads the memory the update (or the backward pass) leaves there."""
    for of_grads in (False, True):
        model = M.make("mlp")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        flat = _flat_views(model, of_grads)

        def clipped_by_the_flat_norm(model, opt, x, y):
            opt.zero_grad(set_to_none=False)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            for p in model.parameters():
                p.grad.mul_(torch.clamp(1.0 / (flat.norm() + 1e-6), max=1.0))
            opt.step()
            return loss
        before, kept = copy.deepcopy(model.state_dict()), flat.clone()
        with pytest.raises(TranspileError, match=r"reads 'flat' outside its arguments, a tensor "
                                                 r"that shares memory with layers.0.weight"):
            transpile(clipped_by_the_flat_norm)(model, opt, *M.batches("mlp", 1, 8)[0])
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert torch.equal(flat, kept) and not opt.state


def rank_ddpm_vs_ddp(mode: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ours = Denoiser()
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    step, ddp = transpile(ddpm_step, mode=mode), DDP(theirs)
    for batch in _ddpm_batches(4, 8, seed=rank):
        if not torch.equal(step(ours, opts[0], *batch), ddpm_step(ddp, opts[1], *batch)):
            return False
    return _equal(ours, theirs)


@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce", "zero"])
def test_a_noise_schedule_in_a_global_equals_ddp(mode, ranks2):
    assert ranks2.run(rank_ddpm_vs_ddp, mode) == [True, True]


FEATURES = {}   # what a forward hook stores, as feature-extraction scripts do


def _keep_features(module, args, output):
    FEATURES["hidden"] = output


def feature_step(model, opt, x, y):
    opt.zero_grad()
    out = model(x)
    loss = F.cross_entropy(out, y) + 0.01 * FEATURES["hidden"].pow(2).mean()
    loss.backward()
    opt.step()
    return loss


def test_a_tensor_a_hook_stores_in_a_dict_is_assigned_after_every_call():
    torch.manual_seed(0)
    ours = M.make("mlp")
    theirs = copy.deepcopy(ours)
    handles = [m.layers[0].register_forward_hook(_keep_features) for m in (ours, theirs)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    step = transpile(feature_step)
    try:
        for x, y in M.batches("mlp", 4, 8):
            FEATURES.clear()
            a = step(ours, opts[0], x, y)
            mine = FEATURES.pop("hidden")
            b = feature_step(theirs, opts[1], x, y)
            assert torch.equal(a, b) and torch.equal(mine, FEATURES["hidden"])
            assert _equal(ours, theirs)
    finally:
        for h in handles:
            h.remove()
        FEATURES.clear()


def _diffusers():
    diffusers = pytest.importorskip("diffusers")
    unet = diffusers.UNet2DModel(sample_size=8, in_channels=3, out_channels=3,
                                 layers_per_block=1, block_out_channels=(8, 16),
                                 down_block_types=("DownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4)
    return unet, diffusers.DDPMScheduler(num_train_timesteps=50)


def diffusers_ddpm_step(model, optimizer, clean_images, noise_scheduler):
    """diffusers' examples/unconditional_image_generation/train_unconditional.py:
    noise drawn with torch, timesteps drawn per sample, the scheduler (a plain
    object holding its tables) passed to the step, MSE on the noise."""
    noise = torch.randn(clean_images.shape)
    bsz = clean_images.shape[0]
    timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,)).long()
    noisy_images = noise_scheduler.add_noise(clean_images, noise, timesteps)
    model_output = model(noisy_images, timesteps, return_dict=False)[0]
    loss = F.mse_loss(model_output.float(), noise.float())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_diffusers_ddpm_step_with_its_scheduler_equals_eager():
    torch.manual_seed(0)
    unet, scheduler = _diffusers()
    twin = copy.deepcopy(unet)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (unet, twin)]
    step = transpile(diffusers_ddpm_step)
    for i in range(3):
        images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(i))
        torch.manual_seed(10 + i)
        a = step(unet, opts[0], images, scheduler)
        torch.manual_seed(10 + i)
        assert torch.equal(a, diffusers_ddpm_step(twin, opts[1], images, scheduler)), i
        assert _equal(unet, twin), i
    assert step.traces == 1


def rank_diffusers_vs_ddp():
    rank = dist.get_rank()
    torch.manual_seed(0)
    unet, scheduler = _diffusers()
    twin = copy.deepcopy(unet)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (unet, twin)]
    step, ddp = transpile(diffusers_ddpm_step, mode="fuse_all_reduce"), DDP(twin)
    for i in range(3):
        images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(10 * rank + i))
        torch.manual_seed(100 * rank + i)
        a = step(unet, opts[0], images, scheduler)
        torch.manual_seed(100 * rank + i)
        if not torch.equal(a, diffusers_ddpm_step(ddp, opts[1], images, scheduler)):
            return False
    return _equal(unet, twin)


def test_diffusers_ddpm_step_equals_ddp(ranks2):
    pytest.importorskip("diffusers")
    assert ranks2.run(rank_diffusers_vs_ddp) == [True, True]
