"""Dropout and an empty KV cache under inductor.

Attention that appends its keys to an empty 1-D cache (torch.cat([torch.tensor([]),
k], -2), as transformers' DynamicCache starts) and multiplies by k.transpose(-2, -1)
is captured with a view after the cat: eager's cat is contiguous. Inductor's
decomposition of cat drops the empty input and clones k with k's strides, and
the view no longer exists ("Cannot view a tensor with shape ... and strides");
GPT-2 with dropout hits it on its first call (dropout sends sdpa to its math
path, which has that matmul). The compiled backends now give the compiler
reshapes instead of views, and run random ops as ATen's kernels, so dropout
draws the masks eager draws.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests import models as M
from transpiler import transpile

pytestmark = pytest.mark.compiles
STEPS = 3
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class CachedAttention(nn.Module):
    def __init__(self, dim, heads, p):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        cache = torch.tensor([], device=x.device)   # an empty cache, 1-D
        k, v = torch.cat([cache, k], dim=-2), torch.cat([cache, v], dim=-2)
        att = (q @ k.transpose(-2, -1)) / k.shape[-1] ** 0.5
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1),
                              float("-inf"))
        y = (self.drop(att.softmax(-1)) @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y + 0.01 * torch.randn_like(y))   # another random op


class TinyLM(nn.Module):
    def __init__(self, vocab=50, dim=32, heads=4, p=0.1):
        super().__init__()
        self.embed, self.drop = nn.Embedding(vocab, dim), nn.Dropout(p)
        self.attn, self.head = CachedAttention(dim, heads, p), nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.drop(self.embed(tokens))
        return self.head(h + self.attn(h)), h


def tiny_step(model, opt, x, y):
    opt.zero_grad()
    logits, h = model(x)
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    opt.step()
    return h   # the embeddings after dropout: their zeros are the mask


def _max_rel(a: dict, b: dict) -> float:
    """Over the floating tensors of b that are not rounding noise: a key bias
    of its own (ViT's) has a zero gradient in exact arithmetic and stays
    within 1e-11 of zero, where any other rounding is a large relative error."""
    keys = [k for k, v in b.items() if v.is_floating_point() and v.abs().max() > 1e-9]
    return M.max_rel_error(*({k: s[k] for k in keys} for s in (a, b)))


def _train(step_fn, base, backend, batches, device):
    model = copy.deepcopy(base).to(device)
    # SGD: Adam would turn the rounding noise of near-zero gradients (GPT-2's key
    # bias has a zero gradient in exact arithmetic) into whole lr-sized steps.
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = step_fn if backend is None else transpile(step_fn, backend=backend)
    torch.manual_seed(1)
    # a batch: tokens (inputs and targets alike) or (inputs, targets)
    outs = [step(model, opt, *(t.to(device) for t in (b if isinstance(b, tuple) else (b, b))))
            for b in batches]
    after = torch.rand(1, device=device)   # where the step left the generator
    return outs, {k: v.detach().clone() for k, v in model.state_dict().items()}, after


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_dropout_after_empty_cache_under_inductor_draws_as_eager(device):
    torch.manual_seed(0)
    base = TinyLM()
    batches = [torch.randint(0, 50, (4, 8)) for _ in range(STEPS)]
    eager_h, eager_params, eager_after = _train(tiny_step, base, None, batches, device)
    h, params, after = _train(tiny_step, base, "inductor", batches, device)
    for got, want in zip(h, eager_h):
        assert torch.equal(got == 0, want == 0)   # the same dropout masks
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(after, eager_after)        # the generator advanced alike
    assert _max_rel(params, eager_params) <= 1e-5


def gpt2_step(model, opt, x, y):
    opt.zero_grad()
    logits = model(x).logits
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    return loss


def seq2seq_step(model, opt, x, y):
    opt.zero_grad()
    loss = model(input_ids=x, labels=y[:, :5].contiguous()).loss   # 5 targets, 8 sources
    loss.backward()
    opt.step()
    return loss


def _gpt2(transformers):
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=50,
                                     n_positions=16)
    assert config.attn_pdrop == config.resid_pdrop == config.embd_pdrop == 0.1
    return transformers.GPT2LMHeadModel(config)


def _t5(transformers):
    """sdpa's math path draws T5's attention dropout mask with bernoulli(x, p);
    inductor fused a consumer of the mask into the kernel before its draw (NaN
    losses from the second call; compiler_graph.draws_as_kernels)."""
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        decoder_start_token_id=0, dropout_rate=0.1))


def image_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(pixel_values=x).logits, y)
    loss.backward()
    opt.step()
    return loss


def _vit(transformers):
    """ViT's dropouts trace as bernoulli(x, p, generator=None): the same
    fusion gave NaN losses from the second call until draws_as_kernels took
    the spelled-out default generator too."""
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        image_size=8, patch_size=4, num_labels=3, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1))


def _tokens(g):
    return torch.randint(2, 50, (4, 8), generator=g)


def _images(g):
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


@pytest.mark.parametrize("build, step, batch", [(_gpt2, gpt2_step, _tokens),
                                                (_t5, seq2seq_step, _tokens),
                                                (_vit, image_step, _images)],
                         ids=["gpt2", "t5", "vit"])
def test_transformer_with_dropout_under_inductor_equals_eager(build, step, batch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    base = build(transformers)
    g = torch.Generator().manual_seed(0)
    batches = [batch(g) for _ in range(STEPS)]
    eager_loss, eager_params, eager_after = _train(step, base, "eager", batches, "cpu")
    loss, params, after = _train(step, base, "inductor", batches, "cpu")
    # Other dropout masks would move the loss by about 1e-2.
    torch.testing.assert_close(torch.stack(loss), torch.stack(eager_loss), rtol=1e-5, atol=0)
    assert torch.equal(after, eager_after)
    assert _max_rel(params, eager_params) <= 1e-5


def mixup_step(model, opt, x, y):
    """Mixup as scripts write it: lambda from numpy's Beta, the partner batch
    by a permutation of torch's (`x[perm]`, `y[perm]`), a loss of each."""
    import numpy as np
    opt.zero_grad()
    lam = np.random.beta(0.4, 0.4)
    perm = torch.randperm(x.shape[0])
    out = model(lam * x + (1 - lam) * x[perm])
    loss = lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])
    loss.backward()
    opt.step()
    return loss.detach()


def test_mixup_by_a_randperm_under_inductor_equals_eager():
    """inductor's pattern for a batch indexed by a randperm failed to compile
    it where the permutation is not sliced (torch 2.13: `Not all inputs to
    pattern found`, as under torch.compile): randperm reaches it as ATen's
    kernel behind a custom op (compiler_graph.draws_as_kernels), which draws
    eager's permutation."""
    import numpy as np
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    step = transpile(mixup_step, backend="inductor")
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
        losses = []
        for fn, model, opt in ((step, ours, opts[0]), (mixup_step, theirs, opts[1])):
            np.random.seed(i)
            torch.manual_seed(i)
            losses.append(fn(model, opt, x, y))
        assert torch.allclose(*losses, rtol=1e-5), (i, losses)
    assert _max_rel(M.state_of(ours, opts[0]), M.state_of(theirs, opts[1])) < 1e-5
    assert step.traces == 1 and step.compiles == 1
