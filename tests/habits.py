"""A bank of habits taken from real public training scripts.

Each habit is what a real script does inside or around its training step
that a static trace could get wrong, re-created in a few lines with tiny
models (the code it comes from is named in `source`; where the package is not
installed here its relevant lines are re-written faithfully). Each is run by
tests/test_habits.py: the eager step against the transpiled step in one
process (and, where `ranks` is set, against torch DDP on 2 ranks), call by
call, with the same seeds for torch, random and numpy before each call.

Expectations:
- EQUAL: the transpiled step trains bit for bit as the eager step (or DDP):
  returned values, parameters, buffers, .grad, optimizer and scaler state,
  the host-visible state the script reads afterwards, and where torch's,
  Python's and numpy's generators are left.
- REFUSED: transpiler.TranspileError at call `refused_at` (0 = the first
  call), matching `match`, with everything as it was before that call. Used
  only where a static program cannot be exact (a Python decision on a value
  that changes every call, a host counter the step increments), or where
  docs/contract.md refuses the idiom by name.

The `rule` of each habit is the mechanism of the contract that covers it
(docs/contract.md, docs/habits.md).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import math
import pathlib
import random
import sys
import tempfile
import types
from collections import OrderedDict
from types import SimpleNamespace
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

EQUAL, REFUSED = "EQUAL", "REFUSED"

# The mechanisms of the contract (docs/contract.md, issue 39).
GUARD = "guard from reads"
AMBIENT = "ambient state"
HOOKS = "hooks"
HOST_RNG = "host randomness replayed"
TORCH_RNG = "torch RNG"
LAZY = "lazy initialization converges"
PATH = "tensor reached through a path is an input"
TRANSACTIONAL = "transactional"
INPUTS = "inputs and state written back"
HOST_WRITE = "host-side writes refused"
HOST_NUMBERS = "host numbers the step changes: inputs, and outputs written back"
DECISION = "decision on a tensor's value traced on the call's values"
PHASES = "update phases"
RETURNED = "numbers returned, read after the call"
GROUP_READS = "optimizer values read from inputs"


@dataclasses.dataclass
class Habit:
    id: str
    source: str
    what: str
    expect: str
    rule: str
    setup: Callable[[], SimpleNamespace]
    step: Callable
    call: Callable          # call(step, s, i, d): how the script calls its step for call i
    between: Callable | None = None   # between(s, i): what the script does before call i
    bind: Callable | None = None      # bind(s) -> the step (a bound method of an object of s)
    refused_at: int = 0
    match: str | None = None
    ranks: bool = False               # also on 2 ranks against DDP
    ddp: Callable | None = None       # ddp(s): wraps s's modules for the DDP run
    calls: int = 4
    options: dict = dataclasses.field(default_factory=dict)
    # what keeps an EQUAL habit from training today: refused (or failing at its
    # first run) with nothing changed, until the named work lands
    gap: str | None = None
    # what keeps its 2-rank run from equalling DDP today (the run is skipped)
    rank_gap: str | None = None

    def step_for(self, s):
        return self.bind(s) if self.bind is not None else self.step


HABITS: list[Habit] = []


def habit(**fields):
    def register(fn):
        HABITS.append(Habit(step=fn, **fields))
        return fn
    return register


def by_id(habit_id: str) -> Habit:
    return next(h for h in HABITS if h.id == habit_id)


def wrap_model(s):
    """DDP with its defaults around s.model (the default for the 2-rank run)."""
    s.model = nn.parallel.DistributedDataParallel(s.model)


def unwrap(model):
    """timm's unwrap_model / ultralytics' de_parallel."""
    return model.module if hasattr(model, "module") else model


# ----------------------------------------------------------------- data

class Data:
    """Call i's batch on one rank: the same in every process that asks."""

    def __init__(self, i: int, rank: int = 0):
        self.g = torch.Generator().manual_seed(7919 * rank + 31 * i + 1)

    def vec(self, n=8, f=16):
        return torch.randn(n, f, generator=self.g)

    def cls(self, n=8, c=4):
        return torch.randint(0, c, (n,), generator=self.g)

    def img(self, n=8, c=3, h=8, w=8):
        return torch.randn(n, c, h, w, generator=self.g)

    def tok(self, n=4, t=8, v=64):
        return torch.randint(0, v, (n, t), generator=self.g)

    def uniform(self, *shape):
        return torch.rand(*shape, generator=self.g)


def xy(step, s, i, d):
    return step(s.model, s.opt, d.vec(), d.cls())


def img_xy(step, s, i, d):
    return step(s.model, s.opt, d.img(), d.cls())


# ----------------------------------------------------------------- tiny models

class MLP(nn.Module):
    def __init__(self, p=0.0, width=32, out=4):
        super().__init__()
        self.fc1 = nn.Linear(16, width)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(width, out)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.fc1(x))))


class ConvBN(nn.Module):
    """A tiny convnet with BatchNorm (the ResNet stem in miniature)."""

    def __init__(self, classes=4, width=8):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.fc = nn.Linear(width, classes)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


def seeded(fn):
    """A setup builds the same objects every time it is called."""
    @functools.wraps(fn)
    def build():
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        return fn()
    return build


@seeded
def mlp_sgd():
    model = MLP()
    return SimpleNamespace(model=model,
                           opt=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


@seeded
def mlp_dropout_sgd():
    model = MLP(p=0.2)
    return SimpleNamespace(model=model,
                           opt=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


@seeded
def conv_sgd():
    model = ConvBN()
    return SimpleNamespace(model=model, opt=torch.optim.SGD(model.parameters(), lr=0.1,
                                                            momentum=0.9, weight_decay=1e-4))


def _quiet_transformers():
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers


def tiny_gpt2(**over):
    transformers = _quiet_transformers()
    cfg = dict(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
               bos_token_id=0, eos_token_id=0)
    cfg.update(over)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg))


def tiny_bert_cls(**over):
    transformers = _quiet_transformers()
    cfg = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=64, max_position_embeddings=16, num_labels=3)
    cfg.update(over)
    return transformers.BertForSequenceClassification(transformers.BertConfig(**cfg))


# ================================================================= timm
# huggingface/pytorch-image-models: train.py train_one_epoch and the helpers
# it calls (timm/data/mixup.py, timm/utils/model_ema.py, timm/utils/agc.py,
# timm/utils/cuda.py NativeScaler, timm/layers/drop.py, timm/scheduler,
# timm/models/_manipulate.py checkpoint_seq, timm/models/_features.py).

def _one_hot(x, num_classes, on_value=1., off_value=0.):
    x = x.long().view(-1, 1)
    return torch.full((x.size()[0], num_classes), off_value, device=x.device).scatter_(1, x, on_value)


def mixup_target(target, num_classes, lam=1., smoothing=0.0):
    off_value = smoothing / num_classes
    on_value = 1. - smoothing + off_value
    y1 = _one_hot(target, num_classes, on_value=on_value, off_value=off_value)
    y2 = _one_hot(target.flip(0), num_classes, on_value=on_value, off_value=off_value)
    return y1 * lam + y2 * (1. - lam)


def rand_bbox(img_shape, lam, margin=0., count=None):
    ratio = np.sqrt(1 - lam)
    img_h, img_w = img_shape[-2:]
    cut_h, cut_w = int(img_h * ratio), int(img_w * ratio)
    margin_y, margin_x = int(margin * cut_h), int(margin * cut_w)
    cy = np.random.randint(0 + margin_y, img_h - margin_y, size=count)
    cx = np.random.randint(0 + margin_x, img_w - margin_x, size=count)
    yl = np.clip(cy - cut_h // 2, 0, img_h)
    yh = np.clip(cy + cut_h // 2, 0, img_h)
    xl = np.clip(cx - cut_w // 2, 0, img_w)
    xh = np.clip(cx + cut_w // 2, 0, img_w)
    return yl, yh, xl, xh


class TimmMixup:
    """timm.data.Mixup, mode='batch': the lines one batch runs."""

    def __init__(self, mixup_alpha=0.8, cutmix_alpha=1.0, prob=1.0, switch_prob=0.5,
                 label_smoothing=0.1, num_classes=4):
        self.mixup_alpha, self.cutmix_alpha = mixup_alpha, cutmix_alpha
        self.mix_prob, self.switch_prob = prob, switch_prob
        self.label_smoothing, self.num_classes = label_smoothing, num_classes
        self.correct_lam = True
        self.mixup_enabled = True

    def _params_per_batch(self):
        lam = 1.
        use_cutmix = False
        if self.mixup_enabled and np.random.rand() < self.mix_prob:
            if self.mixup_alpha > 0. and self.cutmix_alpha > 0.:
                use_cutmix = np.random.rand() < self.switch_prob
                lam_mix = np.random.beta(self.cutmix_alpha, self.cutmix_alpha) if use_cutmix else \
                    np.random.beta(self.mixup_alpha, self.mixup_alpha)
            elif self.mixup_alpha > 0.:
                lam_mix = np.random.beta(self.mixup_alpha, self.mixup_alpha)
            else:
                use_cutmix = True
                lam_mix = np.random.beta(self.cutmix_alpha, self.cutmix_alpha)
            lam = float(lam_mix)
        return lam, use_cutmix

    def _mix_batch(self, x):
        lam, use_cutmix = self._params_per_batch()
        if lam == 1.:
            return 1.
        if use_cutmix:
            yl, yh, xl, xh = rand_bbox(x.shape, lam)
            if self.correct_lam:
                lam = 1. - (yh - yl) * (xh - xl) / float(x.shape[-2] * x.shape[-1])
            x[:, :, yl:yh, xl:xh] = x.flip(0)[:, :, yl:yh, xl:xh]
        else:
            x_flipped = x.flip(0).mul_(1. - lam)
            x.mul_(lam).add_(x_flipped)
        return lam

    def __call__(self, x, target):
        assert len(x) % 2 == 0, 'Batch size should be even when using this'
        lam = self._mix_batch(x)
        target = mixup_target(target, self.num_classes, lam, self.label_smoothing)
        return x, target


class SoftTargetCrossEntropy(nn.Module):
    def forward(self, x, target):
        loss = torch.sum(-target * F.log_softmax(x, dim=-1), dim=-1)
        return loss.mean()


@seeded
def _timm_mixup_setup():
    s = conv_sgd.__wrapped__()
    s.mixup_fn, s.loss_fn = TimmMixup(), SoftTargetCrossEntropy()
    return s


@habit(id="timm_mixup_cutmix_in_step",
       source="huggingface/pytorch-image-models timm/data/mixup.py Mixup.__call__ "
              "(_params_per_batch, _mix_batch), called on the batch in train.py train_one_epoch",
       what="np.random decides mixup or cutmix and draws lam each batch; the batch is mixed "
            "in place (x.mul_(lam).add_(...), or a random box pasted), soft targets",
       expect=REFUSED, rule=HOST_RNG, setup=_timm_mixup_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, d.img(), d.cls(), s.mixup_fn, s.loss_fn))
def timm_mixup_step(model, optimizer, input, target, mixup_fn, loss_fn):
    input, target = mixup_fn(input, target)
    output = model(input)
    loss = loss_fn(output, target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


class ModelEmaV3(nn.Module):
    """timm/utils/model_ema.py ModelEmaV3 (foreach lerp, warmup decay)."""

    def __init__(self, model, decay=0.9999, min_decay=0.0, update_after_step=0,
                 use_warmup=False, warmup_gamma=1.0, warmup_power=2 / 3, foreach=True):
        super().__init__()
        self.module = copy.deepcopy(model)
        self.module.eval()
        self.decay, self.min_decay = decay, min_decay
        self.update_after_step = update_after_step
        self.use_warmup, self.warmup_gamma, self.warmup_power = use_warmup, warmup_gamma, warmup_power
        self.foreach = foreach

    def get_decay(self, step=None):
        if step is None:
            return self.decay
        step = max(0, step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        if self.use_warmup:
            decay = 1 - (1 + step / self.warmup_gamma) ** -self.warmup_power
            decay = max(min(decay, self.decay), self.min_decay)
        else:
            decay = self.decay
        return decay

    @torch.no_grad()
    def update(self, model, step=None):
        decay = self.get_decay(step)
        ema_lerp_values, model_lerp_values = [], []
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            if ema_v.is_floating_point():
                ema_lerp_values.append(ema_v)
                model_lerp_values.append(model_v)
            else:
                ema_v.copy_(model_v)
        torch._foreach_lerp_(ema_lerp_values, model_lerp_values, weight=1. - decay)


@seeded
def _timm_ema_setup():
    s = conv_sgd.__wrapped__()
    s.model_ema = ModelEmaV3(s.model, decay=0.998, use_warmup=True)
    return s


@habit(id="timm_model_ema_v3_warmup",
       source="huggingface/pytorch-image-models train.py train_one_epoch: "
              "model_ema.update(model, step=num_updates); timm/utils/model_ema.py ModelEmaV3",
       what="EMA of parameters and BN buffers after each optimizer step, with a decay computed "
            "on the host from the update counter (warmup, min/max) and torch._foreach_lerp_",
       expect=EQUAL, rule=GUARD, setup=_timm_ema_setup, ranks=True,
       call=lambda step, s, i, d: step(s.model, s.opt, d.img(), d.cls(), s.model_ema, i + 1))
def timm_ema_step(model, optimizer, input, target, model_ema, num_updates):
    output = model(input)
    loss = F.cross_entropy(output, target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    model_ema.update(unwrap(model), step=num_updates)
    return loss


def drop_path(x, drop_prob: float = 0., training: bool = False, scale_by_keep: bool = True):
    if drop_prob == 0. or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0 and scale_by_keep:
        random_tensor.div_(keep_prob)
    return x * random_tensor


class DropPath(nn.Module):
    def __init__(self, drop_prob: float = 0., scale_by_keep: bool = True):
        super().__init__()
        self.drop_prob, self.scale_by_keep = drop_prob, scale_by_keep

    def forward(self, x):
        return drop_path(x, self.drop_prob, self.training, self.scale_by_keep)


class ResBlock(nn.Module):
    def __init__(self, dim, drop_path_rate, p=0.1):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Dropout(p), nn.Linear(dim, dim))
        self.drop_path = DropPath(drop_path_rate) if drop_path_rate > 0. else nn.Identity()

    def forward(self, x):
        return x + self.drop_path(self.mlp(self.norm(x)))


class StochasticDepthNet(nn.Module):
    """Blocks with linearly increasing drop-path rates, as timm's
    VisionTransformer builds them (dpr = torch.linspace(0, rate, depth))."""

    def __init__(self, depth=3, dim=16, drop_path_rate=0.3, grad_checkpointing=False):
        super().__init__()
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]
        self.stem = nn.Linear(16, dim)     # the patch embedding
        self.blocks = nn.Sequential(*[ResBlock(dim, dpr[j]) for j in range(depth)])
        self.head = nn.Linear(dim, 4)
        self.grad_checkpointing = grad_checkpointing

    def forward(self, x):
        x = self.stem(x)
        if self.grad_checkpointing and not torch.jit.is_scripting():
            x = checkpoint_seq(self.blocks, x)
        else:
            x = self.blocks(x)
        return self.head(x)


def checkpoint_seq(functions, x, every=1, skip_last=False, preserve_rng_state=True):
    def run_function(start, end, functions):
        def forward(_x):
            for j in range(start, end + 1):
                _x = functions[j](_x)
            return _x
        return forward

    if isinstance(functions, torch.nn.Sequential):
        functions = functions.children()
    if not isinstance(functions, (tuple, list)):
        functions = tuple(functions)
    num_checkpointed = len(functions)
    if skip_last:
        num_checkpointed -= 1
    end = -1
    for start in range(0, num_checkpointed, every):
        end = min(start + every - 1, num_checkpointed - 1)
        x = torch.utils.checkpoint.checkpoint(run_function(start, end, functions), x,
                                              preserve_rng_state=preserve_rng_state,
                                              use_reentrant=True)
    if skip_last:
        return run_function(end + 1, len(functions) - 1, functions)(x)
    return x


@seeded
def _drop_path_setup(grad_checkpointing=False):
    model = StochasticDepthNet(grad_checkpointing=grad_checkpointing)
    return SimpleNamespace(model=model, opt=torch.optim.AdamW(model.parameters(), lr=1e-2))


@habit(id="timm_drop_path_stochastic_depth",
       source="huggingface/pytorch-image-models timm/layers/drop.py drop_path/DropPath, "
              "rates from timm/models/vision_transformer.py (dpr = torch.linspace(0, rate, depth))",
       what="per-sample stochastic depth: x.new_empty(shape).bernoulli_(keep_prob).div_(keep_prob) "
            "in every block's forward, plus dropout",
       expect=EQUAL, rule=TORCH_RNG, setup=_drop_path_setup, call=xy, ranks=True)
def drop_path_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


habit(id="timm_checkpoint_seq_reentrant",
      source="huggingface/pytorch-image-models timm/models/_manipulate.py checkpoint_seq, "
             "used by model.set_grad_checkpointing() in forward_features",
      what="blocks with drop-path and dropout run under torch.utils.checkpoint (reentrant, "
           "preserve_rng_state): the recomputation must redraw the forward's masks",
      expect=EQUAL, rule=TORCH_RNG, setup=seeded(lambda: _drop_path_setup.__wrapped__(True)), call=xy)(drop_path_step)


def unitwise_norm(x, norm_type=2.0):
    if x.ndim <= 1:
        return x.norm(norm_type)
    return x.norm(norm_type, dim=tuple(range(1, x.ndim)), keepdim=True)


def adaptive_clip_grad(parameters, clip_factor=0.01, eps=1e-3, norm_type=2.0):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    for p in parameters:
        if p.grad is None:
            continue
        p_data = p.detach()
        g_data = p.grad.detach()
        max_norm = unitwise_norm(p_data, norm_type=norm_type).clamp_(min=eps).mul_(clip_factor)
        grad_norm = unitwise_norm(g_data, norm_type=norm_type)
        clipped_grad = g_data * (max_norm / grad_norm.clamp(min=1e-6))
        new_grads = torch.where(grad_norm < max_norm, g_data, clipped_grad)
        p.grad.detach().copy_(new_grads)


def dispatch_clip_grad(parameters, value: float, mode: str = 'norm', norm_type: float = 2.0):
    if mode == 'norm':
        torch.nn.utils.clip_grad_norm_(parameters, value, norm_type=norm_type)
    elif mode == 'value':
        torch.nn.utils.clip_grad_value_(parameters, value)
    elif mode == 'agc':
        adaptive_clip_grad(parameters, value, norm_type=norm_type)
    else:
        assert False, f"Unknown clip mode ({mode})."


def model_parameters(model, exclude_head=False):
    if exclude_head:
        return [p for p in model.parameters()][:-2]
    return model.parameters()


def _timm_args(**over):
    import argparse
    args = argparse.Namespace(clip_grad=0.05, clip_mode='agc', accum_steps=2,
                              channels_last=True)
    vars(args).update(over)
    return args


@seeded
def _agc_setup():
    s = conv_sgd.__wrapped__()
    s.args = _timm_args()
    return s


@habit(id="timm_adaptive_gradient_clipping",
       source="huggingface/pytorch-image-models train.py train_one_epoch: "
              "dispatch_clip_grad(model_parameters(model, exclude_head='agc' in args.clip_mode), "
              "value=args.clip_grad, mode=args.clip_mode); timm/utils/agc.py",
       what="unit-wise adaptive gradient clipping between backward and step, steered by an "
            "argparse Namespace argument (clip mode, value), the head excluded",
       expect=EQUAL, rule=GUARD, setup=_agc_setup, ranks=True,
       call=lambda step, s, i, d: step(s.model, s.opt, d.img(), d.cls(), s.args))
def agc_step(model, optimizer, input, target, args):
    output = model(input)
    loss = F.cross_entropy(output, target)
    optimizer.zero_grad()
    loss.backward()
    if args.clip_grad is not None:
        dispatch_clip_grad(model_parameters(model, exclude_head='agc' in args.clip_mode),
                           value=args.clip_grad, mode=args.clip_mode)
    optimizer.step()
    return loss


class NativeScaler:
    """timm/utils/cuda.py NativeScaler: a callable object holding a GradScaler."""
    state_dict_key = "amp_scaler"

    def __init__(self, device='cpu'):
        self._scaler = torch.amp.GradScaler(device)

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode='norm', parameters=None,
                 create_graph=False, need_update=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                assert parameters is not None
                self._scaler.unscale_(optimizer)
                dispatch_clip_grad(parameters, clip_grad, mode=clip_mode)
            self._scaler.step(optimizer)
            self._scaler.update()


@seeded
def _native_scaler_setup():
    s = conv_sgd.__wrapped__()
    s.args = _timm_args(clip_grad=1.0, clip_mode='norm')
    s.loss_scaler = NativeScaler()
    s.amp_autocast = functools.partial(torch.autocast, device_type='cpu', dtype=torch.bfloat16)
    return s


@habit(id="timm_native_scaler_autocast_partial",
       source="huggingface/pytorch-image-models train.py: amp_autocast = partial(torch.autocast, "
              "device_type=..., dtype=amp_dtype); loss_scaler(loss, optimizer, clip_grad=..., "
              "parameters=model_parameters(...)); timm/utils/cuda.py NativeScaler",
       what="autocast entered through a functools.partial argument; the GradScaler reached "
            "inside a callable scaler object; unscale, clip by norm, step, update",
       expect=EQUAL, rule=PATH, setup=_native_scaler_setup, ranks=True,
       call=lambda step, s, i, d: step(s.model, s.opt, d.img(), d.cls(), s.args,
                                       s.amp_autocast, s.loss_scaler))
def native_scaler_step(model, optimizer, input, target, args, amp_autocast, loss_scaler):
    with amp_autocast():
        output = model(input)
        loss = F.cross_entropy(output, target)
    optimizer.zero_grad()
    loss_scaler(loss, optimizer, clip_grad=args.clip_grad, clip_mode=args.clip_mode,
                parameters=model_parameters(model, exclude_head='agc' in args.clip_mode),
                create_graph=False)
    return loss


@seeded
def _accum_setup():
    s = conv_sgd.__wrapped__()
    s.args = _timm_args(clip_grad=None)
    return s


@habit(id="timm_accum_steps_need_update",
       source="huggingface/pytorch-image-models train.py train_one_epoch (accum_steps): "
              "need_update, _forward/_backward closures, model.no_sync() when not need_update, "
              "loss /= accum_steps, optimizer.zero_grad() after the update",
       what="gradient accumulation over calls chosen by a bool argument; nested closures; "
            "zero_grad only after an update",
       expect=EQUAL, rule=GUARD, setup=_accum_setup, ranks=True,
       call=lambda step, s, i, d: step(s.model, s.opt, d.img(), d.cls(), s.args,
                                       (i + 1) % s.args.accum_steps == 0))
def accum_step(model, optimizer, input, target, args, need_update):
    accum_steps = args.accum_steps
    has_no_sync = hasattr(model, "no_sync")

    def _forward():
        output = model(input)
        loss = F.cross_entropy(output, target)
        if accum_steps > 1:
            loss /= accum_steps
        return loss

    def _backward(_loss):
        _loss.backward()
        if need_update:
            if args.clip_grad is not None:
                dispatch_clip_grad(model_parameters(model), value=args.clip_grad, mode=args.clip_mode)
            optimizer.step()

    if has_no_sync and not need_update:
        with model.no_sync():
            loss = _forward()
            _backward(loss)
    else:
        loss = _forward()
        _backward(loss)
    if need_update:
        optimizer.zero_grad()
    return loss


@seeded
def _channels_last_setup():
    s = conv_sgd.__wrapped__()
    s.model = s.model.to(memory_format=torch.channels_last)
    s.opt = torch.optim.SGD(s.model.parameters(), lr=0.1, momentum=0.9)
    s.args = _timm_args()
    return s


@habit(id="timm_channels_last",
       source="huggingface/pytorch-image-models train.py: model.to(memory_format=torch.channels_last); "
              "train_one_epoch: input = input.contiguous(memory_format=torch.channels_last)",
       what="a channels-last model and a batch converted to channels-last inside the step",
       expect=EQUAL, rule=INPUTS, setup=_channels_last_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, d.img(), d.cls(), s.args))
def channels_last_step(model, optimizer, input, target, args):
    if args.channels_last:
        input = input.contiguous(memory_format=torch.channels_last)
    output = model(input)
    loss = F.cross_entropy(output, target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


class BinaryCrossEntropy(nn.Module):
    """timm/loss/binary_cross_entropy.py"""

    def __init__(self, smoothing=0.1, target_threshold=None, weight=None, reduction='mean',
                 sum_classes=False, pos_weight=None):
        super().__init__()
        self.smoothing = smoothing
        self.target_threshold = target_threshold
        self.reduction = 'sum' if sum_classes else reduction
        self.sum_classes = sum_classes
        self.register_buffer('weight', weight)
        self.register_buffer('pos_weight', pos_weight)

    def forward(self, x, target):
        batch_size = x.shape[0]
        assert batch_size == target.shape[0]
        if target.shape != x.shape:
            num_classes = x.shape[-1]
            off_value = self.smoothing / num_classes
            on_value = 1. - self.smoothing + off_value
            target = target.long().view(-1, 1)
            target = torch.full((batch_size, num_classes), off_value, device=x.device,
                                dtype=x.dtype).scatter_(1, target, on_value)
        if self.target_threshold is not None:
            target = target.gt(self.target_threshold).to(dtype=target.dtype)
        loss = F.binary_cross_entropy_with_logits(x, target, self.weight,
                                                  pos_weight=self.pos_weight,
                                                  reduction=self.reduction)
        if self.sum_classes:
            loss = loss.sum(-1).mean()
        return loss


@seeded
def _bce_setup():
    s = mlp_sgd.__wrapped__()
    s.loss_fn = BinaryCrossEntropy(smoothing=0.1, target_threshold=0.2,
                                   pos_weight=torch.tensor([1.0, 2.0, 0.5, 1.5]))
    return s


@habit(id="timm_bce_loss_module_buffers",
       source="huggingface/pytorch-image-models train.py: train_loss_fn = BinaryCrossEntropy("
              "smoothing=..., target_threshold=args.bce_target_thresh, pos_weight=...), passed to "
              "train_one_epoch; timm/loss/binary_cross_entropy.py",
       what="a loss module with registered buffers (pos_weight) and plain attributes "
            "(smoothing, threshold) given to the step as an argument",
       expect=EQUAL, rule=GUARD, setup=_bce_setup,
       between=lambda s, i: setattr(s.loss_fn, "target_threshold", 0.5) if i == 2 else None,
       call=lambda step, s, i, d: step(s.model, s.opt, d.vec(), d.cls(), s.loss_fn))
def bce_step(model, optimizer, input, target, loss_fn):
    output = model(input)
    loss = loss_fn(output, target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


class CosineLRScheduler:
    """timm/scheduler/cosine_lr.py CosineLRScheduler with timm/scheduler/scheduler.py's
    update_groups (lr_scale) and noise, stepped per update (t_in_epochs=False)."""

    def __init__(self, optimizer, t_initial, lr_min=0., warmup_t=0, warmup_lr_init=0.,
                 noise_range_t=None, noise_pct=0.67, noise_std=1.0, noise_seed=42):
        self.optimizer = optimizer
        self.param_group_field = 'lr'
        self._initial_param_group_field = f"initial_{self.param_group_field}"
        for group in self.optimizer.param_groups:
            group.setdefault(self._initial_param_group_field, group[self.param_group_field])
        self.base_values = [group[self._initial_param_group_field]
                            for group in self.optimizer.param_groups]
        self.t_initial, self.lr_min = t_initial, lr_min
        self.warmup_t, self.warmup_lr_init = warmup_t, warmup_lr_init
        self.noise_range_t, self.noise_pct = noise_range_t, noise_pct
        self.noise_std, self.noise_seed = noise_std, noise_seed
        if self.warmup_t:
            self.warmup_steps = [(v - warmup_lr_init) / self.warmup_t for v in self.base_values]
            self.update_groups([self.warmup_lr_init] * len(self.base_values))
        else:
            self.warmup_steps = [1 for _ in self.base_values]

    def _get_lr(self, t):
        if t < self.warmup_t:
            return [self.warmup_lr_init + t * s for s in self.warmup_steps]
        t = t - self.warmup_t
        return [self.lr_min + 0.5 * (lr_max - self.lr_min) * (1 + math.cos(math.pi * t / self.t_initial))
                for lr_max in self.base_values]

    def _calculate_noise(self, t) -> float:
        g = torch.Generator()
        g.manual_seed(self.noise_seed + t)
        while True:
            noise = torch.randn(1, generator=g).item()
            if abs(noise) < self.noise_pct:
                return noise

    def step_update(self, num_updates: int):
        values = self._get_lr(num_updates)
        lo, hi = self.noise_range_t
        if lo <= num_updates < hi:
            noise = self._calculate_noise(num_updates)
            values = [v + v * noise for v in values]
        self.update_groups(values)

    def update_groups(self, values):
        for param_group, value in zip(self.optimizer.param_groups, values):
            if 'lr_scale' in param_group:
                param_group[self.param_group_field] = value * param_group['lr_scale']
            else:
                param_group[self.param_group_field] = value


@seeded
def _cosine_setup():
    model = MLP()
    # timm/optim/_param_groups.py param_groups_layer_decay: one group per layer,
    # lr_scale = layer_decay ** (num_layers - layer_id), no weight decay on biases
    groups = [{"params": [model.fc1.weight], "weight_decay": 0.05, "lr_scale": 0.5},
              {"params": [model.fc1.bias], "weight_decay": 0.0, "lr_scale": 0.5},
              {"params": [model.fc2.weight], "weight_decay": 0.05, "lr_scale": 1.0},
              {"params": [model.fc2.bias], "weight_decay": 0.0, "lr_scale": 1.0}]
    opt = torch.optim.AdamW(groups, lr=1e-2)
    sched = CosineLRScheduler(opt, t_initial=10, warmup_t=2, warmup_lr_init=1e-4,
                              noise_range_t=(2, 100))
    return SimpleNamespace(model=model, opt=opt, lr_scheduler=sched)


@habit(id="timm_cosine_step_update_lr_scale",
       source="huggingface/pytorch-image-models train.py train_one_epoch: "
              "lr_scheduler.step_update(num_updates=num_updates) after each update; "
              "timm/scheduler/cosine_lr.py, scheduler.py update_groups (lr_scale), "
              "timm/optim/_param_groups.py param_groups_layer_decay",
       what="warmup + cosine LR with per-group lr_scale (layer decay) and seeded noise, set "
            "on the param groups between calls; AdamW",
       expect=EQUAL, rule=INPUTS, setup=_cosine_setup, call=xy,
       between=lambda s, i: s.lr_scheduler.step_update(num_updates=i))
def cosine_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


class FeatureHooks:
    """timm/models/_features.py FeatureHooks: forward hooks that collect
    outputs in a dict keyed by device, cleared when read."""

    def __init__(self, hooks, named_modules):
        from collections import defaultdict
        self._feature_outputs = defaultdict(OrderedDict)
        modules = {k: v for k, v in named_modules}
        for h in hooks:
            hook_name = h['module']
            m = modules[hook_name]
            hook_fn = functools.partial(self._collect_output_hook, hook_name)
            if h.get('hook_type', 'forward') == 'forward_pre':
                m.register_forward_pre_hook(hook_fn)
            else:
                m.register_forward_hook(hook_fn)

    def _collect_output_hook(self, hook_id, *args):
        x = args[-1]
        if isinstance(x, tuple):
            x = x[0]
        self._feature_outputs[x.device][hook_id] = x

    def get_output(self, device):
        output = self._feature_outputs[device]
        self._feature_outputs[device] = OrderedDict()
        return output


class FeatureHookNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = MLP()
        self.hooks = FeatureHooks([{'module': 'fc1'}, {'module': 'fc2', 'hook_type': 'forward_pre'}],
                                  self.body.named_modules())

    def forward(self, x):
        last = self.body(x)
        out = self.hooks.get_output(x.device)
        out['final'] = last
        return out


@seeded
def _feature_hooks_setup():
    model = FeatureHookNet()
    return SimpleNamespace(model=model, opt=torch.optim.SGD(model.parameters(), lr=0.1))


@habit(id="timm_feature_hooks_dict",
       source="huggingface/pytorch-image-models timm/models/_features.py FeatureHooks / "
              "FeatureHookNet.forward (features_only with feature_cls='hook')",
       what="forward and forward-pre hooks store activations in a dict held by a plain object; "
            "forward reads and clears it; the loss uses the hooked features",
       expect=EQUAL, rule=HOOKS, setup=_feature_hooks_setup, call=xy)
def feature_hooks_step(model, optimizer, x, y):
    optimizer.zero_grad()
    feats = model(x)
    loss = F.cross_entropy(feats['final'], y) + 0.1 * feats['fc1'].pow(2).mean() \
        + 0.01 * feats['fc2'].abs().mean()
    loss.backward()
    optimizer.step()
    return loss


# ================================================================= torchvision
# pytorch/vision references/classification/train.py, train_quantization.py,
# references/detection/engine.py, references/segmentation/train.py.

@seeded
def _tv_amp_setup():
    import argparse
    s = conv_sgd.__wrapped__()
    s.criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    s.scaler = torch.amp.GradScaler("cpu")
    s.args = argparse.Namespace(clip_grad_norm=1.0)
    return s


@habit(id="tv_cls_amp_label_smoothing_clip",
       source="pytorch/vision references/classification/train.py train_one_epoch: "
              "autocast(enabled=scaler is not None), criterion(label_smoothing), "
              "scaler.scale(loss).backward(), scaler.unscale_ + clip_grad_norm_, scaler.step/update",
       what="autocast (bf16 on CPU) inside the step, a GradScaler argument, unscale then clip "
            "by global norm, label smoothing; returns the output too",
       expect=EQUAL, rule=AMBIENT, setup=_tv_amp_setup, ranks=True,
       call=lambda step, s, i, d: step(s.model, s.criterion, s.opt, d.img(), d.cls(), s.args,
                                       s.scaler))
def tv_cls_step(model, criterion, optimizer, image, target, args, scaler=None):
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=scaler is not None):
        output = model(image)
        loss = criterion(output, target)
    optimizer.zero_grad()
    if scaler is not None:
        scaler.scale(loss).backward()
        if args.clip_grad_norm is not None:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    return loss, output


class ExponentialMovingAverage(torch.optim.swa_utils.AveragedModel):
    """references/classification/utils.py"""

    def __init__(self, model, decay, device="cpu"):
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, device, ema_avg, use_buffers=True)


@seeded
def _tv_ema_setup():
    s = conv_sgd.__wrapped__()
    s.model_ema = ExponentialMovingAverage(s.model, decay=0.99)
    return s


@habit(id="tv_cls_model_ema_in_step",
       source="pytorch/vision references/classification/train.py train_one_epoch: "
              "if model_ema and i % args.model_ema_steps == 0: model_ema.update_parameters(model); "
              "if epoch < args.lr_warmup_epochs: model_ema.n_averaged.fill_(0); "
              "utils.ExponentialMovingAverage (torch.optim.swa_utils.AveragedModel)",
       what="AveragedModel.update_parameters inside the step: `if self.n_averaged == 0` "
            "decides on a buffer's value (copy on the first update, average later)",
       expect=EQUAL, rule=DECISION, setup=_tv_ema_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, d.img(), d.cls(), s.model_ema,
                                       i % 2 == 0, i < 1))
def tv_ema_step(model, optimizer, image, target, model_ema, update_ema, warmup):
    output = model(image)
    loss = F.cross_entropy(output, target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if model_ema and update_ema:
        model_ema.update_parameters(model)
        if warmup:
            model_ema.n_averaged.fill_(0)
    return loss


class TinyDetector(nn.Module):
    """A model that, like torchvision's detection models in train mode, takes a
    list of images and a list of target dicts and returns a dict of losses."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.cls_head = nn.Linear(8, 4)
        self.box_head = nn.Linear(8, 4)

    def forward(self, images, targets=None):
        x = torch.stack(images)
        f = F.adaptive_avg_pool2d(self.backbone(x), 1).flatten(1)
        labels = torch.stack([t["labels"][0] for t in targets])
        boxes = torch.stack([t["boxes"][0] for t in targets])
        return {"loss_classifier": F.cross_entropy(self.cls_head(f), labels),
                "loss_box_reg": F.smooth_l1_loss(self.box_head(f), boxes, beta=1 / 9)}


def reduce_dict(input_dict, average=True):
    """references/detection/utils.py"""
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world_size < 2:
        return input_dict
    with torch.inference_mode():
        names, values = [], []
        for k in sorted(input_dict.keys()):
            names.append(k)
            values.append(input_dict[k])
        values = torch.stack(values, dim=0)
        dist.all_reduce(values)
        if average:
            values /= world_size
        return {k: v for k, v in zip(names, values)}


def _det_batch(d, n=4):
    images = list(d.img(n))
    targets = [{"boxes": d.uniform(2, 4), "labels": d.cls(2)} for _ in range(n)]
    return images, targets


@seeded
def _det_setup():
    model = TinyDetector()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=1e-4)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0 / 1000, total_iters=2)
    return SimpleNamespace(model=model, opt=opt, lr_scheduler=warmup)


@habit(id="tv_det_isfinite_exit",
       source="pytorch/vision references/detection/engine.py train_one_epoch: "
              "loss_value = losses_reduced.item(); if not math.isfinite(loss_value): sys.exit(1)",
       what="a Python decision on the loss's value (.item() then math.isfinite) every step: "
            "a test of it, one program for every finite loss",
       expect=EQUAL, rule=DECISION, setup=_det_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, *_det_batch(d), s.lr_scheduler))
def det_isfinite_step(model, optimizer, images, targets, lr_scheduler):
    images = list(image for image in images)
    targets = [{k: v for k, v in t.items()} for t in targets]
    loss_dict = model(images, targets)
    losses = sum(loss for loss in loss_dict.values())
    loss_dict_reduced = reduce_dict(loss_dict)
    losses_reduced = sum(loss for loss in loss_dict_reduced.values())
    loss_value = losses_reduced.item()
    if not math.isfinite(loss_value):
        print(f"Loss is {loss_value}, stopping training")
        raise SystemExit(1)
    optimizer.zero_grad()
    losses.backward()
    optimizer.step()
    if lr_scheduler is not None:
        lr_scheduler.step()
    return loss_dict_reduced


@habit(id="tv_det_loss_dict_warmup_scheduler",
       source="pytorch/vision references/detection/engine.py train_one_epoch: loss_dict = "
              "model(images, targets); losses = sum(...); warmup LinearLR made by the caller "
              "and lr_scheduler.step() after optimizer.step()",
       what="images as a list and targets as a list of dicts of tensors, a dict of losses "
            "summed with Python's sum, a warmup scheduler stepped inside the step",
       expect=EQUAL, rule=INPUTS, setup=_det_setup, ranks=True,
       call=lambda step, s, i, d: step(s.model, s.opt, *_det_batch(d), s.lr_scheduler))
def det_step(model, optimizer, images, targets, lr_scheduler):
    images = list(image for image in images)
    targets = [{k: v for k, v in t.items()} for t in targets]
    loss_dict = model(images, targets)
    losses = sum(loss for loss in loss_dict.values())
    loss_dict_reduced = reduce_dict(loss_dict)
    optimizer.zero_grad()
    losses.backward()
    optimizer.step()
    if lr_scheduler is not None:
        lr_scheduler.step()
    return loss_dict_reduced


class TinySeg(nn.Module):
    """torchvision.models.segmentation's _SimpleSegmentationModel: backbone,
    classifier and aux classifier, outputs upsampled to the input size."""

    def __init__(self, classes=4):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False),
                                      nn.BatchNorm2d(8), nn.ReLU())
        self.classifier = nn.Conv2d(8, classes, 1)
        self.aux_classifier = nn.Conv2d(8, classes, 1)

    def forward(self, x):
        input_shape = x.shape[-2:]
        features = self.backbone(x)
        result = OrderedDict()
        out = self.classifier(features)
        result["out"] = F.interpolate(out, size=input_shape, mode="bilinear", align_corners=False)
        aux = self.aux_classifier(features)
        result["aux"] = F.interpolate(aux, size=input_shape, mode="bilinear", align_corners=False)
        return result


def seg_criterion(inputs, target):
    losses = {}
    for name, x in inputs.items():
        losses[name] = nn.functional.cross_entropy(x, target, ignore_index=255)
    if len(losses) == 1:
        return losses["out"]
    return losses["out"] + 0.5 * losses["aux"]


@seeded
def _seg_setup():
    model = TinySeg()
    params_to_optimize = [
        {"params": [p for p in model.backbone.parameters() if p.requires_grad]},
        {"params": [p for p in model.classifier.parameters() if p.requires_grad]},
        {"params": [p for p in model.aux_classifier.parameters() if p.requires_grad], "lr": 0.1},
    ]
    opt = torch.optim.SGD(params_to_optimize, lr=0.01, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=10, power=0.9)
    return SimpleNamespace(model=model, opt=opt, lr_scheduler=sched, criterion=seg_criterion)


def _seg_target(d):
    t = d.cls(8 * 8 * 4).view(4, 8, 8)
    return torch.where(d.uniform(4, 8, 8) < 0.1, torch.full_like(t, 255), t)


@habit(id="tv_seg_aux_loss_ignore_index_poly_lr",
       source="pytorch/vision references/segmentation/train.py: criterion (out + 0.5 * aux, "
              "ignore_index=255), params_to_optimize with the aux classifier at 10x lr, "
              "PolynomialLR stepped every iteration in train_one_epoch",
       what="a model returning an OrderedDict, a loss over its items with ignore_index, "
            "three param groups, a scheduler stepped inside the step",
       expect=EQUAL, rule=INPUTS, setup=_seg_setup, ranks=True,
       call=lambda step, s, i, d: step(s.model, s.criterion, s.opt, d.img(4), _seg_target(d),
                                       s.lr_scheduler))
def seg_step(model, criterion, optimizer, image, target, lr_scheduler):
    output = model(image)
    loss = criterion(output, target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    lr_scheduler.step()
    return loss


def _evaluate_between(s, i):
    """references/classification/train.py evaluate(): model.eval() and
    torch.inference_mode(); then train_one_epoch's model.train()."""
    if i == 2:
        s.model.eval()
        with torch.inference_mode():
            s.model(torch.randn(4, 3, 8, 8))
        s.model.train()


@habit(id="tv_cls_evaluate_between_calls",
       source="pytorch/vision references/classification/train.py main: evaluate(model, ...) "
              "(model.eval(), torch.inference_mode()) between epochs, model.train() in "
              "train_one_epoch",
       what="an evaluation pass under inference_mode between two calls, BatchNorm model",
       expect=EQUAL, rule=GUARD, setup=conv_sgd, call=img_xy, between=_evaluate_between)
def plain_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


class TinyQAT(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant = torch.ao.quantization.QuantStub()
        self.fc1 = nn.Linear(16, 32)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(32, 4)
        self.dequant = torch.ao.quantization.DeQuantStub()

    def forward(self, x):
        return self.dequant(self.fc2(self.relu(self.fc1(self.quant(x)))))


@seeded
def _qat_setup():
    model = TinyQAT()
    model.train()
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
    torch.ao.quantization.prepare_qat(model, inplace=True)
    return SimpleNamespace(model=model, opt=torch.optim.SGD(model.parameters(), lr=0.01,
                                                            momentum=0.9))


@habit(id="tv_qat_fake_quant_observers",
       source="pytorch/vision references/classification/train_quantization.py: "
              "prepare_qat(model); model.apply(torch.ao.quantization.disable_observer) after "
              "num_observer_update_epochs",
       what="FakeQuantize modules decide on their observer_enabled / fake_quant_enabled "
            "buffers' values in forward; observers are disabled between calls",
       expect=REFUSED, rule=DECISION, setup=_qat_setup, call=xy,
       between=lambda s, i: s.model.apply(torch.ao.quantization.disable_observer) if i == 2 else None)
def qat_step(model, optimizer, x, y):
    return plain_step(model, optimizer, x, y)


@seeded
def _sequential_lr_setup():
    s = mlp_sgd.__wrapped__()
    warmup = torch.optim.lr_scheduler.LinearLR(s.opt, start_factor=0.01, total_iters=2)
    main = torch.optim.lr_scheduler.CosineAnnealingLR(s.opt, T_max=5, eta_min=0.0)
    s.lr_scheduler = torch.optim.lr_scheduler.SequentialLR(s.opt, schedulers=[warmup, main],
                                                           milestones=[2])
    return s


@habit(id="tv_cls_sequential_lr_warmup_in_step",
       source="pytorch/vision references/classification/train.py: SequentialLR(optimizer, "
              "schedulers=[LinearLR warmup, CosineAnnealingLR], milestones=[lr_warmup_epochs]), "
              "stepped per iteration inside the step",
       what="a composite scheduler (SequentialLR of LinearLR and CosineAnnealingLR) stepped "
            "after optimizer.step() inside the step",
       expect=EQUAL, rule=INPUTS, setup=_sequential_lr_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, d.vec(), d.cls(), s.lr_scheduler))
def sequential_lr_step(model, optimizer, x, y, lr_scheduler):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    lr_scheduler.step()
    return loss


# ================================================================= pytorch/examples, tutorials

class AverageMeter:
    """pytorch/examples imagenet/main.py"""

    def __init__(self, name, fmt=':f'):
        self.name, self.fmt = name, fmt
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def accuracy(output, target, topk=(1,)):
    with torch.no_grad():
        maxk = max(topk)
        batch_size = target.size(0)
        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))
        res = []
        for k in topk:
            correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
            res.append(correct_k.mul_(100.0 / batch_size))
        return res


@seeded
def _meters_setup():
    s = mlp_sgd.__wrapped__()
    s.criterion = nn.CrossEntropyLoss()
    s.losses, s.top1 = AverageMeter('Loss', ':.4e'), AverageMeter('Acc@1', ':6.2f')
    return s


class SmoothedValue:
    """pytorch/vision references/classification/utils.py SmoothedValue (a window
    of the values in a deque, a total and a count)"""

    def __init__(self, window_size=20, fmt=None):
        if fmt is None:
            fmt = "{median:.4f} ({global_avg:.4f})"
        self.deque = collections.deque(maxlen=window_size)
        self.total = 0.0
        self.count = 0
        self.fmt = fmt

    def update(self, value, n=1):
        self.deque.append(value)
        self.count += n
        self.total += value * n

    @property
    def global_avg(self):
        return self.total / self.count


class MetricLogger:
    """pytorch/vision references/classification/utils.py MetricLogger"""

    def __init__(self, delimiter="\t"):
        self.meters = collections.defaultdict(SmoothedValue)
        self.delimiter = delimiter

    def update(self, **kwargs):
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            assert isinstance(v, (float, int))
            self.meters[k].update(v)

    def add_meter(self, name, meter):
        self.meters[name] = meter


def _metric_logger_setup(lazily):
    @seeded
    def build():
        s = mlp_sgd.__wrapped__()
        s.criterion = nn.CrossEntropyLoss()
        s.metric_logger = MetricLogger(delimiter="  ")
        s.metric_logger.add_meter("lr", SmoothedValue(window_size=1, fmt="{value}"))
        if not lazily:   # as from the second call on: the meters the first call made
            for name in ("loss", "acc1"):
                s.metric_logger.add_meter(name, SmoothedValue(window_size=3))
        return s
    return build


@habit(id="tv_cls_metric_logger_smoothed_values",
       source="pytorch/vision references/classification/train.py train_one_epoch: "
              "metric_logger.update(loss=loss.item(), lr=optimizer.param_groups[0]['lr']); "
              "metric_logger.meters['acc1'].update(acc1.item(), n=batch_size); utils.py "
              "SmoothedValue.update: self.deque.append(value); self.count += n; "
              "self.total += value * n; MetricLogger.update: assert isinstance(v, (float, int))",
       what="every call appends its loss, lr and accuracy to deques on the host and adds to "
            "their totals and counts (the meters made before the first call)",
       expect=EQUAL, rule=HOST_NUMBERS, setup=_metric_logger_setup(lazily=False), ranks=True,
       call=lambda step, s, i, d: step(s.model, s.criterion, s.opt, d.vec(), d.cls(),
                                       s.metric_logger))
@habit(id="tv_cls_metric_logger_meters_made_by_the_first_call",
       source="pytorch/vision references/classification/train.py train_one_epoch and utils.py "
              "MetricLogger (meters = defaultdict(SmoothedValue): 'loss' and 'acc1' made by "
              "the first update)",
       what="the first call makes the meters it appends its values to",
       expect=REFUSED, rule=HOST_WRITE, setup=_metric_logger_setup(lazily=True),
       match="leaves a value it computed from tensors in metric_logger.meters",
       gap="a meter the first call makes holds that call's values; the trace cannot make it "
           "before the program has them",
       call=lambda step, s, i, d: step(s.model, s.criterion, s.opt, d.vec(), d.cls(),
                                       s.metric_logger))
def metric_logger_step(model, criterion, optimizer, image, target, metric_logger):
    output = model(image)
    loss = criterion(output, target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    acc1, = accuracy(output, target, topk=(1,))
    batch_size = image.shape[0]
    metric_logger.update(loss=loss.item(), lr=optimizer.param_groups[0]["lr"])
    metric_logger.meters["acc1"].update(acc1.item(), n=batch_size)
    return loss


@habit(id="examples_imagenet_average_meters",
       source="pytorch/examples imagenet/main.py train(): losses.update(loss.item(), "
              "images.size(0)); top1.update(acc1[0], images.size(0)) (timm's train.py does the "
              "same with losses_m.update(loss.item(), ...))",
       what="host meters updated inside the step with loss.item() and an accuracy tensor: "
            "the first call computes both (the counts and sums are outputs); the second adds "
            "into the accuracy's sum, now a tensor, in place: written back into it",
       expect=EQUAL, rule=HOST_NUMBERS, setup=_meters_setup, ranks=True,
       call=lambda step, s, i, d: step(s.model, s.criterion, s.opt, d.vec(), d.cls(), s.losses,
                                       s.top1))
def meters_step(model, criterion, optimizer, images, target, losses, top1):
    output = model(images)
    loss = criterion(output, target)
    acc1, acc2 = accuracy(output, target, topk=(1, 2))
    losses.update(loss.item(), images.size(0))
    top1.update(acc1[0], images.size(0))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


@habit(id="timm_losses_meter_item_in_step",
       source="huggingface/pytorch-image-models train.py train_one_epoch: losses_m.update("
              "loss.item() * accum_steps, input.size(0)); update_sample_count += input.size(0); "
              "num_updates += 1; timm/utils/metrics.py AverageMeter",
       what="host meters and counters updated inside the step with loss.item() and an "
            "accuracy's .item(): each call's values, from one program",
       expect=EQUAL, rule=HOST_NUMBERS, setup=_meters_setup, ranks=True,
       call=lambda step, s, i, d: step(s.model, s.criterion, s.opt, d.vec(), d.cls(), s.losses,
                                       s.top1))
def meters_item_step(model, criterion, optimizer, images, target, losses, top1):
    output = model(images)
    loss = criterion(output, target)
    acc1, = accuracy(output, target, topk=(1,))
    losses.update(loss.item() * 1, images.size(0))
    top1.update(acc1.item(), images.size(0))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


class RNNModel(nn.Module):
    """pytorch/examples word_language_model/model.py (LSTM)"""

    def __init__(self, ntoken=24, ninp=16, nhid=16, nlayers=2, dropout=0.2):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers = nhid, nlayers

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output)
        decoded = decoded.view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                weight.new_zeros(self.nlayers, bsz, self.nhid))


