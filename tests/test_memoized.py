"""A model that memoizes a function of its shapes with functools, as
transformers memoizes BEiT's relative position index: the transpiled step
equals eager whether the cache is filled by the trace or before it (a forward
outside the step), and the trace leaves no tensor of its own in the cache
(capture/memoized.py)."""

import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

from transpiler import transpile


@functools.lru_cache(maxsize=8)
def position_index(n: int) -> torch.Tensor:
    coords = torch.arange(n)
    return coords[:, None] - coords[None, :] + n - 1


def cached_in_a_wrapper(fn):
    """transformers' compile_compatible_method_lru_cache: the cache in a closure."""
    cached = functools.lru_cache(maxsize=8)(fn)

    @functools.wraps(fn)
    def wrapper(*args):
        return cached(*args)
    return wrapper


class RelativeAttention(nn.Module):
    def __init__(self, width=8, longest=6):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.table = nn.Parameter(torch.randn(2 * longest - 1))
        self.head = nn.Linear(width, 1)

    def index(self, n):
        return position_index(n)

    def forward(self, x):
        h = self.proj(x)
        scores = h @ h.transpose(1, 2) + self.table[self.index(x.shape[1])]
        return self.head(scores.softmax(-1) @ h).mean()


class StaticIndex(RelativeAttention):
    @staticmethod
    @cached_in_a_wrapper
    def index(n):
        coords = torch.arange(n)
        return coords[:, None] - coords[None, :] + n - 1


def step(model, opt, x):
    opt.zero_grad()
    loss = model(x)
    loss.backward()
    opt.step()
    return loss.detach()


def _train_both(cls, lengths, before=None):
    torch.manual_seed(0)
    ours = cls()
    theirs = copy.deepcopy(ours)
    if before is not None:
        before(copy.deepcopy(ours))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    transpiled = transpile(step)
    g = torch.Generator().manual_seed(1)
    for i, n in enumerate(lengths):
        x = torch.randn(2, n, 8, generator=g)
        a, b = transpiled(ours, opts[0], x), step(theirs, opts[1], x)
        assert torch.equal(a, b), f"call {i}: {a} != {b}"
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p, q)


def _clear():
    position_index.cache_clear()
    StaticIndex.index.__closure__[0].cell_contents.cache_clear()


@pytest.mark.parametrize("cls", [RelativeAttention, StaticIndex])
def test_cache_filled_by_the_trace(cls):
    _clear()
    _train_both(cls, [5, 5, 4, 5])   # two shapes: two traces
    index = cls().index(5)
    assert not isinstance(index, FakeTensor) and torch.equal(index, position_index.__wrapped__(5))


@pytest.mark.parametrize("cls", [RelativeAttention, StaticIndex])
def test_cache_filled_before_the_trace(cls):
    _clear()
    _train_both(cls, [5, 5, 5], before=lambda m: m(torch.randn(2, 5, 8)))
