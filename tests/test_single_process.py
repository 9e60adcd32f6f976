"""Without a process group the transpiled step is the eager step: same
parameters, buffers and optimizer state, for every supported optimizer."""

import copy
import gc
import logging
import weakref

import pytest
import torch

from tests import models as M
from transpiler import transpile

OPTIMIZERS = ["sgd", "nesterov", "adam", "adamw"]


def _run(model_name, opt_name, foreach, transpiled: bool, steps=4, sched=True):
    model = M.make(model_name)
    opt = M.make_optimizer(opt_name, model, foreach=foreach)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if sched else None
    fn = M.step_fn(model_name)
    step = transpile(fn) if transpiled else fn
    losses = []
    for batch in M.batches(model_name, steps, 8):
        losses.append(step(model, opt, *batch).item())
        if scheduler:
            scheduler.step()
    return M.state_of(model, opt), losses, step


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("model_name", ["mlp", "tied", "bn"])
def test_matches_eager(model_name, opt_name, foreach):
    expected, expected_losses, _ = _run(model_name, opt_name, foreach, transpiled=False)
    got, losses, step = _run(model_name, opt_name, foreach, transpiled=True)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert losses == expected_losses
    assert step.program.collectives() == []


def test_scheduler_changes_lr_without_tracing_again(caplog):
    with caplog.at_level(logging.INFO, logger="transpiler"):
        _, _, step = _run("mlp", "sgd", None, transpiled=True, steps=6)
    # The momentum buffers are made before the trace: one program for every step.
    assert len(step._cache) == 1
    assert caplog.text.count("traced classify_step") == 1


@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adamw", "amsgrad"])
def test_state_made_before_the_trace_is_the_first_steps(opt_name):
    """The state made before the first trace is the state torch's first step
    makes (same keys, dtypes, devices, layouts); none for the tied model's
    unused and frozen parameters; after steps, state equal to eager's."""
    make = {"amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True)}.get(
        opt_name, lambda m: M.make_optimizer(opt_name, m))
    runs = []
    for transpiled in (False, True):
        model = M.make("tied")
        opt = make(model)
        step = transpile(M.lm_step) if transpiled else M.lm_step
        for batch in M.batches("tied", 3, 8):
            step(model, opt, *batch)
        runs.append((model, opt, step))
    (eager_model, eager_opt, _), (model, opt, step) = runs
    assert len(step._cache) == 1
    names = {id(p): n for n, p in model.named_parameters()}
    eager_names = {id(p): n for n, p in eager_model.named_parameters()}
    layout = {(names[id(p)], k): (v.dtype, v.device, v.stride()) for p, st in opt.state.items()
              for k, v in st.items()}
    assert layout == {(eager_names[id(p)], k): (v.dtype, v.device, v.stride())
                      for p, st in eager_opt.state.items() for k, v in st.items()}
    assert "unused" not in {n for n, _ in layout}
    assert M.max_rel_error(M.state_of(model, opt), M.state_of(eager_model, eager_opt)) == 0.0


def test_dampened_momentum_traces_the_first_step_apart(caplog):
    """SGD's first step copies the undamped gradient into the momentum buffer:
    zeros would damp it, so that state is not made before the trace; the first
    call's program creates it and the second call traces again, and says why."""
    states = []
    for transpiled in (False, True):
        model = M.make("mlp")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
        step = transpile(M.classify_step) if transpiled else M.classify_step
        with caplog.at_level(logging.INFO, logger="transpiler"):
            for batch in M.batches("mlp", 3, 8):
                step(model, opt, *batch)
        states.append(M.state_of(model, opt))
    assert len(step._cache) == 2
    assert "(the optimizer's first step created its state (momentum_buffer for 6 parameters))" \
        in caplog.text
    assert M.max_rel_error(*states) == 0.0


def _steady_mlp():
    """An MLP, SGD with momentum, its transpiled step past the first two calls
    (both programs built) and a batch."""
    model = M.make("mlp")
    opt = M.make_optimizer("sgd", model)
    step = transpile(M.classify_step)
    batch = M.batches("mlp", 1, 8)[0]
    step(model, opt, *batch)
    step(model, opt, *batch)
    return model, opt, step, batch


