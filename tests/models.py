"""Small models, data and steps shared by the tests, the demo and the bench."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from transpiler.bench.bench import MLP
from transpiler.bench.bench import train_step as lm_step


class TiedLM(nn.Module):
    """Embedding tied to the output layer, a frozen scale and an unused parameter."""

    def __init__(self, vocab=24, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight
        self.unused = nn.Parameter(torch.randn(5))
        self.frozen = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, tokens):
        h = torch.tanh(self.hidden(self.embed(tokens))) * self.frozen
        return self.out(h)


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        # No bias before BatchNorm: its gradient would be zero up to rounding noise.
        self.fc1 = nn.Linear(16, 32, bias=False)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class MixedNet(nn.Module):
    """An fp32 layer followed by a bf16 layer: gradients of two dtypes."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4).to(torch.bfloat16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)).to(torch.bfloat16)).float()


def classify_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def sam_step(rho: float):
    """Sharpness-aware minimization with radius rho: ascend along the first
    gradient, take the gradient there, descend from where it started."""
    def sam(model, opt, x, y):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        params = [p for p in model.parameters() if p.grad is not None]
        with torch.no_grad():
            norm = torch.stack([p.grad.norm() for p in params]).norm()
            eps = [p.grad * (rho / (norm + 1e-12)) for p in params]
            for p, e in zip(params, eps):
                p.add_(e)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        with torch.no_grad():
            for p, e in zip(params, eps):
                p.sub_(e)
        opt.step()
        return loss
    return sam


def make(model_name: str, seed: int = 0):
    torch.manual_seed(seed)
    return {"mlp": lambda: MLP([16, 32, 32, 4]), "tied": TiedLM, "bn": BNNet,
            "mixed": MixedNet}[model_name]()


def batches(model_name: str, steps: int, batch: int, seed: int = 1):
    """`steps` global batches for a model, the same in every process."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if model_name == "tied":
            tokens = torch.randint(0, 24, (batch, 6), generator=g)
            out.append((tokens, torch.roll(tokens, 1, dims=1)))
        else:
            out.append((torch.randn(batch, 16, generator=g), torch.randint(0, 4, (batch,), generator=g)))
    return out


def step_fn(model_name: str):
    return lm_step if model_name == "tied" else classify_step


def make_optimizer(name: str, model: nn.Module, foreach: bool | None = None):
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3, foreach=foreach)
    if name == "nesterov":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, foreach=foreach)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2, foreach=foreach)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=foreach)
    raise ValueError(name)


def change_every_hyperparameter(opt):
    """Change every hyperparameter value of SGD/Adam/AdamW's groups. Weight
    decay and momentum that are off (zero) stay off: switching them on changes
    the program; dampening is switched on."""
    for group in opt.param_groups:
        group["lr"] *= 0.8
        group["weight_decay"] *= 1.5
        if "betas" in group:
            group["betas"] = (group["betas"][0] - 0.02, group["betas"][1] - 0.003)
            group["eps"] *= 10
        else:
            group["momentum"] -= 0.1
            if not group["nesterov"]:   # nesterov requires zero dampening
                group["dampening"] += 0.1


def shard(batch, rank: int, world_size: int):
    return tuple(t.chunk(world_size)[rank] for t in batch)


def state_of(model: nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """Parameters, buffers and optimizer state, by name, as plain tensors."""
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in optimizer.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"opt.{names[id(p)]}.{k}"] = v.detach().clone()
    return out


def as_next_forward_sees(ddp) -> torch.nn.Module:
    """DDP's module with the buffers its next forward through its wrapper (an
    evaluation, the next step) starts from: rank 0's, which it broadcasts
    first (broadcast_buffers=True), unless its last forward ran without grad
    (require_forward_param_sync). The transpiled step broadcasts what it wrote
    at the end of the step, so its module holds them already. A collective:
    every rank calls it."""
    import torch.distributed as dist
    if ddp.broadcast_buffers and ddp.require_forward_param_sync:
        for buffer in ddp.module.buffers():
            dist.broadcast(buffer, 0)
    return ddp.module


def evaluated(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's output on `x` in eval mode, without grad (an evaluation
    between steps: through DDP's wrapper, after its buffers' broadcast)."""
    model.eval()
    with torch.no_grad():
        out = model(x)
    model.train()
    return out


def assert_states_equal(ours: dict, theirs: dict) -> None:
    """Two states by name, every tensor bit for bit."""
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), (k, (ours[k] - theirs[k]).abs().max())


def states_compared(pairs, sharded: bool) -> list[dict[str, torch.Tensor]]:
    """state_of each (model, optimizer); without the optimizer's entries where
    a rank keeps only its shard of them (modes zero, fsdp): the parameters,
    updated from that state, stand for it."""
    states = [state_of(m, o) for m, o in pairs]
    if sharded:
        states = [{k: v for k, v in d.items() if k.startswith("model.")} for d in states]
    return states


def max_rel_error(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = 0.0
    for k in a:
        x, y = a[k].double(), b[k].double()
        worst = max(worst, ((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item())
    return worst


def against_eager(step_fn, between=None, calls: int = 4, build=None, args: tuple = (),
                  hosts: tuple = ()):
    """The step transpiled and eager from the same start (SGD with momentum),
    `between(i, (ours, theirs))` run before call i: each call's result and the
    models' state must be equal bit for bit. `hosts`: a host object for each
    (ours, then eager's), its last argument. Returns the transpiled step."""
    from transpiler import transpile
    torch.manual_seed(0)
    ours = build() if build is not None else make("mlp")
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    step = transpile(step_fn)
    own = [(h,) for h in hosts] or [(), ()]
    for i, (x, y) in enumerate(batches("mlp", calls, 8)):
        if between is not None:
            between(i, (ours, theirs))
        a, b = (step(ours, opts[0], x, y, *args, *own[0]),
                step_fn(theirs, opts[1], x, y, *args, *own[1]))
        assert torch.equal(a, b), f"call {i}: {a} != {b}"
        assert all(torch.equal(p, q) for p, q in zip(ours.state_dict().values(),
                                                     theirs.state_dict().values())), f"call {i}"
    return step


def refused_as_it_was(step_fn, host, match: str) -> None:
    """The step, given `host` as its last argument, is refused at its first
    call (a TranspileError matching `match`) with the model as it was."""
    import pytest
    from transpiler import TranspileError, transpile
    model = make("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TranspileError, match=match):
        transpile(step_fn)(model, opt, *batches("mlp", 1, 8)[0], host)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) \
        and not opt.state


def against_ddp(build, step_fn, mode: str, lr: float = 1e-2):
    """The same model (seed 0) twice, one transpiled with `mode`, one in torch
    DDP, each with its AdamW: (ours, theirs, (our opt, their opt), step)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from transpiler import transpile
    torch.manual_seed(0)
    ours = build()
    theirs = DDP(copy.deepcopy(ours))
    opts = tuple(torch.optim.AdamW(m.parameters(), lr=lr) for m in (ours, theirs))
    return ours, theirs, opts, transpile(step_fn, mode=mode)
