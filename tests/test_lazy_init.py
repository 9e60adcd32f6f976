"""Host values the step writes while it runs: a lazy initialization (a value
filled in once, a flag set, hooks installed on the first call) is kept and
replayed; what a second trace from the written state writes again (a
counter) is refused with every write undone. transformers' image classifiers
(config.problem_type set on the first call with labels) train equal to eager
and to DDP."""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import TranspileError, transpile


class LazyScale(nn.Module):
    """A value computed on the first forward and kept."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.scale = None

    def forward(self, x):
        if self.scale is None:
            self.scale = 0.5
        return self.fc(x) * self.scale


class FirstCallDiffers(nn.Module):
    """The first call takes another path than the later ones."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.warm = False

    def forward(self, x):
        out = self.fc(x)
        if not self.warm:
            self.warm = True
            out = out * 0.1
        return out


def train_mode_step(model, opt, x, y):
    """model.train() inside the step, the model put in eval mode between calls."""
    model.train()
    return M.classify_step(model, opt, x, y)


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values()))


@pytest.mark.parametrize("make,step_fn,between", [
    (LazyScale, M.classify_step, None),
    (FirstCallDiffers, M.classify_step, None),
    (lambda: nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.0), nn.Linear(32, 4)),
     train_mode_step, lambda i, m: m.eval() if i % 2 else None),
], ids=["lazy value", "first call differs", "train() in the step"])
def test_a_lazy_write_is_kept_and_replayed_as_in_eager(make, step_fn, between):
    torch.manual_seed(0)
    ours = make()
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    step = transpile(step_fn)
    for i, (x, y) in enumerate(M.batches("mlp", 5, 8)):
        for m in (ours, theirs):
            if between is not None:
                between(i, m)
        assert torch.equal(step(ours, opts[0], x, y), step_fn(theirs, opts[1], x, y)), i
        assert _equal(ours, theirs), i
        assert {k: v for k, v in vars(ours).items() if not k.startswith("_")} == \
            {k: v for k, v in vars(theirs).items() if not k.startswith("_")}, i
        assert [m.training for m in ours.modules()] == [m.training for m in theirs.modules()]
    assert step.traces <= 3


class Global:
    count = 0


def counts_in_a_class(model, opt, x, y):
    Global.count += 1
    return M.classify_step(model, opt, x, y)


def test_a_class_attribute_counter_is_advanced_by_one_program():
    model = M.make("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = transpile(counts_in_a_class)
    try:
        for batch in M.batches("mlp", 3, 8):
            step(model, opt, *batch)
        assert Global.count == 3 and type(Global.count) is int and step._cache.builds == 1
    finally:
        Global.count = 0


class CachedScale(nn.Module):
    """A tensor computed on the first forward by functools.cached_property,
    which stores it straight into the instance's __dict__ (no __setattr__)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    @functools.cached_property
    def scale(self):
        return torch.linspace(0.5, 1.5, 32)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) * self.scale)


def test_a_tensor_cached_by_cached_property_on_the_first_call_is_real_after_it():
    """The value a cached_property computes while the step is traced is the
    program's (an output assigned to the attribute after every call, as eager
    keeps its first): the host holds a real tensor, not the trace's."""
    seen = []

    def cached_after_the_last_call(i, models):
        seen.append(models)
        if i > 0:
            ours, theirs = models
            assert type(vars(ours)["scale"]) is torch.Tensor
            assert torch.equal(vars(ours)["scale"], vars(theirs)["scale"])

    step = M.against_eager(M.classify_step, cached_after_the_last_call, calls=3,
                           build=CachedScale)
    cached_after_the_last_call(len(seen), seen[-1])
    assert step.traces == 1


class LazyTrainer:
    """A trainer that makes its optimizer, or its EMA copy of the model, on the
    first step."""

    def __init__(self, model):
        self.model, self.opt, self.ema = model, None, None

    def step_with_a_lazy_optimizer(self, x, y):
        if self.opt is None:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        return M.classify_step(self.model, self.opt, x, y)

    def step_with_a_lazy_ema(self, opt, x, y):
        loss = M.classify_step(self.model, opt, x, y)
        if self.ema is None:
            self.ema = copy.deepcopy(self.model)
        with torch.no_grad():
            for e, p in zip(self.ema.parameters(), self.model.parameters()):
                e.lerp_(p, 0.1)
        return loss


@pytest.mark.parametrize("lazy,match", [
    ("optimizer", r"AdamW.step\(\) is called at .*:\d+ .*on an optimizer the step "
                  r"makes on the model's parameters as it runs .*create it before the first call"),
    ("ema", r"makes MLP from the model's tensors as it runs and keeps it in "
            r".*__self__.ema .*create it before the first call")])
def test_an_optimizer_or_a_module_made_on_the_first_call_is_refused_and_undone(lazy, match):
    model = M.make("mlp")
    before = copy.deepcopy(model.state_dict())
    trainer, opt = LazyTrainer(model), torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = M.batches("mlp", 1, 8)[0]
    with pytest.raises(TranspileError, match=match):
        if lazy == "optimizer":
            transpile(trainer.step_with_a_lazy_optimizer)(x, y)
        else:
            transpile(trainer.step_with_a_lazy_ema)(opt, x, y)
    assert trainer.opt is None and trainer.ema is None and not opt.state
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def _vit():
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=32,
                                    num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=32, num_labels=3,
                                    hidden_dropout_prob=0.1)
    return transformers.ViTForImageClassification(config)


def image_step(model, opt, pixels, labels):
    opt.zero_grad()
    loss = model(pixel_values=pixels, labels=labels).loss
    loss.backward()
    opt.step()
    return loss


def _images(n, rank=0):
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g))
            for _ in range(n)]


def test_a_transformers_image_classifier_sets_problem_type_once():
    torch.manual_seed(0)
    ours = _vit()
    theirs = copy.deepcopy(ours)
    assert ours.config.problem_type is None
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, theirs)]
    step = transpile(image_step)
    for i, batch in enumerate(_images(3)):
        torch.manual_seed(i)
        a = step(ours, opts[0], *batch)
        torch.manual_seed(i)
        assert torch.equal(a, image_step(theirs, opts[1], *batch)), i
        assert _equal(ours, theirs), i
    assert ours.config.problem_type == theirs.config.problem_type == "single_label_classification"
    assert step.traces == 2   # the first call's program, then the one after the write


def rank_vit_vs_ddp(mode: str):
    rank = dist.get_rank()
    torch.manual_seed(0)
    ours = _vit()
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    step, ddp = transpile(image_step, mode=mode), DDP(theirs)
    for i, batch in enumerate(_images(3, rank)):
        torch.manual_seed(10 * i + rank)
        a = step(ours, opts[0], *batch)
        torch.manual_seed(10 * i + rank)
        if not torch.equal(a, image_step(ddp, opts[1], *batch)):
            return False
    return _equal(ours, theirs)


@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce"])
def test_a_transformers_image_classifier_equals_ddp(mode, ranks2):
    assert ranks2.run(rank_vit_vs_ddp, mode) == [True, True]