# Every hyperparameter of each optimizer with every term on, so that changing
# the values switches nothing on or off (dampening may start at zero: it never
# changes the program).
ALL_TERMS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True,
                                           weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


@pytest.mark.parametrize("opt_name", list(ALL_TERMS))
def test_changing_hyperparameter_values_never_traces_again(opt_name, caplog):
    states = []
    for transpiled in (True, False):
        model = M.make("mlp")
        opt = ALL_TERMS[opt_name](model.parameters())
        step = transpile(M.classify_step) if transpiled else M.classify_step
        for i, batch in enumerate(M.batches("mlp", 6, 8)):
            with caplog.at_level(logging.INFO, logger="transpiler"):
                step(model, opt, *batch)
            M.change_every_hyperparameter(opt)
        states.append(M.state_of(model, opt))
        if transpiled:
            assert len(step._cache) == 1
            assert caplog.text.count("traced classify_step") == 1
    # Every update is eager's, bit for bit.
    assert M.max_rel_error(*states) == 0.0


def _two_groups(cls, **first):
    def make(params):
        params = list(params)
        return cls([{"params": params[:2], **first}, {"params": params[2:]}], lr=1e-2)
    return make


# The flags and mixes the formulations must honour, against eager torch.
EDGE_CASES = {
    "sgd_maximize": ("mlp", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, maximize=True,
                                                       weight_decay=1e-3)),
    "sgd_no_momentum": ("mlp", lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "sgd_two_groups": ("mlp", _two_groups(torch.optim.SGD, momentum=0.9, weight_decay=1e-2)),
    "adam_maximize_amsgrad": ("mlp", lambda ps: torch.optim.Adam(ps, lr=1e-2, maximize=True,
                                                                 amsgrad=True)),
    "adamw_two_groups": ("mlp", _two_groups(torch.optim.AdamW, weight_decay=0.0)),
    "adam_l2_bf16_layer": ("mixed", lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-2)),
    "sgd_tied_frozen_unused": ("tied", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
}


@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_formulations_match_eager(case):
    model_name, make_opt = EDGE_CASES[case]
    states = []
    for transpiled in (True, False):
        model = M.make(model_name)
        opt = make_opt([p for p in model.parameters() if p.requires_grad])
        fn = M.step_fn(model_name)
        step = transpile(fn) if transpiled else fn
        for batch in M.batches(model_name, 4, 8):
            step(model, opt, *batch)
            M.change_every_hyperparameter(opt)
        states.append(M.state_of(model, opt))
    # Every fp32 update is eager's bit for bit. A bf16 parameter's Adam moments
    # round differently from eager's from the first step (lerp and addcmul by
    # a 0-d tensor on bf16), within 8 bits of mantissa.
    tolerance = 1e-2 if model_name == "mixed" else 0.0
    assert M.max_rel_error(*states) <= tolerance


def test_float64_model_matches_eager():
    states = []
    for transpiled in (True, False):
        model = M.make("mlp").double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                              weight_decay=1e-3)
        step = transpile(M.classify_step) if transpiled else M.classify_step
        for x, y in M.batches("mlp", 4, 8):
            step(model, opt, x.double(), y)
            M.change_every_hyperparameter(opt)
        states.append(M.state_of(model, opt))
    assert M.max_rel_error(*states) == 0.0


OTHER_OPTIMIZERS = [torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adamax,
                    torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta,
                    torch.optim.ASGD, torch.optim.Rprop]


