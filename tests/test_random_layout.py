"""Random ops draw what eager draws on any layout.

A random kernel fills a tensor in its memory order, and some take another path
for a strided tensor than for a contiguous one, so what dropout or `t.normal_()`
draws depends on the strides of the tensor it fills. Each op here runs on
transposed, permuted, channels_last, strided and offset tensors, eager against
transpiled from the same seed, bit for bit; then the attention that returns a
transposed tensor (nn.MultiheadAttention with batch_first=True) with dropout on,
on 2 ranks against DDP, and under inductor.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import transpile

# Views and copies of an (8, 32) tensor, none of them contiguous but "offset".
# "normalized" is batch norm of a transposed tensor, transposed back: CPU's
# kernel returns a contiguous tensor, so the result is transposed (the
# decomposition would keep its input's layout, and inductor's batch norm does).
LAYOUTS = {
    "transposed": lambda h: h.t(),
    "permuted": lambda h: h.view(2, 4, 32).permute(2, 0, 1),
    "channels_last": lambda h: h.view(2, 4, 8, 4).contiguous(memory_format=torch.channels_last),
    "strided": lambda h: h[:, ::2],
    "strided_transposed": lambda h: h[::2].t(),
    "offset": lambda h: h[3:],
    "normalized": lambda h: F.batch_norm(h.view(2, 4, 32).transpose(1, 2), None, None,
                                         training=True).transpose(1, 2),
}

# Random ops that fill their tensor in place.
FILLS = {
    "bernoulli_": lambda t: t.bernoulli_(0.7),
    "bernoulli_tensor": lambda t: t.bernoulli_(torch.full_like(t, 0.4)),
    "uniform_": lambda t: t.uniform_(-1, 1),
    "normal_": lambda t: t.normal_(),
    "exponential_": lambda t: t.exponential_(),
    "geometric_": lambda t: t.geometric_(0.3),
    "cauchy_": lambda t: t.cauchy_(),
    "log_normal_": lambda t: t.log_normal_(),
    "random_": lambda t: t.random_(5),
}


class Net(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.proj = nn.Linear(12, 32)
        self.body = body

    def forward(self, x):
        return self.body(self.proj(x)).float().square().mean()


def _step(model, opt, x):
    opt.zero_grad()
    loss = model(x)
    loss.backward()
    opt.step()
    return loss.detach()


def _eager_and_transpiled(build, calls=3, **options):
    torch.manual_seed(0)
    ours = build()
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    step = transpile(_step, **options)
    g = torch.Generator().manual_seed(1)
    for i in range(calls):
        x = torch.randn(8, 12, generator=g)
        torch.manual_seed(100 + i)
        a = step(ours, opts[0], x)
        after_ours = torch.rand(())   # the generator left where eager leaves it
        torch.manual_seed(100 + i)
        b = _step(theirs, opts[1], x)
        assert torch.equal(after_ours, torch.rand(())), f"call {i}: the generator is left elsewhere"
        yield i, (a, b), (ours, theirs)


def _assert_equal(build, **options):
    for i, (a, b), (ours, theirs) in _eager_and_transpiled(build, **options):
        assert torch.equal(a, b), f"call {i}: loss {a} != {b}"
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            assert torch.equal(p, q), f"call {i}: {name} differs by {(p - q).abs().max():.3g}"


class Layout(nn.Module):
    def __init__(self, layout, draw):
        super().__init__()
        self.layout, self.draw = layout, draw

    def forward(self, h):
        return self.draw(LAYOUTS[self.layout](h))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("how", ["dropout", "dropout_inplace", "alpha_dropout", "rand_like"])
def test_dropout_on_any_layout_draws_eagers_mask(layout, how):
    draw = {"dropout": lambda v: F.dropout(v, 0.4),
            "dropout_inplace": lambda v: F.dropout(v * 1, 0.4, inplace=True),
            "alpha_dropout": lambda v: F.alpha_dropout(v, 0.4, training=True),
            "rand_like": lambda v: v * (torch.rand_like(v) > 0.4)}[how]
    _assert_equal(lambda: Net(Layout(layout, draw)))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fill", FILLS)
def test_a_fill_in_place_of_a_view_draws_eagers_numbers(layout, fill):
    """The random op fills a view of a fresh buffer (channels_last: a copy);
    the write reaches the buffer through the view."""
    def draw(v):
        buffer = torch.zeros(8, 32)
        view = LAYOUTS[layout](buffer)
        FILLS[fill](view)
        return v * view + buffer.mean()
    _assert_equal(lambda: Net(Layout(layout, draw)))


def _attention():
    return nn.TransformerEncoderLayer(32, 4, 64, dropout=0.3, batch_first=True)


class AttentionNet(nn.Module):
    """nn.MultiheadAttention(batch_first=True) returns its output transposed:
    the dropout after it fills a tensor that is not contiguous."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(12, 32)
        self.layer = _attention()

    def forward(self, x):
        return self.layer(self.proj(x).view(2, 4, 32)).square().mean()


def test_transformer_layer_batch_first_with_dropout_equals_eager():
    _assert_equal(AttentionNet)


@pytest.mark.compiles
def test_dropout_on_a_transposed_tensor_under_inductor():
    worst = 0.0
    for i, (a, b), (ours, theirs) in _eager_and_transpiled(
            lambda: Net(Layout("transposed", lambda v: F.dropout(v, 0.4))), backend="inductor"):
        worst = max(worst, M.max_rel_error(dict(ours.named_parameters()),
                                           dict(theirs.named_parameters())))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert worst < 1e-5


@pytest.mark.compiles
@pytest.mark.parametrize("layout, draw", [
    ("normalized", lambda v: F.dropout(v, 0.4)),
    ("normalized", lambda v: v * torch.empty_like(v).normal_()),
    ("channels_last", lambda v: v + torch.randn_like(v))],
    ids=["dropout", "normal_", "randn_like"])
def test_a_draw_on_a_layout_the_compiler_chooses_otherwise_draws_eagers_numbers(layout, draw):
    """Under inductor a random op's input is laid out as eager's
    (compiler_graph.draws_in_eager_order), not as the compiler lays the value
    out: inductor keeps batch norm's input layout and made the channels_last
    copy contiguous. Dropout's masks were other ones from the second call on,
    and normal_ and randn_like, which draw another count of numbers for a
    contiguous tensor, left the generator elsewhere than eager."""
    for i, (a, b), (ours, theirs) in _eager_and_transpiled(lambda: Net(Layout(layout, draw)),
                                                           backend="inductor"):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert M.max_rel_error(dict(ours.named_parameters()), dict(theirs.named_parameters())) < 1e-5


def _rank_attention_vs_ddp(mode):
    rank, world = dist.get_rank(), dist.get_world_size()

    def train(step_fn, wrap):
        torch.manual_seed(0)
        model = AttentionNet()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        net = wrap(model)
        g = torch.Generator().manual_seed(1)
        for i in range(3):
            x = torch.randn(world * 8, 12, generator=g).chunk(world)[rank]
            torch.manual_seed(10 * i + rank)   # each rank its own masks
            step_fn(net, opt, x)
        return M.states_compared([(model, opt)], sharded=mode == "zero")[0]

    ours = train(transpile(_step, mode=mode), lambda m: m)
    theirs = train(_step, DDP)
    return M.max_rel_error(ours, theirs)


@pytest.mark.parametrize("mode", ["fuse_all_reduce", "zero"])
def test_attention_with_dropout_on_2_ranks_equals_ddp(mode, ranks2):
    assert ranks2.run(_rank_attention_vs_ddp, mode) == [0.0, 0.0]
