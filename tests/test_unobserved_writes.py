"""Host writes made where a trace once did not look: through a property's
setter or a __setattr__ of the user's (their code is the step's, observed as
it runs), into a class through `type(self)`, into os.environ, into a frozen
dataclass with object.__setattr__, onto a parameter, over a numpy float32, into
a dict that holds a float. Each is eager's on every call, or refused at the
first call with nothing changed."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from tests import models as M


class Counted:
    """A trainer whose step count is a property: its setter also counts the
    assignments."""

    def __init__(self):
        self._step, self.assigned, self.history = 0, 0, []

    @property
    def step(self):
        return self._step

    @step.setter
    def step(self, value):
        self._step = value
        self.assigned += 1

    @property
    def last_loss(self):
        return self.history[-1] if self.history else None

    @last_loss.setter
    def last_loss(self, value):
        self.history.append(value)


def count_through_a_setter(model, opt, x, y, trainer):
    loss = M.classify_step(model, opt, x, y)
    trainer.step = trainer.step + 1
    return loss


def test_a_property_setter_runs_as_the_step_s_own_code():
    hosts = [Counted(), Counted()]
    step = M.against_eager(count_through_a_setter, hosts=hosts)
    assert (hosts[0].step, hosts[0].assigned) == (hosts[1].step, hosts[1].assigned) == (4, 4)
    assert step.traces == 1   # the counter is read from a program input


def loss_through_a_setter(model, opt, x, y, trainer):
    loss = M.classify_step(model, opt, x, y)
    trainer.last_loss = loss.item()
    return loss


def test_a_setter_that_appends_a_tensor_s_value_appends_each_call_s():
    hosts = [Counted(), Counted()]
    step = M.against_eager(loss_through_a_setter, hosts=hosts)
    assert hosts[0].history == hosts[1].history and len(hosts[0].history) == 4
    assert step.traces == 1


class Registry:
    made = 0


def count_on_the_class(model, opt, x, y, registry):
    type(registry).made += 1
    return M.classify_step(model, opt, x, y)


def test_a_class_attribute_written_through_type_self_is_refused_as_it_was():
    M.refused_as_it_was(count_on_the_class, Registry(),
                        r"changes host-side state on every call: Registry.made 1 -> 2")
    assert Registry.made == 0


def count_in_the_environment(model, opt, x, y, _):
    os.environ["TRANSPILER_TEST_CALLS"] = str(int(os.environ.get("TRANSPILER_TEST_CALLS", 0)) + 1)
    return M.classify_step(model, opt, x, y)


def test_an_environment_variable_written_on_every_call_is_refused_as_it_was():
    os.environ.pop("TRANSPILER_TEST_CALLS", None)
    M.refused_as_it_was(count_in_the_environment, None,
                        "environment variable .TRANSPILER_TEST_CALLS. absent -> .1., then .1. -> .2.")
    assert "TRANSPILER_TEST_CALLS" not in os.environ


@dataclasses.dataclass(frozen=True)
class FrozenState:
    step: int = 0


def count_in_a_frozen_dataclass(model, opt, x, y, state):
    object.__setattr__(state, "step", state.step + 1)
    return M.classify_step(model, opt, x, y)


def test_a_frozen_dataclass_counted_with_object_setattr_counts_as_eager():
    hosts = [FrozenState(), FrozenState()]
    M.against_eager(count_in_a_frozen_dataclass, hosts=hosts)
    assert hosts[0].step == hosts[1].step == 4


def count_on_the_weight(model, opt, x, y, _):
    loss = M.classify_step(model, opt, x, y)
    weight = model.layers[0].weight
    weight.updates = getattr(weight, "updates", 0) + 1
    return loss


def test_an_attribute_set_on_a_parameter_is_refused():
    M.refused_as_it_was(count_on_the_weight, None, "sets attribute 'updates' on layers.0.weight")


class Averages:
    def __init__(self):
        self.avg = np.float32(0.0)
        self.totals = {"loss": 0.0}


def average_in_float32(model, opt, x, y, averages):
    loss = M.classify_step(model, opt, x, y)
    averages.avg = 0.9 * averages.avg + 0.1 * loss.item()
    return loss


def total_in_a_dict(model, opt, x, y, averages):
    loss = M.classify_step(model, opt, x, y)
    averages.totals["loss"] += loss.item()
    return loss


@pytest.mark.parametrize("step_fn, match", [
    (average_in_float32, "where it held a numpy float32"),
    (total_in_a_dict, r"leaves a value it computed from tensors in averages.totals"),
])
def test_a_value_numpy_or_a_dict_would_keep_otherwise_is_refused_as_it_was(step_fn, match):
    averages = Averages()
    M.refused_as_it_was(step_fn, averages, match)
    assert type(averages.avg) is np.float32 and averages.totals == {"loss": 0.0}


class Fields:
    """An object that keeps its fields in a dict of its own (ml_collections'
    ConfigDict, OmegaConf's DictConfig work so)."""

    def __init__(self):
        object.__setattr__(self, "_fields", {"calls": 0})

    def __getattr__(self, name):
        return self._fields[name]

    def __setattr__(self, name, value):
        self._fields[name] = value


def count_in_fields(model, opt, x, y, fields):
    fields.calls = fields.calls + 1
    return M.classify_step(model, opt, x, y)


def test_a_counter_an_object_keeps_in_a_dict_of_its_own_is_refused_as_it_was():
    """Its attribute is computed by __getattr__; the write goes into the dict:
    undone there, and no value left in the attribute's place (which would hide
    the dict from every later read)."""
    fields = Fields()
    M.refused_as_it_was(count_in_fields, fields, r"changes host-side state on every call: "
                                                 r"fields.calls 0 -> 1, then 1 -> 2")
    assert vars(fields) == {"_fields": {"calls": 0}}