@pytest.mark.parametrize("cls", OTHER_OPTIMIZERS, ids=lambda c: c.__name__)
def test_other_optimizers_are_traced_as_torch_wrote_them(cls, caplog):
    states = []
    for transpiled in (True, False):
        model = M.make("mlp")
        opt = cls(model.parameters(), lr=1e-2)
        step = transpile(M.classify_step) if transpiled else M.classify_step
        with caplog.at_level(logging.INFO, logger="transpiler"):
            for i, batch in enumerate(M.batches("mlp", 5, 8)):
                if i == 4:
                    opt.param_groups[0]["lr"] = 5e-3
                step(model, opt, *batch)
        states.append(M.state_of(model, opt))
    # Their hyperparameters are baked into the program: a change traces again.
    assert "optimizer 0 group 0 lr: 0.01 -> 0.005" in caplog.text
    # Traced on the path eager takes (its step count read as a number, its
    # foreach and capturable options the user's): bit for bit.
    assert M.max_rel_error(*states) == 0.0


def test_switching_a_term_off_traces_again_and_says_why(caplog):
    model, opt, step, batch = _steady_mlp()
    reference = copy.deepcopy(model)
    ref_opt = M.make_optimizer("sgd", reference)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for o in (opt, ref_opt):
        o.param_groups[0]["weight_decay"] = 0.0
    with caplog.at_level(logging.INFO, logger="transpiler"):
        step(model, opt, *batch)
    assert "optimizer 0 group 0 terms: ('weight_decay', 'momentum') -> ('momentum',)" in caplog.text
    M.classify_step(reference, ref_opt, *batch)
    assert M.max_rel_error(M.state_of(model, opt), M.state_of(reference, ref_opt)) == 0.0


def test_a_hyperparameter_torch_takes_as_a_tensor_is_part_of_the_signature(caplog):
    model = M.make("mlp")
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01), foreach=False)
    step = transpile(M.classify_step)
    batch = M.batches("mlp", 1, 8)[0]
    step(model, opt, *batch)
    step(model, opt, *batch)
    opt.param_groups[0]["betas"] = (0.8, 0.99)
    with caplog.at_level(logging.INFO, logger="transpiler"):
        step(model, opt, *batch)
    assert "optimizer 0 group 0 betas: (0.9, 0.999) -> (0.8, 0.99)" in caplog.text


def test_shape_change_traces_again_and_says_why(caplog):
    model = M.make("mlp")
    opt = M.make_optimizer("sgd", model)
    step = transpile(M.classify_step)
    x, y = M.batches("mlp", 1, 8)[0]
    step(model, opt, x, y)
    with caplog.at_level(logging.INFO, logger="transpiler"):
        step(model, opt, x[:5], y[:5])
    assert "input x: float32[8, 16] on cpu -> float32[5, 16] on cpu" in caplog.text


def test_returns_any_pytree_of_tensors():
    def step_fn(model, optimizer, x, y):
        optimizer.zero_grad()
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        return {"loss": loss.detach(), "logits": (logits.detach(),)}

    model = M.make("mlp")
    opt = M.make_optimizer("sgd", model)
    x, y = M.batches("mlp", 1, 8)[0]
    expected_logits = model(x).detach()
    out = transpile(step_fn)(model, opt, x, y)
    assert set(out) == {"loss", "logits"}
    assert torch.allclose(out["logits"][0], expected_logits)


def test_replacing_a_parameter_traces_again(caplog):
    model, opt, step, batch = _steady_mlp()
    # A new parameter object of the same shape: the program must read the new one.
    model.layers[0].weight = torch.nn.Parameter(torch.zeros_like(model.layers[0].weight))
    opt.param_groups[0]["params"][0] = model.layers[0].weight
    with caplog.at_level(logging.INFO, logger="transpiler"):
        step(model, opt, *batch)
    assert "traced classify_step (module 0 layers.0.weight is another tensor than the program " \
        "was traced with" in caplog.text
    assert model.layers[0].weight.abs().sum() > 0  # it was trained


def test_a_dropped_model_is_garbage_collected():
    # Nothing the transpiler keeps per module (capture's cache of its tensors)
    # may outlive the model and the step.
    model = M.make("bn")
    opt = M.make_optimizer("adamw", model)
    step = transpile(M.step_fn("bn"))
    for batch in M.batches("bn", 2, 8):
        step(model, opt, *batch)
    dead = weakref.ref(model)
    del model, opt, step
    gc.collect()
    assert dead() is None
