"""Parameters in bfloat16, float16 or complex64.

bfloat16 or float16 (a model cast with .to(torch.bfloat16), as pure-bf16
fine-tuning does): the optimizer's update bit for bit as eager's, with lr
changed before every call and nothing traced again. Kernels of those dtypes
round a 0-d tensor operand to the tensor's dtype where a Python number keeps
float32, so these groups read their hyperparameters as numbers
(capture/optimizers.py). complex64 (a Fourier neural operator): exact with
every optimizer, those that update their state through view_as_real views
(Adam, AdamW, RMSprop, Adagrad) included, in one process and against DDP."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from transpiler import transpile

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=True),
    "sgd_momentum_wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd_dampening": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1),
    "sgd_nesterov_maximize": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9,
                                                        nesterov=True, maximize=True),
    "sgd_nesterov_wd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True,
                                                          weight_decay=0.01, foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-4),
    "adam_l2_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-4, weight_decay=1e-2,
                                                   amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1, eps=1e-4),
    "adamw_maximize": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1, eps=1e-4,
                                                   maximize=True),
    "adamw_amsgrad_foreach": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1,
                                                          eps=1e-4, amsgrad=True, foreach=True),
    "adam_l2_foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-4, weight_decay=1e-2,
                                                   foreach=True),
}


class Mixed(nn.Module):
    """A bf16 (or fp16) body and a float32 head in one parameter group."""

    def __init__(self, dtype):
        super().__init__()
        self.body = nn.Linear(8, 16).to(dtype)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.relu(self.body(x.to(self.body.weight.dtype))).float())


def step_fn(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _train(dtype, opt_name, step, calls=4, device="cpu"):
    torch.manual_seed(0)
    model = Mixed(dtype).to(device)
    opt = OPTIMIZERS[opt_name](model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(calls):
        losses.append(step(model, opt, torch.randn(6, 8, generator=g).to(device),
                           torch.randint(0, 3, (6,), generator=g).to(device)))
        scheduler.step()
    return model, opt, losses


# On CUDA eager's update takes torch's multi-tensor path unless a group says
# foreach=False: the other path of the numbers update.
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_update_equals_eager_with_lr_changed_every_call(dtype, opt_name, device):
    step = transpile(step_fn)
    ours = _train(dtype, opt_name, step, device=device)
    theirs = _train(dtype, opt_name, step_fn, device=device)
    # (SGD's first step with dampening makes its buffer undamped: traced again)
    assert step._cache.builds == (2 if opt_name == "sgd_dampening" else 1)
    assert all(torch.isfinite(p).all() for p in theirs[0].parameters())
    assert all(torch.equal(a, b) for a, b in zip(ours[2], theirs[2]))
    for (name, a), b in zip(ours[0].named_parameters(), theirs[0].parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
        assert (a.grad is None) == (b.grad is None)
        assert a.grad is None or torch.equal(a.grad, b.grad), f"{name}.grad"
    for p, q in zip(ours[0].parameters(), theirs[0].parameters()):
        mine, eager = ours[1].state[p], theirs[1].state[q]
        assert mine.keys() == eager.keys()
        assert all(torch.equal(mine[k], eager[k]) for k in eager), name


def rank_vs_ddp(dtype, opt_name, mode):
    """The transpiled step and DDP with the same optimizer in the same
    processes, each rank its own batches, lr changed every call."""
    rank = dist.get_rank()
    runs = []
    for transpiled in (True, False):
        torch.manual_seed(0)
        model = Mixed(dtype)
        opt = OPTIMIZERS[opt_name](model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
        step = transpile(step_fn, mode=mode) if transpiled else step_fn
        net = model if transpiled else DDP(model)
        g = torch.Generator().manual_seed(10 + rank)
        for _ in range(3):
            step(net, opt, torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g))
            scheduler.step()
        runs.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fuse_all_reduce", "zero"])
@pytest.mark.parametrize("opt_name", ["sgd_momentum_wd", "adamw"])
def test_equals_ddp_on_2_ranks(opt_name, mode, ranks2):
    for ours, ddp in ranks2.run(rank_vs_ddp, torch.bfloat16, opt_name, mode):
        assert ours.keys() == ddp.keys()
        assert all(torch.equal(ours[k], ddp[k]) for k in ours)


class Spectral(nn.Module):
    """A Fourier neural operator's spectral weights: a complex parameter."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, dtype=torch.complex64))

    def forward(self, x):
        return torch.fft.irfft(torch.fft.rfft(x) * self.w[:x.shape[-1] // 2 + 1], n=x.shape[-1])


def spectral_step(model, opt, x):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.detach()


COMPLEX_OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "rmsprop_momentum": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
}


def _spectral_run(opt_name, step, calls=4, net=lambda m: m, seed=0):
    torch.manual_seed(0)
    model = Spectral()
    opt = COMPLEX_OPTIMIZERS[opt_name](model.parameters())
    g = torch.Generator().manual_seed(seed)
    for _ in range(calls):
        step(net(model), opt, torch.randn(4, 14, generator=g))
    return model.w.detach().clone(), {k: v.clone() for k, v in opt.state[model.w].items()}


@pytest.mark.parametrize("opt_name", list(COMPLEX_OPTIMIZERS))
def test_complex_parameters_train_as_eager_with_every_optimizer(opt_name):
    """torch's stateful optimizers update a complex parameter's state through
    view_as_real views of it: the state the program creates at the first call
    and updates at the later ones is eager's, bit for bit."""
    (w, state), (w_eager, state_eager) = (_spectral_run(opt_name, transpile(spectral_step)),
                                          _spectral_run(opt_name, spectral_step))
    assert torch.equal(w, w_eager)
    assert state.keys() == state_eager.keys()
    assert all(torch.equal(state[k], state_eager[k]) for k in state), \
        [k for k in state if not torch.equal(state[k], state_eager[k])]


def complex_rank_vs_ddp(opt_name, mode):
    rank = dist.get_rank()
    return [_spectral_run(opt_name, transpile(spectral_step, mode=mode), 3, seed=10 + rank),
            _spectral_run(opt_name, spectral_step, 3, net=DDP, seed=10 + rank)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fuse_all_reduce", "zero"])
def test_complex_parameters_with_adamw_equal_ddp(mode, ranks2):
    """In mode zero each rank keeps its shard of the state: the rank's chunk
    of the parameter's elements (8 complex numbers, 4 a rank)."""
    for rank, ((w, state), (w_ddp, state_ddp)) in enumerate(
            ranks2.run(complex_rank_vs_ddp, "adamw_amsgrad", mode)):
        assert torch.equal(w, w_ddp)
        assert state.keys() == state_ddp.keys()
        for k, theirs in state_ddp.items():
            if mode == "zero" and theirs.dim():
                theirs = theirs.flatten().chunk(2)[rank]
            assert torch.equal(state[k], theirs), k


@pytest.mark.slow
def test_inductor_compiles_a_low_precision_group():
    """A compiler decomposes lerp by a branch on its weight: a group traced
    for inductor reads 0-d tensors (within its tolerance), not numbers."""
    step = transpile(step_fn, backend="inductor")
    ours, theirs = _train(torch.bfloat16, "adamw", step), _train(torch.bfloat16, "adamw", step_fn)
    assert step._cache.builds == 1
    for a, b in zip(ours[0].parameters(), theirs[0].parameters()):
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=4e-3)
