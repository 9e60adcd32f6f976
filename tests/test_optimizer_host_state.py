"""An optimizer of the user's own (timm's Lamb, Adan, Lookahead; a research
repo's) that keeps a value outside a tensor of optimizer.state[p] and changes
it in its step(): a count in the param group, in an attribute, in defaults,
in a module global, state under a key that is no parameter. A program would
replay the traced value forever: each is refused at the first call, naming
the value, with nothing changed (host_state.py). So are sparse gradients,
which no program carries, and an optimizer that skipped
torch.optim.Optimizer.__init__. (Before, each of the counters trained
silently otherwise than eager from the second call on.)"""

import copy
import math
from collections import defaultdict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests import models as M
from transpiler import TranspileError, transpile

STEP = 0


class Base(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-6):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    def adam(self, group, t, scale=1.0):
        beta1, beta2 = group["betas"]
        bc1, bc2 = 1 - beta1 ** t, 1 - beta2 ** t
        for p in group["params"]:
            st = self.state[p]
            if "exp_avg" not in st:
                st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
            m, v = st["exp_avg"], st["exp_avg_sq"]
            m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            p.add_((m / bc1) / (v.sqrt() / math.sqrt(bc2)).add_(group["eps"]),
                   alpha=-group["lr"] * scale)


class InAttribute(Base):
    def __init__(self, *a):
        super().__init__(*a)
        self.global_step = 0

    @torch.no_grad()
    def step(self):
        self.global_step += 1
        for g in self.param_groups:
            self.adam(g, self.global_step)


class InGroup(Base):
    """timm's Lamb and Adan: group['step'] += 1."""

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            g["step"] = g.get("step", 0) + 1
            self.adam(g, g["step"])


class DerivedInGroup(Base):
    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            g["lr_t"] = g.get("lr_t", g["lr"]) * 0.9
            self.adam(g, 1, scale=g["lr_t"] / g["lr"])


class InGlobal(Base):
    @torch.no_grad()
    def step(self):
        global STEP
        STEP += 1
        for g in self.param_groups:
            self.adam(g, STEP)


class InDefaults(Base):
    @torch.no_grad()
    def step(self):
        self.defaults["t"] = self.defaults.get("t", 0) + 1
        for g in self.param_groups:
            self.adam(g, self.defaults["t"])


class UnderAnotherKey(Base):
    @torch.no_grad()
    def step(self):
        st = self.state["global"]
        if "n" not in st:
            st["n"] = torch.tensor(0.)
        st["n"] += 1
        for g in self.param_groups:
            self.adam(g, 1)


class Lookahead(torch.optim.Optimizer):
    """timm's Lookahead: wraps another optimizer, without Optimizer.__init__."""

    def __init__(self, base, k=2):
        self._base_optimizer = base
        self.param_groups = base.param_groups
        self.defaults = base.defaults
        self.state = defaultdict(dict)
        for group in self.param_groups:
            group.setdefault("lookahead_step", 0)
        self.k = k

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._base_optimizer.step(closure)
        for group in self.param_groups:
            group["lookahead_step"] += 1
        return loss


CASES = {
    InAttribute: r"optimizer 0 \.global_step 0 -> 1",
    InGroup: r"param_groups\[0\]\['step'\] 'absent' -> 1",
    DerivedInGroup: r"param_groups\[0\]\['lr_t'\] 'absent' -> 0\.009",
    InDefaults: r"defaults\['t'\] 'absent' -> 1",
    UnderAnotherKey: r"keeps state under 'global', not under a parameter",
}


def _refused_with_nothing_changed(model, opt, step_fn, match, *batch):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TranspileError, match=match):
        transpile(step_fn)(model, opt, *batch)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("cls", list(CASES), ids=[c.__name__ for c in CASES])
def test_a_value_the_optimizer_changes_outside_its_state_is_refused(cls):
    global STEP
    STEP = 0
    model = M.make("mlp")
    opt = cls(model.parameters())
    _refused_with_nothing_changed(model, opt, M.classify_step, CASES[cls],
                                  *M.batches("mlp", 1, 8)[0])
    assert not any(isinstance(k, torch.Tensor) for k in opt.state)
    assert STEP == 0 and getattr(opt, "global_step", 0) == 0


def test_a_global_count_the_optimizer_keeps_trains_as_eager():
    """A global STEP += 1 in step() is lifted (a counter, changed_numbers.py);
    math.sqrt(1 - beta2 ** t) on it is computed on the host before each run
    (host_arithmetic.py): eager's values on every call, from 2 traces."""
    global STEP
    STEP = 0
    model = M.make("mlp")
    reference = copy.deepcopy(model)
    opts = [InGlobal(m.parameters()) for m in (model, reference)]
    step = transpile(M.classify_step)
    for i, (x, y) in enumerate(M.batches("mlp", 5, 8)):
        ours = step(model, opts[0], x, y)
        STEP -= 1   # the reference counts the same call again
        theirs = M.classify_step(reference, opts[1], x, y)
        assert STEP == i + 1 and torch.equal(ours, theirs), i
        assert M.max_rel_error(M.state_of(model, opts[0]), M.state_of(reference, opts[1])) == 0.0
    assert step._cache.builds == 2


def test_an_optimizer_that_skipped_optimizer_init_is_refused():
    model = M.make("mlp")
    opt = Lookahead(torch.optim.SGD(model.parameters(), lr=0.1))
    _refused_with_nothing_changed(model, opt, M.classify_step,
                                  r"Lookahead, whose __init__ does not run "
                                  r"torch.optim.Optimizer.__init__", *M.batches("mlp", 1, 8)[0])


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.fc = nn.Linear(4, 2)

    def forward(self, tokens):
        return self.fc(self.emb(tokens).mean(1))


def test_a_sparse_gradient_is_refused():
    """nn.Embedding(sparse=True) with Adagrad: no program carries it."""
    torch.manual_seed(0)
    model = Bag()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)

    def step(model, opt, tokens, y):
        opt.zero_grad()
        F.cross_entropy(model(tokens), y).backward()
        opt.step()

    state = {p: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    _refused_with_nothing_changed(model, opt, step, r"emb\.weight a sparse gradient.*sparse=False",
                                  torch.randint(0, 10, (6, 3)), torch.randint(0, 2, (6,)))
    # Adagrad makes its state in __init__
    assert all(torch.equal(v, opt.state[p][k]) for p, s in state.items() for k, v in s.items())
