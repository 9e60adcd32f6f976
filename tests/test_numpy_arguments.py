"""numpy arrays among the step's arguments, used as real scripts use them: an
index array picking the minibatch (CleanRL's PPO), a boolean mask, per-sample
weights through torch.Tensor / torch.FloatTensor / x.new_tensor (DQN
replay-buffer code), a schedule indexed by the step count (DINO), idx.tolist().
Each call's values are used, as eager's: torch's reads of an array give its
program input, and a program that read values on the host serves only calls
with the same values (capture/observed_arrays.py). One process, against the
eager step."""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from transpiler import TranspileError, transpile

X, Y = torch.randn(16, 4), torch.randint(0, 3, (16,))


def _setup():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _update(opt, loss):
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def index_array(model, opt, mb_inds):
    return _update(opt, F.cross_entropy(model(X[mb_inds]), Y[mb_inds]))


def mask(model, opt, keep):
    return _update(opt, F.cross_entropy(model(X[keep]), Y[keep]))


def weights_tensor(model, opt, w):
    return _update(opt, (F.cross_entropy(model(X), Y, reduction="none") * torch.Tensor(w)).mean())


def weights_float_tensor(model, opt, w):
    return _update(opt, (F.cross_entropy(model(X), Y, reduction="none")
                         * torch.FloatTensor(w)).mean())


def weights_new_tensor(model, opt, w):
    return _update(opt, (F.cross_entropy(model(X), Y, reduction="none") * X.new_tensor(w)).mean())


def weights_of_a_view(model, opt, w):
    """A view of the argument reaches torch: its values read, as values."""
    return _update(opt, (F.cross_entropy(model(X), Y, reduction="none")
                         * torch.FloatTensor(w.reshape(4, 4)).flatten()).mean())


def index_list(model, opt, idx):
    idx = idx.tolist()
    return _update(opt, F.cross_entropy(model(X[idx]), Y[idx]))


def schedule(model, opt, momentum_schedule, it):
    """DINO's teacher momentum: a numpy schedule indexed by the iteration."""
    m = momentum_schedule[it]
    return _update(opt, F.cross_entropy(model(X), Y) * (1 - m))


def _args(fn, i):
    r = np.random.RandomState(i)
    return {index_array: lambda: (r.permutation(16)[:4],),
            mask: lambda: (r.rand(16) > 0.5,),
            weights_tensor: lambda: (r.rand(16),),
            weights_float_tensor: lambda: (r.rand(16),),
            weights_new_tensor: lambda: (r.rand(16),),
            weights_of_a_view: lambda: (r.rand(16),),
            index_list: lambda: (r.permutation(16)[:4],),
            schedule: lambda: (np.linspace(0.9, 1.0, 4), i)}[fn]()


@pytest.mark.parametrize("fn, builds", [
    (index_array, 1), (mask, 1), (weights_tensor, 1), (weights_float_tensor, 1),
    (weights_new_tensor, 1),
    # read on the host: a program per values
    (index_list, 4), (schedule, 4), (weights_of_a_view, 4)],
    ids=lambda v: getattr(v, "__name__", str(v)))
def test_each_call_uses_its_own_arrays_values_as_eager(fn, builds):
    ours, eager = _setup(), _setup()
    step = transpile(fn)
    for i in range(4):
        args = _args(fn, i)
        assert torch.equal(step(*ours, *args), fn(*eager, *args))
    for a, b in zip(ours[0].parameters(), eager[0].parameters()):
        assert torch.equal(a, b)
    assert step._cache.builds == builds


def draws_an_index(model, opt):
    return _update(opt, F.cross_entropy(model(X[np.random.randint(0, 16, 4)]),
                                        Y[np.random.randint(0, 16, 4)]))


def test_an_index_drawn_with_numpy_in_the_step_is_drawn_again_on_every_call():
    ours, eager = _setup(), _setup()
    step = transpile(draws_an_index)
    for i in range(3):
        np.random.seed(i)
        mine = step(*ours)
        np.random.seed(i)
        assert torch.equal(mine, draws_an_index(*eager))
    assert step._cache.builds == 1


def sorts_a_drawn_index(model, opt):
    idx = np.sort(np.random.randint(0, 16, 4))
    return _update(opt, F.cross_entropy(model(X[idx]), Y[idx]))


def test_numpy_computation_on_a_drawn_array_is_refused():
    model, opt = _setup()
    with pytest.raises(TranspileError, match=r"computes on the host with an array it draws"):
        transpile(sorts_a_drawn_index)(model, opt)
