"""Guards from what the trace reads: host values at any depth and through any
path (an argument that is an object, a bound method's self, a partial's
keywords, a callable object, a standard-library namespace, a nested config, a
user's module, a class attribute), each changed between calls, against the
eager step from the same start, bit for bit, with the log naming the change."""

import argparse
import copy
import dataclasses
import functools
import logging
import os
import sys
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests import models as M
from transpiler import TranspileError, transpile


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x, scale=1.0):
        return self.fc2(torch.relu(self.fc1(x))) * scale


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values()))


def _against_eager(step_fn, change, calls: int = 4, make=Net, args=()):
    """M.against_eager with change(i) editing the host before call i."""
    return M.against_eager(step_fn, lambda i, models: change(i), calls, make, args)


@dataclasses.dataclass
class TextConfig:
    temperature: float = 1.0


class Config:
    scale = 1.0   # a class attribute, read through instances

    def __init__(self):
        self.weight = 1.0
        self.text_config = TextConfig()

    @property
    def factor(self):
        return self.weight * 2


def config_step(model, opt, x, y, cfg):
    opt.zero_grad()
    loss = F.cross_entropy(model(x) / cfg.text_config.temperature, y) * cfg.factor * cfg.scale
    loss.backward()
    opt.step()
    return loss


def test_an_argument_object_read_at_depth_is_guarded(caplog):
    """A config passed as an argument: a field, a nested config's field, a
    property's field and a class attribute, each changed between calls."""
    cfg = Config()
    changes = {1: lambda: setattr(cfg, "weight", 0.5),
               2: lambda: setattr(cfg.text_config, "temperature", 2.0),
               3: lambda: setattr(Config, "scale", 3.0),
               4: lambda: setattr(cfg, "text_config", TextConfig(0.5))}
    try:
        with caplog.at_level(logging.INFO, logger="transpiler"):
            step = _against_eager(config_step, lambda i: changes.get(i, lambda: None)(),
                                  calls=6, args=(cfg,))
    finally:
        Config.scale = 1.0
    # each number, once changed, is read from an input (numbers.py); the
    # nested config is read in place (argument_objects.py): the new TextConfig
    # brings another value to the same input, not another object
    assert step.traces == 4
    for line in ("cfg.weight: 1.0 -> 0.5; lifting cfg.weight to a program input",
                 "cfg.text_config.temperature: 1.0 -> 2.0; lifting",
                 "cfg.scale: 1.0 -> 3.0; lifting"):
        assert line in caplog.text
    assert "-> 0.5" not in caplog.text.split("cfg.scale: 1.0 -> 3.0")[1]


ARGS = argparse.Namespace(label_smoothing=0.0, loss_scale=1.0)


def namespace_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y, label_smoothing=ARGS.label_smoothing) * ARGS.loss_scale
    loss.backward()
    opt.step()
    return loss


def test_an_argparse_namespace_in_a_global_is_guarded(caplog):
    def change(i):
        if i == 2:
            ARGS.label_smoothing = 0.1
        if i == 3:
            ARGS.loss_scale = 2.0
    try:
        with caplog.at_level(logging.INFO, logger="transpiler"):
            step = _against_eager(namespace_step, change)
    finally:
        ARGS.label_smoothing, ARGS.loss_scale = 0.0, 1.0
    assert step.traces == 3 and "ARGS.label_smoothing: 0.0 -> 0.1" in caplog.text


def environment_step(model, opt, x, y):
    opt.zero_grad()
    smoothing = 0.1 if "TEST_SMOOTH" in os.environ else 0.0
    loss = F.cross_entropy(model(x), y, label_smoothing=smoothing)
    loss = loss * float(os.getenv("TEST_LOSS_SCALE", "1.0")) / int(os.environ["TEST_DIVISOR"])
    loss.backward()
    opt.step()
    return loss


def test_environment_variables_the_step_reads_are_guarded(caplog, monkeypatch):
    # Read with `in`, os.getenv and os.environ[...]; set, changed and removed
    # between calls: each call as eager, each read of the environment a guard.
    monkeypatch.setenv("TEST_DIVISOR", "1")
    monkeypatch.delenv("TEST_SMOOTH", raising=False)
    monkeypatch.delenv("TEST_LOSS_SCALE", raising=False)
    changes = {1: lambda: os.environ.update(TEST_LOSS_SCALE="2.5"),
               2: lambda: os.environ.update(TEST_SMOOTH="1"),
               3: lambda: os.environ.update(TEST_DIVISOR="4"),
               4: lambda: os.environ.pop("TEST_SMOOTH")}
    with caplog.at_level(logging.INFO, logger="transpiler"):
        step = _against_eager(environment_step, lambda i: changes.get(i, lambda: None)(),
                              calls=6)
    assert step.traces == 5   # each call that changed the environment traced again
    assert "environment variable 'TEST_LOSS_SCALE'" in caplog.text


