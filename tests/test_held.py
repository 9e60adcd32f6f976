"""The held tensors' state machine (transpiler/runtime/held.py): what runs before a
program, on made-up state sets, without ranks."""

import torch

from transpiler.runtime.held import HeldTensors, Phase, Prelude

MODEL, OTHER = ("model",), ("other model",)
SNAP = "snapshot:w"


def _initialize(held, state_key, prelude):
    held.initializing(state_key)
    held.tensors[SNAP] = torch.zeros(2)   # what the startup program writes
    held.initialized(state_key, prelude)


def test_a_state_set_is_broadcast_once_then_refreshed_when_stale():
    held = HeldTensors()
    assert held.prelude(MODEL, has_startup=True, reads=[]) is Prelude.STARTUP
    _initialize(held, MODEL, Prelude.STARTUP)
    assert held.prelude(MODEL, has_startup=True, reads=[SNAP]) is None
    held.step_done(carried=False, transient=[])   # warm-up: the parameters moved on
    assert held.phase is Phase.EMPTY and held.state_dict() == {}
    assert held.prelude(MODEL, has_startup=True, reads=[SNAP]) is Prelude.REFRESH


def test_another_model_drops_the_held_tensors_of_the_first():
    held = HeldTensors()
    _initialize(held, MODEL, Prelude.STARTUP)
    held.tensors["other:w"] = torch.ones(1)
    assert held.prelude(OTHER, has_startup=True, reads=[SNAP]) is Prelude.STARTUP
    held.initializing(OTHER)
    assert held.tensors == {}


def test_loaded_tensors_are_trusted_for_the_next_state_set():
    saved = HeldTensors()
    _initialize(saved, MODEL, Prelude.STARTUP)
    held = HeldTensors()
    held.load(saved.state_dict())
    assert held.phase is Phase.LOADED
    # No broadcast (ranks legitimately differ between syncs), no refresh.
    assert held.prelude(OTHER, has_startup=True, reads=[SNAP]) is None
    assert held.phase is Phase.CURRENT


def test_loaded_tensors_a_program_does_not_have_are_refreshed():
    held = HeldTensors()
    held.load({"snapshot:v": torch.zeros(1)})
    assert held.prelude(MODEL, has_startup=True, reads=[SNAP]) is Prelude.REFRESH
    held.initializing(MODEL)
    assert held.tensors == {}


def test_values_only_output_for_the_schedule_go_with_the_step():
    held = HeldTensors()
    _initialize(held, MODEL, Prelude.REFRESH)
    held.tensors["skip_nonfinite.skipped"] = torch.tensor(False)
    held.step_done(carried=True, transient=["skip_nonfinite.skipped"])
    assert list(held.tensors) == [SNAP] and held.phase is Phase.CURRENT
