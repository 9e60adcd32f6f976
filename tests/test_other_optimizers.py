"""Optimizers traced as torch wrote them (RMSprop, Adagrad, Adamax, NAdam,
RAdam, ...) on 2 gloo ranks against torch DDP running the same optimizer:
their step count is read as eager reads it (.item()), their options are the
user's, so each mode that averages gradients equals DDP bit for bit. A
decision on a value of their state (RAdam's rectification) is traced on
values, which mode fsdp cannot do once its parameters are shards: refused on
every rank, no crash. (One process: tests/test_single_process.py.)"""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import TranspileError, transpile


def rank_vs_ddp(name: str, mode: str):
    rank = dist.get_rank()
    runs = []
    for transpiled in (True, False):
        model = M.make("mlp", seed=0)
        opt = getattr(torch.optim, name)(model.parameters(), lr=1e-2)
        step = transpile(M.classify_step, mode=mode) if transpiled else M.classify_step
        net = model if transpiled else DDP(model)
        for batch in M.batches("mlp", 6, 12):
            step(net, opt, *M.shard(batch, rank, 2))
        runs.append({k: v.clone() for k, v in model.state_dict().items()})
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fuse_all_reduce", "zero"])
@pytest.mark.parametrize("name", ["RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam"])
def test_equals_ddp_on_2_ranks(name, mode, ranks2):
    for ours, ddp in ranks2.run(rank_vs_ddp, name, mode):
        assert all(torch.equal(ours[k], ddp[k]) for k in ours)


def rank_fsdp_radam():
    model = M.make("mlp", seed=0)
    opt = torch.optim.RAdam(model.parameters(), lr=1e-2)
    step = transpile(M.classify_step, mode="fsdp")
    batches = M.batches("mlp", 3, 12)
    step(model, opt, *M.shard(batches[0], dist.get_rank(), 2))
    try:
        step(model, opt, *M.shard(batches[1], dist.get_rank(), 2))
    except TranspileError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_a_decision_traced_after_the_first_call_of_mode_fsdp_is_refused_on_every_rank(ranks2):
    for error in ranks2.run(rank_fsdp_radam):
        assert error is not None and "kept as shards between the steps of mode fsdp" in error


class SophiaLike(torch.optim.Optimizer):
    """Liuhong99/Sophia's state layout: its step a 1-element tensor beside
    moments shaped like the parameter (a flat entry, not a shard of mode zero)."""

    def __init__(self, params, lr=0.1, beta=0.9):
        super().__init__(params, dict(lr=lr, beta=beta))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.zeros((1,))
                    state["exp_avg"] = torch.zeros_like(p)
                    state["hessian"] = torch.ones_like(p)
                state["step"] += 1
                state["exp_avg"].mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.addcdiv_(state["exp_avg"], state["hessian"], value=-group["lr"])


def test_a_custom_optimizers_one_element_step_saves_and_resumes_as_eager():
    runs = []
    for transpiled in (True, False):
        model = M.make("mlp", seed=0)
        opt = SophiaLike(model.parameters())
        step = transpile(M.classify_step) if transpiled else M.classify_step
        batches = M.batches("mlp", 4, 12)
        for batch in batches[:2]:
            step(model, opt, *batch)
        saved = opt.state_dict()   # refused before as "this rank's shards of mode zero"
        opt.load_state_dict(saved)
        for batch in batches[2:]:
            step(model, opt, *batch)
        runs.append((model.state_dict(), opt.state_dict()["state"]))
    (ours, ours_state), (eager, eager_state) = runs
    assert all(torch.equal(ours[k], eager[k]) for k in eager)
    assert all(torch.equal(ours_state[i][k], eager_state[i][k])
               for i in eager_state for k in eager_state[i])
