"""The signature of a call (capture/signature.py): a module's and an
optimizer's tensors are checked by torch's C++ tensor check against the last
call's, and every change of what _tensor_sig records still changes it."""

import pytest
import torch

from transpiler.capture.arguments import flatten_args
from transpiler.capture.signature import signature


def step(model, opt, x):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()


def _args(model, opt):
    args = flatten_args(step, (model, opt, torch.ones(2, 4)), {})
    args.found = []
    return args


def _model_and_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step(model, opt, torch.randn(2, 4))   # momentum buffers
    return model, opt


def test_an_unchanged_call_reuses_the_groups():
    model, opt = _model_and_optimizer()
    first, second = signature(_args(model, opt)), signature(_args(model, opt))
    assert first == second
    groups = [(a, b) for (key, a), (_, b) in zip(first, second) if key[-1] == "state"]
    assert len(groups) == 2 and all(a is b for a, b in groups)


CHANGES = {
    "a parameter's shape": lambda m, o: setattr(m[0].weight, "data", torch.randn(3, 5)),
    "a parameter's strides": lambda m, o: setattr(m[0].weight, "data",
                                                  torch.randn(4, 3).t()),
    "a parameter's dtype": lambda m, o: setattr(m[0].bias, "data", m[0].bias.data.double()),
    "requires_grad": lambda m, o: m[0].bias.requires_grad_(False),
    "a buffer resized in place": lambda m, o: m[1].running_mean.resize_(6),
    "a momentum buffer's shape": lambda m, o: o.state[m[0].weight].__setitem__(
        "momentum_buffer", torch.zeros(3, 5)),
    "a momentum buffer's dtype": lambda m, o: o.state[m[0].bias].__setitem__(
        "momentum_buffer", torch.zeros(3, dtype=torch.float64)),
    "a state entry added": lambda m, o: o.state[m[0].bias].__setitem__("extra", torch.zeros(1)),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_change_of_a_tensor_changes_the_signature(change):
    model, opt = _model_and_optimizer()
    before = signature(_args(model, opt))
    assert signature(_args(model, opt)) == before   # the check is now the fast one
    CHANGES[change](model, opt)
    assert signature(_args(model, opt)) != before
