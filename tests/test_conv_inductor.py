"""Convolutional models under inductor: a ResNet's stride-2 convolutions
followed by BatchNorm, channels_last included, train within 1e-5 of eager and
of DDP.

Given real tensors, AOTAutograd makes each of their sizes a symbol of the
tracing context's shape environment; BatchNorm's decomposition then computes
1/(n-1) from a convolution's symbolic output size, a float inductor's
tensorify pass cannot bind (KeyError: s49 at the second call, when the program
compiles). A static program is compiled for static sizes: kernels without
symbolic sizes. (torchvision is not installed with torch 2.13 here: the
model is its definition, from torch's layers.)
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
from transpiler.bench.bench import BasicBlock

pytestmark = pytest.mark.compiles


def resnet(classes=10):
    """A small ResNet: its stem (stride 2 and max-pool) and a downsampling
    stage."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.MaxPool2d(3, 2, 1), BasicBlock(8, 16, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, classes))


def _step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
    loss.backward()
    opt.step()
    return loss.detach()


def _batches(n, world=1, channels_last=False):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.randn(4 * world, 3, 32, 32, generator=g)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        yield x, torch.randint(0, 10, (4 * world,), generator=g)


def test_resnet_under_inductor_equals_eager_with_static_kernels():
    from torch._inductor.utils import fresh_cache, run_and_get_code
    ours = resnet()
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    step = transpile(_step, backend="inductor")
    for i, (x, y) in enumerate(_batches(3)):
        if i == 1:   # the first call runs op by op, the second compiles
            with fresh_cache():
                a, code = run_and_get_code(step, ours, opts[0], x, y)
            assert code and not any("ks0" in c for c in code), "compiled for symbolic sizes"
        else:
            a = step(ours, opts[0], x, y)
        torch.testing.assert_close(a, _step(theirs, opts[1], x, y), rtol=1e-5, atol=1e-6)
    assert step.compiles == 1
    assert M.max_rel_error(M.state_of(ours, opts[0]), M.state_of(theirs, opts[1])) < 1e-5


def _rank_resnet_vs_ddp():
    """channels_last: the model and the batches."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def train(step_fn, wrap):
        model = resnet().to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        net = wrap(model)
        for x, y in _batches(3, world, channels_last=True):
            step_fn(net, opt, x.chunk(world)[rank], y.chunk(world)[rank])
        return M.state_of(M.as_next_forward_sees(net) if net is not model else model, opt)

    return M.max_rel_error(train(transpile(_step, mode="fuse_all_reduce", backend="inductor"),
                                 lambda m: m), train(_step, DDP))


def test_channels_last_resnet_under_inductor_on_2_ranks_equals_ddp(ranks2):
    assert max(ranks2.run(_rank_resnet_vs_ddp)) < 1e-5


def _pooled(dims):
    """A convolution, BatchNorm and an average pool with ceil_mode whose window
    runs past the map (transformers' EfficientNet pools its last 4x4 map with
    AvgPool2d(hidden_dim, ceil_mode=True)), or padding past it."""
    conv, bn, pool = ((nn.Conv2d, nn.BatchNorm2d, nn.AvgPool2d) if dims == 2
                      else (nn.Conv3d, nn.BatchNorm3d, nn.AvgPool3d))
    window = pool(160, ceil_mode=True) if dims == 2 else pool(5, 3, 2, ceil_mode=True)
    torch.manual_seed(0)
    return nn.Sequential(conv(3, 8, 3, 2, 1, bias=False), bn(8), nn.ReLU(), window, nn.Flatten(),
                         nn.LazyLinear(10))


@pytest.mark.parametrize("dims", [2, 3])
def test_average_pool_with_ceil_mode_under_inductor_equals_eager(dims):
    """Inductor's own backward of such a pool divides by the whole window:
    the gradients before it came out 1600 times too small
    (compiler_graph.pool_grads_as_kernels)."""
    g = torch.Generator().manual_seed(1)
    shape = (4, 3, 8, 8) if dims == 2 else (4, 3, 10, 10, 10)
    batches = [(torch.randn(shape, generator=g), torch.randint(0, 10, (4,), generator=g))
               for _ in range(3)]
    ours = _pooled(dims)
    ours(batches[0][0])   # the lazy layer
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    step = transpile(_step, backend="inductor")
    for x, y in batches:
        torch.testing.assert_close(step(ours, opts[0], x, y), _step(theirs, opts[1], x, y),
                                   rtol=1e-5, atol=1e-6)
    assert M.max_rel_error(M.state_of(ours, opts[0]), M.state_of(theirs, opts[1])) < 1e-5
