"""torch's fused optimizer kernels: Adam and AdamW with fused=True (nanoGPT's
configure_optimizers on CUDA, torchtitan's default, transformers'
adamw_torch_fused).

With backend eager a fused group's update is torch's own kernel
(capture/optimizers.py, _adam_fused): lr read from a host tensor, the other
values constants of the program. Bit for bit as eager with lr changed every
call and traced once; another beta or eps traces again. With a GradScaler,
whose scale is a power of two, the scaler unscales the gradients before the
kernel (as exact as the kernel's own unscaling) and skips an overflowing step. SGD(fused=True), whose
kernel cannot be traced, is refused; so are shards of a fused update on the
CPU (modes zero and fsdp), whose kernel rounds the last elements of a tensor
on a path of their own."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from tests.test_skipped_update import scaled_step as clipped_step   # unscale_, clip, step
from transpiler import TranspileError, transpile
from transpiler.errors import PassError

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CONFIGS = {
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "adam_l2_amsgrad": (torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-2, amsgrad=True)),
    "adamw": (torch.optim.AdamW, dict(lr=3e-3, weight_decay=0.1)),
    "adamw_maximize_amsgrad": (torch.optim.AdamW, dict(lr=3e-3, weight_decay=0.1,
                                                       maximize=True, amsgrad=True)),
}


def _model(dtype, device):
    torch.manual_seed(0)
    # 37 outputs: tensors whose sizes are no multiple of a vector's width
    return nn.Sequential(nn.Linear(16, 37), nn.ReLU(), nn.Linear(37, 4)).to(device, dtype)


def _train(step, config, dtype=torch.float32, device="cpu", between=None, calls=4):
    model = _model(dtype, device)
    cls, options = CONFIGS[config]
    opt = cls(model.parameters(), fused=True, **options)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
    for i, (x, y) in enumerate(M.batches("mlp", calls, 8)):
        if between is not None:
            between(i, opt)
        step(model, opt, x.to(device, dtype), y.to(device))
        scheduler.step()
    return M.state_of(model, opt)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_fused_update_equals_eager_with_lr_changed_every_call(config, dtype, device):
    step = transpile(M.classify_step)
    ours = _train(step, config, dtype, device)
    M.assert_states_equal(ours, _train(M.classify_step, config, dtype, device))
    assert step._cache.builds == 1


def test_another_beta_or_eps_traces_again_and_equals_eager(caplog):
    def change(i, opt):
        if i == 2:
            opt.param_groups[0]["betas"] = (0.8, 0.99)
            opt.param_groups[0]["eps"] = 1e-6

    step = transpile(M.classify_step)
    ours = _train(step, "adamw", between=change)
    M.assert_states_equal(ours, _train(M.classify_step, "adamw", between=change))
    assert step._cache.builds == 2


def scaled_step(model, opt, scaler, x, y):
    opt.zero_grad()
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    return x.sum()


@pytest.mark.parametrize("step_fn", [scaled_step, clipped_step], ids=["scaled", "unscaled_first"])
@pytest.mark.parametrize("init_scale", [2.0 ** 127, 2.0 ** 8], ids=["overflowing", "finite"])
def test_a_grad_scaler_with_a_fused_optimizer_equals_eager(init_scale, step_fn):
    """Eager's GradScaler.step gives a fused optimizer grad_scale (none once
    unscaled) and found_inf, and the kernel unscales and skips; the program's
    scaler unscales first and skips on the host: the same values."""
    runs = []
    for step in (transpile(step_fn), step_fn):
        model = _model(torch.float32, "cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        for x, y in M.batches("mlp", 4, 8):
            step(model, opt, scaler, x, y)
        runs.append({**M.state_of(model, opt), "scale": scaler.get_scale()})
    scale = runs[0].pop("scale")
    assert scale == runs[1].pop("scale")
    M.assert_states_equal(*runs)


def test_fused_sgd_is_refused_with_nothing_changed():
    model = _model(torch.float32, "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    step = transpile(M.classify_step)
    x, y = M.batches("mlp", 1, 8)[0]
    with pytest.raises(TranspileError, match=r"SGD\(fused=True\).*Use fused=False"):
        step(model, opt, x, y)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not opt.state and all(p.grad is None for p in model.parameters())


def rank_vs_ddp(mode, config, scaled):
    rank = dist.get_rank()
    runs = []
    for transpiled in (True, False):
        model = _model(torch.float32, "cpu")
        cls, options = CONFIGS[config]
        opt = cls(model.parameters(), fused=True, **options)
        net = model if transpiled else DDP(model)
        fn = clipped_step if scaled else M.classify_step
        step = transpile(fn, mode=mode) if transpiled else fn
        extra = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 8),) if scaled else ()
        for x, y in M.batches("mlp", 3, 8):
            step(net, opt, *extra, *M.shard((x, y), rank, 2))
            opt.param_groups[0]["lr"] *= 0.7
        runs.append(M.state_of(model, opt))
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("config,scaled", [("adam_l2_amsgrad", False), ("adamw", False),
                                           ("adamw", True)])
@pytest.mark.parametrize("mode", ["fuse_all_reduce", "grad_allreduce"])
def test_equals_ddp_on_2_ranks(mode, config, scaled, ranks2):
    for ours, ddp in ranks2.run(rank_vs_ddp, mode, config, scaled):
        M.assert_states_equal(ours, ddp)


def rank_sharded(mode):
    model = _model(torch.float32, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    x, y = M.batches("mlp", 1, 8)[0]
    try:
        transpile(M.classify_step, mode=mode)(model, opt, x, y)
    except PassError as e:
        return str(e)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_shards_of_a_fused_cpu_update_are_refused(mode, ranks2):
    for message in ranks2.run(rank_sharded, mode):
        assert message is not None and "fused optimizer update on the CPU" in message
        assert "Use fused=False" in message
