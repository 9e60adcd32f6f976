"""Every value the step depends on is an input, a guard or an error: the habits
of real scripts (values changed between calls, data pulled inside the step,
numpy batches, state written in forward) against the eager step on one process
and torch DDP with its defaults on 2 ranks."""

import copy
import dataclasses
import logging
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import TranspileError, transpile

LOSS_WEIGHT = 1.0   # a global the step reads


class Config:
    scale = 1.0


class Scheduled(nn.Module):
    """A module whose forward reads a float attribute, a config object it holds
    and a dropout whose p a script changes between calls."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)
        self.drop = nn.Dropout(0.0)
        self.temperature = 1.0
        self.config = Config()

    def forward(self, x):
        h = self.drop(torch.relu(self.fc1(x)))
        return self.fc2(h) / self.temperature * self.config.scale


def weighted_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y) * LOSS_WEIGHT
    loss.backward()
    opt.step()
    return loss


def _change(i: int, models, weights: dict):
    """Call i's change to the host values the step reads."""
    if i == 1:
        for m in models:
            m.temperature = 0.5
    elif i == 2:
        for m in models:
            m.drop.p = 0.3
    elif i == 3:
        weights["LOSS_WEIGHT"] = 2.5
    elif i == 4:
        for m in models:
            m.config = Config()
            m.config.scale = 3.0


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values()))


def test_values_changed_between_calls_trace_again_and_equal_eager(caplog):
    torch.manual_seed(0)
    ours, theirs = Scheduled(), Scheduled()
    theirs.load_state_dict(ours.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    step = transpile(weighted_step)
    expected = ["model.temperature: 1.0 -> 0.5", "model.drop.p: 0.0 -> 0.3",
                "global 'LOSS_WEIGHT' of tests.test_host_values: 1.0 -> 2.5",
                "model.config: another Config object"]
    for i, (x, y) in enumerate(M.batches("mlp", 6, 8)):
        _change(i, (ours, theirs), globals())
        with caplog.at_level(logging.INFO, logger="transpiler"):
            caplog.clear()
            torch.manual_seed(100 + i)
            a = step(ours, opts[0], x, y)
        torch.manual_seed(100 + i)
        b = weighted_step(theirs, opts[1], x, y)
        assert torch.equal(a, b) and _equal(ours, theirs), i
        if 1 <= i <= 4:
            assert expected[i - 1] in caplog.text
        else:
            assert "traced" not in caplog.text or i == 0
    globals()["LOSS_WEIGHT"] = 1.0


def test_closure_variable_is_guarded(caplog):
    model = M.make("mlp")
    reference = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    scale = 0.5

    def step_fn(model, opt, x, y):
        opt.zero_grad()
        (F.cross_entropy(model(x), y) * scale).backward()
        opt.step()

    step = transpile(step_fn)
    for i, (x, y) in enumerate(M.batches("mlp", 3, 8)):
        if i == 2:
            scale = 4.0   # rebinds the cell the step's closure reads
        with caplog.at_level(logging.INFO, logger="transpiler"):
            step(model, opts[0], x, y)
        step_fn(reference, opts[1], x, y)
        assert _equal(model, reference), i
    assert "closure variable 'scale' of " in caplog.text and "0.5 -> 4.0" in caplog.text


def test_the_guards_are_what_the_trace_read_and_cost_microseconds():
    """The guards of a real model are the values its trace read (not every
    attribute of every module), checked by one generated function."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(0, 64, (2, 8))

    def lm_step(model, opt, x):
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        return loss

    step = transpile(lm_step)
    step(model, opt, x)
    guards = step._last.guards
    names = [g.name for g in guards.guards]
    assert "model.transformer.h.0.attn.scaling" in names
    # set in __init__ and never read by forward in this version of transformers
    assert "model.transformer.h.0.attn.scale_attn_weights" not in names
    assert 20 < len(guards) < 2000
    assert guards.changed() is None
    model.transformer.h[0].attn.scale_attn_weights = False
    assert guards.changed() is None
    model.transformer.h[0].attn.scaling = 0.5
    assert guards.changed().startswith("model.transformer.h.0.attn.scaling: 0.25 -> 0.5")


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x)


class StoresTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        out = self.fc(x)
        self.last_logits = out
        return out


def test_a_counter_written_in_forward_is_an_output_of_one_program():
    """`self.calls += 1` in forward: the counter is read from an input and the
    program computes what the step leaves there, put back after each run."""
    torch.manual_seed(0)
    ours = Counting()
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    step = transpile(M.classify_step)
    for x, y in M.batches("mlp", 4, 8):
        assert torch.equal(step(ours, opts[0], x, y), M.classify_step(theirs, opts[1], x, y))
        assert _equal(ours, theirs) and type(ours.calls) is int and ours.calls == theirs.calls
    assert ours.calls == 4 and step._cache.builds == 1


def test_a_tensor_stored_in_forward_is_assigned_after_every_call():
    """`self.last_logits = out` in forward: the program returns it and the
    attribute holds it after each call, as after the eager step."""
    torch.manual_seed(0)
    ours = StoresTensor()
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    step = transpile(M.classify_step)
    for x, y in M.batches("mlp", 3, 8):
        assert torch.equal(step(ours, opts[0], x, y), M.classify_step(theirs, opts[1], x, y))
        assert _equal(ours, theirs)
        assert torch.equal(ours.last_logits, theirs.last_logits)
    assert len(step._cache) == 1


def _equal_dicts(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class RunningMean(nn.Module):
    """Re-assigns a buffer in forward, as EMA-style statistics are written."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x):
        out = self.fc(x)
        self.mean = 0.9 * self.mean + 0.1 * out.detach().mean(0)
        return out


def clipped_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    for p in model.parameters():   # weight clipping, as WGAN scripts write it
        p.data = p.data.clamp(-0.05, 0.05)
    return loss


def test_buffer_reassigned_and_data_replaced_are_written_back():
    torch.manual_seed(0)
    ours = RunningMean()
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ours, theirs)]
    step = transpile(clipped_step)
    for x, y in M.batches("mlp", 4, 8):
        assert torch.equal(step(ours, opts[0], x, y), clipped_step(theirs, opts[1], x, y))
        assert _equal(ours, theirs)
    assert ours.mean.abs().sum() > 0 and ours.fc.weight.abs().max() <= 0.05