def repackage_hidden(h):
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


@seeded
def _word_lm_setup():
    import argparse
    model = RNNModel()
    return SimpleNamespace(model=model, hidden=model.init_hidden(2), lr=20.0,
                           criterion=nn.NLLLoss(), args=argparse.Namespace(clip=0.25))


def _word_lm_call(step, s, i, d):
    tokens = d.tok(2, 7, 24).t().contiguous()       # (bptt + 1, batch), as batchify/get_batch
    data, targets = tokens[:-1], tokens[1:].reshape(-1)
    loss, s.hidden = step(s.model, s.criterion, data, targets, s.hidden, s.lr, s.args)
    return loss


def _anneal_lr(s, i):
    if i == 2:
        s.lr /= 4.0    # "Anneal the learning rate if no improvement has been seen"


@habit(id="examples_word_lm_manual_sgd_hidden",
       source="pytorch/examples word_language_model/main.py train(): hidden = "
              "repackage_hidden(hidden); clip_grad_norm_; for p in model.parameters(): "
              "p.data.add_(p.grad, alpha=-lr); lr /= 4.0 between epochs",
       what="no optimizer: SGD written with p.data.add_ and a float lr argument that is "
            "annealed; an LSTM hidden state carried from call to call",
       expect=EQUAL, rule=INPUTS, setup=_word_lm_setup, call=_word_lm_call,
       between=_anneal_lr, ranks=True)
def word_lm_step(model, criterion, data, targets, hidden, lr, args):
    hidden = repackage_hidden(hidden)
    model.zero_grad()
    output, hidden = model(data, hidden)
    loss = criterion(output, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)
    return loss, hidden


class DCGenerator(nn.Module):
    def __init__(self, nz=8, ngf=8):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, 3, 4, 2, 1, bias=False), nn.Tanh())

    def forward(self, input):
        return self.main(input)


class DCDiscriminator(nn.Module):
    def __init__(self, ndf=8):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(3, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, 1, 2, 1, 0, bias=False), nn.Sigmoid())

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


@seeded
def _dcgan_setup():
    netG, netD = DCGenerator(), DCDiscriminator()
    return SimpleNamespace(
        netD=netD, netG=netG, criterion=nn.BCELoss(),
        optimizerD=torch.optim.Adam(netD.parameters(), lr=0.0002, betas=(0.5, 0.999)),
        optimizerG=torch.optim.Adam(netG.parameters(), lr=0.0002, betas=(0.5, 0.999)))


def _dcgan_ddp(s):
    s.netD = nn.parallel.DistributedDataParallel(s.netD)
    s.netG = nn.parallel.DistributedDataParallel(s.netG)


@habit(id="examples_dcgan_two_optimizers",
       source="pytorch/examples dcgan/main.py training loop: netD on real and fake.detach(), "
              "optimizerD.step(), then netG's loss through netD and optimizerG.step() "
              "(D_x = output.mean().item() kept as tensors)",
       what="two models, two optimizers, three forward passes of the BatchNorm discriminator, "
            "a backward after the first optimizer's step, noise from torch.randn",
       expect=EQUAL, rule=PHASES, setup=_dcgan_setup, ranks=True, ddp=_dcgan_ddp,
       rank_gap="the discriminator's gradients of its two backward() calls are summed and averaged "
                "once, as under DDP's no_sync on the first (the contract); DDP without no_sync "
                "averages at each backward(), an ulp apart (tests/test_gan.py checks the step "
                "with no_sync against DDP, bit for bit)",
       call=lambda step, s, i, d: step(s.netD, s.netG, s.optimizerD, s.optimizerG, s.criterion,
                                       (d.img(4), d.cls(4))))
def dcgan_step(netD, netG, optimizerD, optimizerG, criterion, data, nz=8):
    real_label, fake_label = 1., 0.
    netD.zero_grad()
    real_cpu = data[0]
    batch_size = real_cpu.size(0)
    label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)
    output = netD(real_cpu)
    errD_real = criterion(output, label)
    errD_real.backward()
    D_x = output.mean()
    noise = torch.randn(batch_size, nz, 1, 1)
    fake = netG(noise)
    label.fill_(fake_label)
    output = netD(fake.detach())
    errD_fake = criterion(output, label)
    errD_fake.backward()
    D_G_z1 = output.mean()
    errD = errD_real + errD_fake
    optimizerD.step()
    netG.zero_grad()
    label.fill_(real_label)
    output = netD(fake)
    errG = criterion(output, label)
    errG.backward()
    D_G_z2 = output.mean()
    optimizerG.step()
    return errD, errG, D_x, D_G_z1, D_G_z2


SOS_token, EOS_token, teacher_forcing_ratio = 0, 1, 0.5


class EncoderRNN(nn.Module):
    def __init__(self, input_size=10, hidden_size=16):
        super().__init__()
        self.hidden_size = hidden_size
        self.embedding = nn.Embedding(input_size, hidden_size)
        self.gru = nn.GRU(hidden_size, hidden_size)

    def forward(self, input, hidden):
        embedded = self.embedding(input).view(1, 1, -1)
        return self.gru(embedded, hidden)

    def initHidden(self):
        return torch.zeros(1, 1, self.hidden_size)


class DecoderRNN(nn.Module):
    def __init__(self, hidden_size=16, output_size=10):
        super().__init__()
        self.embedding = nn.Embedding(output_size, hidden_size)
        self.gru = nn.GRU(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, output_size)
        self.softmax = nn.LogSoftmax(dim=1)

    def forward(self, input, hidden):
        output = F.relu(self.embedding(input).view(1, 1, -1))
        output, hidden = self.gru(output, hidden)
        return self.softmax(self.out(output[0])), hidden


@seeded
def _seq2seq_setup():
    encoder, decoder = EncoderRNN(), DecoderRNN()
    return SimpleNamespace(encoder=encoder, decoder=decoder, criterion=nn.NLLLoss(),
                           encoder_optimizer=torch.optim.SGD(encoder.parameters(), lr=0.01),
                           decoder_optimizer=torch.optim.SGD(decoder.parameters(), lr=0.01))


@habit(id="tutorial_seq2seq_teacher_forcing",
       source="pytorch/tutorials intermediate_source/seq2seq_translation_tutorial.py train(): "
              "use_teacher_forcing = True if random.random() < teacher_forcing_ratio else False",
       what="a host random draw decides, every call, between teacher forcing and feeding the "
            "decoder its own prediction (with `if decoder_input.item() == EOS_token: break`): "
            "a program per outcome, the draw's value guarded",
       expect=EQUAL, rule=HOST_RNG, setup=_seq2seq_setup,
       call=lambda step, s, i, d: step(d.cls(4, 10).view(4, 1), d.cls(3, 10).view(3, 1),
                                       s.encoder, s.decoder, s.encoder_optimizer,
                                       s.decoder_optimizer, s.criterion))
def seq2seq_train(input_tensor, target_tensor, encoder, decoder, encoder_optimizer,
                  decoder_optimizer, criterion, max_length=6):
    encoder_hidden = encoder.initHidden()
    encoder_optimizer.zero_grad()
    decoder_optimizer.zero_grad()
    input_length, target_length = input_tensor.size(0), target_tensor.size(0)
    encoder_outputs = torch.zeros(max_length, encoder.hidden_size)
    loss = 0
    for ei in range(input_length):
        encoder_output, encoder_hidden = encoder(input_tensor[ei], encoder_hidden)
        encoder_outputs[ei] = encoder_output[0, 0]
    decoder_input = torch.tensor([[SOS_token]])
    decoder_hidden = encoder_hidden
    use_teacher_forcing = True if random.random() < teacher_forcing_ratio else False
    if use_teacher_forcing:
        for di in range(target_length):
            decoder_output, decoder_hidden = decoder(decoder_input, decoder_hidden)
            loss += criterion(decoder_output, target_tensor[di])
            decoder_input = target_tensor[di]
    else:
        for di in range(target_length):
            decoder_output, decoder_hidden = decoder(decoder_input, decoder_hidden)
            topv, topi = decoder_output.topk(1)
            decoder_input = topi.squeeze().detach()
            loss += criterion(decoder_output, target_tensor[di])
            if decoder_input.item() == EOS_token:
                break
    loss.backward()
    encoder_optimizer.step()
    decoder_optimizer.step()
    return loss / target_length


@seeded
def _optimizer_in_backward_setup():
    model = MLP()
    optimizer_dict = {p: torch.optim.Adam([p], foreach=False) for p in model.parameters()}

    def optimizer_hook(parameter) -> None:
        optimizer_dict[parameter].step()
        optimizer_dict[parameter].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(optimizer_hook)
    return SimpleNamespace(model=model, optimizer_dict=optimizer_dict)


@habit(id="tutorial_optimizer_step_in_backward",
       source="pytorch/tutorials intermediate_source/optimizer_step_in_backward_tutorial.py: "
              "register_post_accumulate_grad_hook(optimizer_hook) with one Adam per parameter "
              "(torchtune's optimizer_in_bwd does the same)",
       what="the optimizer steps run from post-accumulate-grad hooks during backward(); the "
            "step itself only calls loss.backward()",
       expect=REFUSED, match="KeyError",
       gap="an optimizer per parameter, keyed by the parameter and stepped in its hook, is given the trace's stand-in",
       rule=HOOKS, setup=_optimizer_in_backward_setup,
       call=lambda step, s, i, d: step(s.model, d.vec(), d.cls()))
def optimizer_in_backward_step(model, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss


# ================================================================= transformers
# huggingface/transformers: src/transformers/trainer.py (training_step,
# compute_loss, _inner_training_loop), trainer_pt_utils.LabelSmoother,
# integrations/neftune.py, data/data_collator.py, the models' forward, and
# examples/pytorch/*_no_trainer.py. The models are built from tiny configs.

def _lm_batch(d, n=4, t=8, pad=False):
    ids = d.tok(n, t)
    labels = ids.clone()
    if pad:
        labels[:, -2:] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


@seeded
def _bert_cls_setup():
    model = tiny_bert_cls()
    return SimpleNamespace(model=model, opt=torch.optim.AdamW(model.parameters(), lr=1e-3))


@habit(id="hf_problem_type_set_on_first_call",
       source="huggingface/transformers models/bert/modeling_bert.py "
              "BertForSequenceClassification.forward: if self.config.problem_type is None: "
              "self.config.problem_type = 'single_label_classification' (by labels' dtype)",
       what="the model writes its config (problem_type) on the first forward with labels; "
            "later calls read the value written",
       expect=EQUAL, rule=LAZY, setup=_bert_cls_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, d.tok(4, 8), d.cls(4, 3)))
def bert_cls_step(model, optimizer, input_ids, labels):
    outputs = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels)
    loss = outputs.loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss, outputs.logits


@dataclasses.dataclass
class TrainingArguments:
    """The fields of transformers.TrainingArguments the loop reads."""
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    label_smoothing_factor: float = 0.1
    n_gpu: int = 1
    logging_nan_inf_filter: bool = True


@dataclasses.dataclass
class TrainerState:
    global_step: int = 0
    epoch: float = 0.0


class MiniTrainer:
    """transformers.Trainer's training_step / compute_loss and one update of
    _inner_training_loop, as methods of an object holding the model, the
    optimizer and the scheduler."""

    def __init__(self, model, args, optimizer, lr_scheduler):
        from transformers.trainer_pt_utils import LabelSmoother
        self.model, self.args = model, args
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.state = TrainerState()
        self.label_smoother = LabelSmoother(epsilon=args.label_smoothing_factor) \
            if args.label_smoothing_factor != 0 else None
        self.compute_loss_context_manager = contextlib.nullcontext
        self._globalstep_last_logged = 0

    def _prepare_input(self, data):
        if isinstance(data, dict):
            return type(data)({k: self._prepare_input(v) for k, v in data.items()})
        if isinstance(data, torch.Tensor):
            return data.to(device=next(self.model.parameters()).device)
        return data

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.label_smoother is not None and "labels" in inputs:
            labels = inputs.pop("labels")
        else:
            labels = None
        outputs = model(**inputs)
        if labels is not None:
            loss = self.label_smoother(outputs, labels, shift_labels=True)
        else:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_input(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if self.args.n_gpu > 1:
            loss = loss.mean()
        loss = loss / self.args.gradient_accumulation_steps
        loss.backward()
        return loss.detach()

    def update(self, inputs, tr_loss):
        """One optimizer update of _inner_training_loop."""
        tr_loss_step = self.training_step(self.model, inputs)
        if self.args.logging_nan_inf_filter and (torch.isnan(tr_loss_step) or torch.isinf(tr_loss_step)):
            tr_loss = tr_loss + tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
        else:
            tr_loss = tr_loss + tr_loss_step
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.model.zero_grad()
        return tr_loss, grad_norm

    def update_and_count(self, inputs, tr_loss):
        tr_loss, grad_norm = self.update(inputs, tr_loss)
        self.state.global_step += 1
        self.state.epoch = self.state.global_step / 100
        return tr_loss, grad_norm


def _trainer_setup(**args):
    @seeded
    def build():
        import transformers
        model = tiny_gpt2()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = transformers.get_linear_schedule_with_warmup(opt, 1, 10)
        trainer = MiniTrainer(model, TrainingArguments(**args), opt, sched)
        return SimpleNamespace(trainer=trainer, tr_loss=torch.tensor(0.0))
    return build


def _trainer_call(step, s, i, d):
    s.tr_loss, grad_norm = step(_lm_batch(d), s.tr_loss)
    return s.tr_loss, grad_norm


@habit(id="hf_trainer_bound_method_update",
       source="huggingface/transformers src/transformers/trainer.py _inner_training_loop: "
              "tr_loss_step = self.training_step(model, inputs); tr_loss = tr_loss + "
              "tr_loss_step; clip_grad_norm_; self.optimizer.step(); self.lr_scheduler.step(); "
              "model.zero_grad(); training_step/compute_loss with LabelSmoother",
       what="the step is a bound method of a trainer object that holds the model, optimizer "
            "and scheduler (none among the arguments); label smoothing pops labels from a "
            "copy of the inputs; dataclass arguments",
       expect=EQUAL, rule=PATH, setup=_trainer_setup(logging_nan_inf_filter=False),
       bind=lambda s: s.trainer.update, call=_trainer_call)
def _unused(*a):
    raise AssertionError


@habit(id="hf_trainer_logging_nan_inf_filter",
       source="huggingface/transformers src/transformers/trainer.py _inner_training_loop: "
              "if args.logging_nan_inf_filter and (torch.isnan(tr_loss_step) or "
              "torch.isinf(tr_loss_step)): ... (on by default)",
       what="the default NaN/Inf filter decides in Python on the step's loss value",
       expect=EQUAL, rule=DECISION, setup=_trainer_setup(logging_nan_inf_filter=True),
       bind=lambda s: s.trainer.update, call=_trainer_call)
def _unused2(*a):
    raise AssertionError


@habit(id="hf_trainer_global_step_in_step",
       source="huggingface/transformers src/transformers/trainer.py _inner_training_loop: "
              "self.state.global_step += 1; self.state.epoch = epoch + (step + 1) / steps_in_epoch "
              "right after the optimizer and scheduler steps",
       what="a host counter on the trainer's state incremented by the step every call",
       expect=EQUAL, rule=HOST_NUMBERS,
       setup=_trainer_setup(logging_nan_inf_filter=False),
       bind=lambda s: s.trainer.update_and_count, call=_trainer_call)
def _unused3(*a):
    raise AssertionError


@habit(id="hf_training_step_model_train_after_evaluate",
       source="huggingface/transformers src/transformers/trainer.py: training_step begins with "
              "model.train(); evaluate() (model.eval()) runs between updates (eval_steps)",
       what="an evaluation between calls leaves the model in eval mode; the step itself "
            "switches it back to train mode",
       expect=EQUAL, rule=GUARD, setup=_trainer_setup(logging_nan_inf_filter=False),
       bind=lambda s: s.trainer.update, call=_trainer_call,
       between=lambda s, i: s.trainer.model.eval() if i == 2 else None)
def _unused4(*a):
    raise AssertionError


@seeded
def _gpt2_setup():
    model = tiny_gpt2()
    return SimpleNamespace(model=model, opt=torch.optim.AdamW(model.parameters(), lr=1e-3))


def gpt2_call(step, s, i, d):
    return step(s.model, s.opt, d.tok(4, 8))


@habit(id="hf_gpt2_lm_dropout",
       source="huggingface/transformers models/gpt2/modeling_gpt2.py GPT2LMHeadModel.forward "
              "(labels shifted inside, embd/attn/resid dropout 0.1), as examples/pytorch/"
              "language-modeling/run_clm.py trains it",
       what="a real transformer with dropout in embeddings, attention (sdpa) and residuals; "
            "loss computed by the model from labels",
       expect=EQUAL, rule=TORCH_RNG, setup=_gpt2_setup, call=gpt2_call, ranks=True)
def gpt2_step(model, optimizer, input_ids):
    outputs = model(input_ids=input_ids, labels=input_ids)
    loss = outputs.loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@seeded
def _gpt2_ckpt_setup():
    s = _gpt2_setup.__wrapped__()
    s.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    s.model.config.use_cache = False
    return s


habit(id="hf_gradient_checkpointing_dropout",
      source="huggingface/transformers modeling_utils.py gradient_checkpointing_enable("
             "gradient_checkpointing_kwargs={'use_reentrant': False}) (Trainer's "
             "--gradient_checkpointing), GPT-2 with dropout",
      what="activation checkpointing (non-reentrant) around each block; recomputation must "
           "replay the forward's dropout masks",
      expect=EQUAL, rule=TORCH_RNG, setup=_gpt2_ckpt_setup, call=gpt2_call)(gpt2_step)


@seeded
def _neftune_setup():
    from transformers.integrations.neftune import neftune_post_forward_hook
    s = _gpt2_setup.__wrapped__()
    embeddings = s.model.get_input_embeddings()
    embeddings.neftune_noise_alpha = 5.0
    s.hook_handle = embeddings.register_forward_hook(neftune_post_forward_hook)
    return s


habit(id="hf_neftune_embedding_noise_hook",
      source="huggingface/transformers integrations/neftune.py activate_neftune / "
             "neftune_post_forward_hook (Trainer's neftune_noise_alpha)",
      what="a forward hook on the input embeddings adds uniform noise whose bounds are a "
           "0-d tensor (alpha / sqrt(L*d)), read from a module attribute",
      expect=EQUAL, rule=HOOKS, setup=_neftune_setup, call=gpt2_call)(gpt2_step)


@habit(id="hf_custom_trainer_class_weights_pop_labels",
       source="huggingface/transformers docs/source/en/trainer.md 'Customize the Trainer': "
              "compute_loss pops labels and uses nn.CrossEntropyLoss(weight=torch.tensor("
              "[1.0, 2.0, 3.0], device=model.device)) with self.model.config.num_labels",
       what="labels popped from the batch dict argument; a weighted loss made from literals "
            "inside the step; model.device and config read",
       expect=EQUAL, rule=INPUTS, setup=_bert_cls_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, {"input_ids": d.tok(4, 8),
                                                        "labels": d.cls(4, 3)}))
