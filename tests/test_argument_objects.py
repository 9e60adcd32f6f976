"""An argument that is an object holding the batch (PyG's Data, a script's
Batch class), new every call: what the step reads through it is read again in
each call's own object, so one program serves every object of its type, and
each call computes what the eager step computes with its object. Where the
trace keeps something of the object itself (it wrote into a container the
object holds; the object is also reached another way), the argument is
guarded by identity, as any object: a new one traces again. In one process
against the eager step; on 2 ranks the habit bank's PyG step against DDP
(tests/habits.py, pyg_gcn_data_object_index_add)."""

import argparse
import copy
import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from transpiler import transpile


class Batch:
    """A batch as a plain object, its tensors and settings as attributes."""

    def __init__(self, x, y, weight=1.0):
        self.x, self.y, self.weight = x, y, weight


class Store:
    """torch_geometric's storage: the tensors in a dict of an object."""

    def __init__(self, **tensors):
        self._mapping = dict(tensors)

    def __getattr__(self, key):
        try:
            return self.__dict__["_mapping"][key]
        except KeyError:
            raise AttributeError(key) from None


class Data:
    """torch_geometric.data.Data in miniature: attributes computed through
    an object held in its __dict__ (a custom __getattr__); an __eq__ of its
    own, so unhashable, and a repr of its tensors' shapes."""

    def __init__(self, **tensors):
        self.__dict__["_store"] = Store(**tensors)

    def __getattr__(self, key):
        return getattr(self.__dict__["_store"], key)

    def __eq__(self, other):
        return type(other) is Data and self._store._mapping == other._store._mapping

    __hash__ = None

    def __repr__(self):
        return "Data(" + ", ".join(f"{k}={list(v.shape)}"
                                   for k, v in self._store._mapping.items()) + ")"


def batch_step(model, opt, batch):
    opt.zero_grad()
    loss = F.cross_entropy(model(batch.x), batch.y) * batch.weight
    loss.backward()
    opt.step()
    return loss


def data_step(model, opt, data):
    opt.zero_grad()
    loss = F.cross_entropy(model(data.x)[data.mask], data.y[data.mask])
    loss.backward()
    opt.step()
    return loss


def _models():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    other = copy.deepcopy(model)
    return [(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)) for m in (model, other)]


def _against_eager(step_fn, make, calls=4):
    """step_fn transpiled and eager, each call given a new object from
    make(i) (its own copy for each): losses and parameters bit for bit."""
    (model, opt), (theirs, their_opt) = _models()
    step = transpile(step_fn)
    for i in range(calls):
        a = step(model, opt, make(i))
        b = step_fn(theirs, their_opt, make(i))
        assert torch.equal(a, b), i
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), theirs.parameters())), i
    return step


def _xy(i, n=8):
    g = torch.Generator().manual_seed(i)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_a_new_batch_object_every_call_runs_one_program():
    step = _against_eager(batch_step, lambda i: Batch(*_xy(i)))
    assert step.traces == 1   # it was one per call: the object was in the signature


@pytest.mark.parametrize("namespace", [SimpleNamespace, argparse.Namespace])
def test_a_new_namespace_every_call_runs_one_program(namespace):
    # a SimpleNamespace's reads are not observed: it is guarded whole, in place
    # (it was refused: its tensors were taken for tensors outside the arguments)
    step = _against_eager(batch_step, lambda i: namespace(**dict(zip("xy", _xy(i))), weight=1.0))
    assert step.traces == 1


def test_an_object_read_through_an_object_it_holds_runs_one_program():
    # PyG's Data was in the signature by its repr (shapes only) and its
    # tensors read through the first call's object: every later call of the
    # same shapes trained on the first call's graph
    def make(i):
        x, y = _xy(i)
        return Data(x=x, y=y, mask=torch.arange(8) % (2 + i % 2) == 0)
    step = _against_eager(data_step, make)
    assert step.traces == 1


@pytest.mark.parametrize("make", [Batch, lambda x, y, weight: SimpleNamespace(x=x, y=y,
                                                                              weight=weight)],
                         ids=["class", "SimpleNamespace"])
def test_a_setting_the_new_object_holds_is_read_from_it(make):
    # weight is guarded by value in each call's own object: a new value is a
    # new program, and the old one runs again for an object with the old value
    weights = [1.0, 0.5, 1.0, 0.5, 2.0]
    step = _against_eager(batch_step, lambda i: make(*_xy(i), weight=weights[i]), calls=5)
    assert step.traces <= 3


def assign_step(model, opt, batch):
    loss = batch_step(model, opt, batch)
    batch.loss = loss.detach()   # the script reads it from its batch afterwards
    batch.seen = True
    return loss


def test_what_the_step_sets_on_the_object_is_set_on_each_calls_object():
    (model, opt), (theirs, their_opt) = _models()
    step = transpile(assign_step)
    for i in range(3):
        ours, eager = Batch(*_xy(i)), Batch(*_xy(i))
        step(model, opt, ours)
        assign_step(theirs, their_opt, eager)
        assert torch.equal(ours.loss, eager.loss) and ours.seen is True, i
    assert step.traces == 1


def tally_step(model, opt, batch):
    batch.stats["seen"] = True   # into a dict the object holds
    return batch_step(model, opt, batch)


def test_a_write_into_a_container_the_object_holds_keeps_it_by_identity():
    (model, opt), (theirs, their_opt) = _models()
    step = transpile(tally_step)
    for i in range(3):
        ours, eager = Batch(*_xy(i)), Batch(*_xy(i))
        ours.stats, eager.stats = {}, {}
        assert torch.equal(step(model, opt, ours), tally_step(theirs, their_opt, eager)), i
        assert ours.stats == eager.stats == {"seen": True}, i
    assert step.traces == 3   # each new object traced again, its own dict written


