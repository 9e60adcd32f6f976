"""Every parameter shape in every mode: a 0-d parameter (CLIP's logit_scale), a
1-element one, odd sizes and sizes below the world size, trained on 2 and 3
ranks against DDP with its defaults in the same processes (sharded modes:
their shards padded, gathered and updated as a whole); and every parameter
layout (channels_last, transposed, a one-element shard), which kernels read
as eager's parameters are laid out."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import transpile


class OddShapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(7, 5)                          # odd sizes
        self.logit_scale = nn.Parameter(torch.tensor(2.5))  # 0-d
        self.gate = nn.Parameter(torch.ones(1))             # one element
        self.small = nn.Parameter(torch.randn(2))           # below 3 ranks
        self.cube = nn.Parameter(torch.randn(3, 5, 1) / 4)

    def forward(self, x):
        h = self.lin(x) * self.logit_scale.exp() * self.gate
        h = h[:, :2] * self.small + (h[:, 2:] @ self.cube.view(3, 5)).sum(-1, keepdim=True)
        return h


class Layouts(nn.Module):
    """Parameters whose layout picks a kernel's path: BatchNorm's fast path
    wants a contiguous weight (2 channels on 2 ranks: one-element shards, whose
    gathered rows are strided), a channels_last convolution, a transposed
    matrix."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3, 2, 1, bias=False)
        self.bn = nn.BatchNorm2d(2)
        self.conv2 = nn.Conv2d(2, 8, 3, 2, 1, bias=False).to(memory_format=torch.channels_last)
        self.bn2 = nn.BatchNorm2d(8)
        self.proj = nn.Parameter(torch.randn(5, 8).t())

    def forward(self, x):
        h = nn.functional.hardswish(self.bn(self.conv(x)))
        h = self.bn2(self.conv2(h)).mean((2, 3))
        return h @ self.proj


def _step(model, opt, x, y):
    opt.zero_grad()
    loss = (model(x).sum(-1) - y).square().mean()
    loss.backward()
    opt.step()
    return loss.detach()


def _rank_vs_ddp(mode, opt_name, model_cls=OddShapes, shape=(7,)):
    rank, world = dist.get_rank(), dist.get_world_size()

    def train(step_fn, wrap):
        torch.manual_seed(0)
        model = model_cls()
        opt = M.make_optimizer(opt_name, model)
        net = wrap(model)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            x, y = torch.randn(6 * world, *shape, generator=g), torch.randn(6 * world, generator=g)
            step_fn(net, opt, x.chunk(world)[rank], y.chunk(world)[rank])
        if step_fn is _step:   # DDP: the buffers its next forward starts from
            M.as_next_forward_sees(net)
        sharded = mode in ("zero", "fsdp")   # the optimizer's state: the parameters stand for it
        if mode == "fsdp" and step_fn is not _step:
            with step_fn.unsharded():
                return M.states_compared([(model, opt)], sharded)[0]
        return M.states_compared([(model, opt)], sharded)[0]

    return M.max_rel_error(train(transpile(_step, mode=mode), lambda m: m), train(_step, DDP))


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce", "zero", "fsdp"])
def test_every_parameter_shape_equals_ddp_on_2_ranks(mode, opt_name, ranks2):
    assert ranks2.run(_rank_vs_ddp, mode, opt_name) == [0.0, 0.0]


@pytest.mark.parametrize("mode", ["fuse_all_reduce", "zero", "fsdp"])
def test_every_parameter_layout_equals_ddp_on_2_ranks(mode, ranks2):
    assert ranks2.run(_rank_vs_ddp, mode, "adamw", Layouts, (3, 16, 16)) == [0.0, 0.0]


@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_shards_of_parameters_smaller_than_3_ranks(mode, ranks3):
    # on 3 ranks the average's 1/3 rounds before the sum, in DDP's order
    assert max(ranks3.run(_rank_vs_ddp, mode, "adamw")) <= 1e-6


def _clip():
    transformers = pytest.importorskip("transformers")
    text = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=8)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=8, patch_size=4)
    torch.manual_seed(0)
    return transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision,
                                                          projection_dim=8))


def _clip_step(model, opt, ids, pixels):
    opt.zero_grad()
    loss = model(input_ids=ids, pixel_values=pixels, return_loss=True).loss
    loss.backward()
    opt.step()
    return loss.detach()


def _rank_clip_vs_ddp(mode):
    rank, world = dist.get_rank(), dist.get_world_size()

    def train(step_fn, wrap):
        model = _clip()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        net = wrap(model)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            ids = torch.randint(0, 40, (4 * world, 6), generator=g).chunk(world)[rank]
            pixels = torch.randn(4 * world, 3, 8, 8, generator=g).chunk(world)[rank]
            step_fn(net, opt, ids, pixels)
        if mode == "fsdp" and step_fn is not _clip_step:
            with step_fn.unsharded():
                return M.states_compared([(model, opt)], True)[0]
        return M.states_compared([(model, opt)], mode != "fuse_all_reduce")[0]

    return M.max_rel_error(train(transpile(_clip_step, mode=mode), lambda m: m),
                           train(_clip_step, DDP))


@pytest.mark.parametrize("mode", ["fuse_all_reduce", "zero", "fsdp"])
def test_clip_with_its_0d_logit_scale_equals_ddp(mode, ranks2):
    assert ranks2.run(_rank_clip_vs_ddp, mode) == [0.0, 0.0]