def class_weights_step(model, optimizer, inputs):
    labels = inputs.pop("labels")
    outputs = model(**inputs)
    logits = outputs.get("logits")
    loss_fct = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0], device=model.device))
    loss = loss_fct(logits.view(-1, model.config.num_labels), labels.view(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


class SpecAugmentNet(nn.Module):
    """Wav2Vec2Model._mask_hidden_states: SpecAugment time masks drawn with
    numpy on the host by _compute_mask_indices in every training forward."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(apply_spec_augment=True, mask_time_prob=0.3,
                                      mask_time_length=2, mask_time_min_masks=2)
        self.proj = nn.Linear(16, 16)
        self.masked_spec_embed = nn.Parameter(torch.Tensor(16).uniform_())
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        from transformers.models.wav2vec2.modeling_wav2vec2 import _compute_mask_indices
        hidden_states = self.proj(x)
        if self.config.apply_spec_augment and self.training and self.config.mask_time_prob > 0:
            batch_size, sequence_length, hidden_size = hidden_states.size()
            mask_time_indices = _compute_mask_indices(
                (batch_size, sequence_length), mask_prob=self.config.mask_time_prob,
                mask_length=self.config.mask_time_length, attention_mask=None,
                min_masks=self.config.mask_time_min_masks)
            mask_time_indices = torch.tensor(mask_time_indices, device=hidden_states.device,
                                             dtype=torch.bool)
            hidden_states[mask_time_indices] = self.masked_spec_embed.to(hidden_states.dtype)
        return self.head(hidden_states.mean(1))


@seeded
def _specaug_setup():
    model = SpecAugmentNet()
    return SimpleNamespace(model=model, opt=torch.optim.AdamW(model.parameters(), lr=1e-3))


@habit(id="hf_wav2vec2_spec_augment_numpy_masks",
       source="huggingface/transformers models/wav2vec2/modeling_wav2vec2.py "
              "Wav2Vec2Model._mask_hidden_states -> _compute_mask_indices (np.random) -> "
              "torch.tensor(mask_time_indices)",
       what="time masks drawn with numpy on the host inside forward, turned into a tensor and "
            "used to overwrite hidden states",
       expect=REFUSED, rule=HOST_RNG, setup=_specaug_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, d.vec(4 * 10).view(4, 10, 16), d.cls(4)))
def specaug_step(model, optimizer, x, y):
    return plain_step(model, optimizer, x, y)


def torch_mask_tokens(inputs, special_tokens_mask, mlm_probability=0.15, mask_token_id=3,
                      vocab_size=64):
    """DataCollatorForLanguageModeling.torch_mask_tokens, done on the batch in the step."""
    labels = inputs.clone()
    probability_matrix = torch.full(labels.shape, mlm_probability)
    special_tokens_mask = special_tokens_mask.bool()
    probability_matrix.masked_fill_(special_tokens_mask, value=0.0)
    masked_indices = torch.bernoulli(probability_matrix).bool()
    labels[~masked_indices] = -100
    indices_replaced = torch.bernoulli(torch.full(labels.shape, 0.8)).bool() & masked_indices
    inputs[indices_replaced] = mask_token_id
    indices_random = torch.bernoulli(torch.full(labels.shape, 0.5)).bool() & masked_indices \
        & ~indices_replaced
    random_words = torch.randint(vocab_size, labels.shape, dtype=torch.long)
    inputs[indices_random] = random_words[indices_random]
    return inputs, labels


@seeded
def _mlm_setup():
    transformers = _quiet_transformers()
    model = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16))
    return SimpleNamespace(model=model, opt=torch.optim.AdamW(model.parameters(), lr=1e-3))


def _mlm_call(step, s, i, d):
    ids = d.tok(4, 8)
    special = torch.zeros_like(ids)
    special[:, 0] = special[:, -1] = 1
    return step(s.model, s.opt, ids, special)


@habit(id="hf_mlm_masking_in_step",
       source="huggingface/transformers data/data_collator.py DataCollatorForLanguageModeling."
              "torch_mask_tokens (bernoulli masks, 80/10/10), moved into the step as on-device "
              "masking; BertForMaskedLM",
       what="torch.bernoulli / torch.randint masks and boolean-mask assignment "
            "(inputs[mask] = random_words[mask]) whose number of elements changes every call",
       expect=EQUAL, rule=TORCH_RNG, setup=_mlm_setup, call=_mlm_call)
def mlm_step(model, optimizer, input_ids, special_tokens_mask):
    inputs, labels = torch_mask_tokens(input_ids.clone(), special_tokens_mask)
    loss = model(input_ids=inputs, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@seeded
def _vitmae_setup():
    transformers = _quiet_transformers()
    model = transformers.ViTMAEForPreTraining(transformers.ViTMAEConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=64, decoder_hidden_size=32,
        decoder_num_hidden_layers=1, decoder_num_attention_heads=2,
        decoder_intermediate_size=64, mask_ratio=0.5))
    return SimpleNamespace(model=model, opt=torch.optim.AdamW(model.parameters(), lr=1e-3,
                                                              betas=(0.9, 0.95)))


@habit(id="hf_vit_mae_random_masking",
       source="huggingface/transformers models/vit_mae/modeling_vit_mae.py "
              "ViTMAEEmbeddings.random_masking (noise = torch.rand, argsort, gather), as "
              "facebookresearch/mae models_mae.py; examples/pytorch/image-pretraining/run_mae.py",
       what="per-sample random patch masking from torch.rand + argsort inside the model",
       expect=EQUAL, rule=TORCH_RNG, setup=_vitmae_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, d.img(4)))
def vitmae_step(model, optimizer, pixel_values):
    outputs = model(pixel_values=pixel_values)
    loss = outputs.loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@seeded
def _clm_no_trainer_setup():
    import transformers
    model = tiny_gpt2()
    no_decay = ["bias", "layer_norm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(optimizer_grouped_parameters, lr=1e-3)
    sched = transformers.get_scheduler(name="cosine", optimizer=opt, num_warmup_steps=1,
                                       num_training_steps=10)
    return SimpleNamespace(model=model, opt=opt, lr_scheduler=sched)


@habit(id="hf_run_clm_no_trainer_step",
       source="huggingface/transformers examples/pytorch/language-modeling/run_clm_no_trainer.py: "
              "outputs = model(**batch); accelerator.backward(loss); optimizer.step(); "
              "lr_scheduler.step(); optimizer.zero_grad(); no_decay groups; get_scheduler",
       what="a BatchEncoding batch unpacked into the model, weight-decay groups, "
            "transformers' cosine schedule (a LambdaLR) stepped inside the step",
       expect=EQUAL, rule=INPUTS, setup=_clm_no_trainer_setup, ranks=True,
       call=lambda step, s, i, d: step(s.model, s.opt, s.lr_scheduler,
                                       _quiet_transformers().BatchEncoding(_lm_batch(d))))
def clm_no_trainer_step(model, optimizer, lr_scheduler, batch):
    outputs = model(**batch)
    loss = outputs.loss
    loss.backward()
    optimizer.step()
    lr_scheduler.step()
    optimizer.zero_grad()
    return loss


@habit(id="hf_trainer_num_items_in_batch_accumulation",
       source="huggingface/transformers src/transformers/trainer.py get_batch_samples: "
              "num_items_in_batch = sum((batch['labels'].ne(-100)).sum() ...); "
              "model(**inputs, num_items_in_batch=...) (loss summed then divided), one "
              "backward per micro-batch, clip, step",
       what="gradient accumulation over a list of micro-batches in one step with the loss "
            "normalised by a token count computed as a tensor",
       expect=EQUAL, rule=INPUTS, setup=_gpt2_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, [_lm_batch(d, pad=True),
                                                        _lm_batch(d, pad=True)]))
def num_items_step(model, optimizer, batch_samples):
    num_items_in_batch = sum([(batch["labels"].ne(-100)).sum() for batch in batch_samples])
    total = 0
    for inputs in batch_samples:
        loss = model(**inputs, num_items_in_batch=num_items_in_batch).loss
        loss.backward()
        total = total + loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    model.zero_grad()
    return total, grad_norm


# ================================================================= nanoGPT
# karpathy/nanoGPT model.py (CausalSelfAttention with F.scaled_dot_product_attention,
# tied embeddings, configure_optimizers) and train.py (get_lr, the micro-step loop).

class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout, self.resid_dropout = nn.Dropout(dropout), nn.Dropout(dropout)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class NanoBlock(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.1):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(dropout),
            h=nn.ModuleList([NanoBlock(n_embd, n_head, dropout) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [{'params': decay_params, 'weight_decay': weight_decay},
                        {'params': nodecay_params, 'weight_decay': 0.0}]
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)


def get_lr(it, learning_rate=6e-4, warmup_iters=2, lr_decay_iters=6, min_lr=6e-5):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


# train.py's module-level settings, read by the loop as globals
gradient_accumulation_steps = 2
grad_clip = 1.0
ctx = torch.amp.autocast(device_type='cpu', dtype=torch.bfloat16)


@seeded
def _nanogpt_setup():
    model = NanoGPT()
    opt = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95))
    scaler = torch.amp.GradScaler('cpu', enabled=False)   # enabled=(dtype == 'float16')
    return SimpleNamespace(model=model, opt=opt, scaler=scaler)


def _nanogpt_between(s, i):
    lr = get_lr(i)
    for param_group in s.opt.param_groups:
        param_group['lr'] = lr


def _nanogpt_batches(d):
    out = []
    for _ in range(gradient_accumulation_steps):
        t = d.tok(4, 9)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


@habit(id="nanogpt_train_loop_micro_steps",
       source="karpathy/nanoGPT train.py: lr = get_lr(iter_num) set on every param group; "
              "for micro_step in range(gradient_accumulation_steps): model."
              "require_backward_grad_sync = (...); with ctx: logits, loss = model(X, Y); "
              "loss = loss / gradient_accumulation_steps; scaler.scale(loss).backward(); "
              "then unscale_, clip_grad_norm_, scaler.step, scaler.update, "
              "zero_grad(set_to_none=True)",
       what="micro-batches with the DDP sync flag set on the model, module-level globals "
            "(accumulation steps, grad_clip, an autocast object reused every call), a disabled "
            "GradScaler, AdamW decay/no-decay groups, tied embeddings, sdpa dropout",
       expect=EQUAL, rule=GUARD, setup=_nanogpt_setup, between=_nanogpt_between, ranks=True,
       call=lambda step, s, i, d: step(s.model, s.opt, s.scaler, _nanogpt_batches(d)))
def nanogpt_step(model, optimizer, scaler, batches):
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        X, Y = batches[micro_step]
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss


@seeded
def _build_nanogpt_setup():
    model = NanoGPT()
    log_dir = tempfile.mkdtemp(prefix="habit-log-")
    log_file = pathlib.Path(log_dir) / "log.txt"
    with open(log_file, "w") as f:   # open for writing to clear the file
        pass
    return SimpleNamespace(model=model, opt=model.configure_optimizers(0.1, 6e-4, (0.9, 0.95)),
                           log_file=log_file)


@habit(id="build_nanogpt_log_file_append",
       source="karpathy/build-nanogpt train_gpt2.py: loss_accum += loss.detach() over the "
              "micro-steps (require_backward_grad_sync on the last); norm = clip_grad_norm_(...); print(f\"step {step:5d} | loss: "
              "{loss_accum.item():.6f} | ...\"); with open(log_file, \"a\") as f: "
              "f.write(f\"{step} train {loss_accum.item():.6f}\\n\") on the master process",
       what="each step opens the log file to append a line with the step and its loss, and "
            "prints the loss, lr and gradient norm",
       expect=EQUAL, rule=RETURNED, setup=_build_nanogpt_setup, between=_nanogpt_between,
       ranks=True,
       call=lambda step, s, i, d: step(s.model, s.opt, _nanogpt_batches(d), i, s.log_file))
def build_nanogpt_step(model, optimizer, batches, step, log_file):
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    optimizer.zero_grad()
    loss_accum = 0.0
    for micro_step, (x, y) in enumerate(batches):
        if ddp:
            model.require_backward_grad_sync = (micro_step == len(batches) - 1)
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            logits, loss = model(x, y)
        loss = loss / len(batches)
        loss_accum += loss.detach()
        loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    lr = optimizer.param_groups[0]["lr"]
    print(f"step {step:5d} | loss: {loss_accum.item():.6f} | lr {lr:.4e} | norm: {norm:.4f}")
    with open(log_file, "a") as f:
        f.write(f"{step} train {loss_accum.item():.6f}\n")
    return loss_accum


@seeded
def _nanogpt_plain_setup():
    model = NanoGPT()
    return SimpleNamespace(model=model, opt=torch.optim.AdamW(model.parameters(), lr=1e-3))


@habit(id="nanogpt_sdpa_dropout_tied_weights",
       source="karpathy/nanoGPT model.py CausalSelfAttention.forward: F.scaled_dot_product_"
              "attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True); "
              "self.transformer.wte.weight = self.lm_head.weight",
       what="attention dropout drawn inside the fused sdpa kernel, tied input/output embedding",
       expect=EQUAL, rule=TORCH_RNG, setup=_nanogpt_plain_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, *_nanogpt_batches(d)[0]))
def nanogpt_plain_step(model, optimizer, X, Y):
    logits, loss = model(X, Y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def get_batch(data, block_size=8, batch_size=4):
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i:i + block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + block_size]).astype(np.int64)) for i in ix])
    return x, y


@seeded
def _get_batch_setup():
    s = _nanogpt_plain_setup.__wrapped__()
    s.train_data = np.random.randint(0, 64, size=256).astype(np.uint16)   # the np.memmap
    return s


@habit(id="nanogpt_get_batch_inside_step",
       source="karpathy/nanoGPT train.py get_batch(split): ix = torch.randint(len(data) - "
              "block_size, (batch_size,)); torch.from_numpy(data[i:i+block_size]) from a "
              "np.memmap; called inside the micro-step loop (X, Y = get_batch('train'))",
       what="the step samples its own batch: torch RNG offsets index a numpy array on the host",
       expect=REFUSED, rule=PATH, setup=_get_batch_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, s.train_data))
def nanogpt_get_batch_step(model, optimizer, train_data):
    X, Y = get_batch(train_data)
    logits, loss = model(X, Y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


# ================================================================= fairseq
# facebookresearch/fairseq: fairseq/trainer.py train_step, fairseq/tasks/
# fairseq_task.py train_step, criterions/label_smoothed_cross_entropy.py,
# modules/layer_drop.py, models/transformer (LayerDrop), modules/
# gumbel_vector_quantizer.py, fairseq/utils.py clip_grad_norm_.

class LayerDropEncoder(nn.Module):
    """fairseq/models/transformer.py TransformerEncoder.forward (fairseq 0.9):
    dropout_probability = random.uniform(0, 1); if not self.training or
    (dropout_probability > self.encoder_layerdrop): x = layer(x)"""

    def __init__(self, encoder_layerdrop=0.2):
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.layers = nn.ModuleList([ResBlock(16, 0.0) for _ in range(3)])
        self.encoder_layerdrop = encoder_layerdrop
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            dropout_probability = random.uniform(0, 1)
            if not self.training or (dropout_probability > self.encoder_layerdrop):
                x = layer(x)
        return self.head(x)


class LayerDropModuleList(nn.ModuleList):
    """fairseq/modules/layer_drop.py"""

    def __init__(self, p, modules=None):
        super().__init__(modules)
        self.p = p

    def __iter__(self):
        dropout_probs = torch.empty(len(self)).uniform_()
        for i, m in enumerate(super().__iter__()):
            if not self.training or (dropout_probs[i] > self.p):
                yield m


class LayerDropListEncoder(LayerDropEncoder):
    def __init__(self):
        super().__init__()
        self.layers = LayerDropModuleList(p=0.2, modules=[ResBlock(16, 0.0) for _ in range(3)])

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _model_setup(make, opt=lambda p: torch.optim.Adam(p, lr=1e-3)):
    @seeded
    def build():
        model = make()
        return SimpleNamespace(model=model, opt=opt(model.parameters()))
    return build


habit(id="fairseq_layerdrop_random_uniform",
      source="facebookresearch/fairseq fairseq/models/transformer.py TransformerEncoder.forward "
             "(v0.9): dropout_probability = random.uniform(0, 1); if not self.training or "
             "(dropout_probability > self.encoder_layerdrop): x = layer(x)",
      what="LayerDrop: Python's random decides per layer and per call whether it runs (a "
           "program per set of layers run)",
      expect=EQUAL, rule=HOST_RNG, setup=_model_setup(LayerDropEncoder), call=xy)(plain_step)

habit(id="fairseq_layerdrop_module_list",
      source="facebookresearch/fairseq fairseq/modules/layer_drop.py LayerDropModuleList.__iter__: "
             "dropout_probs = torch.empty(len(self)).uniform_(); if not self.training or "
             "(dropout_probs[i] > self.p): yield m",
      what="LayerDrop from torch's generator: a Python decision on a fresh random tensor, "
           "per layer and call",
      expect=EQUAL, rule=DECISION, calls=6,
      setup=_model_setup(LayerDropListEncoder), call=xy)(plain_step)


class GumbelVectorQuantizer(nn.Module):
    """fairseq/modules/gumbel_vector_quantizer.py, one group: its temperature
    is annealed by set_num_updates and read by gumbel_softmax in forward."""

    def __init__(self, dim=16, num_vars=8, temp=(2.0, 0.5, 0.9)):
        super().__init__()
        self.num_vars = num_vars
        self.vars = nn.Parameter(torch.FloatTensor(1, num_vars, dim))
        nn.init.uniform_(self.vars)
        self.weight_proj = nn.Linear(dim, num_vars)
        self.max_temp, self.min_temp, self.temp_decay = temp
        self.curr_temp = self.max_temp

    def set_num_updates(self, num_updates):
        self.curr_temp = max(self.max_temp * self.temp_decay ** num_updates, self.min_temp)

    def forward(self, x):
        x = self.weight_proj(x)
        if self.training:
            x = F.gumbel_softmax(x.float(), tau=self.curr_temp, hard=True).type_as(x)
        else:
            _, k = x.max(-1)
            x = x.new_zeros(*x.shape).scatter_(-1, k.view(-1, 1), 1.0)
        return (x.unsqueeze(-1) * self.vars).sum(1)


class QuantizerModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(16, 16)
        self.quantizer = GumbelVectorQuantizer()
        self.head = nn.Linear(16, 4)

    def set_num_updates(self, num_updates):
        """fairseq/models/fairseq_model.py BaseFairseqModel.set_num_updates"""
        for m in self.modules():
            if hasattr(m, "set_num_updates") and m != self:
                m.set_num_updates(num_updates)

    def forward(self, x):
        return self.head(self.quantizer(self.encoder(x)))


habit(id="fairseq_set_num_updates_gumbel_temperature",
      source="facebookresearch/fairseq fairseq/trainer.py set_num_updates -> model."
             "set_num_updates(num_updates) -> GumbelVectorQuantizer.set_num_updates "
             "(curr_temp = max(max_temp * temp_decay**num_updates, min_temp)); wav2vec 2.0",
      what="a float attribute of a submodule annealed between calls and read as "
           "gumbel_softmax's tau (torch RNG) in forward",
      expect=EQUAL, rule=GUARD, setup=_model_setup(QuantizerModel), call=xy,
      between=lambda s, i: s.model.set_num_updates(i * 3))(plain_step)


class TinySeq2Seq(nn.Module):
    def __init__(self, vocab=24, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=1)
        self.proj = nn.Linear(dim, vocab)

    def forward(self, src_tokens, src_lengths=None):
        return (self.proj(torch.tanh(self.embed(src_tokens))), None)

    def get_normalized_probs(self, net_output, log_probs):
        return F.log_softmax(net_output[0], dim=-1) if log_probs else F.softmax(net_output[0], -1)


def label_smoothed_nll_loss(lprobs, target, epsilon, ignore_index=None, reduce=True):
    if target.dim() == lprobs.dim() - 1:
        target = target.unsqueeze(-1)
    nll_loss = -lprobs.gather(dim=-1, index=target)
    smooth_loss = -lprobs.sum(dim=-1, keepdim=True)
    if ignore_index is not None:
        pad_mask = target.eq(ignore_index)
        nll_loss.masked_fill_(pad_mask, 0.0)
        smooth_loss.masked_fill_(pad_mask, 0.0)
    else:
        nll_loss = nll_loss.squeeze(-1)
        smooth_loss = smooth_loss.squeeze(-1)
    if reduce:
        nll_loss = nll_loss.sum()
        smooth_loss = smooth_loss.sum()
    eps_i = epsilon / (lprobs.size(-1) - 1)
    loss = (1.0 - epsilon - eps_i) * nll_loss + eps_i * smooth_loss
    return loss, nll_loss


class LabelSmoothedCrossEntropyCriterion(nn.Module):
    def __init__(self, sentence_avg=False, label_smoothing=0.1, padding_idx=1):
        super().__init__()
        self.sentence_avg, self.eps, self.padding_idx = sentence_avg, label_smoothing, padding_idx

    def forward(self, model, sample, reduce=True):
        net_output = model(**sample["net_input"])
        # fairseq's DistributedFairseqModel forwards attributes to the module
        lprobs = unwrap(model).get_normalized_probs(net_output, log_probs=True)
        lprobs, target = lprobs.view(-1, lprobs.size(-1)), sample["target"].view(-1)
        loss, nll_loss = label_smoothed_nll_loss(lprobs, target, self.eps,
                                                 ignore_index=self.padding_idx, reduce=reduce)
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        logging_output = {"loss": loss.data, "nll_loss": nll_loss.data,
                          "ntokens": sample["ntokens"], "sample_size": sample_size}
        return loss, sample_size, logging_output


def fairseq_clip_grad_norm_(params, max_norm):
    """fairseq/utils.py clip_grad_norm_"""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if len(grads) == 1:
        total_norm = torch.norm(grads[0], p=2, dtype=torch.float32)
    else:
        total_norm = torch.norm(torch.stack([torch.norm(g, p=2, dtype=torch.float32)
                                             for g in grads]))
    if max_norm > 0:
        clip_coef = (max_norm / (total_norm + 1e-6)).clamp_(max=1)
        torch._foreach_mul_(grads, clip_coef)
    return total_norm


def _sample(d, n=4, t=6):
    tokens = d.tok(n, t, 24)
    target = torch.roll(tokens, 1, dims=1)
    lengths = torch.randint(3, t + 1, (n,), generator=d.g)
    pad = torch.arange(t)[None, :] >= lengths[:, None]
    target = target.masked_fill(pad, 1)
    return {"net_input": {"src_tokens": tokens, "src_lengths": lengths}, "target": target,
            "ntokens": int((~pad).sum())}


@seeded
def _fairseq_setup():
    model = TinySeq2Seq()
    return SimpleNamespace(model=model, criterion=LabelSmoothedCrossEntropyCriterion(),
                           opt=torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98)))


def _world():
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@habit(id="fairseq_sample_size_multiply_grads",
       source="facebookresearch/fairseq fairseq/trainer.py train_step: loss, sample_size_i, "
              "logging_output = task.train_step(...); optimizer.multiply_grads(numer / "
              "(sample_size or 1.0)); grad_norm = clip_grad_norm(clip_norm); optimizer.step(); "
              "criterions/label_smoothed_cross_entropy.py (sample_size = sample['ntokens'])",
       what="a nested sample dict whose 'ntokens' is a Python int that changes every batch; "
            "gradients multiplied by 1/ntokens on the host number; fairseq's own clip",
       expect=EQUAL, rule=INPUTS, setup=_fairseq_setup,
       call=lambda step, s, i, d: step([_sample(d)], s.model, s.criterion, s.opt))
def fairseq_train_step(samples, model, criterion, optimizer, clip_norm=0.1):
    model.train()
    optimizer.zero_grad()
    sample_size, losses = 0, []
    for i, sample in enumerate(samples):
        def maybe_no_sync():
            if _world() > 1 and hasattr(model, "no_sync") and i < len(samples) - 1:
                return model.no_sync()
            return contextlib.ExitStack()

        with maybe_no_sync():
            loss, sample_size_i, logging_output = criterion(model, sample)
            loss.backward()
        sample_size += sample_size_i
        losses.append(logging_output["loss"])
    numer = _world()
    for p in model.parameters():     # FairseqOptimizer.multiply_grads
        if p.grad is not None:
            p.grad.data.mul_(numer / (sample_size or 1.0))
    grad_norm = fairseq_clip_grad_norm_(list(model.parameters()), clip_norm)
    optimizer.step()
    return torch.stack(losses), grad_norm


habit(id="fairseq_update_freq_no_sync",
      source="facebookresearch/fairseq fairseq/trainer.py train_step: for i, sample in "
             "enumerate(samples): maybe_no_sync() (model.no_sync() for all but the last), "
             "--update-freq accumulation, sample sizes summed on the host",
      what="accumulation over a list of samples with DDP's no_sync on all but the last, "
           "the summed host int normalising the gradients",
      expect=EQUAL, rule=INPUTS, setup=_fairseq_setup, ranks=True,
      call=lambda step, s, i, d: step([_sample(d), _sample(d), _sample(d)], s.model,
                                      s.criterion, s.opt))(fairseq_train_step)


@habit(id="fairseq_grad_norm_isfinite_raise",
       source="facebookresearch/fairseq fairseq/trainer.py train_step: grad_norm = "
              "self.clip_grad_norm(...); if not torch.isfinite(grad_norm).all(): raise "
              "FloatingPointError('gradients are Nan/Inf')",
       what="a Python decision on the gradient norm's value after clipping",
       expect=EQUAL, rule=DECISION, setup=_fairseq_setup,
       call=lambda step, s, i, d: step([_sample(d)], s.model, s.criterion, s.opt))
def fairseq_isfinite_step(samples, model, criterion, optimizer):
    model.train()
    optimizer.zero_grad()
    loss, sample_size, logging_output = criterion(model, samples[0])
    loss.backward()
    grad_norm = fairseq_clip_grad_norm_(list(model.parameters()), 0.1)
    if not torch.isfinite(grad_norm).all():
        raise FloatingPointError("gradients are Nan/Inf")
    optimizer.step()
    return loss


@habit(id="fairseq_set_seed_per_update",
       source="facebookresearch/fairseq fairseq/trainer.py (v0.9) train_step: self._set_seed(): "
              "seed = self.args.seed + self.get_num_updates(); torch.manual_seed(seed)",
       what="torch.manual_seed inside the step from a host int that changes every call, then "
            "dropout draws from the reseeded generator",
       expect=EQUAL, rule=TORCH_RNG, setup=mlp_dropout_sgd,
       call=lambda step, s, i, d: step(s.model, s.opt, d.vec(), d.cls(), 1, i))
def fairseq_seed_step(model, optimizer, x, y, seed, num_updates):
    torch.manual_seed(seed + num_updates)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


# ================================================================= ultralytics (YOLO)
# ultralytics/ultralytics: engine/trainer.py _do_train (warmup with np.interp,
# accumulate, optimizer_step, multi-scale), models/yolo/detect/train.py
# preprocess_batch, nn/tasks.py BaseModel.loss (lazy criterion), utils/torch_utils.py ModelEMA.

class YoloLoss:
    """The shape of ultralytics' v8DetectionLoss: a plain object made on the
    first call, holding the hyperparameters and tensors (proj)."""

    def __init__(self, model):
        device = next(model.parameters()).device
        self.bce = nn.BCEWithLogitsLoss(reduction="none")
        self.hyp = model.args
        self.nc = model.nc
        self.reg_max = 4
        self.proj = torch.arange(self.reg_max, dtype=torch.float, device=device)
        self.python_max = getattr(model, "python_max", False)

    def __call__(self, preds, batch):
        loss = torch.zeros(3, device=preds.device)
        batch_size = preds.shape[0]
        pred_scores, pred_dist = preds.split((self.nc, 4 * self.reg_max), 1)
        target_scores = F.one_hot(batch["cls"], self.nc).float()
        if self.python_max:     # ultralytics/utils/loss.py: max(target_scores.sum(), 1)
            target_scores_sum = max(target_scores.sum(), 1)
        else:                   # the same written with a tensor op
            target_scores_sum = target_scores.sum().clamp(min=1)
        loss[1] = self.bce(pred_scores, target_scores).sum() / target_scores_sum
        boxes = pred_dist.view(batch_size, 4, self.reg_max).softmax(2).matmul(self.proj)
        loss[0] = F.l1_loss(boxes, batch["bboxes"] * (self.reg_max - 1))
        loss[2] = boxes.var(dim=1).mean()
        loss[0] *= self.hyp.box
        loss[1] *= self.hyp.cls
        loss[2] *= self.hyp.dfl
        return loss.sum() * batch_size, loss.detach()


class TinyYolo(nn.Module):
    def __init__(self, nc=4):
        super().__init__()
        self.nc = nc
        self.args = SimpleNamespace(box=7.5, cls=0.5, dfl=1.5)
        self.model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                                   nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                   nn.Linear(8, nc + 16))

    def forward(self, x, *args, **kwargs):
        if isinstance(x, dict):
            return self.loss(x, *args, **kwargs)
        return self.model(x)

    def init_criterion(self):
        return YoloLoss(self)

    def loss(self, batch, preds=None):
        if getattr(self, "criterion", None) is None:
            self.criterion = self.init_criterion()
        preds = self.forward(batch["img"]) if preds is None else preds
        return self.criterion(preds, batch)


def build_yolo_optimizer(model, lr=0.01, momentum=0.937, decay=5e-4):
    """engine/trainer.py build_optimizer (SGD): biases, norm weights, other weights."""
    g = [], [], []
    bn = tuple(v for k, v in nn.__dict__.items() if "Norm" in k)
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            fullname = f"{module_name}.{param_name}" if module_name else param_name
            if "bias" in fullname:
                g[2].append(param)
            elif isinstance(module, bn):
                g[1].append(param)
            else:
                g[0].append(param)
    optimizer = torch.optim.SGD(g[2], lr=lr, momentum=momentum, nesterov=True)
    optimizer.add_param_group({"params": g[0], "weight_decay": decay})
    optimizer.add_param_group({"params": g[1], "weight_decay": 0.0})
    return optimizer


def _yolo_setup(pre_init=True):
    @seeded
    def build():
        model = TinyYolo()
        if pre_init:
            model.criterion = model.init_criterion()
        opt = build_yolo_optimizer(model)
        lf = lambda x: max(1 - x / 10, 0) * (1.0 - 0.01) + 0.01   # noqa: E731
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=lf)
        return SimpleNamespace(model=model, opt=opt, scheduler=scheduler, lf=lf,
                               scaler=torch.amp.GradScaler("cpu"), epoch=0)
    return build


def _yolo_batch(d, n=4):
    return {"img": (d.uniform(n, 3, 8, 8) * 255).to(torch.uint8), "cls": d.cls(n),
            "bboxes": d.uniform(n, 4)}


def _yolo_warmup(s, i, nw=3, warmup_bias_lr=0.1, warmup_momentum=0.8, momentum=0.937):
    ni = i
    if ni <= nw:
        xi = [0, nw]
        for j, x in enumerate(s.opt.param_groups):
            x["lr"] = np.interp(ni, xi, [warmup_bias_lr if j == 0 else 0.0,
                                         x["initial_lr"] * s.lf(s.epoch)])
            if "momentum" in x:
                x["momentum"] = np.interp(ni, xi, [warmup_momentum, momentum])


def yolo_preprocess_batch(batch):
    batch["img"] = batch["img"].float() / 255
    return batch


@habit(id="yolo_warmup_np_interp_lr_momentum",
       source="ultralytics/ultralytics engine/trainer.py _do_train warmup: x['lr'] = np.interp(ni, "
              "xi, [warmup_bias_lr if j == 0 else 0.0, x['initial_lr'] * self.lf(epoch)]); "
              "x['momentum'] = np.interp(ni, xi, [warmup_momentum, momentum]); build_optimizer",
       what="lr and momentum of three SGD (nesterov) groups set between calls to numpy float64 "
            "values; the bias group's lr falls while the others rise",
       expect=EQUAL, rule=INPUTS, setup=_yolo_setup(), between=_yolo_warmup,
       call=lambda step, s, i, d: step(s.model, s.opt, s.scaler, _yolo_batch(d), True))
def yolo_step(model, optimizer, scaler, batch, do_optimizer_step):
    with torch.autocast("cpu", enabled=False):
        batch = yolo_preprocess_batch(batch)
        loss, loss_items = model(batch)
    scaler.scale(loss).backward()
    if do_optimizer_step:            # ni - last_opt_step >= self.accumulate
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return loss, loss_items


habit(id="yolo_lazy_criterion_and_batch_dict_write",
      source="ultralytics/ultralytics nn/tasks.py BaseModel.loss: if getattr(self, 'criterion', "
             "None) is None: self.criterion = self.init_criterion(); models/yolo/detect/train.py "
             "preprocess_batch: batch['img'] = batch['img'].to(device).float() / 255",
      what="the first call creates model.criterion (a plain object holding a tensor and the "
           "hyperparameters); the step writes the uint8->float image back into the batch dict",
      expect=EQUAL, rule=LAZY, setup=_yolo_setup(pre_init=False),
      call=lambda step, s, i, d: step(s.model, s.opt, s.scaler, _yolo_batch(d), True))(yolo_step)

habit(id="yolo_accumulate_optimizer_step_flag",
      source="ultralytics/ultralytics engine/trainer.py _do_train: self.accumulate = max(1, "
             "round(nbs / batch_size)); if ni - last_opt_step >= self.accumulate: "
             "self.optimizer_step() (unscale_, clip_grad_norm_(max_norm=10.0), scaler.step, "
             "update, zero_grad)",
      what="gradients accumulated over calls, the optimizer step taken on every second call "
           "(a bool from the loop's counter), GradScaler",
      expect=EQUAL, rule=GUARD, setup=_yolo_setup(), ranks=True,
       rank_gap="gradients accumulated across calls are reduced once, at the update, as under DDP's no_sync (the contract); DDP without no_sync averages them at every call, so .grad between updates differs",
      call=lambda step, s, i, d: step(s.model, s.opt, s.scaler, _yolo_batch(d),
                                      i % 2 == 1))(yolo_step)


class ModelEMA:
    """ultralytics/utils/torch_utils.py ModelEMA"""

    def __init__(self, model, decay=0.9999, tau=2000, updates=0):
        self.ema = copy.deepcopy(unwrap(model)).eval()
        self.updates = updates
        self.decay = lambda x: decay * (1 - math.exp(-x / tau))
        for p in self.ema.parameters():
            p.requires_grad_(False)
        self.enabled = True

    def update(self, model):
        if self.enabled:
            self.updates += 1
            d = self.decay(self.updates)
            msd = unwrap(model).state_dict()
            for k, v in self.ema.state_dict().items():
                if v.dtype.is_floating_point:
                    v *= d
                    v += (1 - d) * msd[k].detach()


@seeded
def _yolo_ema_setup():
    s = _yolo_setup().__wrapped__()
    s.ema = ModelEMA(s.model)
    return s


@habit(id="yolo_model_ema_update_in_optimizer_step",
       source="ultralytics/ultralytics engine/trainer.py optimizer_step: ... if self.ema: "
              "self.ema.update(self.model); utils/torch_utils.py ModelEMA.update "
              "(self.updates += 1; d = self.decay(self.updates))",
       what="the EMA's host counter is incremented inside the step and decides its decay "
            "through math.exp: the counter is lifted, the decay computed on the host before "
            "each run",
       expect=EQUAL, rule=HOST_NUMBERS, setup=_yolo_ema_setup, ranks=True,
       call=lambda step, s, i, d: step(s.model, s.opt, s.scaler, _yolo_batch(d), s.ema))
def yolo_ema_step(model, optimizer, scaler, batch, ema):
    batch = yolo_preprocess_batch(batch)
    loss, loss_items = model(batch)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    if ema:
        ema.update(model)
    return loss


@habit(id="yolo_multi_scale_random_size",
       source="ultralytics/ultralytics models/yolo/detect/train.py preprocess_batch: "
              "if self.args.multi_scale: sz = random.randrange(int(imgsz * 0.5), int(imgsz * 1.5 "
              "+ stride)) // stride * stride; ... imgs = nn.functional.interpolate(imgs, size=ns)",
       what="Python's random picks the input resolution every call (a shape): the drawn "
            "integer taken as a constant, a program per value drawn",
       expect=EQUAL, rule=HOST_RNG, setup=_yolo_setup(),
       call=lambda step, s, i, d: step(s.model, s.opt, s.scaler, _yolo_batch(d)))
def yolo_multiscale_step(model, optimizer, scaler, batch, imgsz=8, stride=4):
    batch = yolo_preprocess_batch(batch)
    imgs = batch["img"]
    sz = random.randrange(int(imgsz * 0.5), int(imgsz * 1.5 + stride)) // stride * stride
    sf = sz / max(imgs.shape[2:])
    if sf != 1:
        ns = [math.ceil(x * sf / stride) * stride for x in imgs.shape[2:]]
        imgs = nn.functional.interpolate(imgs, size=ns, mode="bilinear", align_corners=False)
    batch["img"] = imgs
    loss, loss_items = model(batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss


@seeded
def _yolo_python_max_setup():
    s = _yolo_setup(pre_init=False).__wrapped__()
    s.model.python_max = True
    return s


habit(id="yolo_v8_loss_python_max",
      source="ultralytics/ultralytics utils/loss.py v8DetectionLoss.__call__: "
             "target_scores_sum = max(target_scores.sum(), 1)",
      what="Python's max() between a tensor and an int inside the loss: a comparison of a "
           "tensor's value (the other YOLO habits write it as .clamp(min=1))",
      expect=EQUAL, rule=DECISION, setup=_yolo_python_max_setup,
      call=lambda step, s, i, d: step(s.model, s.opt, s.scaler, _yolo_batch(d), True))(yolo_step)


# ================================================================= self-supervised: MoCo, DINO, BYOL, SimCLR, SwAV, Barlow Twins

def concat_all_gather(tensor):
    """moco/builder.py concat_all_gather (identity on one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    tensors_gather = [torch.ones_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(tensors_gather, tensor, async_op=False)
    return torch.cat(tensors_gather, dim=0)


def _mlp_encoder(num_classes=8):
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, num_classes))


class MoCo(nn.Module):
    """facebookresearch/moco moco/builder.py"""

    def __init__(self, base_encoder, dim=8, K=16, m=0.999, T=0.07):
        super().__init__()
        self.K, self.m, self.T = K, m, T
        self.encoder_q = base_encoder(num_classes=dim)
        self.encoder_k = base_encoder(num_classes=dim)
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data.copy_(param_q.data)
            param_k.requires_grad = False
        self.register_buffer("queue", torch.randn(dim, K))
        self.queue = nn.functional.normalize(self.queue, dim=0)
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self):
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data = param_k.data * self.m + param_q.data * (1. - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys):
        keys = concat_all_gather(keys)
        batch_size = keys.shape[0]
        ptr = int(self.queue_ptr)
        assert self.K % batch_size == 0
        self.queue[:, ptr:ptr + batch_size] = keys.T
        ptr = (ptr + batch_size) % self.K
        self.queue_ptr[0] = ptr

    def forward(self, im_q, im_k):
        q = nn.functional.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            self._momentum_update_key_encoder()
            k = nn.functional.normalize(self.encoder_k(im_k), dim=1)
        l_pos = torch.einsum('nc,nc->n', [q, k]).unsqueeze(-1)
        l_neg = torch.einsum('nc,ck->nk', [q, self.queue.clone().detach()])
        logits = torch.cat([l_pos, l_neg], dim=1)
        logits /= self.T
        labels = torch.zeros(logits.shape[0], dtype=torch.long)
        self._dequeue_and_enqueue(k)
        return logits, labels


@seeded
def _moco_setup():
    model = MoCo(_mlp_encoder)
    return SimpleNamespace(model=model, criterion=nn.CrossEntropyLoss(),
                           opt=torch.optim.SGD(model.parameters(), 0.03, momentum=0.9,
                                               weight_decay=1e-4))


@habit(id="moco_v2_queue_and_key_encoder",
       source="facebookresearch/moco moco/builder.py MoCo.forward: _momentum_update_key_encoder "
              "(param_k.data = param_k.data * m + param_q.data * (1 - m)); _dequeue_and_enqueue: "
              "ptr = int(self.queue_ptr); self.queue[:, ptr:ptr + batch_size] = keys.T",
       what="a queue buffer written at an offset read from another buffer with int() (a slice "
            "bound from a tensor's value), a key encoder updated by replacing .data",
       expect=EQUAL, rule=DECISION, setup=_moco_setup, ranks=True,
       call=lambda step, s, i, d: step(s.model, s.criterion, s.opt, [d.vec(), d.vec()]))
def moco_step(model, criterion, optimizer, images):
    output, target = model(im_q=images[0], im_k=images[1])
    loss = criterion(output, target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


class MoCoV3(nn.Module):
    """facebookresearch/moco-v3 moco/builder.py (MoCo with a predictor, momentum as an argument)."""

    def __init__(self, base_encoder, dim=8, mlp_dim=16, T=1.0):
        super().__init__()
        self.T = T
        self.base_encoder = base_encoder(num_classes=dim)
        self.momentum_encoder = base_encoder(num_classes=dim)
        self.predictor = nn.Sequential(nn.Linear(dim, mlp_dim), nn.BatchNorm1d(mlp_dim), nn.ReLU(),
                                       nn.Linear(mlp_dim, dim))
        for param_b, param_m in zip(self.base_encoder.parameters(), self.momentum_encoder.parameters()):
            param_m.data.copy_(param_b.data)
            param_m.requires_grad = False

    @torch.no_grad()
    def _update_momentum_encoder(self, m):
        for param_b, param_m in zip(self.base_encoder.parameters(), self.momentum_encoder.parameters()):
            param_m.data = param_m.data * m + param_b.data * (1. - m)

    def contrastive_loss(self, q, k):
        q = nn.functional.normalize(q, dim=1)
        k = nn.functional.normalize(k, dim=1)
        k = concat_all_gather(k)
        logits = torch.einsum('nc,mc->nm', [q, k]) / self.T
        N = logits.shape[0]
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        labels = (torch.arange(N, dtype=torch.long) + N * rank)
        return nn.CrossEntropyLoss()(logits, labels) * (2 * self.T)

    def forward(self, x1, x2, m):
        q1 = self.predictor(self.base_encoder(x1))
        q2 = self.predictor(self.base_encoder(x2))
        with torch.no_grad():
            self._update_momentum_encoder(m)
            k1 = self.momentum_encoder(x1)
            k2 = self.momentum_encoder(x2)
        return self.contrastive_loss(q1, k2) + self.contrastive_loss(q2, k1)


@seeded
def _mocov3_setup():
    import argparse
    model = MoCoV3(_mlp_encoder)
    return SimpleNamespace(model=model, opt=torch.optim.AdamW(model.parameters(), lr=1.5e-4,
                                                              weight_decay=0.1),
                           scaler=torch.amp.GradScaler("cpu"),
                           args=argparse.Namespace(lr=1.5e-4, warmup_epochs=1, epochs=4,
                                                   moco_m=0.99, moco_m_cos=True))


def _mocov3_adjust(s, i):
    """main_moco.py adjust_learning_rate(optimizer, epoch + i / iters_per_epoch, args)"""
    epoch, args = i / 2, s.args
    if epoch < args.warmup_epochs:
        lr = args.lr * epoch / args.warmup_epochs
    else:
        lr = args.lr * 0.5 * (1. + math.cos(math.pi * (epoch - args.warmup_epochs)
                                            / (args.epochs - args.warmup_epochs)))
    for param_group in s.opt.param_groups:
        param_group['lr'] = lr


def _mocov3_call(step, s, i, d):
    epoch = i / 2      # adjust_moco_momentum(epoch + i / iters_per_epoch, args)
    moco_m = 1. - 0.5 * (1. + math.cos(math.pi * epoch / s.args.epochs)) * (1. - s.args.moco_m)
    return step(s.model, s.opt, s.scaler, [d.vec(), d.vec()], moco_m)


@habit(id="moco_v3_momentum_argument_amp",
       source="facebookresearch/moco-v3 main_moco.py train(): adjust_learning_rate(...); "
              "moco_m = adjust_moco_momentum(epoch + i / iters_per_epoch, args); with autocast: "
              "loss = model(images[0], images[1], moco_m); scaler.scale(loss).backward(); "
              "moco/builder.py _update_momentum_encoder(m)",
       what="the momentum of the key encoder is a float argument that changes every call, "
            "the lr set between calls; GradScaler",
       expect=EQUAL, rule=INPUTS, setup=_mocov3_setup, between=_mocov3_adjust, call=_mocov3_call)
def mocov3_step(model, optimizer, scaler, images, moco_m):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(images[0], images[1], moco_m)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss


class PatchBackbone(nn.Module):
    """A ViT-like backbone that accepts crops of any size (patch embed + mean)."""

    def __init__(self, dim=16):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, 4, stride=4)
        self.norm = nn.LayerNorm(dim)
        self.fc, self.head = nn.Identity(), nn.Identity()

    def forward(self, x):
        return self.norm(self.patch_embed(x).flatten(2).transpose(1, 2)).mean(1)


class DINOHead(nn.Module):
    def __init__(self, in_dim=16, out_dim=32, hidden_dim=32, bottleneck_dim=8, norm_last_layer=True):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.GELU(),
                                 nn.Linear(hidden_dim, bottleneck_dim))
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        if norm_last_layer:
            self.last_layer.weight_g.requires_grad = False

    def forward(self, x):
        x = self.mlp(x)
        x = nn.functional.normalize(x, dim=-1, p=2)
        return self.last_layer(x)


