"""The program lays each value out as eager does: where an op's meta function
or decomposition gives other strides than its CPU kernel
(transpiler/capture/kernel_layouts.py), and where an in-place op becomes an
out-of-place one that allocates another layout (capture/functionalize.py),
the step still computes what eager computes, its views, its random draws and
its sums' order included, with static and with symbolic sizes. Without them,
each case raised in the program's first run (a view of a value laid out
otherwise) or, for the fills in place, returned a loss an ulp from eager's."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from transpiler import transpile
from transpiler.capture import functionalize


class TransposedBatchNorm(nn.Module):
    """PatchTST's normalization: BatchNorm1d over the features of a
    (batch, time, features) tensor, through two transposes. CPU's kernel
    returns a contiguous result where the decomposition keeps the transposed
    layout: the reshape after it copies in eager, and dropout on it fills its
    mask in the kernel's memory order."""

    def __init__(self, dropout: float, flat: bool = True):
        super().__init__()
        self.flat = flat
        self.proj = nn.Linear(6, 16)
        self.norm = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.norm(self.proj(x).transpose(1, 2)).transpose(1, 2)
        h = self.drop(h)
        return self.head(h.reshape(-1, 16) if self.flat else h.sum(1))


class GatedSoftplus(nn.Module):
    """A softplus gate read transposed (Qwen3-Next's decay gate is padded and
    transposed after its softplus): its gradient comes back transposed, CPU's
    softplus_backward follows that layout and its decomposition does not, and
    the linear layer's backward reshapes the result."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 8)
        self.gate = nn.Parameter(torch.randn(8, 5))

    def forward(self, x):
        s = F.softplus(self.proj(x))
        return (s.transpose(1, 2) * self.gate).sum(1)[:, :3]


class FilledInPlace(nn.Module):
    """masked_fill_ on a transposed tensor with a broadcast mask: eager keeps
    the tensor's layout, the out-of-place masked_fill returns a contiguous
    one, and the loss's sum runs in another order (an ulp apart). With a
    write through a view beside it, the step is functionalized by tracing it
    again (capture/trace.py) instead of by the graph's rewrite."""

    def __init__(self, through_view: bool):
        super().__init__()
        self.proj = nn.Linear(6, 8)
        self.through_view = through_view

    def forward(self, x):
        h = self.proj(x).transpose(1, 2) * 2
        h.masked_fill_(torch.zeros(8, 1, dtype=torch.bool), 0)
        if self.through_view:
            h[:, :2].mul_(3)
        return h.transpose(1, 2).reshape(-1, 8)[:, :3]


class MatrixNorm(nn.Module):
    """torch.linalg.matrix_norm of a transposed tensor: its backward fills a
    transposed gradient in place, and the program's view of it raised."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 8)

    def forward(self, x):
        h = self.proj(x).reshape(-1, 40)
        norm = torch.linalg.matrix_norm(h.view(-1, 5, 8).transpose(1, 2))
        return (h * norm.unsqueeze(1)).reshape(-1, 8)[:, :3]


def _step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x).reshape(-1, 3), y)
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("build, rows", [(lambda: TransposedBatchNorm(0.0), 20),
                                         (lambda: TransposedBatchNorm(0.3), 20),
                                         (lambda: TransposedBatchNorm(0.3, flat=False), 4),
                                         (GatedSoftplus, 4),
                                         (lambda: FilledInPlace(False), 20),
                                         (lambda: FilledInPlace(True), 20),
                                         (MatrixNorm, 20)],
                         ids=["batch_norm", "batch_norm_dropout", "dropout_mask",
                              "softplus_backward", "filled_in_place",
                              "filled_in_place_traced_again", "matrix_norm"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "symbolic"])
def test_a_result_laid_out_otherwise_by_its_kernel_trains_as_eager(build, rows, dynamic):
    torch.manual_seed(0)
    ours = build()
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    step, g = transpile(_step, dynamic=dynamic), torch.Generator().manual_seed(1)
    for i, batch in enumerate([4, 4, 3]):   # a smaller last batch: the symbolic program runs it
        x = torch.randn(batch, 5, 6, generator=g)
        y = torch.randint(0, 3, (rows * batch // 4,), generator=g)
        torch.manual_seed(i)
        a = step(ours, opts[0], x, y)
        torch.manual_seed(i)
        b = _step(theirs, opts[1], x, y)
        assert torch.equal(a, b), f"call {i}: loss {a} != {b}"
    for (name, p), q in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(p, q), f"{name} differs"


def test_the_layout_check_of_an_in_place_draw_draws_nothing():
    """An in-place random op keeps its layout by capture/random_layout.py:
    checking its out-of-place twin's layout would draw. In the trace on a
    call's real values that draw shifted every later one, and NLLB-MoE's
    LayerDrop decided otherwise than its first trace (refused on 2 ranks)."""
    target = torch.empty(4, 6).t()
    state = torch.get_rng_state()
    assert functionalize.relaid_twin(torch.ops.aten.bernoulli_.float, (target, 0.5), {}) is None
    assert torch.equal(state, torch.get_rng_state())