def test_buffer_reassigned_with_another_shape_is_refused():
    class Grows(RunningMean):
        def forward(self, x):
            self.mean = torch.cat([self.mean, self.mean])
            return self.fc(x)

    model = Grows()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TranspileError, match=r"replaces mean \(float32\[4\] on cpu\) with "
                                             r"float32\[8\] on cpu"):
        transpile(M.classify_step)(model, opt, *M.batches("mlp", 1, 8)[0])
    assert model.mean.shape == (4,) and model.fc.weight.grad is None


def pulls_its_batch(model, opt, batches):
    x, y = next(batches)
    return M.classify_step(model, opt, x, y)


SCALE = torch.tensor(2.0)   # a tensor in a global


def uses_a_global_tensor(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x) * SCALE, y)
    loss.backward()
    opt.step()
    return loss


def converts_a_numpy_array_of_its_own(model, opt, x, y):
    return M.classify_step(model, opt, torch.from_numpy(np.asarray(x) * 2), y)


@pytest.mark.parametrize("fn,args,match", [
    (pulls_its_batch, lambda b: (iter(b),),
     r"pulls an item from batches \(a list_iterator\) at .*test_host_values.py:\d+ "
     r"\(x, y = next\(batches\)\).*Pull outside the step .*nothing was pulled"),
    (converts_a_numpy_array_of_its_own, lambda b: (b[0][0].numpy(), b[0][1]),
     r"makes a tensor from a numpy array of shape \(8, 16\) \(float32\) that is not among its "
     r"arguments at .*test_host_values.py"),
])
def test_tensors_from_outside_the_arguments_are_refused(fn, args, match):
    model = M.make("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TranspileError, match=match):
        transpile(fn)(model, opt, *args(M.batches("mlp", 2, 8)))
    assert _equal_dicts(model.state_dict(), before) and not opt.state


def test_a_tensor_in_a_global_is_an_input_read_through_it():
    """A tensor the step reads from a global is read again on every call:
    changed in place, or the global rebound to another tensor of its layout,
    the step uses the new value without tracing again."""
    global SCALE
    model = M.make("mlp")
    reference = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    step = transpile(uses_a_global_tensor)
    original = SCALE
    try:
        for i, (x, y) in enumerate(M.batches("mlp", 4, 8)):
            if i == 1:
                SCALE.fill_(3.0)
            if i == 2:
                SCALE = torch.tensor(0.5)
            assert torch.equal(step(model, opts[0], x, y),
                               uses_a_global_tensor(reference, opts[1], x, y))
            assert _equal(model, reference)
        assert step.traces == 1
        assert "r_SCALE" in str(step.program)
    finally:
        SCALE = original
        SCALE.fill_(2.0)


def numpy_step(model, opt, x, y):
    return M.classify_step(model, opt, torch.from_numpy(x), torch.as_tensor(y))


def test_numpy_batches_are_inputs():
    model = M.make("mlp")
    reference = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    step = transpile(numpy_step)
    for x, y in M.batches("mlp", 3, 8):
        x, y = x.numpy().copy(), y.numpy().copy()
        assert torch.equal(step(model, opts[0], x, y), numpy_step(reference, opts[1], x, y))
        assert _equal(model, reference)
    assert len(step._cache) == 1   # every batch ran the program built for the first


def rank_scheduled_vs_ddp(mode: str):
    """A temperature and a loss weight changed between calls, transpiled and
    under DDP with its defaults, same processes, each rank its own batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    models = [Scheduled() for _ in range(2)]
    torch.manual_seed(0)
    reference = Scheduled()
    for m in models:
        m.load_state_dict(reference.state_dict())
    ours, theirs = models
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    step, ddp = transpile(weighted_step, mode=mode), DDP(theirs)
    for i, batch in enumerate(M.batches("mlp", 5, 16)):
        x, y = M.shard(batch, rank, world)
        if i == 1:
            ours.temperature = theirs.temperature = 0.5
        if i == 3:
            globals()["LOSS_WEIGHT"] = 2.0
        step(ours, opts[0], x, y)
        weighted_step(ddp, opts[1], x, y)
    globals()["LOSS_WEIGHT"] = 1.0
    return _equal(ours, theirs) and all(
        torch.equal(opts[0].state[p]["momentum_buffer"], opts[1].state[q]["momentum_buffer"])
        for p, q in zip(ours.parameters(), theirs.parameters()))


@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce"])
def test_values_changed_between_calls_equal_ddp(mode, ranks2):
    assert ranks2.run(rank_scheduled_vs_ddp, mode) == [True, True]


def test_programs_kept_are_bounded(caplog):
    model = M.make("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = transpile(M.classify_step, dynamic=False)   # one program per shape
    step._cache.limit = 3
    with caplog.at_level(logging.WARNING, logger="transpiler"):
        for n in range(4, 9):
            step(model, opt, *(t[:n] for t in M.batches("mlp", 1, 8)[0]))
    assert len(step._cache) == 3
    assert "the step has been traced 4 times; 3 programs are kept" in caplog.text


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


def container_step(model, opt, batch):
    x, y = (batch.x, batch.y) if isinstance(batch, (Batch, Pair)) else (batch["x"], batch["y"])
    return M.classify_step(model, opt, x, y)


def _batch_encoding(x, y):
    transformers = pytest.importorskip("transformers")
    return transformers.BatchEncoding({"x": x, "y": y})


@pytest.mark.parametrize("make", [Batch, Pair, _batch_encoding, lambda x, y: {"x": x, "y": y}],
                         ids=["dataclass", "namedtuple", "BatchEncoding", "dict"])
def test_containers_as_batches_are_inputs(make):
    model = M.make("mlp")
    reference = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    step = transpile(container_step)
    for x, y in M.batches("mlp", 3, 8):
        assert torch.equal(step(model, opts[0], make(x, y)),
                           container_step(reference, opts[1], make(x, y)))
        assert _equal(model, reference)
    assert len(step._cache) == 1   # every batch ran the program built for the first


FACTORS = [1.0]   # a global list a script changes in place


def list_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y) * FACTORS[0]
    loss.backward()
    opt.step()
    return loss


def test_a_global_list_changed_in_place_is_guarded():
    model = M.make("mlp")
    reference = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    step = transpile(list_step)
    for i, (x, y) in enumerate(M.batches("mlp", 3, 8)):
        FACTORS[0] = 3.0 if i == 2 else 1.0
        assert torch.equal(step(model, opts[0], x, y), list_step(reference, opts[1], x, y))
        assert _equal(model, reference)
    FACTORS[0] = 1.0


def appends_to_a_global_list(model, opt, x, y):
    FACTORS.append(2.0)
    return list_step(model, opt, x, y)


def test_a_global_list_the_step_changes_is_refused_and_restored():
    model = M.make("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = FACTORS
    with pytest.raises(TranspileError, match=r"changes host-side state on every call: global "
                                             r"'FACTORS' of tests.test_host_values \[1.0\] -> "
                                             r"\[1.0, 2.0\], then \[1.0, 2.0\] -> \[1.0, 2.0, 2.0\]"):
        transpile(appends_to_a_global_list)(model, opt, *M.batches("mlp", 1, 8)[0])
    assert FACTORS is before and FACTORS == [1.0]