class MultiCropWrapper(nn.Module):
    """facebookresearch/dino utils.py MultiCropWrapper"""

    def __init__(self, backbone, head):
        super().__init__()
        backbone.fc, backbone.head = nn.Identity(), nn.Identity()
        self.backbone, self.head = backbone, head

    def forward(self, x):
        if not isinstance(x, list):
            x = [x]
        idx_crops = torch.cumsum(torch.unique_consecutive(
            torch.tensor([inp.shape[-1] for inp in x]), return_counts=True)[1], 0)
        start_idx, output = 0, torch.empty(0).to(x[0].device)
        for end_idx in idx_crops:
            _out = self.backbone(torch.cat(x[start_idx: end_idx]))
            if isinstance(_out, tuple):
                _out = _out[0]
            output = torch.cat((output, _out))
            start_idx = end_idx
        return self.head(output)


class DINOLoss(nn.Module):
    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp,
                 warmup_teacher_temp_epochs, nepochs, student_temp=0.1, center_momentum=0.9):
        super().__init__()
        self.student_temp, self.center_momentum, self.ncrops = student_temp, center_momentum, ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.teacher_temp_schedule = np.concatenate((
            np.linspace(warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs),
            np.ones(nepochs - warmup_teacher_temp_epochs) * teacher_temp))

    def forward(self, student_output, teacher_output, epoch):
        student_out = student_output / self.student_temp
        student_out = student_out.chunk(self.ncrops)
        temp = self.teacher_temp_schedule[epoch]
        teacher_out = F.softmax((teacher_output - self.center) / temp, dim=-1)
        teacher_out = teacher_out.detach().chunk(2)
        total_loss, n_loss_terms = 0, 0
        for iq, q in enumerate(teacher_out):
            for v in range(len(student_out)):
                if v == iq:
                    continue
                loss = torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1)
                total_loss += loss.mean()
                n_loss_terms += 1
        total_loss /= n_loss_terms
        self.update_center(teacher_output)
        return total_loss

    @torch.no_grad()
    def update_center(self, teacher_output):
        batch_center = torch.sum(teacher_output, dim=0, keepdim=True)
        world = 1
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(batch_center)
            world = dist.get_world_size()
        batch_center = batch_center / (len(teacher_output) * world)
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)


def clip_gradients(model, clip):
    norms = []
    for name, p in model.named_parameters():
        if p.grad is not None:
            param_norm = p.grad.data.norm(2)
            norms.append(param_norm.item())
            clip_coef = clip / (param_norm + 1e-6)
            if clip_coef < 1:
                p.grad.data.mul_(clip_coef)
    return norms


def cancel_gradients_last_layer(epoch, model, freeze_last_layer):
    if epoch >= freeze_last_layer:
        return
    for n, p in model.named_parameters():
        if "last_layer" in n:
            p.grad = None


def get_params_groups(model):
    regularized, not_regularized = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if name.endswith(".bias") or len(param.shape) == 1:
            not_regularized.append(param)
        else:
            regularized.append(param)
    return [{'params': regularized}, {'params': not_regularized, 'weight_decay': 0.}]


def _dino_setup(clip_grad=0.0):
    @seeded
    def build():
        import argparse
        student = MultiCropWrapper(PatchBackbone(), DINOHead())
        teacher = MultiCropWrapper(PatchBackbone(), DINOHead())
        teacher.load_state_dict(student.state_dict())
        for p in teacher.parameters():
            p.requires_grad = False
        n = 8
        return SimpleNamespace(
            student=student, teacher=teacher,
            dino_loss=DINOLoss(32, 4, 0.04, 0.07, 2, 4),
            opt=torch.optim.AdamW(get_params_groups(student)),
            lr_schedule=np.linspace(5e-4, 1e-4, n), wd_schedule=np.linspace(0.04, 0.4, n),
            momentum_schedule=np.linspace(0.996, 1.0, n),
            args=argparse.Namespace(clip_grad=clip_grad, freeze_last_layer=1))
    return build


def _dino_between(s, i):
    it = i
    for j, param_group in enumerate(s.opt.param_groups):
        param_group["lr"] = s.lr_schedule[it]
        if j == 0:
            param_group["weight_decay"] = s.wd_schedule[it]


def _dino_crops(d):
    return [d.img(4), d.img(4), d.img(4, 3, 4, 4), d.img(4, 3, 4, 4)]


def _dino_ddp(s):
    s.student = nn.parallel.DistributedDataParallel(s.student)


def _dino_call(step, s, i, d):
    return step(s.student, s.teacher, s.dino_loss, s.opt, _dino_crops(d), i // 2, i,
                s.momentum_schedule, s.args)


@habit(id="dino_train_one_epoch",
       source="facebookresearch/dino main_dino.py train_one_epoch: lr/weight_decay from "
              "schedules set on the param groups; teacher(images[:2]), student(images) through "
              "MultiCropWrapper; DINOLoss (teacher_temp_schedule[epoch], center buffer re-assigned, "
              "dist.all_reduce); cancel_gradients_last_layer; teacher EMA with momentum_schedule[it]",
       what="multi-crop inputs of two sizes, a weight-normed head, a teacher updated in place "
            "from numpy schedules indexed by int arguments, a collective inside the loss",
       expect=EQUAL,
       rule=GUARD, setup=_dino_setup(), between=_dino_between, call=_dino_call,
       ranks=True, ddp=_dino_ddp)
def dino_step(student, teacher, dino_loss, optimizer, images, epoch, it, momentum_schedule, args):
    teacher_output = teacher(images[:2])
    student_output = student(images)
    loss = dino_loss(student_output, teacher_output, epoch)
    optimizer.zero_grad()
    loss.backward()
    if args.clip_grad:
        clip_gradients(student, args.clip_grad)
    cancel_gradients_last_layer(epoch, student, args.freeze_last_layer)
    optimizer.step()
    with torch.no_grad():
        m = momentum_schedule[it]
        for param_q, param_k in zip(unwrap(student).parameters(), teacher.parameters()):
            param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)
    return loss


habit(id="dino_clip_gradients_per_parameter",
      source="facebookresearch/dino utils.py clip_gradients: param_norm = p.grad.data.norm(2); "
             "norms.append(param_norm.item()); clip_coef = clip / (param_norm + 1e-6); "
             "if clip_coef < 1: p.grad.data.mul_(clip_coef)",
      what="per-parameter clipping decided in Python on each gradient norm's value",
      expect=EQUAL, rule=DECISION, setup=_dino_setup(clip_grad=3.0), between=_dino_between,
      call=_dino_call)(dino_step)


def singleton(cache_key):
    def inner_fn(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            instance = getattr(self, cache_key)
            if instance is not None:
                return instance
            instance = fn(self, *args, **kwargs)
            setattr(self, cache_key, instance)
            return instance
        return wrapper
    return inner_fn


class EMA:
    def __init__(self, beta):
        self.beta = beta

    def update_average(self, old, new):
        if old is None:
            return new
        return old * self.beta + (1 - self.beta) * new


def update_moving_average(ema_updater, ma_model, current_model):
    for current_params, ma_params in zip(current_model.parameters(), ma_model.parameters()):
        old_weight, up_weight = ma_params.data, current_params.data
        ma_params.data = ema_updater.update_average(old_weight, up_weight)


def byol_loss_fn(x, y):
    x = F.normalize(x, dim=-1, p=2)
    y = F.normalize(y, dim=-1, p=2)
    return 2 - 2 * (x * y).sum(dim=-1)


def byol_mlp(dim, projection_size, hidden_size=16):
    return nn.Sequential(nn.Linear(dim, hidden_size), nn.BatchNorm1d(hidden_size),
                         nn.ReLU(inplace=True), nn.Linear(hidden_size, projection_size))


class NetWrapper(nn.Module):
    def __init__(self, net, projection_size, projection_hidden_size, layer=-2):
        super().__init__()
        self.net, self.layer = net, layer
        self.projector = None
        self.projection_size, self.projection_hidden_size = projection_size, projection_hidden_size
        self.hidden = {}
        self.hook_registered = False

    def _find_layer(self):
        children = [*self.net.children()]
        return children[self.layer]

    def _hook(self, _, input, output):
        device = input[0].device
        self.hidden[device] = output.flatten(1)

    def _register_hook(self):
        layer = self._find_layer()
        layer.register_forward_hook(self._hook)
        self.hook_registered = True

    @singleton('projector')
    def _get_projector(self, hidden):
        _, dim = hidden.shape
        return byol_mlp(dim, self.projection_size, self.projection_hidden_size).to(hidden)

    def get_representation(self, x):
        if not self.hook_registered:
            self._register_hook()
        self.hidden.clear()
        _ = self.net(x)
        hidden = self.hidden[x.device]
        self.hidden.clear()
        assert hidden is not None, f'hidden layer {self.layer} never emitted an output'
        return hidden

    def forward(self, x, return_projection=True):
        representation = self.get_representation(x)
        if not return_projection:
            return representation
        projector = self._get_projector(representation)
        return projector(representation), representation


class RandomApply(nn.Module):
    """byol_pytorch.py RandomApply"""

    def __init__(self, fn, p):
        super().__init__()
        self.fn, self.p = fn, p

    def forward(self, x):
        if random.random() > self.p:
            return x
        return self.fn(x)


def torch_flip_noise_aug(x):
    """an augment_fn drawn from torch's generator only: per-sample flips and noise"""
    flip = torch.rand(x.shape[0], 1, 1, 1) < 0.5
    return torch.where(flip, x.flip(-1), x) + 0.05 * torch.randn_like(x)


class BYOL(nn.Module):
    """lucidrains/byol-pytorch byol_pytorch/byol_pytorch.py"""

    def __init__(self, net, image_size=8, hidden_layer=-2, projection_size=8,
                 projection_hidden_size=16, augment_fn=None, moving_average_decay=0.99):
        super().__init__()
        self.net = net
        self.augment1 = self.augment2 = augment_fn
        self.online_encoder = NetWrapper(net, projection_size, projection_hidden_size, layer=hidden_layer)
        self.use_momentum = True
        self.target_encoder = None
        self.target_ema_updater = EMA(moving_average_decay)
        self.online_predictor = byol_mlp(projection_size, projection_size, projection_hidden_size)
        # send a mock image tensor to instantiate singleton parameters
        self.forward(torch.randn(2, 3, image_size, image_size))

    @singleton('target_encoder')
    def _get_target_encoder(self):
        target_encoder = copy.deepcopy(self.online_encoder)
        for p in target_encoder.parameters():
            p.requires_grad = False
        return target_encoder

    def update_moving_average(self):
        assert self.use_momentum
        assert self.target_encoder is not None, 'target encoder has not been created yet'
        update_moving_average(self.target_ema_updater, self.target_encoder, self.online_encoder)

    def forward(self, x, return_embedding=False, return_projection=True):
        assert not (self.training and x.shape[0] == 1)
        if return_embedding:
            return self.online_encoder(x, return_projection=return_projection)
        image_one, image_two = self.augment1(x), self.augment2(x)
        images = torch.cat((image_one, image_two), dim=0)
        online_projections, _ = self.online_encoder(images)
        online_predictions = self.online_predictor(online_projections)
        online_pred_one, online_pred_two = online_predictions.chunk(2, dim=0)
        with torch.no_grad():
            target_encoder = self._get_target_encoder() if self.use_momentum else self.online_encoder
            target_projections, _ = target_encoder(images)
            target_projections = target_projections.detach()
            target_proj_one, target_proj_two = target_projections.chunk(2, dim=0)
        loss_one = byol_loss_fn(online_pred_one, target_proj_two.detach())
        loss_two = byol_loss_fn(online_pred_two, target_proj_one.detach())
        return (loss_one + loss_two).mean()


def _byol_net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Linear(1, 4))   # hidden_layer=-2: the pool


def _byol_setup(augment):
    @seeded
    def build():
        learner = BYOL(_byol_net(), augment_fn=augment)
        return SimpleNamespace(model=learner, opt=torch.optim.Adam(learner.parameters(), lr=3e-4))
    return build


def _byol_ddp(s):
    """The final Linear of _byol_net runs but never reaches the loss (BYOL
    hooks the layer before it): DDP with its defaults never sends its bucket
    and fails at the next call (lucidrains/byol-pytorch issue 92), so a BYOL
    script wraps with find_unused_parameters=True, and so does this one. The
    transpiled step averages the gradients that exist without being told."""
    s.model = nn.parallel.DistributedDataParallel(s.model, find_unused_parameters=True)


@habit(id="byol_hook_target_encoder_ema",
       source="lucidrains/byol-pytorch byol_pytorch.py: NetWrapper's forward hook stores the hidden "
              "layer's output in self.hidden[device] and clears it; @singleton('target_encoder') / "
              "('projector'); README loop: loss = learner(images); opt.zero_grad(); "
              "loss.backward(); opt.step(); learner.update_moving_average()",
       what="a forward hook writing into a dict on the module, lazily created submodules "
            "(created by the constructor's mock forward), a target encoder updated by .data "
            "replacement after the step, augmentation from torch's generator",
       expect=EQUAL, rule=HOOKS, setup=_byol_setup(torch_flip_noise_aug), ranks=True,
       ddp=_byol_ddp,
       call=lambda step, s, i, d: step(s.model, s.opt, d.img(4)))
def byol_step(learner, opt, images):
    loss = learner(images)
    opt.zero_grad()
    loss.backward()
    opt.step()
    unwrap(learner).update_moving_average()
    return loss


habit(id="byol_default_aug_random_apply",
      source="lucidrains/byol-pytorch byol_pytorch.py RandomApply.forward: if random.random() > "
             "self.p: return x (DEFAULT_AUG's color jitter and blur)",
      what="augmentations applied or skipped by Python's random inside forward (a program "
           "per set applied)",
      expect=EQUAL, rule=HOST_RNG,
      setup=_byol_setup(RandomApply(lambda x: x * 0.8 + 0.1, p=0.3)),
      call=lambda step, s, i, d: step(s.model, s.opt, d.img(4)))(byol_step)


class SimCLR:
    """sthalles/SimCLR simclr.py: the trainer object, its train() loop body as a method."""

    def __init__(self, *args, **kwargs):
        self.args = kwargs['args']
        self.model = kwargs['model']
        self.optimizer = kwargs['optimizer']
        self.scheduler = kwargs['scheduler']
        self.criterion = torch.nn.CrossEntropyLoss()

    def info_nce_loss(self, features):
        labels = torch.cat([torch.arange(self.args.batch_size) for i in range(self.args.n_views)], dim=0)
        labels = (labels.unsqueeze(0) == labels.unsqueeze(1)).float()
        features = F.normalize(features, dim=1)
        similarity_matrix = torch.matmul(features, features.T)
        mask = torch.eye(labels.shape[0], dtype=torch.bool)
        labels = labels[~mask].view(labels.shape[0], -1)
        similarity_matrix = similarity_matrix[~mask].view(similarity_matrix.shape[0], -1)
        positives = similarity_matrix[labels.bool()].view(labels.shape[0], -1)
        negatives = similarity_matrix[~labels.bool()].view(similarity_matrix.shape[0], -1)
        logits = torch.cat([positives, negatives], dim=1)
        labels = torch.zeros(logits.shape[0], dtype=torch.long)
        logits = logits / self.args.temperature
        return logits, labels

    def train_step(self, images, scaler):
        images = torch.cat(images, dim=0)
        with torch.autocast("cpu", enabled=self.args.fp16_precision):
            features = self.model(images)
            logits, labels = self.info_nce_loss(features)
            loss = self.criterion(logits, labels)
        self.optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(self.optimizer)
        scaler.update()
        return loss, logits


@seeded
def _simclr_setup():
    import argparse
    model = _mlp_encoder()
    opt = torch.optim.Adam(model.parameters(), 3e-4, weight_decay=1e-4)
    args = argparse.Namespace(batch_size=8, n_views=2, temperature=0.07, fp16_precision=False)
    simclr = SimCLR(model=model, optimizer=opt, args=args,
                    scheduler=torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10))
    return SimpleNamespace(simclr=simclr, scaler=torch.amp.GradScaler("cpu", enabled=False))


@habit(id="simclr_trainer_method_info_nce",
       source="sthalles/SimCLR simclr.py SimCLR.info_nce_loss (boolean-mask indexing with "
              "torch.eye, self.args.temperature) and train() (scaler = GradScaler(enabled="
              "args.fp16_precision); autocast(enabled=...); self.optimizer.zero_grad(); ...)",
       what="a trainer object's method holding model, optimizer and argparse args; boolean "
            "mask indexing of the similarity matrix; a disabled GradScaler argument",
       expect=EQUAL, rule=PATH, setup=_simclr_setup, bind=lambda s: s.simclr.train_step,
       call=lambda step, s, i, d: step([d.vec(), d.vec()], s.scaler))
def _unused5(*a):
    raise AssertionError


@torch.no_grad()
def distributed_sinkhorn(out, args):
    Q = torch.exp(out / args.epsilon).t()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    B = Q.shape[1] * world
    K = Q.shape[0]
    sum_Q = torch.sum(Q)
    if world > 1:
        dist.all_reduce(sum_Q)
    Q /= sum_Q
    for it in range(args.sinkhorn_iterations):
        sum_of_rows = torch.sum(Q, dim=1, keepdim=True)
        if world > 1:
            dist.all_reduce(sum_of_rows)
        Q /= sum_of_rows
        Q /= K
        Q /= torch.sum(Q, dim=0, keepdim=True)
        Q /= B
    Q *= B
    return Q.t()


class SwAVNet(nn.Module):
    def __init__(self, nmb_prototypes=12):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU())
        self.projection_head = nn.Linear(32, 8)
        self.prototypes = nn.Linear(8, nmb_prototypes, bias=False)

    def forward(self, inputs):
        x = self.projection_head(self.backbone(torch.cat(inputs)))
        x = nn.functional.normalize(x, dim=1, p=2)
        return x, self.prototypes(x)


@seeded
def _swav_setup():
    import argparse
    model = SwAVNet()
    return SimpleNamespace(model=model, opt=torch.optim.SGD(model.parameters(), lr=0.6,
                                                            momentum=0.9, weight_decay=1e-6),
                           args=argparse.Namespace(crops_for_assign=[0, 1], nmb_crops=[2],
                                                   temperature=0.1, epsilon=0.05,
                                                   sinkhorn_iterations=3,
                                                   freeze_prototypes_niters=2))


@habit(id="swav_sinkhorn_freeze_prototypes",
       source="facebookresearch/swav main_swav.py train(): normalize prototypes in place "
              "(w = model.module.prototypes.weight.data.clone(); ...copy_(w)); "
              "distributed_sinkhorn (dist.all_reduce); for v in np.delete(np.arange(np.sum("
              "args.nmb_crops)), crop_id); if iteration < args.freeze_prototypes_niters: "
              "p.grad = None for the prototypes",
       what="a parameter normalised in place under no_grad before forward, Sinkhorn with "
            "collectives inside, numpy index loops, gradients dropped by an int argument",
       expect=EQUAL, rule=GUARD, setup=_swav_setup, ranks=True,
       call=lambda step, s, i, d: step(s.model, s.opt, [d.vec(), d.vec()], i, s.args))
def swav_step(model, optimizer, inputs, iteration, args):
    with torch.no_grad():
        w = unwrap(model).prototypes.weight.data.clone()
        w = nn.functional.normalize(w, dim=1, p=2)
        unwrap(model).prototypes.weight.copy_(w)
    embedding, output = model(inputs)
    embedding = embedding.detach()
    bs = inputs[0].size(0)
    loss = 0
    for i, crop_id in enumerate(args.crops_for_assign):
        with torch.no_grad():
            out = output[bs * crop_id: bs * (crop_id + 1)].detach()
            q = distributed_sinkhorn(out, args)[-bs:]
        subloss = 0
        for v in np.delete(np.arange(np.sum(args.nmb_crops)), crop_id):
            x = output[bs * v: bs * (v + 1)] / args.temperature
            subloss -= torch.mean(torch.sum(q * F.log_softmax(x, dim=1), dim=1))
        loss += subloss / (np.sum(args.nmb_crops) - 1)
    loss /= len(args.crops_for_assign)
    optimizer.zero_grad()
    loss.backward()
    if iteration < args.freeze_prototypes_niters:
        for name, p in model.named_parameters():
            if "prototypes" in name:
                p.grad = None
    optimizer.step()
    return loss


def off_diagonal(x):
    n, m = x.shape
    assert n == m
    return x.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()


class BarlowTwins(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.projector = nn.Sequential(nn.Linear(32, 16, bias=False), nn.BatchNorm1d(16),
                                       nn.ReLU(inplace=True), nn.Linear(16, 16, bias=False))
        self.bn = nn.BatchNorm1d(16, affine=False)

    def forward(self, y1, y2):
        z1 = self.projector(self.backbone(y1))
        z2 = self.projector(self.backbone(y2))
        c = self.bn(z1).T @ self.bn(z2)
        c.div_(self.args.batch_size)
        if dist.is_available() and dist.is_initialized():
            torch.distributed.all_reduce(c)
        on_diag = torch.diagonal(c).add_(-1).pow_(2).sum()
        off_diag = off_diagonal(c).pow_(2).sum()
        return on_diag + self.args.lambd * off_diag


class LARS(torch.optim.Optimizer):
    """facebookresearch/barlowtwins main.py LARS"""

    def __init__(self, params, lr, weight_decay=0, momentum=0.9, eta=0.001,
                 weight_decay_filter=None, lars_adaptation_filter=None):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, eta=eta,
                        weight_decay_filter=weight_decay_filter,
                        lars_adaptation_filter=lars_adaptation_filter)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g['params']:
                dp = p.grad
                if dp is None:
                    continue
                if g['weight_decay_filter'] is None or not g['weight_decay_filter'](p):
                    dp = dp.add(p, alpha=g['weight_decay'])
                if g['lars_adaptation_filter'] is None or not g['lars_adaptation_filter'](p):
                    param_norm = torch.norm(p)
                    update_norm = torch.norm(dp)
                    one = torch.ones_like(param_norm)
                    q = torch.where(param_norm > 0.,
                                    torch.where(update_norm > 0,
                                                (g['eta'] * param_norm / update_norm), one), one)
                    dp = dp.mul(q)
                param_state = self.state[p]
                if 'mu' not in param_state:
                    param_state['mu'] = torch.zeros_like(p)
                mu = param_state['mu']
                mu.mul_(g['momentum']).add_(dp)
                p.add_(mu, alpha=-g['lr'])


def exclude_bias_and_norm(p):
    return p.ndim == 1


@seeded
def _barlow_setup():
    import argparse
    args = argparse.Namespace(batch_size=8, lambd=0.0051, weight_decay=1e-6,
                              learning_rate_weights=0.2, learning_rate_biases=0.0048, epochs=4)
    model = BarlowTwins(args)
    param_weights = [p for p in model.parameters() if p.ndim != 1]
    param_biases = [p for p in model.parameters() if p.ndim == 1]
    opt = LARS([{'params': param_weights}, {'params': param_biases}], lr=0,
               weight_decay=args.weight_decay, weight_decay_filter=exclude_bias_and_norm,
               lars_adaptation_filter=exclude_bias_and_norm)
    return SimpleNamespace(model=model, opt=opt, args=args, scaler=torch.amp.GradScaler("cpu"))


def _barlow_adjust(s, step, steps_per_epoch=1):
    """main.py adjust_learning_rate(args, optimizer, loader, step)"""
    args = s.args
    max_steps, warmup_steps = args.epochs * steps_per_epoch, 2 * steps_per_epoch
    base_lr = args.batch_size / 256
    if step < warmup_steps:
        lr = base_lr * step / warmup_steps
    else:
        step -= warmup_steps
        max_steps -= warmup_steps
        q = 0.5 * (1 + math.cos(math.pi * step / max_steps))
        lr = base_lr * q + base_lr * 0.001 * (1 - q)
    s.opt.param_groups[0]['lr'] = lr * args.learning_rate_weights
    s.opt.param_groups[1]['lr'] = lr * args.learning_rate_biases


@habit(id="barlow_twins_lars_custom_optimizer",
       source="facebookresearch/barlowtwins main.py: LARS (custom Optimizer: filters as "
              "functions in the param groups, torch.where trust ratio, state['mu'] created at "
              "the first step), adjust_learning_rate between steps, BarlowTwins.forward "
              "(c.div_, all_reduce, off_diagonal), scaler.scale(loss).backward()",
       what="a custom optimizer traced as written, whose lr changes every call and whose state "
            "is created lazily by its first step; callables in param groups",
       expect=EQUAL, rule=LAZY, setup=_barlow_setup, between=_barlow_adjust,
       call=lambda step, s, i, d: step(s.model, s.opt, s.scaler, d.vec(), d.vec()))
def barlow_step(model, optimizer, scaler, y1, y2):
    loss = model.forward(y1, y2)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss


# ================================================================= diffusers
# huggingface/diffusers examples/text_to_image/train_text_to_image.py (and _lora),
# src/diffusers/schedulers/scheduling_ddpm.py, src/diffusers/training_utils.py.