LAST = Batch(*_xy(0))


def global_step(model, opt, batch):
    """Trains on the batch, then evaluates on a global batch (a fixed probe)."""
    loss = batch_step(model, opt, batch)
    with torch.no_grad():
        return loss, F.cross_entropy(model(LAST.x), LAST.y)


def test_an_object_also_reached_another_way_is_kept_by_identity():
    # traced on a call given LAST itself, the program's reads of LAST.x would
    # follow the argument; so that program runs only for LAST
    global LAST
    (model, opt), (theirs, their_opt) = _models()
    step = transpile(global_step)
    LAST = Batch(*_xy(0))
    for i in range(3):
        batch = LAST if i == 0 else Batch(*_xy(i))
        a, b = step(model, opt, batch), global_step(theirs, their_opt, batch)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), i
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), theirs.parameters()))
    assert step.traces == 2   # LAST's program, then one for the other objects


def two_batches_step(model, opt, a, b):
    return batch_step(model, opt, a) + batch_step(model, opt, b)


def test_one_object_given_twice_is_kept_by_identity():
    # traced on step(m, o, batch, batch), its reads of b would follow a
    (model, opt), (theirs, their_opt) = _models()
    step = transpile(two_batches_step)
    for i in range(3):
        a = Batch(*_xy(i))
        b = a if i == 0 else Batch(*_xy(10 + i))
        assert torch.equal(step(model, opt, a, b), two_batches_step(theirs, their_opt, a, b)), i
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), theirs.parameters()))
    assert step.traces == 2


def vars_step(model, opt, batch):
    settings = {k: v for k, v in vars(batch).items() if not isinstance(v, torch.Tensor)}
    opt.zero_grad()
    loss = F.cross_entropy(model(batch.x), batch.y) * settings["weight"]
    loss.backward()
    opt.step()
    return loss


def keeps_the_batch_step(model, opt, batch):
    model.last_batch = batch   # an object of the call kept on the host
    return batch_step(model, opt, batch)


def test_what_vars_reads_is_guarded():
    # vars(batch) reads no attribute by name: every attribute of the call's
    # object is guarded (a new weight there traces again)
    step = _against_eager(vars_step, lambda i: Batch(*_xy(i), weight=[1.0, 2.0, 1.0][i]),
                          calls=3)
    assert step.traces == 2


def test_an_object_the_step_keeps_is_each_calls_own():
    (model, opt), (theirs, their_opt) = _models()
    step = transpile(keeps_the_batch_step)
    for i in range(3):
        ours, eager = Batch(*_xy(i)), Batch(*_xy(i))
        assert torch.equal(step(model, opt, ours), keeps_the_batch_step(theirs, their_opt, eager))
        assert model.last_batch is ours, i


def copied_settings_step(model, opt, batch):
    settings = copy.copy(batch.settings)   # a copy read, not the argument's object
    settings.weight *= 2
    opt.zero_grad()
    loss = F.cross_entropy(model(batch.x), batch.y) * settings.weight
    loss.backward()
    opt.step()
    return loss


class Settings:
    def __init__(self, weight):
        self.weight = weight


def test_an_object_copied_in_the_step_is_guarded_whole():
    def make(i):
        batch = Batch(*_xy(i))
        batch.settings = Settings([1.0, 2.0, 1.0][i])
        return batch
    step = _against_eager(copied_settings_step, make, calls=3)
    assert step.traces == 2


def scheduled_step(model, opt, scheduler, batch):
    loss = batch_step(model, opt, batch)
    scheduler.step()   # stepped on the host after the program: this call's scheduler
    return loss


def test_a_scheduler_among_the_arguments_is_kept_by_identity():
    (model, opt), (theirs, their_opt) = _models()
    step = transpile(scheduled_step)
    for i in range(3):
        ours = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        eager = torch.optim.lr_scheduler.StepLR(their_opt, step_size=1, gamma=0.5)
        a = step(model, opt, ours, Batch(*_xy(i)))
        b = scheduled_step(theirs, their_opt, eager, Batch(*_xy(i)))
        assert torch.equal(a, b) and ours.last_epoch == eager.last_epoch == 1, i
        assert opt.param_groups[0]["lr"] == their_opt.param_groups[0]["lr"], i


def rank_batch_vs_ddp(mode: str, backend: str) -> list[str]:
    """batch_step transpiled and under DDP, a new Batch each call on each
    rank (its own samples): what differs (bit for bit; under inductor, within
    its rounding, as tests/test_backends.py)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank = dist.get_rank()
    (model, opt), (theirs, their_opt) = _models()
    ddp = DDP(theirs)
    step = transpile(batch_step, mode=mode, backend=backend)
    same = torch.equal if backend == "eager" else functools.partial(torch.allclose, rtol=1e-5,
                                                                    atol=1e-6)
    differ = []
    for i in range(4):
        a = step(model, opt, Batch(*_xy(10 * i + rank)))
        b = batch_step(ddp, their_opt, Batch(*_xy(10 * i + rank)))
        differ += [f"call {i}: loss"] * (not same(a, b))
        differ += [f"call {i}: {n}" for (n, p), q in zip(model.named_parameters(),
                                                         theirs.parameters())
                   if not same(p, q)]
    return differ + [f"traces {step.traces}"] * (step.traces != 1)


@pytest.mark.parametrize("mode,backend", [("fuse_all_reduce", "eager"), ("zero", "eager"),
                                          ("fuse_all_reduce", "inductor")])
def test_a_new_batch_object_every_call_equals_ddp_on_2_ranks(mode, backend, ranks2):
    assert ranks2.run(rank_batch_vs_ddp, mode, backend) == [[], []]