SETTINGS = types.SimpleNamespace(scale=1.0)
TABLE = {"scale": 1.0}


def namespaces_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y) * SETTINGS.scale * TABLE["scale"]
    loss.backward()
    opt.step()
    return loss


def test_a_simple_namespace_and_a_dict_changed_in_place_are_guarded():
    def change(i):
        if i == 1:
            SETTINGS.scale = 2.0
        if i == 2:
            TABLE["scale"] = 0.5
    try:
        step = _against_eager(namespaces_step, change)
    finally:
        SETTINGS.scale, TABLE["scale"] = 1.0, 1.0
    assert step.traces == 3


def scaled_step(model, opt, x, y, scale=1.0):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y) * scale
    loss.backward()
    opt.step()
    return loss


def test_a_partial_keyword_changed_in_place_is_guarded():
    partial = functools.partial(scaled_step, scale=1.0)
    torch.manual_seed(0)
    ours, theirs = Net(), Net()
    theirs.load_state_dict(ours.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    step = transpile(partial)
    for i, (x, y) in enumerate(M.batches("mlp", 3, 8)):
        if i == 2:
            partial.keywords["scale"] = 3.0
        assert torch.equal(step(ours, opts[0], x, y), partial(theirs, opts[1], x, y))
        assert _equal(ours, theirs)
    assert step.traces == 2


class Trainer:
    """A training loop as an object: the step is a bound method or the
    object itself, and reads its own attributes."""

    def __init__(self):
        self.alpha = 1.0
        self.loss_fn = nn.CrossEntropyLoss()

    def train_step(self, model, opt, x, y):
        opt.zero_grad()
        loss = self.loss_fn(model(x), y) * self.alpha
        loss.backward()
        opt.step()
        return loss

    __call__ = train_step


@pytest.mark.parametrize("how", ["bound method", "callable object"])
def test_the_self_of_a_bound_method_or_a_callable_object_is_guarded(how):
    trainer = Trainer()
    fn = trainer.train_step if how == "bound method" else trainer

    def change(i):
        if i == 1:
            trainer.alpha = 0.25
        if i == 2:
            trainer.loss_fn.label_smoothing = 0.2
    step = _against_eager(fn, change)
    assert step.traces == 3


def test_a_user_module_used_as_a_config_is_guarded():
    cfg = types.ModuleType("habit_config")
    cfg.__file__ = __file__.replace("test_reads", "habit_config")
    cfg.SCALE = 1.0
    sys.modules["habit_config"] = cfg

    def module_step(model, opt, x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y) * cfg.SCALE
        loss.backward()
        opt.step()
        return loss
    try:
        step = _against_eager(module_step, lambda i: setattr(cfg, "SCALE", 2.0) if i == 2 else None)
    finally:
        del sys.modules["habit_config"]
    assert step.traces == 2 and type(cfg) is types.ModuleType


class CFG:
    """A config as a class of constants (the `class CFG:` of many notebooks),
    a nested class for a section, a base class's defaults."""

    loss_weight = 1.0

    class optim:
        clip = 10.0


class FinetuneCFG(CFG):
    pass


def class_config_step(model, opt, x, y, cfg):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y) * cfg.loss_weight
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip)
    opt.step()
    return loss


def test_a_class_used_as_a_config_is_guarded_through_its_bases_and_nested_classes(caplog):
    """The class given as an argument: its attribute, its nested class's and
    the one it inherits, each changed between calls, and one shadowed."""
    changes = {1: lambda: setattr(CFG, "loss_weight", 0.5),
               2: lambda: setattr(CFG.optim, "clip", 0.01),
               3: lambda: setattr(FinetuneCFG, "loss_weight", 2.0),
               4: lambda: setattr(CFG.optim, "clip", 0.02)}
    try:
        with caplog.at_level(logging.INFO, logger="transpiler"):
            step = _against_eager(class_config_step, lambda i: changes.get(i, lambda: None)(),
                                  calls=6, args=(FinetuneCFG,))
    finally:
        CFG.loss_weight, CFG.optim.clip = 1.0, 10.0
        del FinetuneCFG.loss_weight
    for line in ("cfg.loss_weight: 1.0 -> 0.5; lifting cfg.loss_weight to a program input",
                 "cfg.optim.clip: 10.0 -> 0.01; lifting",
                 "cfg.loss_weight: absent -> 2.0"):   # FinetuneCFG's own, now
        assert line in caplog.text
    assert step.traces == 5