class FrozenDict(OrderedDict):
    """diffusers.configuration_utils.FrozenDict: items also readable as attributes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for key, value in self.items():
            object.__setattr__(self, key, value)
        object.__setattr__(self, "_FrozenDict__frozen", True)

    def __setattr__(self, name, value):
        raise Exception(f"You cannot use ``__setattr__`` on a {self.__class__.__name__} instance.")


class DDPMScheduler:
    """scheduling_ddpm.py: the tables and add_noise / get_velocity used in training."""

    def __init__(self, num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                 beta_schedule="scaled_linear", prediction_type="epsilon"):
        self._internal_dict = FrozenDict(num_train_timesteps=num_train_timesteps,
                                         beta_start=beta_start, beta_end=beta_end,
                                         beta_schedule=beta_schedule, prediction_type=prediction_type)
        if beta_schedule == "linear":
            self.betas = torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float32)
        else:
            self.betas = torch.linspace(beta_start ** 0.5, beta_end ** 0.5, num_train_timesteps,
                                        dtype=torch.float32) ** 2
        self.alphas = 1.0 - self.betas
        self.alphas_cumprod = torch.cumprod(self.alphas, dim=0)

    @property
    def config(self):
        return self._internal_dict

    def register_to_config(self, **kwargs):
        internal_dict = dict(self._internal_dict)
        internal_dict.update(kwargs)
        self._internal_dict = FrozenDict(internal_dict)

    def _coefficients(self, sample, timesteps):
        self.alphas_cumprod = self.alphas_cumprod.to(device=sample.device)
        alphas_cumprod = self.alphas_cumprod.to(dtype=sample.dtype)
        timesteps = timesteps.to(sample.device)
        sqrt_alpha_prod = alphas_cumprod[timesteps] ** 0.5
        sqrt_alpha_prod = sqrt_alpha_prod.flatten()
        while len(sqrt_alpha_prod.shape) < len(sample.shape):
            sqrt_alpha_prod = sqrt_alpha_prod.unsqueeze(-1)
        sqrt_one_minus_alpha_prod = (1 - alphas_cumprod[timesteps]) ** 0.5
        sqrt_one_minus_alpha_prod = sqrt_one_minus_alpha_prod.flatten()
        while len(sqrt_one_minus_alpha_prod.shape) < len(sample.shape):
            sqrt_one_minus_alpha_prod = sqrt_one_minus_alpha_prod.unsqueeze(-1)
        return sqrt_alpha_prod, sqrt_one_minus_alpha_prod

    def add_noise(self, original_samples, noise, timesteps):
        sqrt_alpha_prod, sqrt_one_minus_alpha_prod = self._coefficients(original_samples, timesteps)
        return sqrt_alpha_prod * original_samples + sqrt_one_minus_alpha_prod * noise

    def get_velocity(self, sample, noise, timesteps):
        sqrt_alpha_prod, sqrt_one_minus_alpha_prod = self._coefficients(sample, timesteps)
        return sqrt_alpha_prod * noise - sqrt_one_minus_alpha_prod * sample


def compute_snr(noise_scheduler, timesteps):
    """diffusers/training_utils.py compute_snr"""
    alphas_cumprod = noise_scheduler.alphas_cumprod
    sqrt_alphas_cumprod = alphas_cumprod ** 0.5
    sqrt_one_minus_alphas_cumprod = (1.0 - alphas_cumprod) ** 0.5
    sqrt_alphas_cumprod = sqrt_alphas_cumprod.to(device=timesteps.device)[timesteps].float()
    while len(sqrt_alphas_cumprod.shape) < len(timesteps.shape):
        sqrt_alphas_cumprod = sqrt_alphas_cumprod[..., None]
    alpha = sqrt_alphas_cumprod.expand(timesteps.shape)
    sqrt_one_minus_alphas_cumprod = sqrt_one_minus_alphas_cumprod.to(device=timesteps.device)[timesteps].float()
    while len(sqrt_one_minus_alphas_cumprod.shape) < len(timesteps.shape):
        sqrt_one_minus_alphas_cumprod = sqrt_one_minus_alphas_cumprod[..., None]
    sigma = sqrt_one_minus_alphas_cumprod.expand(timesteps.shape)
    return (alpha / sigma) ** 2


def get_timestep_embedding(timesteps, embedding_dim, max_period=10000, downscale_freq_shift=1):
    half_dim = embedding_dim // 2
    exponent = -math.log(max_period) * torch.arange(0, half_dim, dtype=torch.float32)
    exponent = exponent / (half_dim - downscale_freq_shift)
    emb = torch.exp(exponent)
    emb = timesteps[:, None].float() * emb[None, :]
    return torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)


@dataclasses.dataclass
class UNetOutput:
    sample: torch.Tensor


class TinyUNet(nn.Module):
    def __init__(self, channels=4, cross_dim=8):
        super().__init__()
        self.conv_in = nn.Conv2d(channels, 8, 3, padding=1)
        self.time_proj = nn.Linear(8, 8)
        self.cross = nn.Linear(cross_dim, 8)
        self.norm = nn.GroupNorm(2, 8)
        self.conv_out = nn.Conv2d(8, channels, 3, padding=1)

    def forward(self, sample, timestep, encoder_hidden_states, return_dict=True):
        t = self.time_proj(get_timestep_embedding(timestep, 8))
        h = self.conv_in(sample) + t[:, :, None, None] + self.cross(encoder_hidden_states.mean(1))[:, :, None, None]
        out = self.conv_out(F.silu(self.norm(h)))
        return UNetOutput(out) if return_dict else (out,)


@seeded
def _t2i_setup():
    import argparse
    unet = TinyUNet()
    text_encoder = nn.Embedding(24, 8)
    text_encoder.requires_grad_(False)
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    return SimpleNamespace(unet=unet, text_encoder=text_encoder, opt=opt, lr_scheduler=sched,
                           noise_scheduler=DDPMScheduler(),
                           args=argparse.Namespace(noise_offset=0.1, input_perturbation=0.1,
                                                   prediction_type="v_prediction", snr_gamma=5.0,
                                                   max_grad_norm=1.0))


def _t2i_batch(d):
    return {"pixel_values": d.img(4, 4, 8, 8), "input_ids": d.tok(4, 5, 24)}


@habit(id="diffusers_t2i_add_noise_snr_register_to_config",
       source="huggingface/diffusers examples/text_to_image/train_text_to_image.py: noise = "
              "torch.randn_like(latents); noise += args.noise_offset * torch.randn(...); "
              "input_perturbation; timesteps = torch.randint(0, noise_scheduler.config."
              "num_train_timesteps, (bsz,)); noise_scheduler.add_noise; if args.prediction_type "
              "is not None: noise_scheduler.register_to_config(prediction_type=...); "
              "get_velocity; compute_snr min-SNR weighting; clip; step; lr_scheduler.step()",
       what="a scheduler object (not a module) holding tensor tables, re-assigning "
            "self.alphas_cumprod in add_noise, its FrozenDict config read and re-registered by "
            "the step; four torch draws; min-SNR weights",
       expect=EQUAL, rule=PATH, setup=_t2i_setup,
       call=lambda step, s, i, d: step(s.unet, s.text_encoder, s.noise_scheduler, s.opt,
                                       s.lr_scheduler, _t2i_batch(d), s.args))
def t2i_step(unet, text_encoder, noise_scheduler, optimizer, lr_scheduler, batch, args):
    latents = batch["pixel_values"]
    noise = torch.randn_like(latents)
    if args.noise_offset:
        noise += args.noise_offset * torch.randn((latents.shape[0], latents.shape[1], 1, 1),
                                                 device=latents.device)
    if args.input_perturbation:
        new_noise = noise + args.input_perturbation * torch.randn_like(noise)
    bsz = latents.shape[0]
    timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,),
                              device=latents.device).long()
    if args.input_perturbation:
        noisy_latents = noise_scheduler.add_noise(latents, new_noise, timesteps)
    else:
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
    encoder_hidden_states = text_encoder(batch["input_ids"])
    if args.prediction_type is not None:
        noise_scheduler.register_to_config(prediction_type=args.prediction_type)
    if noise_scheduler.config.prediction_type == "epsilon":
        target = noise
    elif noise_scheduler.config.prediction_type == "v_prediction":
        target = noise_scheduler.get_velocity(latents, noise, timesteps)
    model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
    if args.snr_gamma is None:
        loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
    else:
        snr = compute_snr(noise_scheduler, timesteps)
        mse_loss_weights = torch.stack([snr, args.snr_gamma * torch.ones_like(timesteps)],
                                       dim=1).min(dim=1)[0]
        if noise_scheduler.config.prediction_type == "epsilon":
            mse_loss_weights = mse_loss_weights / snr
        elif noise_scheduler.config.prediction_type == "v_prediction":
            mse_loss_weights = mse_loss_weights / (snr + 1)
        loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
        loss = loss.mean(dim=list(range(1, len(loss.shape)))) * mse_loss_weights
        loss = loss.mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(unet.parameters(), args.max_grad_norm)
    optimizer.step()
    lr_scheduler.step()
    optimizer.zero_grad()
    return loss


class EMAModel:
    """diffusers/training_utils.py EMAModel (step, get_decay)"""

    def __init__(self, parameters, decay=0.9999, min_decay=0.0, update_after_step=0):
        parameters = list(parameters)
        self.shadow_params = [p.clone().detach() for p in parameters]
        self.decay, self.min_decay, self.update_after_step = decay, min_decay, update_after_step
        self.optimization_step = 0
        self.cur_decay_value = None

    def get_decay(self, optimization_step):
        step = max(0, optimization_step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        cur_decay_value = (1 + step) / (10 + step)
        cur_decay_value = min(cur_decay_value, self.decay)
        return max(cur_decay_value, self.min_decay)

    @torch.no_grad()
    def step(self, parameters):
        parameters = list(parameters)
        self.optimization_step += 1
        decay = self.get_decay(self.optimization_step)
        self.cur_decay_value = decay
        one_minus_decay = 1 - decay
        for s_param, param in zip(self.shadow_params, parameters):
            if param.requires_grad:
                s_param.sub_(one_minus_decay * (s_param - param))
            else:
                s_param.copy_(param)


@seeded
def _t2i_ema_setup():
    s = _t2i_setup.__wrapped__()
    s.args.prediction_type, s.args.use_ema = None, True
    s.ema_unet = EMAModel(s.unet.parameters())
    return s


def _t2i_ddp(s):
    s.unet = nn.parallel.DistributedDataParallel(s.unet)


@habit(id="diffusers_ema_model_step_in_step",
       source="huggingface/diffusers examples/text_to_image/train_text_to_image.py: if "
              "accelerator.sync_gradients: if args.use_ema: ema_unet.step(unet.parameters()); "
              "src/diffusers/training_utils.py EMAModel.step (self.optimization_step += 1)",
       what="an EMA object (not a module) whose host counter the step increments and whose "
            "decay is computed from it; its shadow parameters, a list of tensors, are updated "
            "in place and written back after each run",
       expect=EQUAL, rule=HOST_NUMBERS, setup=_t2i_ema_setup, ranks=True, ddp=_t2i_ddp,
       call=lambda step, s, i, d: step(s.unet, s.text_encoder, s.noise_scheduler, s.opt,
                                       s.lr_scheduler, _t2i_batch(d), s.args, s.ema_unet))
def t2i_ema_step(unet, text_encoder, noise_scheduler, optimizer, lr_scheduler, batch, args, ema_unet):
    loss = t2i_step(unet, text_encoder, noise_scheduler, optimizer, lr_scheduler, batch, args)
    if args.use_ema:
        ema_unet.step(unet.parameters())
    return loss


class LoraLinear(nn.Module):
    """peft's lora.Linear forward: base layer (frozen, bf16) + lora_B(lora_A(dropout(x))) * scaling
    in the adapter's dtype (fp32 after cast_training_params)."""

    def __init__(self, base, r=4, alpha=4, dropout=0.1):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)
        self.lora_dropout = nn.Dropout(dropout)
        self.scaling = alpha / r

    def forward(self, x):
        result = self.base_layer(x)
        torch_result_dtype = result.dtype
        x = x.to(self.lora_A.weight.dtype)
        result = result + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
        return result.to(torch_result_dtype)


@seeded
def _lora_setup():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    model.requires_grad_(False)
    model.to(dtype=torch.bfloat16)
    model[0], model[2] = LoraLinear(model[0]), LoraLinear(model[2])
    for p in model.parameters():              # cast_training_params(unet, dtype=torch.float32)
        if p.requires_grad:
            p.data = p.to(torch.float32)
    lora_layers = filter(lambda p: p.requires_grad, model.parameters())
    return SimpleNamespace(model=model, opt=torch.optim.AdamW(lora_layers, lr=1e-3))


@habit(id="diffusers_lora_bf16_base_fp32_adapters",
       source="huggingface/diffusers examples/text_to_image/train_text_to_image_lora.py: "
              "unet.requires_grad_(False); unet.to(dtype=weight_dtype); unet.add_adapter(...); "
              "cast_training_params(unet, dtype=torch.float32); lora_layers = filter(lambda p: "
              "p.requires_grad, unet.parameters())",
       what="a frozen bf16 base with fp32 trainable adapters (lora dropout), the optimizer "
            "built from a filter iterator, bf16 inputs",
       expect=EQUAL, rule=INPUTS, setup=_lora_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, d.vec().to(torch.bfloat16), d.vec()))
def lora_step(model, optimizer, x, target):
    model_pred = model(x)
    loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


# ================================================================= Lightning
# Lightning-AI/pytorch-lightning: src/lightning/pytorch/core/module.py
# (LightningModule: optimizers(), manual_backward, toggle_optimizer, log,
# current_epoch, hparams), loops/optimization/automatic.py (optimizer.step(closure)),
# callbacks/finetuning.py, trainer (detect_anomaly, precision plugins).

class AttributeDict(dict):
    """lightning.fabric.utilities.data.AttributeDict"""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError as e:
            raise AttributeError(key) from e

    def __setattr__(self, key, val):
        self[key] = val


class MiniLightningModule(nn.Module):
    def __init__(self):
        super().__init__()
        self._trainer = None
        self._optimizers = []
        self._param_requires_grad_state = {}
        self._results = {}

    @property
    def trainer(self):
        return self._trainer

    @property
    def current_epoch(self):
        return self.trainer.current_epoch if self._trainer else 0

    def optimizers(self):
        return self._optimizers if len(self._optimizers) > 1 else self._optimizers[0]

    def manual_backward(self, loss):
        loss.backward()

    def log(self, name, value, prog_bar=False, on_step=True):
        self._results[name] = value.detach()

    def toggle_optimizer(self, optimizer):
        param_requires_grad_state = {}
        for opt in self._optimizers:
            if opt is optimizer:
                continue
            for group in opt.param_groups:
                for param in group["params"]:
                    if param in param_requires_grad_state:
                        continue
                    param_requires_grad_state[param] = param.requires_grad
                    param.requires_grad = False
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.requires_grad = param_requires_grad_state.get(param, param.requires_grad)
        self._param_requires_grad_state = param_requires_grad_state

    def untoggle_optimizer(self, optimizer):
        for opt in self._optimizers:
            if opt is not optimizer:
                for group in opt.param_groups:
                    for param in group["params"]:
                        if param in self._param_requires_grad_state:
                            param.requires_grad = self._param_requires_grad_state[param]
        self._param_requires_grad_state = {}


class GAN(MiniLightningModule):
    """Lightning's GAN example (docs 'manual optimization', tutorials basic-gan)."""

    def __init__(self, latent_dim=8):
        super().__init__()
        self.automatic_optimization = False
        self.hparams = AttributeDict(latent_dim=latent_dim, lr=2e-4)
        self.generator = nn.Sequential(nn.Linear(latent_dim, 16), nn.ReLU(), nn.Linear(16, 16))
        self.discriminator = nn.Sequential(nn.Linear(16, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, z):
        return self.generator(z)

    def adversarial_loss(self, y_hat, y):
        return F.binary_cross_entropy_with_logits(y_hat, y)

    def training_step(self, batch, batch_idx):
        imgs, _ = batch
        optimizer_g, optimizer_d = self.optimizers()
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim)
        z = z.type_as(imgs)
        self.toggle_optimizer(optimizer_g)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        self.manual_backward(g_loss)
        optimizer_g.step()
        optimizer_g.zero_grad()
        self.untoggle_optimizer(optimizer_g)
        self.toggle_optimizer(optimizer_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        self.manual_backward(d_loss)
        optimizer_d.step()
        optimizer_d.zero_grad()
        self.untoggle_optimizer(optimizer_d)
        return g_loss, d_loss


@seeded
def _gan_setup():
    gan = GAN()
    gan._optimizers = [torch.optim.Adam(gan.generator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
                       torch.optim.Adam(gan.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))]
    return SimpleNamespace(module=gan)


@habit(id="lightning_manual_optimization_gan_toggle",
       source="Lightning-AI/pytorch-lightning docs (manual optimization GAN) and "
              "src/lightning/pytorch/core/module.py toggle_optimizer/untoggle_optimizer, "
              "optimizers(), manual_backward; training_step(self, batch, batch_idx)",
       what="a bound training_step with two optimizers reached through self.optimizers(), "
            "requires_grad toggled off and back inside the step, a backward after the first "
            "optimizer's step, a batch_idx int that changes every call",
       expect=EQUAL, rule=PATH, setup=_gan_setup, bind=lambda s: s.module.training_step,
       call=lambda step, s, i, d: step((d.vec(), d.cls()), i))
def _unused6(*a):
    raise AssertionError


class LitClassifier(MiniLightningModule):
    def __init__(self, log_metrics=False):
        super().__init__()
        self.backbone = ConvBN()
        self.hparams = AttributeDict(lr=0.1, kl_warmup_epochs=4)
        self.log_metrics = log_metrics

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.backbone(x), y)
        if self.log_metrics:
            self.log("train_loss", loss, prog_bar=True)
        return loss


class FitLoop:
    """What Lightning's automatic optimization runs for one batch, without the closure."""

    def __init__(self, module, optimizer, use_closure=False):
        self.module, self.optimizer, self.use_closure = module, optimizer, use_closure

    def run(self, batch, batch_idx):
        if self.use_closure:   # loops/optimization/automatic.py: optimizer.step(closure=closure)
            def closure():
                self.optimizer.zero_grad()
                loss = self.module.training_step(batch, batch_idx)
                loss.backward()
                return loss
            return self.optimizer.step(closure=closure)
        self.optimizer.zero_grad()
        loss = self.module.training_step(batch, batch_idx)
        loss.backward()
        self.optimizer.step()
        return loss


def _lit_setup(log_metrics=False, use_closure=False):
    @seeded
    def build():
        module = LitClassifier(log_metrics)
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        module._optimizers = [opt]
        return SimpleNamespace(module=module, loop=FitLoop(module, opt, use_closure))
    return build


def _lit_call(step, s, i, d):
    return step((d.img(), d.cls()), i)


@habit(id="lightning_self_log_in_training_step",
       source="Lightning-AI/pytorch-lightning src/lightning/pytorch/core/module.py "
              "LightningModule.log (self.log('train_loss', loss, prog_bar=True) in training_step "
              "stores the value in the trainer's result collection)",
       what="training_step stores a tensor on the host (the logged metric) every call",
       expect=EQUAL, rule=LAZY, setup=_lit_setup(log_metrics=True),
       bind=lambda s: s.loop.run, call=_lit_call)
def _unused7(*a):
    raise AssertionError


class LitOutputsClassifier(LitClassifier):
    """Lightning 2's documented replacement of training_epoch_end: the module
    keeps its step outputs in a list it stacks at the epoch's end."""

    def __init__(self):
        super().__init__()
        self.training_step_outputs = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.backbone(x), y)
        self.training_step_outputs.append(loss)
        return loss

    def on_train_epoch_end(self):
        epoch_mean = torch.stack(self.training_step_outputs).mean()
        self.training_step_outputs.clear()
        return epoch_mean


@seeded
def _lit_outputs_setup():
    module = LitOutputsClassifier()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module._optimizers = [opt]
    return SimpleNamespace(module=module, loop=FitLoop(module, opt))


def _lit_epoch_end(s, i):
    if i == 3:   # an epoch of three batches ended: what the hook makes of the outputs
        s.epoch_mean = s.module.on_train_epoch_end()


@habit(id="lightning_training_step_outputs_append",
       source="Lightning-AI/pytorch-lightning docs/source-pytorch/upgrade (2.0: "
              "training_epoch_end removed): self.training_step_outputs.append(loss) in "
              "training_step; torch.stack(self.training_step_outputs).mean() and .clear() in "
              "on_train_epoch_end",
       what="training_step appends its loss tensor to a list on the module every call; the "
            "epoch-end hook stacks and clears it between calls",
       expect=EQUAL, rule=RETURNED, setup=_lit_outputs_setup, between=_lit_epoch_end,
       bind=lambda s: s.loop.run, call=_lit_call, calls=5)
def _unused_lit_outputs(*a):
    raise AssertionError


@habit(id="lightning_automatic_optimization_closure",
       source="Lightning-AI/pytorch-lightning src/lightning/pytorch/loops/optimization/"
              "automatic.py: closure = self._make_closure(...); optimizer.step(closure=closure)",
       what="automatic optimization hands the forward/backward to optimizer.step as a closure",
       expect=REFUSED, rule=DECISION, match="closure", setup=_lit_setup(use_closure=True),
       bind=lambda s: s.loop.run, call=_lit_call)
def _unused8(*a):
    raise AssertionError


class FakeTrainer:
    def __init__(self):
        self.fit_loop = SimpleNamespace(epoch_progress=SimpleNamespace(
            current=SimpleNamespace(completed=0)))

    @property
    def current_epoch(self):
        return self.fit_loop.epoch_progress.current.completed


class LitVAE(MiniLightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(16, 8)
        self.decoder = nn.Linear(4, 16)
        self.hparams = AttributeDict(kl_warmup_epochs=4)

    def training_step(self, batch, batch_idx):
        x = batch
        mu, logvar = self.encoder(x).chunk(2, dim=-1)
        std = torch.exp(0.5 * logvar)
        z = mu + torch.randn_like(std) * std
        recon_loss = F.mse_loss(self.decoder(z), x)
        kl = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
        beta = min(1.0, self.current_epoch / self.hparams.kl_warmup_epochs)
        return recon_loss + beta * kl


@seeded
def _vae_setup():
    module = LitVAE()
    module._trainer = FakeTrainer()
    opt = torch.optim.Adam(module.parameters(), lr=1e-3)
    module._optimizers = [opt]
    return SimpleNamespace(module=module, loop=FitLoop(module, opt))


def _next_epoch(s, i):
    s.module.trainer.fit_loop.epoch_progress.current.completed = i // 2


@habit(id="lightning_current_epoch_kl_annealing",
       source="Lightning-AI/pytorch-lightning src/lightning/pytorch/core/module.py "
              "current_epoch property (self.trainer.current_epoch -> fit_loop.epoch_progress."
              "current.completed), hparams AttributeDict; KL warm-up written on it",
       what="a loss weight computed from a property chain module -> trainer -> loop -> "
            "progress that changes between calls, and an AttributeDict hyperparameter",
       expect=EQUAL, rule=GUARD, setup=_vae_setup, between=_next_epoch,
       bind=lambda s: s.loop.run, call=lambda step, s, i, d: step(d.vec(), i))
def _unused9(*a):
    raise AssertionError


@habit(id="lightning_optimizer_step_override_warmup",
       source="Lightning-AI/pytorch-lightning docs (optimization: 'learning rate warm-up'): "
              "def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure): "
              "optimizer.step(closure=optimizer_closure); if self.trainer.global_step < 500: "
              "pg['lr'] = lr_scale * self.hparams.learning_rate",
       what="the step assigns the learning rate of the param groups after optimizer.step()",
       expect=REFUSED, rule=HOST_WRITE, match="lr", setup=mlp_sgd,
       call=lambda step, s, i, d: step(s.model, s.opt, d.vec(), d.cls(), i))
def warmup_override_step(model, optimizer, x, y, global_step, learning_rate=0.1):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    if global_step < 500:
        lr_scale = min(1.0, float(global_step + 1) / 500.0)
        for pg in optimizer.param_groups:
            pg["lr"] = lr_scale * learning_rate
    return loss


def _with_context(make):
    def call(step, s, i, d):
        with make():
            return step(s.model, s.opt, d.img(), d.cls())
    return call


habit(id="lightning_bf16_mixed_forward_context",
      source="Lightning-AI/pytorch-lightning src/lightning/pytorch/plugins/precision/amp.py "
             "MixedPrecision.forward_context() (torch.autocast around training_step, "
             "Trainer(precision='bf16-mixed'))",
      what="autocast entered by the caller around every call (ambient, not in the step)",
      expect=EQUAL, rule=AMBIENT, setup=conv_sgd,
      call=_with_context(lambda: torch.autocast("cpu", dtype=torch.bfloat16)))(plain_step)

habit(id="lightning_detect_anomaly",
      source="Lightning-AI/pytorch-lightning src/lightning/pytorch/trainer/trainer.py _run_stage: "
             "with isolate_rng(), torch.autograd.set_detect_anomaly(self._detect_anomaly) "
             "(Trainer(detect_anomaly=True))",
      what="anomaly detection switched on by the caller around the calls",
      expect=EQUAL, rule=AMBIENT, setup=conv_sgd,
      call=_with_context(lambda: torch.autograd.set_detect_anomaly(True)))(plain_step)


class FinetuneNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.backbone(x))


@seeded
def _finetune_setup():
    model = FinetuneNet()
    for mod in model.backbone.modules():     # BaseFinetuning.freeze(pl_module.backbone, train_bn=True)
        if not isinstance(mod, nn.BatchNorm2d):
            for param in mod.parameters(recurse=False):
                param.requires_grad = False
    opt = torch.optim.Adam(filter(lambda p: p.requires_grad, model.parameters()), lr=1e-3)
    return SimpleNamespace(model=model, opt=opt)


def _unfreeze(s, i, unfreeze_backbone_at_epoch=2, initial_denom_lr=10.0):
    """callbacks/finetuning.py BackboneFinetuning.finetune_function -> unfreeze_and_add_param_group"""
    if i == unfreeze_backbone_at_epoch:
        params = [p for p in s.model.backbone.parameters() if not p.requires_grad]
        for p in s.model.backbone.parameters():
            p.requires_grad = True
        s.model.backbone.train()
        s.opt.add_param_group({"params": params, "lr": s.opt.param_groups[0]["lr"] / initial_denom_lr})


@habit(id="lightning_backbone_finetuning_unfreeze",
       source="Lightning-AI/pytorch-lightning src/lightning/pytorch/callbacks/finetuning.py "
              "BackboneFinetuning: freeze_before_training (BaseFinetuning.freeze, train_bn=True), "
              "at unfreeze_backbone_at_epoch: unfreeze_and_add_param_group(modules=backbone, "
              "optimizer, lr=..., initial_denom_lr=10)",
       what="the frozen backbone is made trainable between calls and its parameters added "
            "to the optimizer as a new param group",
       expect=EQUAL, rule=GUARD, setup=_finetune_setup, call=img_xy, between=_unfreeze)
def finetune_step(model, optimizer, x, y):
    return plain_step(model, optimizer, x, y)


# ================================================================= detectron2, mmengine, accelerate

class D2Model(nn.Module):
    """A model taking detectron2's list[dict] inputs and returning a dict of losses;
    pixel_mean/std are non-persistent buffers as in GeneralizedRCNN."""

    def __init__(self):
        super().__init__()
        self.register_buffer("pixel_mean", torch.tensor([0.5, 0.4, 0.3]).view(-1, 1, 1), False)
        self.register_buffer("pixel_std", torch.tensor([0.2, 0.2, 0.2]).view(-1, 1, 1), False)
        self.net = ConvBN()

    def forward(self, batched_inputs):
        images = [(x["image"] - self.pixel_mean) / self.pixel_std for x in batched_inputs]
        logits = self.net(torch.stack(images))
        labels = torch.stack([x["label"] for x in batched_inputs])
        return {"loss_cls": F.cross_entropy(logits, labels), "loss_reg": logits.pow(2).mean() * 0.01}


class EventStorage:
    def __init__(self):
        self.iter = 0
        self._history = {}

    def put_scalar(self, name, value):
        self._history.setdefault(name, []).append((float(value), self.iter))

    def put_scalars(self, **kwargs):
        for k, v in kwargs.items():
            self.put_scalar(k, v)


class SimpleTrainer:
    """facebookresearch/detectron2 detectron2/engine/train_loop.py SimpleTrainer"""

    def __init__(self, model, data_loader, optimizer):
        self.model, self.data_loader, self.optimizer = model, data_loader, optimizer
        self._data_loader_iter_obj = None
        self.storage = EventStorage()

    @property
    def _data_loader_iter(self):
        if self._data_loader_iter_obj is None:
            self._data_loader_iter_obj = iter(self.data_loader)
        return self._data_loader_iter_obj

    def run_step(self):
        assert self.model.training, "[SimpleTrainer] model was changed to eval mode!"
        data = next(self._data_loader_iter)
        return self.run_step_on(data)

    def run_step_on(self, data):
        loss_dict = self.model(data)
        if isinstance(loss_dict, torch.Tensor):
            losses = loss_dict
            loss_dict = {"total_loss": loss_dict}
        else:
            losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        losses.backward()
        self._write_metrics(loss_dict, 0.0)
        self.optimizer.step()

    def _write_metrics(self, loss_dict, data_time, prefix=""):
        metrics_dict = {k: v.detach().cpu().item() for k, v in loss_dict.items()}
        metrics_dict["data_time"] = data_time
        all_metrics_dict = [metrics_dict]
        data_time = np.max([x.pop("data_time") for x in all_metrics_dict])
        self.storage.put_scalar("data_time", data_time)
        metrics_dict = {k: np.mean([x[k] for x in all_metrics_dict]) for k in all_metrics_dict[0].keys()}
        total_losses_reduced = sum(metrics_dict.values())
        if not np.isfinite(total_losses_reduced):
            raise FloatingPointError(f"Loss became infinite or NaN at iteration={self.storage.iter}!")
        self.storage.put_scalar("{}total_loss".format(prefix), total_losses_reduced)
        if len(metrics_dict) > 1:
            self.storage.put_scalars(**metrics_dict)


def _d2_data(d, n=4):
    imgs, labels = d.img(n), d.cls(n)
    return [{"image": imgs[j], "label": labels[j]} for j in range(n)]


@seeded
def _d2_setup():
    model = D2Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=1e-4)
    loader = [_d2_data(Data(100 + j)) for j in range(8)]
    return SimpleNamespace(trainer=SimpleTrainer(model, loader, opt))


@habit(id="d2_simple_trainer_run_step_next_iter",
       source="facebookresearch/detectron2 detectron2/engine/train_loop.py SimpleTrainer.run_step: "
              "data = next(self._data_loader_iter) (a lazily created iterator property)",
       what="the step (a method with no arguments) pulls its batch from an iterator it creates "
            "lazily on its object",
       expect=REFUSED, rule=PATH, setup=_d2_setup, bind=lambda s: s.trainer.run_step,
       call=lambda step, s, i, d: step())
def _unused10(*a):
    raise AssertionError


@habit(id="d2_write_metrics_item_isfinite",
       source="facebookresearch/detectron2 detectron2/engine/train_loop.py SimpleTrainer."
              "_write_metrics: {k: v.detach().cpu().item()}; np.isfinite(total_losses_reduced) "
              "raise FloatingPointError; storage.put_scalar(...) between backward and step",
       what="losses read with .item() into a host event storage, and a decision on their sum: "
            "each call traces again (the storage it reads has grown, and each loss turned "
            "into a float is a decision on its value), and the storage holds eager's values",
       expect=EQUAL, rule=GUARD, setup=_d2_setup, bind=lambda s: s.trainer.run_step_on,
       call=lambda step, s, i, d: step(_d2_data(d)))
def _unused11(*a):
    raise AssertionError


class OptimWrapper:
    """open-mmlab/mmengine mmengine/optim/optimizer/optimizer_wrapper.py OptimWrapper"""

    def __init__(self, optimizer, accumulative_counts=1, clip_grad=None):
        self.optimizer = optimizer
        self._accumulative_counts = accumulative_counts
        self._inner_count = 0
        self._max_counts = -1
        self._remainder_counts = -1
        self.clip_grad_kwargs = clip_grad
        if clip_grad is not None:
            self.clip_func = torch.nn.utils.clip_grad_norm_

    @contextlib.contextmanager
    def optim_context(self, model):
        yield

    def update_params(self, loss, step_kwargs=None, zero_kwargs=None):
        loss = self.scale_loss(loss)
        self.backward(loss)
        if self.should_update():
            self.step(**(step_kwargs or {}))
            self.zero_grad(**(zero_kwargs or {}))

    def scale_loss(self, loss):
        if self._accumulative_counts == 1:
            loss_factor = 1
        elif self._max_counts == -1:
            loss_factor = self._accumulative_counts
        else:
            loss_factor = self._remainder_counts
        return loss / loss_factor

    def backward(self, loss, **kwargs):
        loss.backward(**kwargs)
        self._inner_count += 1

    def zero_grad(self, **kwargs):
        self.optimizer.zero_grad(**kwargs)

    def step(self, **kwargs):
        if self.clip_grad_kwargs:
            params = [p for g in self.optimizer.param_groups for p in g['params']
                      if p.requires_grad and p.grad is not None]
            self.clip_func(params, **self.clip_grad_kwargs)
        self.optimizer.step(**kwargs)

    def should_update(self):
        return (self._inner_count % self._accumulative_counts == 0
                or self._inner_count == self._max_counts)


class MMClassifier(nn.Module):
    """mmengine BaseModel.train_step / _run_forward / parse_losses"""

    def __init__(self):
        super().__init__()
        self.backbone = MLP()

    def forward(self, inputs, data_samples=None, mode='tensor'):
        logits = self.backbone(inputs)
        if mode == 'loss':
            return {'loss_cls': F.cross_entropy(logits, data_samples), 'acc': (logits.argmax(1) == data_samples).float().mean()}
        return logits

    def data_preprocessor(self, data, training=False):
        return {k: v.to(next(self.parameters()).device) for k, v in data.items()}

    def train_step(self, data, optim_wrapper):
        with optim_wrapper.optim_context(self):
            data = self.data_preprocessor(data, True)
            losses = self._run_forward(data, mode='loss')
        parsed_losses, log_vars = self.parse_losses(losses)
        optim_wrapper.update_params(parsed_losses)
        return log_vars

    def _run_forward(self, data, mode):
        if isinstance(data, dict):
            return self(**data, mode=mode)
        return self(*data, mode=mode)

    def parse_losses(self, losses):
        log_vars = []
        for loss_name, loss_value in losses.items():
            if isinstance(loss_value, torch.Tensor):
                log_vars.append([loss_name, loss_value.mean()])
            else:
                log_vars.append([loss_name, sum(_loss.mean() for _loss in loss_value)])
        loss = sum(value for key, value in log_vars if 'loss' in key)
        log_vars.insert(0, ['loss', loss])
        return loss, OrderedDict(log_vars)


@seeded
def _mm_setup():
    model = MMClassifier()
    return SimpleNamespace(model=model, optim_wrapper=OptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), clip_grad=dict(max_norm=1.0)))


@habit(id="mmengine_train_step_optim_wrapper",
       source="open-mmlab/mmengine mmengine/model/base_model/base_model.py BaseModel.train_step "
              "(data_preprocessor, _run_forward(mode='loss'), parse_losses, optim_wrapper."
              "update_params) and mmengine/optim/optimizer/optimizer_wrapper.py (backward: "
              "self._inner_count += 1; should_update())",
       what="the optimizer inside a wrapper object whose host counter the step increments "
            "and decides on (accumulation)",
       expect=EQUAL, rule=HOST_NUMBERS, setup=_mm_setup,
       bind=lambda s: s.model.train_step,
       call=lambda step, s, i, d: step({"inputs": d.vec(), "data_samples": d.cls()}, s.optim_wrapper))
def _unused12(*a):
    raise AssertionError


class GradientState:
    def __init__(self, num_steps):
        self.num_steps, self.sync_gradients = num_steps, True
        self.end_of_dataloader, self.sync_with_dataloader = False, True

    def _set_sync_gradients(self, sync_gradients):
        self.sync_gradients = sync_gradients


class MiniAccelerator:
    """huggingface/accelerate src/accelerate/accelerator.py accumulate/_do_sync/backward"""

    def __init__(self, gradient_accumulation_steps=2):
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.gradient_state = GradientState(gradient_accumulation_steps)
        self.step = 0

    @property
    def sync_gradients(self):
        return self.gradient_state.sync_gradients

    def _do_sync(self):
        if self.gradient_state.sync_with_dataloader and self.gradient_state.end_of_dataloader:
            self.step = 0
            self.gradient_state._set_sync_gradients(True)
        else:
            self.step += 1
            self.gradient_state._set_sync_gradients((self.step % self.gradient_state.num_steps) == 0)

    @contextlib.contextmanager
    def accumulate(self, *models):
        self._do_sync()
        with contextlib.ExitStack() as cm_stack:
            for m in models:
                no_sync = getattr(m, "no_sync", contextlib.nullcontext)
                cm_stack.enter_context(contextlib.nullcontext() if self.sync_gradients else no_sync())
            yield

    def backward(self, loss, **kwargs):
        loss = loss / self.gradient_accumulation_steps
        loss.backward(**kwargs)


class AcceleratedOptimizer:
    def __init__(self, optimizer, gradient_state):
        self.optimizer, self.gradient_state = optimizer, gradient_state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        if self.gradient_state.sync_gradients:
            self.optimizer.step(closure)

    def zero_grad(self, set_to_none=None):
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)


@seeded
def _accelerate_setup():
    model = MLP()
    accelerator = MiniAccelerator(2)
    opt = AcceleratedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), accelerator.gradient_state)
    return SimpleNamespace(model=model, accelerator=accelerator, opt=opt)


@habit(id="accelerate_accumulate_context",
       source="huggingface/accelerate src/accelerate/accelerator.py Accelerator.accumulate -> "
              "_do_sync (self.step += 1; sync_gradients = step % num_steps == 0), backward "
              "(loss / gradient_accumulation_steps); optimizer.py AcceleratedOptimizer.step/"
              "zero_grad skip unless sync_gradients; as in every *_no_trainer.py example",
       what="accumulation decided by a host counter that accelerate increments inside the step",
       expect=EQUAL, rule=HOST_NUMBERS, setup=_accelerate_setup,
       call=lambda step, s, i, d: step(s.accelerator, s.model, s.opt, d.vec(), d.cls()))
def accelerate_step(accelerator, model, optimizer, x, y):
    with accelerator.accumulate(model):
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return loss


# ================================================================= more research code

def mixup_data(x, y, alpha=1.0):
    """facebookresearch/mixup-cifar10 train.py"""
    if alpha > 0:
        lam = np.random.beta(alpha, alpha)
    else:
        lam = 1
    batch_size = x.size()[0]
    index = torch.randperm(batch_size)
    mixed_x = lam * x + (1 - lam) * x[index, :]
    y_a, y_b = y, y[index]
    return mixed_x, y_a, y_b, lam


def mixup_criterion(criterion, pred, y_a, y_b, lam):
    return lam * criterion(pred, y_a) + (1 - lam) * criterion(pred, y_b)


@seeded
def _mixup_setup():
    s = conv_sgd.__wrapped__()
    s.criterion = nn.CrossEntropyLoss()
    return s


@habit(id="mixup_cifar10_numpy_beta_lam",
       source="facebookresearch/mixup-cifar10 train.py mixup_data: lam = np.random.beta(alpha, "
              "alpha); index = torch.randperm(batch_size); mixed_x = lam * x + (1 - lam) * "
              "x[index, :]; mixup_criterion",
       what="a numpy draw every call that enters only arithmetic (lam), plus torch.randperm",
       expect=EQUAL, rule=HOST_RNG, setup=_mixup_setup, ranks=True,
       call=lambda step, s, i, d: step(s.model, s.criterion, s.opt, d.img(), d.cls()))
def mixup_step(net, criterion, optimizer, inputs, targets):
    inputs, targets_a, targets_b, lam = mixup_data(inputs, targets, 1.0)
    outputs = net(inputs)
    loss = mixup_criterion(criterion, outputs, targets_a, targets_b, lam)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


