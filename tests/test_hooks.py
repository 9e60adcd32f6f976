"""Hooks the step runs: module hooks (forward, pre-forward, full backward,
global), a parameter's own hooks (register_hook,
register_post_accumulate_grad_hook), parametrizations and pruning's
pre-hooks. Present at the trace they run in the program as in eager; added or
removed later, the step traces again. Against the eager step on one process,
and against torch DDP with its defaults on 2 ranks (a hook on a gradient sees
the local gradient, before the average)."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.prune as prune
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import transpile


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values()))


def _grads_equal(a: nn.Module, b: nn.Module) -> bool:
    return all((p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
               for p, q in zip(a.parameters(), b.parameters()))


def _run(models, between, calls=5, step_fn=M.classify_step):
    """Call i: between(i, model) on both, then the transpiled and the eager step."""
    ours, theirs = models
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    step = transpile(step_fn)
    for i, (x, y) in enumerate(M.batches("mlp", calls, 8)):
        between(i, ours)
        between(i, theirs)
        assert torch.equal(step(ours, opts[0], x, y), step_fn(theirs, opts[1], x, y)), i
        assert _equal(ours, theirs) and _grads_equal(ours, theirs), i
    return step


def _pair(make=Net):
    """Two models with the same weights (made twice: a pruned one cannot be copied)."""
    torch.manual_seed(0)
    ours = make()
    torch.manual_seed(0)
    return ours, make()


def _doubling(module, args, output):
    return output * 2


def _negating_pre(module, args):
    return (-args[0],)


def test_module_hooks_added_and_removed_between_calls():
    handles = {}

    def between(i, model):
        if i == 1:
            handles[id(model), "fwd"] = model.fc1.register_forward_hook(_doubling)
        if i == 2:
            handles[id(model), "pre"] = model.fc2.register_forward_pre_hook(_negating_pre)
        if i == 3:
            handles[id(model), "fwd"].remove()
        if i == 4:
            handles[id(model), "pre"].remove()
    step = _run(_pair(), between)
    assert step.traces == 4   # with both removed, the first program fits again


def _halve_grad_input(module, grad_input, grad_output):
    return tuple(None if g is None else g * 0.5 for g in grad_input)


def test_a_full_backward_hook_and_a_global_forward_hook():
    handles = []

    def between(i, model):
        if i == 1:
            handles.append(model.fc2.register_full_backward_hook(_halve_grad_input))
    step = _run(_pair(), between, calls=3)
    global_hook = nn.modules.module.register_module_forward_hook(
        lambda m, a, out: out + 1 if isinstance(m, nn.Linear) else out)
    try:
        _run(_pair(), lambda i, m: None, calls=2)
    finally:
        global_hook.remove()
        for h in handles:
            h.remove()
    assert step.traces == 2


def _halve_accumulated(param):
    param.grad.mul_(0.5)


def test_parameter_hooks_run_on_the_gradient():
    def between(i, model):
        if i == 1:
            model.fc1.weight.register_hook(lambda g: g.clamp(-0.01, 0.01))
        if i == 2:
            model.fc2.bias.register_post_accumulate_grad_hook(_halve_accumulated)
    step = _run(_pair(), between, calls=4)
    assert step.traces == 3


def test_parametrizations_and_pruning_run_as_in_eager():
    def make():
        model = Net()
        nn.utils.parametrizations.weight_norm(model.fc1)
        nn.utils.parametrizations.spectral_norm(model.fc2)
        return model
    step = _run(_pair(make), lambda i, m: None, calls=3)
    assert step.traces == 1

    def make_pruned():
        model = Net()
        prune.l1_unstructured(model.fc1, "weight", amount=0.5)
        return model
    models = _pair(make_pruned)
    step = _run(models, lambda i, m: None, calls=3)
    assert step.traces == 1
    assert torch.equal(models[0].fc1.weight, models[1].fc1.weight)   # assigned by the pre-hook


def rank_parameter_hook_vs_ddp(mode: str):
    """A hook on a parameter sees the local gradient (before the average), as
    under DDP."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ours = Net()
    theirs = copy.deepcopy(ours)
    for m in (ours, theirs):
        m.fc1.weight.register_hook(lambda g: g.clamp(-0.002, 0.002))
        m.fc2.register_forward_hook(_doubling)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    step, ddp = transpile(M.classify_step, mode=mode), DDP(theirs)
    for batch in M.batches("mlp", 4, 16):
        x, y = M.shard(batch, rank, world)
        a = step(ours, opts[0], x, y)
        b = M.classify_step(ddp, opts[1], x, y)
        if not torch.equal(a, b):
            return False
    return _equal(ours, theirs) and _grads_equal(ours, theirs)


@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce"])
def test_hooks_equal_ddp(mode, ranks2):
    assert ranks2.run(rank_parameter_hook_vs_ddp, mode) == [True, True]