class FieldsConfig:
    """A config whose fields live in a dict that __getattr__ and __setattr__
    go through (ml_collections' ConfigDict, OmegaConf's DictConfig)."""

    def __init__(self, **fields):
        object.__setattr__(self, "_fields", dict(fields))

    def __getattr__(self, name):
        try:
            return self._fields[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self._fields[name] = value


def fields_config_step(model, opt, x, y, cfg):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y, weight=cfg.class_weights) * cfg.loss.weight
    loss.backward()
    opt.step()
    return loss


def test_a_config_computing_its_fields_is_guarded_and_left_as_it_was():
    """A number and a tensor read through __getattr__, each changed between
    calls through __setattr__: the trace's stand-ins leave no attribute of the
    instance behind (which would hide every later change from eager and the
    program alike)."""
    cfg = FieldsConfig(loss=FieldsConfig(weight=1.0), class_weights=torch.ones(4))
    changes = {1: lambda: setattr(cfg.loss, "weight", 0.5),
               2: lambda: setattr(cfg, "class_weights", torch.tensor([1.0, 2.0, 0.5, 1.0])),
               3: lambda: setattr(cfg.loss, "weight", 2.0),
               4: lambda: setattr(cfg, "class_weights", torch.tensor([0.5, 1.0, 1.0, 3.0]))}
    _against_eager(fields_config_step, lambda i: changes.get(i, lambda: None)(), calls=6,
                   args=(cfg,))
    assert vars(cfg).keys() == {"_fields"} and vars(cfg.loss).keys() == {"_fields"}


class Stream:
    """An iterator object of the user's own class."""

    def __init__(self, batches):
        self.batches, self.i = batches, 0

    def __next__(self):
        batch = self.batches[self.i]
        self.i += 1
        return batch


def pulls_from_a_stream(model, opt, stream):
    x, y = next(stream)
    return M.classify_step(model, opt, x, y)


def test_an_iterator_of_the_users_class_inside_the_step_is_refused_and_undone():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = copy.deepcopy(model.state_dict())
    stream = Stream(M.batches("mlp", 3, 8))
    with pytest.raises(TranspileError, match=r"changes stream.i on every call and takes one "
                                             r"value of it \(Eq\(stream.i, 0\)\) at .*"
                                             r"self.batches\[self.i\]"):
        transpile(pulls_from_a_stream)(model, opt, stream)
    assert stream.i == 0 and all(isinstance(b[0], torch.Tensor) and type(b[0]) is torch.Tensor
                                 for b in stream.batches)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not opt.state and all(p.grad is None for p in model.parameters())


def test_the_recording_leaves_classes_and_objects_as_they_were():
    trainer = Trainer()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = transpile(trainer.train_step)
    step(model, opt, *M.batches("mlp", 1, 8)[0])
    for cls in (Trainer, Net, nn.Module, nn.Linear, nn.CrossEntropyLoss):
        assert not any(getattr(v, "_transpiler_records", False) for v in vars(cls).values())
    assert type(trainer) is Trainer and type(model) is Net


class Shared(nn.Module):
    """One module under two attribute paths (a wrapper holding the same
    network, as BYOL's learner and its online encoder do)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8))
        self.wrapper = nn.Module()
        self.wrapper.net = self.net
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.wrapper.net(x))


def test_a_module_shared_under_two_paths_keeps_its_own_tensors():
    step = _against_eager(M.classify_step, lambda i: None, calls=3, make=Shared)
    assert step.traces == 1


def test_the_shared_modules_tensors_after_a_call_are_real():
    model = Shared()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    transpile(M.classify_step)(model, opt, *M.batches("mlp", 1, 8)[0])
    assert all(type(t) in (torch.Tensor, nn.Parameter)
               for t in [*model.parameters(), *model.buffers()])


def _module_zero_grad_step(model, opt, x, y):
    model.zero_grad()   # the module's, as the word language model and HF's Trainer call it
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def test_what_the_trace_installs_on_the_steps_objects_is_not_guarded():
    # the trace's own zero_grad on the module was read as the module's
    # attribute: its guard failed on every call, and every call traced again
    step = M.against_eager(_module_zero_grad_step, calls=4)
    assert step.traces == 1