def cutmix_rand_bbox(size, lam):
    W, H = size[2], size[3]
    cut_rat = np.sqrt(1. - lam)
    cut_w, cut_h = int(W * cut_rat), int(H * cut_rat)
    cx, cy = np.random.randint(W), np.random.randint(H)
    bbx1, bby1 = np.clip(cx - cut_w // 2, 0, W), np.clip(cy - cut_h // 2, 0, H)
    bbx2, bby2 = np.clip(cx + cut_w // 2, 0, W), np.clip(cy + cut_h // 2, 0, H)
    return bbx1, bby1, bbx2, bby2


@habit(id="cutmix_clovaai_random_box",
       source="clovaai/CutMix-PyTorch train.py train(): r = np.random.rand(1); if args.beta > 0 and "
              "r < args.cutmix_prob: lam = np.random.beta(...); rand_bbox(input.size(), lam); "
              "input[:, :, bbx1:bbx2, bby1:bby2] = input[rand_index, :, bbx1:bbx2, bby1:bby2]",
       what="a numpy draw decides whether to cut and mix; the box bounds (slices) are random ints",
       expect=REFUSED, rule=HOST_RNG, setup=_mixup_setup,
       call=lambda step, s, i, d: step(s.model, s.criterion, s.opt, d.img(), d.cls()))
def cutmix_step(model, criterion, optimizer, input, target, beta=1.0, cutmix_prob=0.5):
    r = np.random.rand(1)
    if beta > 0 and r < cutmix_prob:
        lam = np.random.beta(beta, beta)
        rand_index = torch.randperm(input.size()[0])
        target_a, target_b = target, target[rand_index]
        bbx1, bby1, bbx2, bby2 = cutmix_rand_bbox(input.size(), lam)
        input = input.clone()
        input[:, :, bbx1:bbx2, bby1:bby2] = input[rand_index, :, bbx1:bbx2, bby1:bby2]
        lam = 1 - ((bbx2 - bbx1) * (bby2 - bby1) / (input.size()[-1] * input.size()[-2]))
        output = model(input)
        loss = criterion(output, target_a) * lam + criterion(output, target_b) * (1. - lam)
    else:
        output = model(input)
        loss = criterion(output, target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


class AllenNLPModel(nn.Module):
    """An allennlp Model: forward(**batch) returns a dict with 'loss'."""

    def __init__(self):
        super().__init__()
        self.encoder = MLP()

    def forward(self, tokens, label):
        logits = self.encoder(tokens)
        return {"logits": logits, "loss": F.cross_entropy(logits, label)}


@seeded
def _allennlp_setup():
    model = AllenNLPModel()
    grad_clipping = 0.01
    for parameter in model.parameters():     # training/util.py enable_gradient_clipping
        if parameter.requires_grad:
            parameter.register_hook(lambda grad: grad.clamp(-grad_clipping, grad_clipping))
    return SimpleNamespace(model=model, opt=torch.optim.Adam(model.parameters(), lr=1e-3))


@habit(id="allennlp_gradient_clipping_tensor_hooks",
       source="allenai/allennlp allennlp/training/util.py enable_gradient_clipping: "
              "parameter.register_hook(lambda grad: nn_util.clamp_tensor(grad, -c, c)); "
              "gradient_descent_trainer.py batch_outputs = model(**batch); loss.backward(); "
              "rescale_gradients (clip_grad_norm_); optimizer.step()",
       what="gradient hooks on every parameter clamp each rank's gradient before it "
            "accumulates (under DDP: before the all-reduce), then a global-norm rescale",
       expect=EQUAL, rule=HOOKS, setup=_allennlp_setup, ranks=True,
       call=lambda step, s, i, d: step(s.model, s.opt, {"tokens": d.vec(), "label": d.cls()}))
def allennlp_step(model, optimizer, batch, grad_norm=1.0):
    optimizer.zero_grad()
    batch_outputs = model(**batch)
    loss = batch_outputs["loss"]
    loss.backward()
    parameters_to_clip = [p for p in model.parameters() if p.grad is not None]
    batch_grad_norm = torch.nn.utils.clip_grad_norm_(parameters_to_clip, grad_norm)
    optimizer.step()
    return loss, batch_grad_norm


one = torch.tensor(1.)      # gan_toy.py: one = torch.FloatTensor([1]); mone = one * -1
mone = one * -1


def calc_gradient_penalty(netD, real_data, fake_data, LAMBDA=0.1):
    alpha = torch.rand(real_data.size(0), 1)
    alpha = alpha.expand(real_data.size())
    interpolates = alpha * real_data + ((1 - alpha) * fake_data)
    interpolates.requires_grad_(True)
    disc_interpolates = netD(interpolates)
    gradients = torch.autograd.grad(outputs=disc_interpolates, inputs=interpolates,
                                    grad_outputs=torch.ones(disc_interpolates.size()),
                                    create_graph=True, retain_graph=True, only_inputs=True)[0]
    return ((gradients.norm(2, dim=1) - 1) ** 2).mean() * LAMBDA


@seeded
def _wgan_setup():
    netG = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2))
    netD = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
    return SimpleNamespace(netG=netG, netD=netD,
                           optimizerD=torch.optim.Adam(netD.parameters(), lr=1e-4, betas=(0.5, 0.9)),
                           optimizerG=torch.optim.Adam(netG.parameters(), lr=1e-4, betas=(0.5, 0.9)))


@habit(id="wgan_gp_double_backward_critic_loop",
       source="caogang/wgan-gp gan_toy.py: for p in netD.parameters(): p.requires_grad = True; "
              "for iter_d in range(CRITIC_ITERS): D_real.backward(mone); D_fake.backward(one); "
              "calc_gradient_penalty (autograd.grad(create_graph=True)); optimizerD.step(); then "
              "p.requires_grad = False and the generator's step",
       what="gradient penalty through a double backward, backward(gradient) with global "
            "tensors, several critic steps, requires_grad flipped and left False at the end",
       expect=EQUAL, rule=PHASES, setup=_wgan_setup,
       call=lambda step, s, i, d: step(s.netD, s.netG, s.optimizerD, s.optimizerG, d.vec(8, 2)))
def wgan_gp_step(netD, netG, optimizerD, optimizerG, real_data, CRITIC_ITERS=2):
    for p in netD.parameters():
        p.requires_grad = True
    for iter_d in range(CRITIC_ITERS):
        netD.zero_grad()
        D_real = netD(real_data).mean()
        D_real.backward(mone)
        noise = torch.randn(real_data.size(0), 2)
        with torch.no_grad():
            fake = netG(noise)
        D_fake = netD(fake).mean()
        D_fake.backward(one)
        gradient_penalty = calc_gradient_penalty(netD, real_data, fake)
        gradient_penalty.backward()
        D_cost = D_fake - D_real + gradient_penalty
        optimizerD.step()
    for p in netD.parameters():
        p.requires_grad = False
    netG.zero_grad()
    noise = torch.randn(real_data.size(0), 2)
    G = netD(netG(noise)).mean()
    G.backward(mone)
    optimizerG.step()
    return D_cost, -G


@seeded
def _sngan_setup():
    import warnings
    sn = torch.nn.utils.spectral_norm
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        netD = nn.Sequential(sn(nn.Conv2d(3, 8, 3, 1, 1)), nn.LeakyReLU(0.1),
                             sn(nn.Conv2d(8, 8, 4, 2, 1)), nn.LeakyReLU(0.1), nn.Flatten(),
                             sn(nn.Linear(8 * 4 * 4, 1)))
    netG = nn.Sequential(nn.Linear(8, 3 * 8 * 8), nn.Tanh())
    return SimpleNamespace(netD=netD, netG=netG,
                           optimD=torch.optim.Adam(netD.parameters(), 2e-4, betas=(0.0, 0.9)))


@habit(id="sngan_spectral_norm_hinge",
       source="w86763777/pytorch-gan-collections source/models/sngan.py (torch.nn.utils."
              "spectral_norm on every layer of D) and train.py's hinge loss for D: "
              "loss = F.relu(1 - net_D(real)).mean() + F.relu(1 + net_D(fake)).mean()",
       what="spectral norm's forward pre-hook runs a power iteration (u, v buffers updated in "
            "place) and sets the layer's weight attribute on every forward",
       expect=EQUAL, rule=HOOKS, setup=_sngan_setup,
       call=lambda step, s, i, d: step(s.netD, s.netG, s.optimD, d.img(4)))
def sngan_d_step(net_D, net_G, optim_D, real):
    with torch.no_grad():
        z = torch.randn(real.size(0), 8)
        fake = net_G(z).view(-1, 3, 8, 8).detach()
    net_D_real, net_D_fake = net_D(real), net_D(fake)
    loss = F.relu(1 - net_D_real).mean() + F.relu(1 + net_D_fake).mean()
    optim_D.zero_grad()
    loss.backward()
    optim_D.step()
    return loss


class ClipLoss(nn.Module):
    """mlfoundations/open_clip src/open_clip/loss.py ClipLoss (one process)"""

    def __init__(self, local_loss=False, gather_with_grad=False, cache_labels=False, rank=0,
                 world_size=1, use_horovod=False):
        super().__init__()
        self.local_loss, self.gather_with_grad, self.cache_labels = local_loss, gather_with_grad, cache_labels
        self.rank, self.world_size, self.use_horovod = rank, world_size, use_horovod
        self.prev_num_logits = 0
        self.labels = {}

    def get_ground_truth(self, device, num_logits):
        if self.prev_num_logits != num_logits or device not in self.labels:
            labels = torch.arange(num_logits, device=device, dtype=torch.long)
            if self.world_size > 1 and self.local_loss:
                labels = labels + num_logits * self.rank
            if self.cache_labels:
                self.labels[device] = labels
                self.prev_num_logits = num_logits
        else:
            labels = self.labels[device]
        return labels

    def get_logits(self, image_features, text_features, logit_scale):
        logits_per_image = logit_scale * image_features @ text_features.T
        logits_per_text = logit_scale * text_features @ image_features.T
        return logits_per_image, logits_per_text

    def forward(self, image_features, text_features, logit_scale, output_dict=False):
        device = image_features.device
        logits_per_image, logits_per_text = self.get_logits(image_features, text_features, logit_scale)
        labels = self.get_ground_truth(device, logits_per_image.shape[0])
        total_loss = (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2
        return {"contrastive_loss": total_loss} if output_dict else total_loss


class TinyCLIP(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = nn.Linear(16, 8)
        self.token_embedding = nn.Embedding(24, 8)
        self.logit_scale = nn.Parameter(torch.ones([]) * np.log(1 / 0.07))

    def forward(self, image, text):
        image_features = F.normalize(self.visual(image), dim=-1)
        text_features = F.normalize(self.token_embedding(text).mean(1), dim=-1)
        return {"image_features": image_features, "text_features": text_features,
                "logit_scale": self.logit_scale.exp()}


@seeded
def _clip_setup():
    model = TinyCLIP()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, betas=(0.9, 0.98), eps=1e-6)
    return SimpleNamespace(model=model, opt=opt, loss=ClipLoss(cache_labels=True))


def _clip_cosine_lr(s, step, base_lr=5e-4, warmup_length=2, steps=8):
    """open_clip src/training/scheduler.py cosine_lr -> assign_learning_rate"""
    if step < warmup_length:
        lr = base_lr * (step + 1) / warmup_length
    else:
        e, es = step - warmup_length, steps - warmup_length
        lr = 0.5 * (1 + np.cos(np.pi * e / es)) * base_lr
    for param_group in s.opt.param_groups:
        param_group["lr"] = lr


@habit(id="open_clip_cached_labels_logit_scale_clamp",
       source="mlfoundations/open_clip src/training/train.py train_one_epoch: scheduler(step); "
              "model_out = model(images, texts); losses = loss(**model_out, output_dict=True); "
              "with torch.no_grad(): unwrap_model(model).logit_scale.clamp_(0, math.log(100)); "
              "src/open_clip/loss.py ClipLoss.get_ground_truth (cache_labels=True)",
       what="the loss caches its labels tensor and the batch size on its first call "
            "(self.labels[device], self.prev_num_logits) and reads the cache afterwards; "
            "a parameter clamped in place after the step; lr from numpy between calls",
       expect=EQUAL, rule=LAZY, setup=_clip_setup, between=_clip_cosine_lr,
       call=lambda step, s, i, d: step(s.model, s.loss, s.opt, d.vec(), d.tok(8, 5, 24)))
def open_clip_step(model, loss, optimizer, images, texts):
    optimizer.zero_grad()
    model_out = model(images, texts)
    losses = loss(**model_out, output_dict=True)
    total_loss = sum(losses.values())
    losses["loss"] = total_loss
    total_loss.backward()
    optimizer.step()
    with torch.no_grad():
        unwrap(model).logit_scale.clamp_(0, math.log(100))
    return losses


_GLOBAL_ARGS = None


def get_args():
    """megatron/global_vars.py get_args"""
    return _GLOBAL_ARGS


@seeded
def _megatron_setup():
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = SimpleNamespace(curriculum_learning_legacy=True, curriculum_seqlen=4)
    s = _nanogpt_plain_setup.__wrapped__()
    s.args = _GLOBAL_ARGS
    return s


def _curriculum(s, i):
    """deepspeed's curriculum scheduler raises the sequence length during training"""
    s.args.curriculum_seqlen = 4 if i < 2 else 6


@habit(id="megatron_curriculum_seqlen_global_args",
       source="microsoft/Megatron-DeepSpeed pretrain_gpt.py forward_step/get_batch: args = "
              "get_args(); if args.curriculum_learning_legacy and args.curriculum_seqlen < "
              "tokens.size()[1]: tokens = tokens[:, :args.curriculum_seqlen].contiguous()",
       what="a global args object (reached through a function) whose attribute, changed "
            "between calls, decides the sequence length (a shape)",
       expect=EQUAL, rule=GUARD, setup=_megatron_setup, between=_curriculum,
       call=lambda step, s, i, d: step(s.model, s.opt, *_nanogpt_batches(d)[0]))
def megatron_step(model, optimizer, tokens, labels):
    args = get_args()
    if args.curriculum_learning_legacy and args.curriculum_seqlen < tokens.size()[1]:
        tokens = tokens[:, :args.curriculum_seqlen].contiguous()
        labels = labels[:, :args.curriculum_seqlen].contiguous()
    logits, loss = model(tokens, labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


class VPSDE:
    """yang-song/score_sde_pytorch sde_lib.py VPSDE (continuous marginal_prob)"""

    def __init__(self, beta_min=0.1, beta_max=20, N=1000):
        self.beta_0, self.beta_1, self.N = beta_min, beta_max, N
        self.discrete_betas = torch.linspace(beta_min / N, beta_max / N, N)

    @property
    def T(self):
        return 1

    def marginal_prob(self, x, t):
        log_mean_coeff = -0.25 * t ** 2 * (self.beta_1 - self.beta_0) - 0.5 * t * self.beta_0
        mean = torch.exp(log_mean_coeff[:, None, None, None]) * x
        std = torch.sqrt(1. - torch.exp(2. * log_mean_coeff))
        return mean, std


class ScoreNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.t_embed = nn.Linear(1, 3)

    def forward(self, x, labels):
        return self.conv(x) + self.t_embed(labels[:, None] / 1000.)[:, :, None, None]


class ScoreEMA:
    """score_sde_pytorch models/ema.py ExponentialMovingAverage"""

    def __init__(self, parameters, decay, use_num_updates=True):
        self.decay = decay
        self.num_updates = 0 if use_num_updates else None
        self.shadow_params = [p.clone().detach() for p in parameters if p.requires_grad]

    def update(self, parameters):
        decay = self.decay
        if self.num_updates is not None:
            self.num_updates += 1
            decay = min(decay, (1 + self.num_updates) / (10 + self.num_updates))
        one_minus_decay = 1.0 - decay
        with torch.no_grad():
            parameters = [p for p in parameters if p.requires_grad]
            for s_param, param in zip(self.shadow_params, parameters):
                s_param.sub_(one_minus_decay * (s_param - param))


def get_score_step_fn(sde, lr=2e-4, warmup=2, grad_clip=1., eps=1e-5):
    """losses.py get_sde_loss_fn / optimization_manager / get_step_fn (train=True)"""
    reduce_op = lambda *args, **kwargs: 0.5 * torch.sum(*args, **kwargs)   # noqa: E731

    def loss_fn(model, batch):
        t = torch.rand(batch.shape[0], device=batch.device) * (sde.T - eps) + eps
        z = torch.randn_like(batch)
        mean, std = sde.marginal_prob(batch, t)
        perturbed_data = mean + std[:, None, None, None] * z
        score = -model(perturbed_data, t * 999) / std[:, None, None, None]
        losses = torch.square(score * std[:, None, None, None] + z)
        losses = reduce_op(losses.reshape(losses.shape[0], -1), dim=-1)
        return torch.mean(losses)

    def optimize_fn(optimizer, params, step):
        if warmup > 0:
            for g in optimizer.param_groups:
                g['lr'] = lr * np.minimum(step / warmup, 1.0)
        if grad_clip >= 0:
            torch.nn.utils.clip_grad_norm_(params, max_norm=grad_clip)
        optimizer.step()

    def step_fn(state, batch):
        model = state['model']
        optimizer = state['optimizer']
        optimizer.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        optimize_fn(optimizer, model.parameters(), step=state['step'])
        state['step'] += 1
        state['ema'].update(model.parameters())
        return loss

    return step_fn


@seeded
def _score_setup():
    model = ScoreNet()
    state = dict(optimizer=torch.optim.Adam(model.parameters(), lr=2e-4), model=model,
                 ema=ScoreEMA(model.parameters(), decay=0.999), step=0)
    return SimpleNamespace(state=state, step_fn=get_score_step_fn(VPSDE()))


@habit(id="score_sde_state_dict_step_fn",
       source="yang-song/score_sde_pytorch losses.py get_step_fn: step_fn(state, batch): "
              "optimize_fn(optimizer, model.parameters(), step=state['step']) (g['lr'] = lr * "
              "np.minimum(step / warmup, 1.0)); state['step'] += 1; state['ema'].update(...)",
       what="a closure-built step over a state dict: the step writes the lr of the param "
            "groups, increments state['step'] and the EMA's num_updates on the host",
       expect=REFUSED, rule=HOST_WRITE, setup=_score_setup, bind=lambda s: s.step_fn,
       call=lambda step, s, i, d: step(s.state, d.img(4)))
def _unused13(*a):
    raise AssertionError


class SAM(torch.optim.Optimizer):
    """davda54/sam sam.py"""

    def __init__(self, params, base_optimizer, rho=0.05, adaptive=False, **kwargs):
        defaults = dict(rho=rho, adaptive=adaptive, **kwargs)
        super().__init__(params, defaults)
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        grad_norm = self._grad_norm()
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                e_w = (torch.pow(p, 2) if group["adaptive"] else 1.0) * p.grad * scale.to(p)
                p.add_(e_w)
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    def _grad_norm(self):
        shared_device = self.param_groups[0]["params"][0].device
        return torch.norm(torch.stack([
            ((torch.abs(p) if group["adaptive"] else 1.0) * p.grad).norm(p=2).to(shared_device)
            for group in self.param_groups for p in group["params"] if p.grad is not None]), p=2)


def smooth_crossentropy(pred, gold, smoothing=0.1):
    n_class = pred.size(1)
    one_hot = torch.full_like(pred, fill_value=smoothing / (n_class - 1))
    one_hot.scatter_(dim=1, index=gold.unsqueeze(1), value=1.0 - smoothing)
    log_prob = F.log_softmax(pred, dim=1)
    return F.kl_div(input=log_prob, target=one_hot, reduction='none').sum(-1)


def disable_running_stats(model):
    def _disable(module):
        if isinstance(module, nn.BatchNorm2d):
            module.backup_momentum = module.momentum
            module.momentum = 0
    model.apply(_disable)


def enable_running_stats(model):
    def _enable(module):
        if isinstance(module, nn.BatchNorm2d) and hasattr(module, "backup_momentum"):
            module.momentum = module.backup_momentum
    model.apply(_enable)


def _sam_setup(make):
    @seeded
    def build():
        model = make()
        return SimpleNamespace(model=model, opt=SAM(model.parameters(), torch.optim.SGD, rho=2.0,
                                                    adaptive=True, lr=0.1, momentum=0.9,
                                                    weight_decay=5e-4))
    return build


@habit(id="sam_running_stats_toggle",
       source="davda54/sam example/train.py: enable_running_stats(model); ...; "
              "optimizer.first_step(zero_grad=True); disable_running_stats(model) (module."
              "backup_momentum = module.momentum; module.momentum = 0); second forward/backward; "
              "optimizer.second_step(zero_grad=True)",
       what="BatchNorm momentum changed inside the step and left changed (restored at the "
            "next call's start); a new attribute added to the BN modules",
       expect=EQUAL, rule=LAZY, setup=_sam_setup(ConvBN),
       call=img_xy)
def sam_bn_step(model, optimizer, inputs, targets):
    enable_running_stats(model)
    predictions = model(inputs)
    loss = smooth_crossentropy(predictions, targets)
    loss.mean().backward()
    optimizer.first_step(zero_grad=True)
    disable_running_stats(model)
    smooth_crossentropy(model(inputs), targets).mean().backward()
    optimizer.second_step(zero_grad=True)
    return loss.mean()


@habit(id="sam_optimizer_first_second_step",
       source="davda54/sam sam.py SAM.first_step / second_step (state['old_p'] = p.data.clone(); "
              "p.data = self.state[p]['old_p']; self.base_optimizer.step()), adaptive SAM",
       what="a wrapper optimizer (SAM around SGD sharing param_groups) with two backward passes; "
            "parameters' .data replaced by a tensor kept in the optimizer's state",
       expect=EQUAL, rule=INPUTS, setup=_sam_setup(MLP), call=xy)
def sam_step(model, optimizer, inputs, targets):
    loss = smooth_crossentropy(model(inputs), targets)
    loss.mean().backward()
    optimizer.first_step(zero_grad=True)
    smooth_crossentropy(model(inputs), targets).mean().backward()
    optimizer.second_step(zero_grad=True)
    return loss.mean()


# ================================================================= RL, DP-SGD, GANs, graphs, preference tuning
# (CleanRL, stable-baselines3, ignite, Opacus, StyleGAN2, PyG, TRL, ...)

# ----------------------------------------------------------------- 1 SB3 DQN + polyak (out=)

class QNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)


class ReplayBufferSamples(NamedTuple):
    observations: torch.Tensor
    actions: torch.Tensor
    next_observations: torch.Tensor
    dones: torch.Tensor
    rewards: torch.Tensor


def polyak_update(params, target_params, tau):
    """stable_baselines3/common/utils.py polyak_update"""
    with torch.no_grad():
        for param, target_param in zip(params, target_params, strict=True):
            target_param.data.mul_(1 - tau)
            torch.add(target_param.data, param.data, alpha=tau, out=target_param.data)


def get_parameters_by_name(model, included_names):
    return [param for name, param in model.state_dict().items()
            if any(key in name for key in included_names)]


class DQNPolicy(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_net = QNet()
        self.q_net_target = QNet()
        self.q_net_target.load_state_dict(self.q_net.state_dict())
        self.q_net_target.train(False)


@seeded
def _sb3_dqn_setup():
    policy = DQNPolicy()
    opt = torch.optim.Adam(policy.q_net.parameters(), lr=1e-3)
    return SimpleNamespace(q_net=policy.q_net, q_net_target=policy.q_net_target, opt=opt,
                           gamma=0.99, tau=0.005, max_grad_norm=10.0)


def _replay(d):
    return ReplayBufferSamples(d.vec(), torch.randint(0, 4, (8, 1), generator=d.g),
                               d.vec(), (d.uniform(8, 1) > 0.8).float(), d.uniform(8, 1))


def _sb3_dqn_ddp(s):
    s.q_net = nn.parallel.DistributedDataParallel(s.q_net)


@habit(id="sb3_dqn_train_polyak_update_out",
       source="DLR-RM/stable-baselines3 stable_baselines3/dqn/dqn.py DQN.train (target under "
              "no_grad, th.gather, smooth_l1, clip_grad_norm_) and _on_step -> "
              "common/utils.py polyak_update (th.add(target.data, param.data, alpha=tau, "
              "out=target_param.data)), batch_norm_stats polyak with tau=1.0",
       what="soft target update written through torch.add(..., out=p.data) on target "
            "parameters and BN running stats; ReplayBufferSamples NamedTuple batch",
       expect=EQUAL, rule=INPUTS, setup=_sb3_dqn_setup, ranks=True, ddp=_sb3_dqn_ddp,
       call=lambda step, s, i, d: step(SimpleNamespace(q_net=s.q_net, q_net_target=s.q_net_target),
                                       s.opt, _replay(d), s.gamma, s.tau, s.max_grad_norm))
def sb3_dqn_step(policy, optimizer, replay_data, gamma, tau, max_grad_norm):
    with torch.no_grad():
        next_q_values = policy.q_net_target(replay_data.next_observations)
        next_q_values, _ = next_q_values.max(dim=1)
        next_q_values = next_q_values.reshape(-1, 1)
        target_q_values = replay_data.rewards + (1 - replay_data.dones) * gamma * next_q_values
    current_q_values = policy.q_net(replay_data.observations)
    current_q_values = torch.gather(current_q_values, dim=1, index=replay_data.actions.long())
    loss = F.smooth_l1_loss(current_q_values, target_q_values)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.q_net.parameters(), max_grad_norm)
    optimizer.step()
    polyak_update(policy.q_net.parameters(), policy.q_net_target.parameters(), tau)
    polyak_update(get_parameters_by_name(policy.q_net, ["running_"]),
                  get_parameters_by_name(policy.q_net_target, ["running_"]), 1.0)
    return loss


# ----------------------------------------------------------------- 2 CleanRL PPO with numpy minibatch indices

def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """vwxyzjn/cleanrl cleanrl/ppo.py Agent"""

    def __init__(self):
        super().__init__()
        self.critic = nn.Sequential(layer_init(nn.Linear(16, 32)), nn.Tanh(),
                                    layer_init(nn.Linear(32, 1), std=1.0))
        self.actor = nn.Sequential(layer_init(nn.Linear(16, 32)), nn.Tanh(),
                                   layer_init(nn.Linear(32, 4), std=0.01))

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        logits = self.actor(x)
        probs = torch.distributions.Categorical(logits=logits)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


def _ppo_args(**over):
    import argparse
    a = argparse.Namespace(learning_rate=2.5e-4, num_iterations=10, norm_adv=True,
                           clip_coef=0.2, clip_vloss=True, ent_coef=0.01, vf_coef=0.5,
                           max_grad_norm=0.5, minibatch_size=8, batch_size=32, anneal_lr=True)
    vars(a).update(over)
    return a


@seeded
def _ppo_setup():
    agent = Agent()
    args = _ppo_args()
    opt = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    g = torch.Generator().manual_seed(5)
    rollout = SimpleNamespace(
        b_obs=torch.randn(32, 16, generator=g),
        b_actions=torch.randint(0, 4, (32,), generator=g).float(),
        b_logprobs=-torch.rand(32, generator=g) * 1.5,
        b_advantages=torch.randn(32, generator=g),
        b_returns=torch.randn(32, generator=g),
        b_values=torch.randn(32, generator=g))
    return SimpleNamespace(agent=agent, opt=opt, args=args, rollout=rollout,
                           b_inds=np.arange(args.batch_size))


def _ppo_between(s, i):
    # iteration loop: lr annealing, then each epoch shuffles b_inds (np.random.shuffle)
    if s.args.anneal_lr:
        frac = 1.0 - (i - 1.0) / s.args.num_iterations
        s.opt.param_groups[0]["lr"] = frac * s.args.learning_rate
    np.random.shuffle(s.b_inds)


def _ppo_call(step, s, i, d):
    start = (i % 4) * s.args.minibatch_size
    mb_inds = s.b_inds[start:start + s.args.minibatch_size]
    r = s.rollout
    return step(s.agent, s.opt, s.args, r.b_obs, r.b_logprobs, r.b_actions, r.b_advantages,
                r.b_returns, r.b_values, mb_inds)


@habit(id="cleanrl_ppo_numpy_minibatch_indices",
       source="vwxyzjn/cleanrl cleanrl/ppo.py: b_inds = np.arange(args.batch_size); "
              "np.random.shuffle(b_inds); mb_inds = b_inds[start:end]; "
              "agent.get_action_and_value(b_obs[mb_inds], b_actions.long()[mb_inds]); "
              "norm_adv; clipped value loss; clip_grad_norm_; lr annealed through "
              "optimizer.param_groups[0]['lr'] = lrnow",
       what="the whole rollout tensors are arguments and the minibatch is picked inside the "
            "step by indexing them with a numpy int array argument that changes every call; "
            "Categorical (validate_args) log_prob/entropy; advantages normalized per minibatch",
       expect=EQUAL, rule=INPUTS, setup=_ppo_setup, between=_ppo_between,
       call=_ppo_call)
def cleanrl_ppo_step(agent, optimizer, args, b_obs, b_logprobs, b_actions, b_advantages,
                     b_returns, b_values, mb_inds):
    _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds],
                                                                  b_actions.long()[mb_inds])
    logratio = newlogprob - b_logprobs[mb_inds]
    ratio = logratio.exp()
    with torch.no_grad():
        old_approx_kl = (-logratio).mean()
        approx_kl = ((ratio - 1) - logratio).mean()
    mb_advantages = b_advantages[mb_inds]
    if args.norm_adv:
        mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
    pg_loss1 = -mb_advantages * ratio
    pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
    pg_loss = torch.max(pg_loss1, pg_loss2).mean()
    newvalue = newvalue.view(-1)
    if args.clip_vloss:
        v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
        v_clipped = b_values[mb_inds] + torch.clamp(newvalue - b_values[mb_inds],
                                                    -args.clip_coef, args.clip_coef)
        v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
        v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
    else:
        v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2).mean()
    entropy_loss = entropy.mean()
    loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
    optimizer.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
    optimizer.step()
    return loss, old_approx_kl, approx_kl


# ----------------------------------------------------------------- 2b the same, clipfracs list

@habit(id="cleanrl_ppo_clipfracs_item_append",
       source="vwxyzjn/cleanrl cleanrl/ppo.py: clipfracs += [((ratio - 1.0).abs() > "
              "args.clip_coef).float().mean().item()] inside the minibatch loop",
       what="a host list grows with a .item() of every minibatch",
       expect=REFUSED, rule=HOST_WRITE, setup=_ppo_setup, between=_ppo_between,
       call=lambda step, s, i, d: _ppo_clip_call(step, s, i, d))
def cleanrl_ppo_clipfrac_step(agent, optimizer, args, b_obs, b_actions, b_logprobs, mb_inds,
                              clipfracs):
    _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds],
                                                                  b_actions.long()[mb_inds])
    logratio = newlogprob - b_logprobs[mb_inds]
    ratio = logratio.exp()
    with torch.no_grad():
        clipfracs += [((ratio - 1.0).abs() > args.clip_coef).float().mean().item()]
    loss = -(ratio.mean()) + 0.5 * newvalue.pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


def _ppo_clip_call(step, s, i, d):
    return step(s.agent, s.opt, s.args, s.rollout.b_obs, s.rollout.b_actions,
                s.rollout.b_logprobs, torch.from_numpy(s.b_inds[:8].copy()), [])


# ----------------------------------------------------------------- 3 CleanRL DQN: target update decided by global_step

@seeded
def _cleanrl_dqn_setup():
    import argparse
    q = MLP()
    target = MLP()
    target.load_state_dict(q.state_dict())
    args = argparse.Namespace(gamma=0.99, tau=1.0, target_network_frequency=2,
                              train_frequency=1, learning_starts=0)
    return SimpleNamespace(q_network=q, target_network=target, args=args,
                           opt=torch.optim.Adam(q.parameters(), lr=2.5e-4))


def _cleanrl_dqn_ddp(s):
    s.q_network = nn.parallel.DistributedDataParallel(s.q_network)


@habit(id="cleanrl_dqn_global_step_target_copy",
       source="vwxyzjn/cleanrl cleanrl/dqn.py: if global_step > args.learning_starts: if "
              "global_step % args.train_frequency == 0: ... td_target; F.mse_loss; step; "
              "if global_step % args.target_network_frequency == 0: "
              "target_network_param.data.copy_(args.tau * q_network_param.data + (1.0 - "
              "args.tau) * target_network_param.data)",
       what="an int global_step argument (new every call) decides whether the target network "
            "is overwritten inside the step; target network a module that is only read",
       expect=EQUAL, rule=GUARD, setup=_cleanrl_dqn_setup, ranks=True, ddp=_cleanrl_dqn_ddp,
       calls=5,
       call=lambda step, s, i, d: step(s.q_network, s.target_network, s.opt, s.args, i + 1,
                                       d.vec(), d.cls(), d.vec(), d.uniform(8), 
                                       (d.uniform(8) > 0.8).float()))
def cleanrl_dqn_step(q_network, target_network, optimizer, args, global_step, observations,
                     actions, next_observations, rewards, dones):
    if global_step > args.learning_starts:
        if global_step % args.train_frequency == 0:
            with torch.no_grad():
                target_max, _ = target_network(next_observations).max(dim=1)
                td_target = rewards.flatten() + args.gamma * target_max * (1 - dones.flatten())
            old_val = q_network(observations).gather(1, actions.view(-1, 1)).squeeze()
            loss = F.mse_loss(td_target, old_val)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if global_step % args.target_network_frequency == 0:
            for target_network_param, q_network_param in zip(target_network.parameters(),
                                                             q_network.parameters()):
                target_network_param.data.copy_(
                    args.tau * q_network_param.data + (1.0 - args.tau) * target_network_param.data)
        return loss


# ----------------------------------------------------------------- 4 SWA: AveragedModel + SWALR in step, update_bn between

@seeded
def _swa_setup():
    from torch.optim.swa_utils import AveragedModel, SWALR
    model = ConvBN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    swa_model = AveragedModel(model)
    swa_scheduler = SWALR(opt, swa_lr=0.05, anneal_epochs=2)
    return SimpleNamespace(model=model, opt=opt, swa_model=swa_model, swa_scheduler=swa_scheduler)


def _swa_between(s, i):
    if i == 2:   # torch.optim.swa_utils.update_bn(loader, swa_model) at an epoch's end
        from torch.optim.swa_utils import update_bn
        g = torch.Generator().manual_seed(11)
        loader = [torch.randn(8, 3, 8, 8, generator=g) for _ in range(2)]
        update_bn(loader, s.swa_model)


@habit(id="swa_averaged_model_swalr_in_step",
       source="pytorch/pytorch torch/optim/swa_utils.py docs example: loss.backward(); "
              "optimizer.step(); swa_model.update_parameters(model); swa_scheduler.step(); "
              "torch.optim.swa_utils.update_bn(loader, swa_model) at the end",
       what="AveragedModel.update_parameters (bool(n_averaged == 0) decision, n_averaged += 1 "
            "buffer, foreach SWA average) and SWALR stepped inside the step; update_bn "
            "between calls (resets BN momentum/stats on the swa model)",
       expect=EQUAL, rule=DECISION, setup=_swa_setup, between=_swa_between,
       call=lambda step, s, i, d: step(s.model, s.opt, s.swa_model, s.swa_scheduler, d.img(),
                                       d.cls()))
def swa_step(model, optimizer, swa_model, swa_scheduler, x, y):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    swa_model.update_parameters(model)
    swa_scheduler.step()
    return loss


# ----------------------------------------------------------------- 5 ReduceLROnPlateau stepped with the batch loss

@seeded
def _plateau_setup():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0)
    return SimpleNamespace(model=model, opt=opt, sched=sched)


@habit(id="reduce_lr_on_plateau_step_loss_in_step",
       source="pytorch/pytorch torch/optim/lr_scheduler.py ReduceLROnPlateau.step(metrics) "
              "(current = float(metrics); num_bad_epochs; _reduce_lr), called per batch "
              "with the training loss in many scripts: scheduler.step(loss)",
       what="a plateau scheduler stepped inside the step with the loss tensor: float() of a "
            "tensor, a counter and best value written on the host, lr written to the group",
       expect=REFUSED, rule=HOST_WRITE, setup=_plateau_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, s.sched, d.vec(), d.cls()))
def plateau_step(model, optimizer, scheduler, x, y):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    scheduler.step(loss)
    return loss


# ----------------------------------------------------------------- 6 OneCycleLR with AdamW (cycles betas) in step

@seeded
def _onecycle_setup():
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10,
                                                pct_start=0.3, cycle_momentum=True,
                                                base_momentum=0.85, max_momentum=0.95)
    return SimpleNamespace(model=model, opt=opt, sched=sched)


@habit(id="onecycle_adamw_cycle_momentum_in_step",
       source="pytorch/pytorch torch/optim/lr_scheduler.py OneCycleLR (cycle_momentum with "
              "Adam-family: group['betas'] = (computed_momentum, *group['betas'][1:])); "
              "fastai fit_one_cycle / docs example: optimizer.step(); scheduler.step() per batch",
       what="OneCycleLR stepped inside the step rewrites lr and betas[0] of AdamW every call",
       expect=EQUAL, rule=INPUTS, setup=_onecycle_setup, calls=5,
       call=lambda step, s, i, d: step(s.model, s.opt, s.sched, d.vec(), d.cls()))
def onecycle_step(model, optimizer, scheduler, x, y):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss


# ----------------------------------------------------------------- 7 ignite supervised_training_step (closure, .item())

def _prepare_batch(batch, device=None, non_blocking=False):
    x, y = batch
    return x, y


def supervised_training_step(model, optimizer, loss_fn, device=None, non_blocking=False,
                             prepare_batch=_prepare_batch, model_transform=lambda output: output,
                             output_transform=lambda x, y, y_pred, loss: loss.item(),
                             gradient_accumulation_steps=1, model_fn=lambda model, x: model(x)):
    """pytorch/ignite ignite/engine/__init__.py supervised_training_step"""
    if gradient_accumulation_steps <= 0:
        raise ValueError("Gradient_accumulation_steps must be strictly positive.")

    def update(engine, batch):
        if (engine.state.iteration - 1) % gradient_accumulation_steps == 0:
            optimizer.zero_grad()
        model.train()
        x, y = prepare_batch(batch, device=device, non_blocking=non_blocking)
        output = model_fn(model, x)
        y_pred = model_transform(output)
        loss = loss_fn(y_pred, y)
        if gradient_accumulation_steps > 1:
            loss = loss / gradient_accumulation_steps
        loss.backward()
        if engine.state.iteration % gradient_accumulation_steps == 0:
            optimizer.step()
        return output_transform(x, y, y_pred, loss)

    return update


class _EngineState:
    def __init__(self):
        self.iteration = 0
        self.epoch = 0
        self.output = None


class Engine:
    def __init__(self, process_function):
        self._process_function = process_function
        self.state = _EngineState()


def _ignite_setup(**kw):
    @seeded
    def setup():
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        update = supervised_training_step(model, opt, nn.CrossEntropyLoss(), **kw)
        return SimpleNamespace(model=model, opt=opt, engine=Engine(update))
    return setup


def _ignite_between(s, i):
    s.engine.state.iteration += 1                       # Engine._run_once_on_dataset_as_gen


def _ignite_call(step, s, i, d):
    s.engine.state.output = step(s.engine, (d.vec(), d.cls()))
    return s.engine.state.output


@habit(id="ignite_supervised_step_returns_item",
       source="pytorch/ignite ignite/engine/__init__.py create_supervised_trainer -> "
              "supervised_training_step.update (output_transform default: loss.item())",
       what="the step is a closure over model, optimizer and loss_fn; returns a Python float",
       expect=EQUAL, rule=RETURNED, setup=_ignite_setup(),
       bind=lambda s: s.engine._process_function, call=_ignite_call, between=_ignite_between)
def _ignite_unused(*a):
    raise AssertionError


@habit(id="ignite_supervised_step_grad_accumulation",
       source="pytorch/ignite ignite/engine/__init__.py supervised_training_step with "
              "gradient_accumulation_steps=2 and output_transform=lambda x, y, y_pred, loss: "
              "(y_pred, loss)",
       what="closure step; engine.state.iteration (incremented by the engine outside) decides "
            "zero_grad and optimizer.step; the loss divided by the accumulation steps",
       expect=EQUAL, rule=GUARD,
       setup=_ignite_setup(gradient_accumulation_steps=2,
                           output_transform=lambda x, y, y_pred, loss: (y_pred, loss)),
       bind=lambda s: s.engine._process_function, call=_ignite_call, calls=5,
       between=_ignite_between)
def _ignite_unused2(*a):
    raise AssertionError


# ----------------------------------------------------------------- 8 DANN gradient reversal (custom autograd.Function, float alpha)

class ReverseLayerF(torch.autograd.Function):
    """fungtion/DANN models/functions.py"""

    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output):
        output = grad_output.neg() * ctx.alpha
        return output, None


class DANNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.feature = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.class_classifier = nn.Sequential(nn.Linear(32, 4), nn.LogSoftmax(dim=1))
        self.domain_classifier = nn.Sequential(nn.Linear(32, 2), nn.LogSoftmax(dim=1))

    def forward(self, input_data, alpha):
        feature = self.feature(input_data)
        reverse_feature = ReverseLayerF.apply(feature, alpha)
        return self.class_classifier(feature), self.domain_classifier(reverse_feature)


@seeded
def _dann_setup():
    net = DANNModel()
    return SimpleNamespace(model=net, opt=torch.optim.Adam(net.parameters(), lr=1e-3),
                           loss_class=nn.NLLLoss(), loss_domain=nn.NLLLoss())


def _dann_call(step, s, i, d, n_epoch=2, len_dataloader=3):
    epoch, it = divmod(i, len_dataloader)
    p = float(it + epoch * len_dataloader) / n_epoch / len_dataloader
    alpha = 2. / (1. + np.exp(-10 * p)) - 1
    return step(s.model, s.opt, s.loss_class, s.loss_domain, d.vec(), d.cls(), d.vec(), alpha)


@habit(id="dann_gradient_reversal_alpha",
       source="fungtion/DANN main.py (p = float(i + epoch * len_dataloader) / n_epoch / "
              "len_dataloader; alpha = 2. / (1. + np.exp(-10 * p)) - 1) and "
              "models/functions.py ReverseLayerF (ctx.alpha; grad_output.neg() * ctx.alpha)",
       what="a custom autograd.Function keeps a float argument (new every call, a numpy "
            "float64) in ctx and uses it in its backward",
       expect=EQUAL, rule=INPUTS, setup=_dann_setup, call=_dann_call, calls=5, ranks=True)
def dann_step(my_net, optimizer, loss_class, loss_domain, s_img, s_label, t_img, alpha):
    my_net.zero_grad()
    batch_size = len(s_label)
    domain_label = torch.zeros(batch_size).long()
    class_output, domain_output = my_net(input_data=s_img, alpha=alpha)
    err_s_label = loss_class(class_output, s_label)
    err_s_domain = loss_domain(domain_output, domain_label)
    domain_label = torch.ones(batch_size).long()
    _, domain_output = my_net(input_data=t_img, alpha=alpha)
    err_t_domain = loss_domain(domain_output, domain_label)
    err = err_t_domain + err_s_domain + err_s_label
    err.backward()
    optimizer.step()
    return err


# ----------------------------------------------------------------- 9 Opacus grad sample hooks + DP optimizer

class GradSampleLinear(nn.Module):
    """opacus GradSampleModule in miniature: a forward hook keeps the activations, a full
    backward hook computes per-sample gradients into p.grad_sample (opacus/grad_sample/linear.py
    compute_linear_grad_sample: einsum('n...i,n...j->nij', backprops, activations))."""

    def __init__(self, m):
        super().__init__()
        self._module = m
        for mod in m.modules():
            if isinstance(mod, nn.Linear):
                mod.register_forward_hook(self.capture_activations_hook)
                mod.register_full_backward_hook(self.capture_backprops_hook)

    def forward(self, x):
        return self._module(x)

    def capture_activations_hook(self, module, forward_input, _forward_output):
        if not hasattr(module, "activations"):
            module.activations = []
        module.activations.append([t.detach() for t in forward_input])

    def capture_backprops_hook(self, module, _forward_input, forward_output):
        backprops = forward_output[0].detach()
        activations = module.activations.pop()[0]
        gs = {module.weight: torch.einsum("n...i,n...j->nij", backprops, activations),
              module.bias: torch.einsum("n...k->nk", backprops)}
        for param, gsample in gs.items():
            if param.requires_grad:
                if getattr(param, "grad_sample", None) is None:
                    param.grad_sample = gsample
                else:
                    param.grad_sample += gsample


class DPOptimizer:
    """opacus/optimizers/optimizer.py DPOptimizer (clip_and_accumulate, add_noise, scale_grad)"""

    def __init__(self, optimizer, noise_multiplier, max_grad_norm, expected_batch_size):
        self.original_optimizer = optimizer
        self.noise_multiplier, self.max_grad_norm = noise_multiplier, max_grad_norm
        self.expected_batch_size = expected_batch_size
        self.step_skip_queue = []

    @property
    def params(self):
        return [p for g in self.original_optimizer.param_groups for p in g["params"]
                if p.requires_grad]

    def zero_grad(self, set_to_none=False):
        for p in self.params:
            p.grad_sample = None
            p.summed_grad = None
        self.original_optimizer.zero_grad(set_to_none)

    def clip_and_accumulate(self):
        per_param_norms = [g.reshape(len(g), -1).norm(2, dim=-1)
                           for g in (p.grad_sample for p in self.params)]
        per_sample_norms = torch.stack(per_param_norms, dim=1).norm(2, dim=1)
        per_sample_clip_factor = (self.max_grad_norm / (per_sample_norms + 1e-6)).clamp(max=1.0)
        for p in self.params:
            grad = torch.einsum("i,i...", per_sample_clip_factor, p.grad_sample)
            if p.summed_grad is not None:
                p.summed_grad += grad
            else:
                p.summed_grad = grad

    def add_noise(self):
        for p in self.params:
            noise = torch.normal(mean=0, std=self.noise_multiplier * self.max_grad_norm,
                                 size=p.summed_grad.shape, device=p.summed_grad.device)
            p.grad = (p.summed_grad + noise).view_as(p)

    def scale_grad(self):
        for p in self.params:
            p.grad /= self.expected_batch_size

    def step(self):
        self.clip_and_accumulate()
        self.add_noise()
        self.scale_grad()
        return self.original_optimizer.step()


@seeded
def _opacus_setup():
    model = GradSampleLinear(MLP())
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                      max_grad_norm=1.0, expected_batch_size=8)
    for p in opt.params:
        p.grad_sample = None
        p.summed_grad = None
    return SimpleNamespace(model=model, opt=opt)


@habit(id="opacus_grad_sample_hooks_dp_optimizer",
       source="pytorch/opacus opacus/grad_sample/grad_sample_module.py (capture_activations_hook, "
              "capture_backprops_hook -> p.grad_sample) and opacus/optimizers/optimizer.py "
              "DPOptimizer.pre_step (clip_and_accumulate, add_noise with torch.normal, "
              "scale_grad); examples/mnist.py train loop",
       what="module hooks store per-sample gradients as tensor attributes of parameters "
            "(p.grad_sample), a wrapper optimizer clips them per sample, adds Gaussian noise "
            "and assigns p.grad itself",
       expect=EQUAL, rule=HOOKS, setup=_opacus_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, d.vec(), d.cls()))
def opacus_step(model, optimizer, data, target):
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()
    return loss


# ----------------------------------------------------------------- 10 torch.func per-sample grads (no backward)

@seeded
def _func_setup():
    model = MLP()
    return SimpleNamespace(model=model, opt=torch.optim.SGD(model.parameters(), lr=0.1))


@habit(id="torch_func_vmap_grad_per_sample_clip",
       source="pytorch/tutorials intermediate_source/per_sample_grads.py (functional_call, "
              "vmap(grad(compute_loss), in_dims=(None, None, 0, 0))) used for DP-SGD: clip "
              "per sample, add noise, p.grad = ..., optimizer.step()",
       what="gradients computed with torch.func (no loss.backward()), clipped per sample and "
            "written to p.grad before optimizer.step()",
       expect=REFUSED, rule=INPUTS, setup=_func_setup, match="backward",
       call=lambda step, s, i, d: step(s.model, s.opt, d.vec(), d.cls()))
def func_dp_step(model, optimizer, data, targets, max_norm=1.0, sigma=0.5):
    from torch.func import functional_call, grad, vmap
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def compute_loss(params, buffers, sample, target):
        batch = sample.unsqueeze(0)
        targets = target.unsqueeze(0)
        predictions = functional_call(model, (params, buffers), (batch,))
        return F.cross_entropy(predictions, targets)

    ft_per_sample_grads = vmap(grad(compute_loss), in_dims=(None, None, 0, 0))(
        params, buffers, data, targets)
    norms = torch.stack([g.reshape(len(g), -1).norm(dim=1) for g in ft_per_sample_grads.values()],
                        dim=1).norm(dim=1)
    factor = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for name, p in model.named_parameters():
        g = torch.einsum("i,i...", factor, ft_per_sample_grads[name])
        p.grad = (g + torch.randn_like(g) * sigma * max_norm) / len(data)
    optimizer.step()
    return norms


# ----------------------------------------------------------------- 11 StyleGAN2 R1: requires_grad set on the batch

class TinyD(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 1)

    def forward(self, x):
        return self.fc(F.leaky_relu(self.conv(x), 0.2).mean((2, 3)))


def d_r1_loss(real_pred, real_img):
    grad_real, = torch.autograd.grad(outputs=real_pred.sum(), inputs=real_img, create_graph=True)
    return grad_real.pow(2).reshape(grad_real.shape[0], -1).sum(1).mean()


@seeded
def _r1_setup():
    import argparse
    d = TinyD()
    return SimpleNamespace(model=d, opt=torch.optim.Adam(d.parameters(), lr=2e-3, betas=(0.0, 0.99)),
                           args=argparse.Namespace(r1=10.0, d_reg_every=16), real_img=None)


def _r1_call(step, s, i, d):
    s.real_img = d.img()
    return step(s.model, s.opt, s.real_img, s.args)


@habit(id="stylegan2_r1_requires_grad_on_batch",
       source="rosinality/stylegan2-pytorch train.py (d_regularize: real_img.requires_grad = "
              "True; real_pred = discriminator(real_img); r1_loss = d_r1_loss(real_pred, "
              "real_img); (args.r1 / 2 * r1_loss * args.d_reg_every + 0 * real_pred[0])"
              ".backward(); d_optim.step())",
       what="the step flips requires_grad on its batch tensor and differentiates with respect "
            "to it (autograd.grad, create_graph) before backward",
       expect=EQUAL, rule=INPUTS, setup=_r1_setup, call=_r1_call, ranks=True)
def r1_step(discriminator, d_optim, real_img, args):
    real_img.requires_grad = True
    real_pred = discriminator(real_img)
    r1_loss = d_r1_loss(real_pred, real_img)
    discriminator.zero_grad()
    (args.r1 / 2 * r1_loss * args.d_reg_every + 0 * real_pred[0]).backward()
    d_optim.step()
    return r1_loss


# ----------------------------------------------------------------- 12 PyG-style graph batch object, index_add_ message passing

class GraphData:
    """torch_geometric.data.Data in miniature: tensors as attributes of a plain object."""

    def __init__(self, x, edge_index, y, train_mask):
        self.x, self.edge_index, self.y, self.train_mask = x, edge_index, y, train_mask

    @property
    def num_nodes(self):
        return self.x.size(0)


class GCNConv(nn.Module):
    """torch_geometric/nn/conv/gcn_conv.py gcn_norm + propagate (scatter sum) in miniature"""

    def __init__(self, i, o):
        super().__init__()
        self.lin = nn.Linear(i, o, bias=False)
        self.bias = nn.Parameter(torch.zeros(o))

    def forward(self, x, edge_index):
        n = x.size(0)
        loops = torch.arange(n, device=x.device)
        edge_index = torch.cat([edge_index, torch.stack([loops, loops])], dim=1)
        row, col = edge_index[0], edge_index[1]
        edge_weight = torch.ones(edge_index.size(1), device=x.device)
        deg = torch.zeros(n, device=x.device).scatter_add_(0, col, edge_weight)
        deg_inv_sqrt = deg.pow_(-0.5)
        deg_inv_sqrt.masked_fill_(deg_inv_sqrt == float("inf"), 0)
        norm = deg_inv_sqrt[row] * edge_weight * deg_inv_sqrt[col]
        x = self.lin(x)
        msg = norm.view(-1, 1) * x.index_select(0, row)
        out = torch.zeros_like(x).index_add_(0, col, msg)
        return out + self.bias


class GCN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = GCNConv(16, 16)
        self.conv2 = GCNConv(16, 4)

    def forward(self, x, edge_index):
        x = F.dropout(x, p=0.5, training=self.training)
        x = self.conv1(x, edge_index).relu()
        x = F.dropout(x, p=0.5, training=self.training)
        return self.conv2(x, edge_index)


@seeded
def _gcn_setup():
    model = GCN()
    return SimpleNamespace(model=model,
                           opt=torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4))


def _graph(d, i):
    n = 10 + (i % 2) * 3           # NeighborLoader subgraphs: node and edge counts vary
    e = 2 * n
    return GraphData(torch.randn(n, 16, generator=d.g),
                     torch.randint(0, n, (2, e), generator=d.g),
                     torch.randint(0, 4, (n,), generator=d.g),
                     torch.rand(n, generator=d.g) > 0.3)


@habit(id="pyg_gcn_data_object_index_add",
       source="pyg-team/pytorch_geometric examples/gcn.py train(): out = model(data.x, "
              "data.edge_index, data.edge_attr); loss = F.cross_entropy(out[data.train_mask], "
              "data.y[data.train_mask]); torch_geometric/nn/conv/gcn_conv.py gcn_norm "
              "(scatter, deg.pow_(-0.5), masked_fill_ inf)",
       what="the batch is a plain object holding tensors as attributes (a new one each call, "
            "node counts varying); scatter_add_/index_add_ message passing; boolean-mask loss",
       expect=EQUAL, rule=INPUTS, setup=_gcn_setup, ranks=True,
       call=lambda step, s, i, d: step(s.model, s.opt, _graph(d, i)))
def gcn_step(model, optimizer, data):
    model.train()
    optimizer.zero_grad()
    out = model(data.x, data.edge_index)
    loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
    loss.backward()
    optimizer.step()
    return loss


# ----------------------------------------------------------------- 13 tutorial train_model: set_grad_enabled(phase == 'train')

@seeded
def _tl_setup():
    model = ConvBN()
    return SimpleNamespace(model=model, criterion=nn.CrossEntropyLoss(),
                           opt=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))


def _tl_call(step, s, i, d):
    phase = "train"
    if phase == "train":
        s.model.train()
    return step(s.model, s.criterion, s.opt, d.img(), d.cls(), phase)


@habit(id="tutorial_transfer_learning_set_grad_enabled",
       source="pytorch/tutorials beginner_source/transfer_learning_tutorial.py train_model: "
              "optimizer.zero_grad(); with torch.set_grad_enabled(phase == 'train'): outputs = "
              "model(inputs); _, preds = torch.max(outputs, 1); loss = criterion(outputs, "
              "labels); if phase == 'train': loss.backward(); optimizer.step(); "
              "torch.sum(preds == labels.data)",
       what="grad mode decided inside the step from a string argument, labels.data on a batch "
            "tensor, corrects as a tensor",
       expect=EQUAL, rule=AMBIENT, setup=_tl_setup, call=_tl_call, ranks=True)
def tl_step(model, criterion, optimizer, inputs, labels, phase):
    optimizer.zero_grad()
    with torch.set_grad_enabled(phase == "train"):
        outputs = model(inputs)
        _, preds = torch.max(outputs, 1)
        loss = criterion(outputs, labels)
        if phase == "train":
            loss.backward()
            optimizer.step()
    running_loss = loss * inputs.size(0)
    running_corrects = torch.sum(preds == labels.data)
    return running_loss, running_corrects


# ----------------------------------------------------------------- 14 MuZero: register_hook on hidden state, PER weights

class MuZeroNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.repr = nn.Linear(16, 16)
        self.dyn = nn.Linear(16 + 4, 16)
        self.value = nn.Linear(16, 1)
        self.policy = nn.Linear(16, 4)
        self.reward = nn.Linear(16, 1)

    def initial_inference(self, obs):
        h = torch.tanh(self.repr(obs))
        return self.value(h), torch.zeros(obs.size(0), 1), self.policy(h), h

    def recurrent_inference(self, h, action):
        a = F.one_hot(action, 4).float()
        h = torch.tanh(self.dyn(torch.cat([h, a], dim=1)))
        return self.value(h), self.reward(h), self.policy(h), h


@seeded
def _muzero_setup():
    m = MuZeroNet()
    return SimpleNamespace(model=m, opt=torch.optim.Adam(m.parameters(), lr=1e-3,
                                                         weight_decay=1e-4))


def _muzero_call(step, s, i, d, K=3):
    obs = d.vec()
    actions = torch.randint(0, 4, (8, K + 1), generator=d.g)
    target_value = d.uniform(8, K + 1)
    target_reward = d.uniform(8, K + 1)
    target_policy = F.softmax(torch.randn(8, K + 1, 4, generator=d.g), -1)
    weight_batch = d.uniform(8) + 0.5
    return step(s.model, s.opt, obs, actions, target_value, target_reward, target_policy,
                weight_batch)


@habit(id="muzero_register_hook_scale_hidden_grad",
       source="werner-duvaud/muzero-general trainer.py update_weights: for i in range(1, "
              "action_batch.shape[1]): value, reward, policy_logits, hidden_state = "
              "model.recurrent_inference(hidden_state, action_batch[:, i]); "
              "hidden_state.register_hook(lambda grad: grad * 0.5); loss *= weight_batch; "
              "priorities from |pred_value - target_value|",
       what="a hook registered inside the step on intermediate tensors (every unroll step) "
            "scales their gradient; per-sample PER weights; priorities returned",
       expect=EQUAL, rule=HOOKS, setup=_muzero_setup, call=_muzero_call)
def muzero_step(model, optimizer, observation_batch, action_batch, target_value, target_reward,
                target_policy, weight_batch):
    value, reward, policy_logits, hidden_state = model.initial_inference(observation_batch)
    predictions = [(value, reward, policy_logits)]
    for i in range(1, action_batch.shape[1]):
        value, reward, policy_logits, hidden_state = model.recurrent_inference(
            hidden_state, action_batch[:, i])
        hidden_state.register_hook(lambda grad: grad * 0.5)
        predictions.append((value, reward, policy_logits))
    value_loss, reward_loss, policy_loss = 0, 0, 0
    priorities = []
    for i, (value, reward, policy_logits) in enumerate(predictions):
        cur_v = ((value.squeeze(-1) - target_value[:, i]) ** 2)
        cur_r = ((reward.squeeze(-1) - target_reward[:, i]) ** 2)
        cur_p = (-target_policy[:, i] * F.log_softmax(policy_logits, 1)).sum(1)
        if i > 0:
            cur_v.register_hook(lambda grad: grad / (action_batch.shape[1] - 1))
        value_loss = value_loss + cur_v
        reward_loss = reward_loss + (cur_r if i > 0 else 0)
        policy_loss = policy_loss + cur_p
        priorities.append((value.squeeze(-1).detach() - target_value[:, i]).abs() ** 1.0)
    loss = value_loss * 0.25 + reward_loss + policy_loss
    loss *= weight_batch
    loss = loss.mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss, torch.stack(priorities, 1)


# ----------------------------------------------------------------- 15 TRL DPO with reference model

@seeded
def _dpo_setup():
    model = tiny_gpt2()
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return SimpleNamespace(model=model, ref_model=ref,
                           opt=torch.optim.AdamW(model.parameters(), lr=5e-4),
                           beta=0.1, label_smoothing=0.0)


def get_batch_logps(logits, labels, label_pad_token_id=-100):
    """huggingface/trl trl/trainer/dpo_trainer.py get_batch_logps (older releases)"""
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    loss_mask = labels != label_pad_token_id
    labels[labels == label_pad_token_id] = 0
    per_token_logps = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
    return (per_token_logps * loss_mask).sum(-1), loss_mask.sum(-1)


def concatenated_forward(model, batch):
    input_ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]], 0)
    attn = torch.cat([batch["chosen_attention_mask"], batch["rejected_attention_mask"]], 0)
    labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]], 0)
    logits = model(input_ids, attention_mask=attn).logits.to(torch.float32)
    logps, _ = get_batch_logps(logits, labels)
    n = batch["chosen_input_ids"].shape[0]
    return logps[:n], logps[n:], logits[:n], logits[n:]


def _dpo_batch(d):
    ids_c, ids_r = d.tok(2, 8, 64), d.tok(2, 8, 64)
    lab_c, lab_r = ids_c.clone(), ids_r.clone()
    lab_c[:, :3] = -100
    lab_r[:, :3] = -100
    return {"chosen_input_ids": ids_c, "rejected_input_ids": ids_r,
            "chosen_attention_mask": torch.ones_like(ids_c),
            "rejected_attention_mask": torch.ones_like(ids_r),
            "chosen_labels": lab_c, "rejected_labels": lab_r}


@habit(id="trl_dpo_reference_model_no_grad",
       source="huggingface/trl trl/trainer/dpo_trainer.py get_batch_loss_metrics: "
              "concatenated_forward (get_batch_logps: labels[labels == -100] = 0 on a clone), "
              "reference logps with torch.no_grad(), dpo_loss (sigmoid, label_smoothing), "
              "metrics dict of rewards/chosen, rewards/accuracies, logps",
       what="a frozen reference model (found in the setup, not an argument) scored under "
            "no_grad; a dict batch; metrics returned as a dict of detached tensors",
       expect=EQUAL, rule=PATH, setup=_dpo_setup, ranks=True,
       call=lambda step, s, i, d: step(s.model, s.ref_model, s.opt, _dpo_batch(d), s.beta,
                                       s.label_smoothing))
def dpo_step(model, ref_model, optimizer, batch, beta, label_smoothing):
    policy_chosen_logps, policy_rejected_logps, chosen_logits, rejected_logits = \
        concatenated_forward(model, batch)
    with torch.no_grad():
        reference_chosen_logps, reference_rejected_logps, _, _ = concatenated_forward(ref_model, batch)
    pi_logratios = policy_chosen_logps - policy_rejected_logps
    ref_logratios = reference_chosen_logps - reference_rejected_logps
    logits = pi_logratios - ref_logratios
    losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
              - F.logsigmoid(-beta * logits) * label_smoothing)
    chosen_rewards = beta * (policy_chosen_logps - reference_chosen_logps).detach()
    rejected_rewards = beta * (policy_rejected_logps - reference_rejected_logps).detach()
    reward_accuracies = (chosen_rewards > rejected_rewards).float()
    loss = losses.mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    prefix = ""
    metrics = {}
    metrics[f"{prefix}rewards/chosen"] = chosen_rewards.mean().cpu()
    metrics[f"{prefix}rewards/rejected"] = rejected_rewards.mean().cpu()
    metrics[f"{prefix}rewards/accuracies"] = reward_accuracies.mean().cpu()
    metrics[f"{prefix}rewards/margins"] = (chosen_rewards - rejected_rewards).mean().cpu()
    metrics[f"{prefix}logps/rejected"] = policy_rejected_logps.detach().mean().cpu()
    metrics[f"{prefix}logits/chosen"] = chosen_logits.detach().mean().cpu()
    return loss, metrics


# ----------------------------------------------------------------- 16 parametrize.cached orthogonal RNN

class OrthoRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.rec = nn.Linear(16, 16, bias=False)
        torch.nn.utils.parametrizations.orthogonal(self.rec)
        self.out = nn.Linear(16, 4)

    def forward(self, xs):
        h = torch.zeros(xs.size(1), 16)
        for t in range(xs.size(0)):
            h = torch.tanh(self.inp(xs[t]) + self.rec(h))
        return self.out(h)


@seeded
def _ortho_setup():
    m = OrthoRNN()
    return SimpleNamespace(model=m, opt=torch.optim.Adam(m.parameters(), lr=1e-2))


@habit(id="parametrize_cached_orthogonal_rnn",
       source="pytorch/tutorials intermediate_source/parametrizations.py (Caching: with "
              "P.cached(): output = rnn(input)); torch/nn/utils/parametrizations.py orthogonal",
       what="an orthogonal parametrization (matrix_exp map, right-inverse state) computed once "
            "per step under parametrize.cached() and reused across an RNN's time steps",
       expect=EQUAL, rule=HOOKS, setup=_ortho_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, torch.randn(5, 4, 16, generator=d.g),
                                       d.cls(4)))
def ortho_step(model, optimizer, xs, y):
    from torch.nn.utils import parametrize
    optimizer.zero_grad()
    with parametrize.cached():
        out = model(xs)
    loss = F.cross_entropy(out, y)
    loss.backward()
    optimizer.step()
    return loss



# ----------------------------------------------------------------- 17 fast adversarial training (FGSM, persistent delta)

def clamp(X, lower_limit, upper_limit):
    return torch.max(torch.min(X, upper_limit), lower_limit)


@seeded
def _fgsm_setup():
    model = ConvBN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.0, max_lr=0.2, step_size_up=2,
                                              step_size_down=2)
    std = torch.tensor([0.2471, 0.2435, 0.2616]).view(3, 1, 1)
    mu = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
    return SimpleNamespace(model=model, opt=opt, sched=sched,
                           epsilon=(8 / 255.) / std, alpha=(10 / 255.) / std,
                           upper_limit=((1 - mu) / std), lower_limit=((0 - mu) / std),
                           delta=torch.zeros(8, 3, 8, 8))


@habit(id="fast_adversarial_fgsm_persistent_delta",
       source="locuslab/fast_adversarial CIFAR10/train_fgsm.py: delta[:, j, :, :].uniform_("
              "-epsilon[j][0][0].item(), epsilon[j][0][0].item()); delta.data = clamp(delta, "
              "lower_limit - X, upper_limit - X); delta.requires_grad = True; loss.backward(); "
              "grad = delta.grad.detach(); delta.data = delta + alpha * torch.sign(grad); "
              "... opt.step(); scheduler.step()",
       what="a perturbation tensor made once outside the loop is re-drawn in place, gets "
            "requires_grad and a .grad, and is rewritten through .data inside the step",
       expect=REFUSED, rule=INPUTS, setup=_fgsm_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, s.sched, d.img(), d.cls(), s.delta,
                                       s.epsilon, s.alpha, s.lower_limit, s.upper_limit))
def fgsm_step(model, opt, scheduler, X, y, delta, epsilon, alpha, lower_limit, upper_limit):
    for j in range(len(epsilon)):
        delta[:, j, :, :].uniform_(-epsilon[j][0][0].item(), epsilon[j][0][0].item())
    delta.data = clamp(delta, lower_limit - X, upper_limit - X)
    delta.requires_grad = True
    output = model(X + delta[:X.size(0)])
    loss = F.cross_entropy(output, y)
    loss.backward()
    grad = delta.grad.detach()
    delta.data = delta + alpha * torch.sign(grad)
    delta.data[:X.size(0)] = clamp(delta[:X.size(0)], lower_limit - X, upper_limit - X)
    delta = delta.detach()
    output = model(X + delta[:X.size(0)])
    loss = F.cross_entropy(output, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    scheduler.step()
    return loss


# ----------------------------------------------------------------- 18 a TrainState dataclass argument

@dataclasses.dataclass
class TrainState:
    step: int = 0
    epoch: int = 0


@seeded
def _state_setup():
    s = SimpleNamespace(model=MLP(), state=TrainState())
    s.opt = torch.optim.SGD(s.model.parameters(), lr=0.1)
    return s


@habit(id="dataclass_train_state_counter_argument",
       source="a train state object passed to the step and advanced by it (the pattern of "
              "flax's TrainState ported to torch scripts: state.step += 1 inside train_step)",
       what="the step increments an int field of a dataclass argument",
       expect=EQUAL, rule=HOST_NUMBERS, setup=_state_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, d.vec(), d.cls(), s.state))
def state_step(model, optimizer, x, y, state):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    state.step += 1
    return loss


# ----------------------------------------------------------------- several updates in one call

class PPOAgent(nn.Module):
    """cleanrl/ppo.py Agent: a critic and an actor over a discrete action space."""

    def __init__(self, obs=8, actions=3, hidden=16):
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(obs, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.actor = nn.Sequential(nn.Linear(obs, hidden), nn.Tanh(), nn.Linear(hidden, actions))

    def get_action_and_value(self, x, action=None):
        logits = self.actor(x)
        probs = torch.distributions.Categorical(logits=logits)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


@seeded
def _ppo_epochs_setup():
    agent = PPOAgent()
    return SimpleNamespace(agent=agent, args=SimpleNamespace(
        update_epochs=2, batch_size=8, minibatch_size=4, clip_coef=0.2, norm_adv=True,
        clip_vloss=True, ent_coef=0.01, vf_coef=0.5, max_grad_norm=0.5),
        optimizer=torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5))


def _ppo_epochs_call(step, s, i, d):
    obs = d.vec(8, 8)
    with torch.no_grad():
        actions, logprobs, _, values = s.agent.get_action_and_value(obs)
    return step(s.agent, s.optimizer, s.args, obs, logprobs, actions, d.vec(8, 1).view(-1),
                d.vec(8, 1).view(-1), values.view(-1))


@habit(id="cleanrl_ppo_update_epochs_minibatches",
       source="vwxyzjn/cleanrl cleanrl/ppo.py: for epoch in range(args.update_epochs): for start "
              "in range(0, args.batch_size, args.minibatch_size): ... clipped surrogate and "
              "value losses, optimizer.zero_grad(); loss.backward(); "
              "nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm); "
              "optimizer.step() (the minibatch order drawn outside: b_inds)",
       what="one optimizer (Adam) stepped once per minibatch, four times in one call, each "
            "backward() reading the parameters the previous step updated; Categorical "
            "log-probabilities and entropy, advantages normalized per minibatch",
       expect=EQUAL, rule=PHASES, setup=_ppo_epochs_setup, call=_ppo_epochs_call)
def ppo_update(agent, optimizer, args, b_obs, b_logprobs, b_actions, b_advantages, b_returns,
               b_values):
    b_inds = torch.arange(args.batch_size)
    for epoch in range(args.update_epochs):
        for start in range(0, args.batch_size, args.minibatch_size):
            end = start + args.minibatch_size
            loss, _, approx_kl = cleanrl_ppo_step(agent, optimizer, args, b_obs, b_logprobs,
                                                  b_actions, b_advantages, b_returns, b_values,
                                                  b_inds[start:end])
    return loss.detach(), approx_kl


def _ppo_rollout_setup():
    s = _ppo_setup()
    s.args.update_epochs = 2
    return s


def _ppo_rollout_call(step, s, i, d):
    r = s.rollout
    return step(s.agent, s.opt, s.args, r.b_obs, r.b_logprobs, r.b_actions, r.b_advantages,
                r.b_returns, r.b_values)


habit(id="cleanrl_ppo_update_loop_adam_orthogonal_init",
      source="vwxyzjn/cleanrl cleanrl/ppo.py: the update loop of the iteration (update_epochs "
             "x minibatches) over the Agent as the script builds it (layer_init: orthogonal, "
             "the actor's head at std 0.01), Adam(lr=2.5e-4, eps=1e-5)",
      what="eight Adam updates in one call; each minibatch's Categorical checks its logits "
           "(a decision on values), computed through the earlier updates of the call and "
           "their bias corrections",
      expect=EQUAL, rule=PHASES, setup=_ppo_rollout_setup, call=_ppo_rollout_call)(ppo_update)


@seeded
def _reptile_setup():
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    return SimpleNamespace(model=model, opt=torch.optim.SGD(model.parameters(), lr=0.02))


@habit(id="openai_reptile_inner_sgd_outer_interpolation",
       source="openai/supervised-reptile (and the sine-wave Reptile example of its paper): "
              "weights_before = deepcopy(model.state_dict()); innerepochs of "
              "train_on_batch (zero_grad, backward, SGD step); then weights_after and "
              "model.load_state_dict({name: weights_before[name] + (weights_after[name] - "
              "weights_before[name]) * outerstepsize})",
       what="an inner loop of SGD steps on one task in one call, then the parameters moved "
            "from their value before the call toward the adapted ones by load_state_dict",
       expect=EQUAL, rule=PHASES, setup=_reptile_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, d.uniform(3, 4, 1) * 10 - 5,
                                       d.uniform(1) * 5, d.uniform(1) * 3.14))
def reptile_step(model, opt, xs, amplitude, phase, outerstepsize=0.1):
    weights_before = copy.deepcopy(model.state_dict())
    for x in xs:
        y = amplitude * torch.sin(x + phase)
        model.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
    weights_after = model.state_dict()
    model.load_state_dict({name: weights_before[name] + (weights_after[name] - weights_before[name])
                           * outerstepsize for name in weights_before})
    return loss.detach()


class _ResBlockG(nn.Module):
    """A tiny image-to-image generator (CycleGAN's ResnetGenerator in miniature)."""

    def __init__(self, ch=3, width=8):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(ch, width, 3, padding=1), nn.InstanceNorm2d(width),
                                 nn.ReLU(True), nn.Conv2d(width, ch, 3, padding=1), nn.Tanh())

    def forward(self, x):
        return self.net(x)


def _patch_d(ch=3, width=8):
    """CycleGAN's NLayerDiscriminator (PatchGAN) in miniature."""
    return nn.Sequential(nn.Conv2d(ch, width, 4, 2, 1), nn.LeakyReLU(0.2, True),
                         nn.Conv2d(width, 1, 4, 1, 1))


class CycleGANModel:
    """junyanz/pytorch-CycleGAN-and-pix2pix models/cycle_gan_model.py, with its
    base class's set_requires_grad and LSGAN's GANLoss (MSE to 1 or 0), the
    image pools left out (they keep tensors on the host)."""

    def __init__(self, lambda_A=10.0, lambda_B=10.0, lambda_idt=0.5):
        import itertools
        self.netG_A, self.netG_B = _ResBlockG(), _ResBlockG()
        self.netD_A, self.netD_B = _patch_d(), _patch_d()
        self.lambda_A, self.lambda_B, self.lambda_idt = lambda_A, lambda_B, lambda_idt
        self.criterionGAN, self.criterionCycle = nn.MSELoss(), nn.L1Loss()
        self.criterionIdt = nn.L1Loss()
        self.optimizer_G = torch.optim.Adam(
            itertools.chain(self.netG_A.parameters(), self.netG_B.parameters()),
            lr=2e-4, betas=(0.5, 0.999))
        self.optimizer_D = torch.optim.Adam(
            itertools.chain(self.netD_A.parameters(), self.netD_B.parameters()),
            lr=2e-4, betas=(0.5, 0.999))

    def gan_loss(self, prediction, target_is_real):
        target = torch.tensor(1.0 if target_is_real else 0.0).expand_as(prediction)
        return self.criterionGAN(prediction, target)

    def set_requires_grad(self, nets, requires_grad=False):
        for net in nets:
            for param in net.parameters():
                param.requires_grad = requires_grad

    def forward(self):
        self.fake_B = self.netG_A(self.real_A)
        self.rec_A = self.netG_B(self.fake_B)
        self.fake_A = self.netG_B(self.real_B)
        self.rec_B = self.netG_A(self.fake_A)

    def backward_D_basic(self, netD, real, fake):
        loss_D = (self.gan_loss(netD(real), True) + self.gan_loss(netD(fake.detach()), False)) * 0.5
        loss_D.backward()
        return loss_D

    def backward_G(self):
        idt_A = self.netG_A(self.real_B)
        loss_idt_A = self.criterionIdt(idt_A, self.real_B) * self.lambda_B * self.lambda_idt
        idt_B = self.netG_B(self.real_A)
        loss_idt_B = self.criterionIdt(idt_B, self.real_A) * self.lambda_A * self.lambda_idt
        loss_G = (self.gan_loss(self.netD_A(self.fake_B), True)
                  + self.gan_loss(self.netD_B(self.fake_A), True)
                  + self.criterionCycle(self.rec_A, self.real_A) * self.lambda_A
                  + self.criterionCycle(self.rec_B, self.real_B) * self.lambda_B
                  + loss_idt_A + loss_idt_B)
        loss_G.backward()
        return loss_G

    def optimize_parameters(self, real_A, real_B):
        self.real_A, self.real_B = real_A, real_B
        self.forward()
        self.set_requires_grad([self.netD_A, self.netD_B], False)
        self.optimizer_G.zero_grad()
        loss_G = self.backward_G()
        self.optimizer_G.step()
        self.set_requires_grad([self.netD_A, self.netD_B], True)
        self.optimizer_D.zero_grad()
        loss_D_A = self.backward_D_basic(self.netD_A, self.real_B, self.fake_B)
        loss_D_B = self.backward_D_basic(self.netD_B, self.real_A, self.fake_A)
        self.optimizer_D.step()
        return loss_G.detach(), loss_D_A.detach(), loss_D_B.detach()


@seeded
def _cyclegan_setup():
    return SimpleNamespace(model=CycleGANModel())


@habit(id="cyclegan_optimize_parameters_set_requires_grad",
       source="junyanz/pytorch-CycleGAN-and-pix2pix models/cycle_gan_model.py "
              "optimize_parameters (forward; set_requires_grad([netD_A, netD_B], False); "
              "backward_G; optimizer_G.step(); set_requires_grad(..., True); backward_D_A; "
              "backward_D_B; optimizer_D.step()) and models/base_model.py set_requires_grad",
       what="a bound method of a model object holding four networks and two optimizers over "
            "itertools.chain of their parameters; the discriminators frozen for the generators' "
            "backward() and unfrozen for their own two, which come after the generators' step; "
            "the results kept as attributes (self.fake_B) between its methods",
       expect=EQUAL, rule=PHASES, setup=_cyclegan_setup,
       bind=lambda s: s.model.optimize_parameters,
       call=lambda step, s, i, d: step(d.img(2), d.img(2)))
def _unused_cyclegan(*a):
    raise AssertionError


# ----------------------------------------------------------------- numbers returned; optimizer values read

@seeded
def _trainer_setup():
    s = mlp_sgd.__wrapped__()
    s.opt = torch.optim.AdamW(s.model.parameters(), lr=1e-2, weight_decay=0.01)
    s.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(s.opt, lambda k: min(1.0, (k + 1) / 3))
    return s


def _trainer_ddp(s):
    wrap_model(s)


@habit(id="hf_trainer_logs_loss_item_and_last_lr",
       source="huggingface/transformers src/transformers/trainer.py inner training loop: "
              "self.optimizer.step(); self.lr_scheduler.step(); model.zero_grad(); then "
              "_maybe_log_save_evaluate: logs['loss'] from tr_loss.item(), "
              "logs['learning_rate'] = self._get_learning_rate() (lr_scheduler.get_last_lr()[0]), "
              "logs['grad_norm'] from grad_norm.item(), with a warmup LambdaLR",
       what="the step returns a dict of Python numbers: .item() of the loss and of the clipped "
            "gradient norm, the scheduler's last lr read after its step() inside the step, the "
            "param group's lr, and a string",
       expect=EQUAL, rule=RETURNED, setup=_trainer_setup, ranks=True, ddp=_trainer_ddp, calls=5,
       call=lambda step, s, i, d: step(s.model, s.opt, s.lr_scheduler, d.vec(), d.cls()))
def hf_trainer_logs_step(model, optimizer, lr_scheduler, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    lr_scheduler.step()
    model.zero_grad()
    return {"loss": round(loss.item(), 4), "grad_norm": grad_norm.item(),
            "learning_rate": lr_scheduler.get_last_lr()[0],
            "group_lr": optimizer.param_groups[0]["lr"], "epoch": lr_scheduler.last_epoch,
            "phase": "train"}


@seeded
def _fastai_wd_setup():
    s = mlp_sgd.__wrapped__()
    s.opt = torch.optim.Adam(s.model.parameters(), lr=1e-2)
    s.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(s.opt, T_max=4)
    return s


def _fastai_between(s, i):
    if i:
        s.scheduler.step()


def _fastai_weight_decay(optimizer, wd):
    for group in optimizer.param_groups:
        for param in group["params"]:
            current_lr = group["lr"]
            param.data = param.data.add(param.data, alpha=-wd * group["lr"])
    return optimizer, current_lr


@habit(id="fastai_weight_decay_reads_group_lr",
       source="fast.ai's 'AdamW and super-convergence' post (2018-07-02), its weight_decay("
              "optimizer, wd) helper as copied into many repositories: for each group, "
              "param.data = param.data.add(-wd * group['lr'], param.data) before "
              "optimizer.step(); the cosine schedule stepped per epoch outside the step",
       what="the step's own Python reads param_groups[0]['lr'], which the scheduler outside "
            "changes between calls, for a decoupled weight decay, and returns it",
       expect=EQUAL, rule=GROUP_READS, setup=_fastai_wd_setup, between=_fastai_between,
       ranks=True, call=xy)
def fastai_weight_decay_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer, lr = _fastai_weight_decay(optimizer, 1e-2)
    optimizer.step()
    return loss, lr


@seeded
def _wgan_setup():
    s = mlp_sgd.__wrapped__()
    s.model = MLP(out=1)
    s.opt = torch.optim.RMSprop(s.model.parameters(), lr=5e-3)
    return s


@habit(id="wgan_critic_weight_clipping",
       source="martinarjovsky/WassersteinGAN main.py: the critic's loop clamps every "
              "parameter in place (for p in netD.parameters(): p.data.clamp_(clamp_lower, "
              "clamp_upper)) before errD_real and errD_fake, RMSprop",
       what="parameters clamped through .data in place inside the step, then a backward() of "
            "a difference of two means and the optimizer's step",
       expect=EQUAL, rule=INPUTS, setup=_wgan_setup, ranks=True,
       call=lambda step, s, i, d: step(s.model, s.opt, d.vec(), d.vec()))
def wgan_critic_step(netD, optimizerD, real, fake, clamp=0.05):
    for p in netD.parameters():
        p.data.clamp_(-clamp, clamp)
    netD.zero_grad()
    errD = netD(real).mean() - netD(fake).mean()
    errD.backward()
    optimizerD.step()
    return errD


class _PackedClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(64, 8, padding_idx=0)
        self.rnn = nn.LSTM(8, 8, batch_first=True)
        self.fc = nn.Linear(8, 4)

    def forward(self, text, text_lengths):
        embedded = self.embedding(text)
        packed = nn.utils.rnn.pack_padded_sequence(embedded, text_lengths, batch_first=True,
                                                   enforce_sorted=False)
        _, (hidden, _) = self.rnn(packed)
        return self.fc(hidden[-1])


@seeded
def _packed_setup():
    model = _PackedClassifier()
    return SimpleNamespace(model=model, opt=torch.optim.Adam(model.parameters(), lr=1e-2))


@habit(id="sentiment_pack_padded_sequence_lengths",
       source="bentrevett/pytorch-sentiment-analysis (the LSTM notebook): "
              "nn.utils.rnn.pack_padded_sequence(embedded, text_lengths, batch_first=True, "
              "enforce_sorted=False) before nn.LSTM, the lengths a tensor of the batch",
       what="the recurrent layer runs a packed batch whose lengths are read on the host",
       expect=REFUSED, rule=DECISION, match="pack_padded_sequence", setup=_packed_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, d.tok(4, 8), torch.tensor([8, 5, 3, 6]),
                                       d.cls(4)))
def packed_sentiment_step(model, optimizer, text, text_lengths, label):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(text, text_lengths), label)
    loss.backward()
    optimizer.step()
    return loss


def _class_weights_between(s, i):
    """The epoch's class weights, set anew as the criterion's weight."""
    s.criterion.weight = torch.tensor([1.0, 2.0, 0.5, 1.0]) * (1 + i)


@seeded
def _class_weights_setup():
    model = MLP()
    return SimpleNamespace(model=model, opt=torch.optim.AdamW(model.parameters(), lr=1e-2),
                           criterion=nn.CrossEntropyLoss(weight=torch.ones(4)))


@habit(id="class_weights_set_anew_each_epoch",
       source="a class-balanced loss: nn.CrossEntropyLoss(weight=w) whose weights are "
              "recomputed from the label counts at each epoch and assigned "
              "(`criterion.weight = torch.tensor(w)`: its weight is a registered buffer)",
       what="a buffer replaced by another tensor of the same shape between calls",
       expect=EQUAL, rule=GUARD, setup=_class_weights_setup,
       call=lambda step, s, i, d: step(s.model, s.opt, s.criterion, d.vec(), d.cls()),
       between=_class_weights_between, ranks=True)
def class_weighted_step(model, optimizer, criterion, x, y):
    optimizer.zero_grad()
    loss = criterion(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def _new_head_between(s, i):
    if i == 2:
        s.model.fc2 = nn.Linear(32, 4)


habit(id="head_replaced_optimizer_kept",
      source="a transfer-learning script that swaps the classifier "
             "(`model.fc = nn.Linear(num_ftrs, n)`, pytorch/tutorials' transfer learning "
             "tutorial) after its optimizer was made, and keeps that optimizer",
      what="a parameter replaced by a new one of the same shape between calls; the "
           "optimizer still holds the old one (eager leaves the new head untrained)",
      expect=EQUAL, rule=GUARD, setup=mlp_sgd, call=xy,
      between=_new_head_between)(plain_step)


def _patch_forward_between(s, i):
    if i == 2:   # the outputs scaled from now on, through a forward set on the instance
        model = unwrap(s.model)
        forward = type(model).forward
        model.forward = types.MethodType(lambda self, x: forward(self, x) / 2.0, model)


habit(id="forward_patched_on_the_instance",
      source="accelerate's prepare_model and peft assign a wrapped forward on the model "
             "instance (`model.forward = MethodType(f, model)`); here a script does so "
             "after training began",
      what="an instance attribute assigned between calls takes the place of a method the "
           "trace called",
      expect=EQUAL, rule=GUARD, setup=mlp_sgd, call=xy,
      between=_patch_forward_between)(plain_step)


def _dropout_off_between(s, i):
    if i == 2:   # the last epochs without dropout
        unwrap(s.model).drop = nn.Identity()


habit(id="dropout_replaced_by_identity_for_the_last_epochs",
      source="a script that turns a regularizer off for the final epochs by replacing the "
             "module (`model.drop = nn.Identity()`), keeping its optimizer",
      what="a submodule without parameters replaced by another between calls",
      expect=EQUAL, rule=GUARD, setup=mlp_dropout_sgd, call=xy, between=_dropout_off_between,
      ranks=True)(plain_step)


def _clip_hook_between(s, i):
    if i == 2:   # after the warm-up: every step clips the weights it updated
        model = unwrap(s.model)

        def clip(optimizer, args, kwargs):
            with torch.no_grad():
                for p in model.parameters():
                    p.clamp_(-0.05, 0.05)
        s.opt.register_step_post_hook(clip)


habit(id="weight_clipping_step_post_hook_registered_after_warmup",
      source="WGAN's weight clipping (`p.data.clamp_(-c, c)` after each optimizer step) "
             "written as an optimizer step post-hook "
             "(`optimizer.register_step_post_hook`), registered once the warm-up ends",
      what="an optimizer hook registered between calls",
      expect=EQUAL, rule=HOOKS, setup=mlp_sgd, call=xy, between=_clip_hook_between,
      ranks=True)(plain_step)


@seeded
def _sac_alpha_setup():
    actor = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    log_alpha = torch.zeros(1, requires_grad=True)
    return SimpleNamespace(actor=actor, log_alpha=log_alpha,
                           actor_optimizer=torch.optim.Adam(actor.parameters(), lr=3e-4),
                           a_optimizer=torch.optim.Adam([log_alpha], lr=1e-3))


@habit(id="cleanrl_sac_log_alpha_argument",
       source="vwxyzjn/cleanrl sac_continuous_action.py: `log_alpha = torch.zeros(1, "
              "requires_grad=True)`, `a_optimizer = optim.Adam([log_alpha], lr=args.q_lr)`, "
              "the actor's loss weighted by `alpha = log_alpha.exp().item()`, then "
              "`alpha_loss = (-log_alpha.exp() * (log_pi + target_entropy)).mean()`; here "
              "log_alpha is the step's argument",
       what="a tensor stepped by an optimizer, passed to the step itself (not in a module)",
       expect=EQUAL, rule=INPUTS, setup=_sac_alpha_setup,
       call=lambda step, s, i, d: step(s.actor, s.log_alpha, s.actor_optimizer, s.a_optimizer,
                                       d.vec()))
def sac_alpha_step(actor, log_alpha, actor_optimizer, a_optimizer, obs):
    alpha = log_alpha.exp().item()
    log_pi = F.log_softmax(actor(obs), -1).max(-1).values
    actor_loss = (alpha * log_pi - log_pi.exp()).mean()
    actor_optimizer.zero_grad()
    actor_loss.backward()
    actor_optimizer.step()
    target_entropy = -4.0
    alpha_loss = (-log_alpha.exp() * (log_pi.detach() + target_entropy)).mean()
    a_optimizer.zero_grad()
    alpha_loss.backward()
    a_optimizer.step()
    return actor_loss, alpha


class _TinyUNet(nn.Module):
    """An encoder, a bilinear upsampling decoder and a skip connection."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Conv2d(3, 4, 3, padding=1)
        self.down = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.dec = nn.Conv2d(8, 2, 3, padding=1)

    def forward(self, x):
        e = F.relu(self.enc(x))
        up = F.interpolate(F.relu(self.down(e)), scale_factor=2, mode="bilinear",
                           align_corners=False)
        return self.dec(torch.cat([e, up], 1))


@seeded
def _unet_setup():
    model = _TinyUNet()
    return SimpleNamespace(model=model, opt=torch.optim.Adam(model.parameters(), lr=1e-3))


habit(id="unet_bilinear_upsampling_last_batch_smaller",
      source="milesial/Pytorch-UNet's Up block (`nn.Upsample(scale_factor=2, mode='bilinear', "
             "align_corners=True)`; segmentation_models' decoders call F.interpolate) trained "
             "with a DataLoader whose last batch is smaller (drop_last=False)",
      what="a batch of another size traces with symbolic sizes: the upsampling runs "
           "eager's kernel there too (torch's Python decomposition rounds otherwise)",
      expect=EQUAL, rule=GUARD, setup=_unet_setup, calls=5,
      call=lambda step, s, i, d: step(s.model, s.opt, d.img(n=(8, 8, 8, 5, 8)[i]),
                                      torch.randint(0, 2, ((8, 8, 8, 5, 8)[i], 8, 8),
                                                    generator=d.g)))(plain_step)


def _multilabel_target(y: torch.Tensor) -> torch.Tensor:
    """Two labels per sample, padded with -1 (MultiLabelMarginLoss's targets)."""
    pad = torch.full_like(y, -1)
    return torch.stack([y, (y + 1) % 4, pad, pad], 1)


@habit(id="multilabel_margin_loss_last_batch_smaller",
       source="multi-label classification with nn.MultiLabelMarginLoss (its targets padded "
              "with -1), the last batch of the epoch smaller",
       what="a loss whose Python decomposition computes another value than its kernel, in "
            "the program traced with symbolic sizes",
       expect=EQUAL, rule=GUARD, setup=mlp_sgd, calls=4,
       call=lambda step, s, i, d: step(s.model, s.opt, d.vec(n=(8, 8, 6, 8)[i]),
                                       _multilabel_target(d.cls(n=(8, 8, 6, 8)[i]))))
def multilabel_step(model, optimizer, x, target):
    optimizer.zero_grad()
    loss = nn.MultiLabelMarginLoss()(model(x), target)
    loss.backward()
    optimizer.step()
    return loss


class _PerSample(nn.Module):
    """A loop over the batch's samples in forward (per-sample attention pooling,
    as set-based and graph models write it)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(torch.stack([h[i] * h[i].softmax(0) for i in range(h.shape[0])]))


@seeded
def _per_sample_setup():
    model = _PerSample()
    return SimpleNamespace(model=model, opt=torch.optim.SGD(model.parameters(), lr=0.1))


habit(id="loop_over_the_batch_size_varying_batches",
      source="a forward that loops `for i in range(x.shape[0])` over its samples, called "
             "with batches of several sizes",
      what="a symbolic trace that reads the batch size as a number holds the program at "
           "that size: a batch of another size gets a program of its own",
      expect=EQUAL, rule=GUARD, setup=_per_sample_setup, calls=6,
      call=lambda step, s, i, d: step(s.model, s.opt, d.vec(n=(4, 4, 6, 4, 5, 6)[i]),
                                      d.cls(n=(4, 4, 6, 4, 5, 6)[i])))(plain_step)


def _unfreeze_at_epoch(model, optimizer, x, y, epoch):
    if epoch == 2 and len(optimizer.param_groups) == 1:   # unfreeze the backbone
        model.fc1.requires_grad_(True)
        optimizer.add_param_group({"params": model.fc1.parameters(), "lr": 0.01})
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


@seeded
def _frozen_backbone_setup():
    model = MLP()
    model.fc1.requires_grad_(False)
    return SimpleNamespace(model=model, opt=torch.optim.SGD(model.fc2.parameters(), lr=0.1))


@habit(id="unfreeze_backbone_add_param_group_in_step",
       source="fine-tuning scripts that unfreeze the backbone at an epoch inside the training "
              "step (`optimizer.add_param_group({'params': backbone.parameters(), 'lr': ...})`, "
              "Lightning's BackboneFinetuning callback does it between epochs)",
       what="a param group added by the step itself",
       expect=REFUSED, rule=HOST_WRITE, setup=_frozen_backbone_setup, refused_at=2,
       match="param_groups", call=lambda step, s, i, d: step(s.model, s.opt, d.vec(), d.cls(), i))
def unfreeze_step(model, optimizer, x, y, epoch):
    return _unfreeze_at_epoch(model, optimizer, x, y, epoch)


class _ClippingTrainer:
    """allennlp's GradientDescentTrainer: its first batch registers a hook on
    every parameter that clamps its gradient (enable_gradient_clipping)."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.hooked = model, optimizer, False

    def train_step(self, x, y):
        if not self.hooked:
            for p in self.model.parameters():
                p.register_hook(lambda grad: grad.clamp(-0.01, 0.01))
            self.hooked = True
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return loss


@seeded
def _clipping_trainer_setup():
    s = mlp_sgd()
    s.trainer = _ClippingTrainer(s.model, s.opt)
    return s


HABITS.append(Habit(
       id="allennlp_gradient_clipping_hooks_registered_by_the_first_step",
       source="allenai/allennlp training/util.py enable_gradient_clipping: "
              "`parameter.register_hook(lambda grad: nn_util.clamp_tensor(grad, ...))` for "
              "every parameter, called from the trainer's first batch",
       what="hooks on parameters registered by the step itself",
       expect=REFUSED, rule=HOOKS, setup=_clipping_trainer_setup, match="registers a hook",
       bind=lambda s: s.trainer.train_step, step=_ClippingTrainer.train_step,
       call=lambda step, s, i, d: step(d.vec(), d.cls())))


class _DynamicRope(nn.Module):
    """transformers' dynamic RoPE update (modeling_rope_utils.dynamic_rope_update),
    its few lines: a longer sequence than cached rescales the frequencies and
    caches its length (a 0-d tensor); a sequence back under the original
    length restores them and the cached length as the int it was."""

    def __init__(self, alias: bool):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.original_max_seq_len = self.max_seq_len_cached = 8
        self.register_buffer("inv_freq", torch.ones(4), persistent=False)
        # transformers keeps the buffer's own tensor (`self.original_inv_freq = self.inv_freq`)
        self.original_inv_freq = self.inv_freq if alias else self.inv_freq.clone()

    def forward(self, x):
        seq_len = torch.max(torch.arange(x.shape[0])) + 1
        if seq_len > self.max_seq_len_cached:   # growth
            self.register_buffer("inv_freq", self.original_inv_freq * 0.5, persistent=False)
            self.max_seq_len_cached = seq_len
        if seq_len < self.original_max_seq_len \
                and self.max_seq_len_cached > self.original_max_seq_len:
            self.original_inv_freq = self.original_inv_freq.to(x.device)   # reset
            self.register_buffer("inv_freq", self.original_inv_freq, persistent=False)
            self.max_seq_len_cached = self.original_max_seq_len
        return self.fc(x) * self.inv_freq


def _dynamic_rope_setup(alias: bool):
    @seeded
    def setup():
        model = _DynamicRope(alias)
        return SimpleNamespace(model=model, opt=torch.optim.AdamW(model.parameters(), lr=1e-2))
    return setup


def _rope_call(step, s, i, d):
    n = (6, 12, 16, 6, 12)[i]
    return step(s.model, s.opt, d.vec(n=n), d.cls(n=n))


habit(id="dynamic_rope_cache_grows_and_resets",
      source="huggingface/transformers modeling_rope_utils.py dynamic_rope_update: "
             "`self.max_seq_len_cached = seq_len` (a tensor) on growth, "
             "`self.max_seq_len_cached = self.original_max_seq_len` (an int) on reset, "
             "inv_freq registered anew each time; the original frequencies a copy",
      what="a module attribute that the step sets to a tensor, then back to an int: the "
           "program traced from the tensor runs from the state the call found, and the "
           "step's writes follow it",
      expect=EQUAL, rule=LAZY, setup=_dynamic_rope_setup(alias=False), calls=5,
      call=_rope_call)(plain_step)


HABITS.append(Habit(
    id="hf_dynamic_rope_original_inv_freq_is_the_buffer",
    source="huggingface/transformers LlamaRotaryEmbedding with rope_type 'dynamic': "
           "`self.original_inv_freq = self.inv_freq` in __init__, then dynamic_rope_update "
           "registers a new inv_freq on growth",
    what="the step replaces a buffer whose tensor it also reads through another attribute: "
         "eager leaves that tensor as it was, a transpiled step would write into it",
    expect=REFUSED, rule=HOST_WRITE, setup=_dynamic_rope_setup(alias=True), calls=5,
    refused_at=1, match="also reads as model.original_inv_freq", call=_rope_call,
    step=plain_step))


class _TwoRoutedLayers(nn.Module):
    """Two top-1 routed expert layers, dropout before each router (Switch
    Transformers' dropout on the router's input): the second routing decides
    on values computed from a random draw."""

    def __init__(self):
        super().__init__()
        self.a, self.fc, self.router = nn.Linear(16, 16), nn.Linear(16, 4), nn.Linear(16, 4)
        self.drop = nn.Dropout(0.1)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def route(self, h):
        top = self.router(h).argmax(-1)
        out = torch.zeros_like(h)
        for e in torch.bincount(top, minlength=4).nonzero():
            idx = torch.where(top == e[0])[0]
            out = out.index_add(0, idx, self.experts[e[0]](h[idx]))
        return out

    def forward(self, x):
        return self.fc(self.route(self.drop(self.route(self.drop(self.a(x))))))


habit(id="two_routed_layers_after_dropout",
      source="Switch Transformers / Mixtral-style top-1 routing (`torch.where(top == e)` per hit "
            "expert) in two stacked layers, dropout on each router's input",
      what="decisions on values computed from a random draw, traced on the call's values",
      expect=EQUAL, rule=DECISION,
      setup=_model_setup(_TwoRoutedLayers, lambda p: torch.optim.AdamW(p, lr=0.1)),
      call=xy)(plain_step)


@seeded
def _step_lr_setup():
    s = mlp_sgd.__wrapped__()
    s.scheduler = torch.optim.lr_scheduler.StepLR(s.opt, step_size=2, gamma=0.5)
    return s


@habit(id="warmup_factor_from_the_schedulers_last_epoch",
       source="a hand-written warm-up in the step, as training scripts scale the first steps: "
              "warm = min(1.0, (scheduler.last_epoch + 1) / warmup_steps), the scheduler "
              "stepped after optimizer.step() in the same step",
       what="the step reads its LR scheduler's step count before stepping it; the scheduler "
            "is stepped on the host after every call, so the count changes every call",
       expect=EQUAL, rule=GROUP_READS, setup=_step_lr_setup, ranks=True, calls=6,
       call=lambda step, s, i, d: step(s.model, s.opt, s.scheduler, d.vec(), d.cls()))
def warmup_from_last_epoch_step(model, optimizer, scheduler, x, y):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    warm = min(1.0, (scheduler.last_epoch + 1) / 3)
    (loss * warm).backward()
    optimizer.step()
    scheduler.step()
    return loss.detach()


@habit(id="mnist_log_interval_prints_loss_item",
       source="pytorch/examples mnist/main.py train(): if batch_idx % args.log_interval == 0: "
              "print('Train Epoch: {} [{}/{} ({:.0f}%)]\\tLoss: {:.6f}'.format(epoch, "
              "batch_idx * len(data), len(train_loader.dataset), 100. * batch_idx / "
              "len(train_loader), loss.item()))",
       what="the step prints the loss's value every other call, formatted with '{:.6f}'",
       expect=EQUAL, rule=DECISION, setup=mlp_sgd, ranks=True, calls=4,
       call=lambda step, s, i, d: step(s.model, s.opt, d.vec(), d.cls(), i))
def mnist_log_interval_step(model, optimizer, data, target, batch_idx):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()
    if batch_idx % 2 == 0:
        print("Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}".format(
            1, batch_idx * len(data), 4 * len(data), 100. * batch_idx / 4, loss.item()))
    return loss.detach()


class _PaddedEncoder(nn.Module):
    """nn.TransformerEncoder over a padded batch, a linear head on the sum of the
    positions the mask keeps."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)   # enable_nested_tensor=True
        self.head = nn.Linear(16, 4)

    def forward(self, x, pad):
        h = self.encoder(x, src_key_padding_mask=pad)
        return self.head(h.masked_fill(pad[..., None], 0).sum(1))


def _mha_fastpath(enabled: bool):
    @contextlib.contextmanager
    def switched():
        was = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(enabled)
        try:
            yield
        finally:
            torch.backends.mha.set_fastpath_enabled(was)
    return switched()


def _call_with(context, step, *args):
    with context:
        return step(*args)


def _padded_call(fastpath: bool):
    def call(step, s, i, d):
        x = d.vec(4 * 6, 16).view(4, 6, 16)
        pad = torch.zeros(4, 6, dtype=torch.bool)
        pad[1, 4:] = pad[3, 2:] = True
        return _call_with(_mha_fastpath(fastpath), step, s.model, s.opt, x, pad, d.cls(4))
    return call


def padded_encoder_validated_step(model, optimizer, x, pad, y):
    model.train()
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x, pad), y)
    loss.backward()
    optimizer.step()
    model.eval()
    with torch.no_grad():
        val_logits = model(x, pad)
    model.train()
    return loss.detach(), val_logits


for _fastpath in (True, False):
    habit(id="transformer_encoder_validated_in_step_" + ("fast_path" if _fastpath
                                                          else "fast_path_off"),
          source="torch/nn/modules/transformer.py TransformerEncoder.forward: in eval mode, "
                 "without grad and with src_key_padding_mask, the fast path packs the batch "
                 "into a nested tensor (torch._nested_tensor_from_mask); "
                 "torch.backends.mha.set_fastpath_enabled(False) turns it off",
          what="a validation forward after the update inside the step, through "
               "nn.TransformerEncoder with a padding mask, "
               + ("the fast path on (torch's default): refused at the encoder's line, naming "
                  "the switch" if _fastpath else "the fast path switched off around the calls"),
          expect=REFUSED if _fastpath else EQUAL, rule=AMBIENT,
          match=r"makes a nested tensor at .*set_fastpath_enabled\(False\)" if _fastpath else None,
          setup=_model_setup(_PaddedEncoder, lambda p: torch.optim.AdamW(p, lr=1e-3)),
          call=_padded_call(_fastpath), calls=3)(padded_encoder_validated_step)


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


@habit(id="mha_fast_path_switched_off_for_one_call",
       source="torch.backends.mha.set_fastpath_enabled (torch/backends/mha): "
              "nn.MultiheadAttention in eval mode without grad runs the fused "
              "_native_multi_head_attention kernel unless it is off",
       what="an attention's eval output inside the step, with the fast path switched off by "
            "the caller for the second call only: another kernel, which rounds differently",
       expect=EQUAL, rule=AMBIENT,
       setup=_model_setup(_Attention, lambda p: torch.optim.SGD(p, lr=0.1)), calls=3,
       call=lambda step, s, i, d: _call_with(_mha_fastpath(i != 1), step, s.model, s.opt,
                                             d.vec(4 * 5, 16).view(4, 5, 16), d.cls(4)))
def mha_eval_output_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    model.eval()
    with torch.no_grad():
        out = model.attn(x, x, x, need_weights=False)[0]
    model.train()
    return loss.detach(), out



class CFG:
    """A notebook's config: a class of constants, read as a global."""

    max_grad_norm = 1000.0
    loss_weight = 1.0


def _cfg_between(s, i):
    if i == 2:   # the script tightens clipping and weighs the loss for the last epochs
        CFG.max_grad_norm, CFG.loss_weight = 0.05, 0.5
    if i == 0:
        CFG.max_grad_norm, CFG.loss_weight = 1000.0, 1.0


@habit(id="kaggle_class_cfg_passed_to_train_fn",
       source="Kaggle training notebooks: `class CFG:` of constants (apex, "
              "gradient_accumulation_steps, max_grad_norm, ...), the class passed to "
              "train_fn(cfg, ...), which reads cfg.max_grad_norm in "
              "torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)",
       what="attributes of the user's config class, read through the class given as an "
            "argument, changed by the script between calls",
       expect=EQUAL, rule=GUARD, setup=mlp_sgd, between=_cfg_between, ranks=True, calls=4,
       call=lambda step, s, i, d: step(CFG, s.model, s.opt, d.vec(), d.cls()))
def kaggle_cfg_train_fn_step(cfg, model, optimizer, inputs, labels):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(inputs), labels) * cfg.loss_weight
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    optimizer.step()
    return loss.detach()


@habit(id="torchtitan_total_norm_then_clip_with_it",
       source="pytorch/torchtitan torchtitan/distributed/utils.py clip_grad_norm_: "
              "total_norm = torch.nn.utils.get_total_norm(grads, norm_type, "
              "error_if_nonfinite, foreach); torch.nn.utils.clip_grads_with_norm_(parameters, "
              "max_norm, total_norm, foreach)",
       what="the gradient norm taken and applied in two calls (torch's newer clipping API), "
            "the norm returned for logging",
       expect=EQUAL, rule=GUARD, setup=mlp_sgd, ranks=True, call=xy)
def titan_clip_step(model, optimizer, inputs, labels):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(inputs), labels)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm(grads, 2.0, False, True)
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.1, total_norm, True)
    optimizer.step()
    return loss.detach(), total_norm


# ================================================================= a raise on the call's values
# The step raises on a bad batch; the script's loop catches it and goes on.

def _nan_at(bad: int, caught, after=None):
    """The loop: call `bad` gets a nan in its batch (on every rank); an
    exception of `caught` is caught (then `after(s)`), and the loop goes on."""
    def run(step, s, i, d):
        x = d.vec()
        if i == bad:
            x = x.clone()
            x[0, 0] = float("nan")
        try:
            return step(s.model, s.opt, x, d.cls())
        except caught as exc:
            if after is not None:
                after(s)
            return f"{type(exc).__name__}: {exc}"
    return run


@habit(id="mae_loss_value_not_finite_sys_exit",
       source="facebookresearch/mae engine_pretrain.py train_one_epoch (DeiT's and ConvNeXt's "
              "engine.py alike): loss_value = loss.item(); if not math.isfinite(loss_value): "
              "print('Loss is {}, stopping training'.format(loss_value)); sys.exit(1)",
       what="a nan loss on one call: the step prints it and exits, after zero_grad and a "
            "dropout's draws (SystemExit caught here, as a launcher sees it); one program "
            "for every finite loss",
       expect=EQUAL, rule=DECISION, setup=mlp_dropout_sgd, ranks=True, calls=5,
       call=_nan_at(2, SystemExit))
def mae_exit_step(model, optimizer, samples, targets):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(samples), targets)
    loss_value = loss.item()
    if not math.isfinite(loss_value):
        print("Loss is {}, stopping training".format(loss_value))
        sys.exit(1)
    loss.backward()
    optimizer.step()
    return loss


@habit(id="fairseq_overflow_error_caught_drops_the_gradients",
       source="facebookresearch/fairseq fairseq/trainer.py train_step: `except OverflowError "
              "as e: overflow = True; logger.info(f'NOTE: gradient overflow detected, ignoring "
              "gradient, {str(e)}'); self.zero_grad()`, raised where the gradient norm is not "
              "finite (optim/dynamic_loss_scaler.py check_overflow)",
       what="the step raises after backward() on a nan gradient norm, naming the norm; the "
            "loop catches it and drops the gradients",
       expect=EQUAL, rule=DECISION, setup=mlp_dropout_sgd, calls=5,
       call=_nan_at(1, OverflowError, after=lambda s: s.opt.zero_grad()))
def fairseq_overflow_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if not torch.isfinite(grad_norm):
        raise OverflowError(f"gradient overflow detected, grad_norm={grad_norm}")
    optimizer.step()
    return loss


@habit(id="clip_grad_norm_error_if_nonfinite_caught",
       source="torch.nn.utils.clip_grad_norm_(..., error_if_nonfinite=True) (timm's train.py "
              "and Lightning expose the flag), the script's loop catching the RuntimeError and "
              "skipping the batch",
       what="torch's own check raises on a nan gradient norm after backward()",
       expect=EQUAL, rule=DECISION, setup=mlp_dropout_sgd, calls=5,
       call=_nan_at(3, RuntimeError))
def clip_nonfinite_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    optimizer.step()
    return loss


def _boxes_call(step, s, i, d):
    """Boxes (x1, y1, x2, y2); call 2's second box has x2 < x1. The loop
    catches the assertion and goes on (a bad sample skipped)."""
    b = d.vec(4, 4).abs()
    boxes = torch.cat([b[:, :2], b[:, :2] + b[:, 2:] + 0.1], 1)
    if i == 2:
        boxes = boxes.clone()
        boxes[1, 2] = boxes[1, 0] - 0.5
    try:
        return step(s.model, s.opt, d.vec(4, 16), boxes, d.cls(4))
    except AssertionError as exc:
        return str(exc)


@habit(id="tv_rcnn_degenerate_boxes_assert",
       source="pytorch/vision torchvision/models/detection/generalized_rcnn.py GeneralizedRCNN."
              "forward: degenerate_boxes = boxes[:, 2:] <= boxes[:, :2]; if degenerate_boxes.any(): "
              "bb_idx = torch.where(degenerate_boxes.any(dim=1))[0][0]; degen_bb = "
              "boxes[bb_idx].tolist(); torch._assert(False, f'... Found invalid box {degen_bb} ...')",
       what="a check of the targets' values in the model's training forward: the message holds "
            "the bad box's values; the loop catches the AssertionError",
       expect=EQUAL, rule=DECISION, setup=mlp_dropout_sgd, calls=4, call=_boxes_call)
def rcnn_boxes_step(model, optimizer, x, boxes, y):
    degenerate_boxes = boxes[:, 2:] <= boxes[:, :2]
    if degenerate_boxes.any():
        bb_idx = torch.where(degenerate_boxes.any(dim=1))[0][0]
        degen_bb = boxes[bb_idx].tolist()
        torch._assert(False, "All bounding boxes should have positive height and width. "
                             f"Found invalid box {degen_bb} for target at index 0.")
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss
