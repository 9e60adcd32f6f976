"""Bad input gets a clear error that says what to do, raised before any
collective and with the model and optimizer exactly as they were."""

import copy

import pytest
import torch
import torch.nn.functional as F

from tests import models as M
from transpiler import TranspileError, transpile


def _setup():
    model = M.make("mlp")
    opt = M.make_optimizer("adamw", model)
    M.classify_step(model, opt, *M.batches("mlp", 1, 8)[0])  # some state to protect
    return model, opt, M.batches("mlp", 1, 8)[0]


def _raises_and_touches_nothing(step, match, *args):
    model, opt, (x, y) = _setup()
    before = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    with pytest.raises(TranspileError, match=match):
        step(*(a if a is not None else v for a, v in zip(args, (model, opt, x, y))))
    after = (model.state_dict(), opt.state_dict())
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    for p, st in before[1]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, after[1]["state"][p][k])
    assert before[1]["param_groups"] == after[1]["param_groups"]


def test_no_module_among_arguments():
    def step_fn(optimizer, x, y):
        raise AssertionError("not reached")

    model, opt, (x, y) = _setup()
    with pytest.raises(TranspileError, match="no torch.nn.Module among its arguments: pass the model"):
        transpile(step_fn)(opt, x, y)


def test_an_optimizer_made_inside_the_step_is_refused():
    """An optimizer the step neither takes nor reaches through its own roots
    (made in the step: a new one, without state, on every eager call) is
    refused at its step(), naming the line, with nothing changed."""
    def step_fn(model, x, y):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    model, _, (x, y) = _setup()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TranspileError, match=r"SGD.step\(\) is called at .*test_errors.py"
                                             r".* on an optimizer the step makes on the model's parameters "
                                             r"as it runs \(a new one on every call"):
        transpile(step_fn)(model, x, y)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_unknown_mode():
    with pytest.raises(TranspileError, match="unknown mode 'fastest'; choose one of grad_allreduce"):
        transpile(M.classify_step, mode="fastest")


@pytest.mark.parametrize("nrings", [0, -1, 17, 1.5, True])
def test_bad_nrings(nrings):
    with pytest.raises(TranspileError, match="nrings must be an integer from 1 to 16"):
        transpile(M.classify_step, nrings=nrings)


# An op whose result's size is a count of values, tagged so, with no fake
# kernel to size it while traced (torch's ctc_loss was one; it traces now).
_LIB = torch.library.Library("transpiler_tests", "DEF")
_LIB.define("positives(Tensor x) -> Tensor", tags=(torch.Tag.dynamic_output_shape,))
_LIB.impl("positives", lambda x: x[x > 0].clone(), "CompositeExplicitAutograd")


def test_an_op_whose_size_depends_on_values_untraceably_names_the_line():
    def step_fn(model, optimizer, x, y):
        optimizer.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y) + torch.ops.transpiler_tests.positives(out).sum()
        loss.backward()
        optimizer.step()
        return loss

    _raises_and_touches_nothing(
        transpile(step_fn),
        r"calls transpiler_tests.positives.default at .*test_errors.py:\d+ \(loss = .*whose "
        r"result's shape depends on tensor values",
        None, None, None, None)


def _step_returning(result):
    """The usual step, returning result(loss) instead of the loss."""
    def step_fn(model, optimizer, x, y):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return result(loss)
    return step_fn


def test_item_returned_is_the_eager_float():
    fn = _step_returning(lambda loss: loss.item())
    model, reference = M.make("mlp"), M.make("mlp")
    opts = [M.make_optimizer("sgd", m) for m in (model, reference)]
    step = transpile(fn)
    for x, y in M.batches("mlp", 2, 8):
        ours, theirs = step(model, opts[0], x, y), fn(reference, opts[1], x, y)
        assert type(ours) is float and ours == theirs


def _scheduled_step(call_scheduler, before_step=False):
    def step_fn(model, optimizer, x, y):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if before_step:
            call_scheduler(optimizer)
        optimizer.step()
        if not before_step:
            call_scheduler(optimizer)
        return loss
    return step_fn


def test_scheduler_before_optimizer_step():
    schedulers = {}

    def call(opt):
        schedulers.setdefault(id(opt), torch.optim.lr_scheduler.StepLR(opt, 1)).step()

    _raises_and_touches_nothing(transpile(_scheduled_step(call, before_step=True)),
                                r"StepLR.step\(\) is called before optimizer.step\(\) .* at .*"
                                r"test_errors.py.*call it after optimizer.step\(\)",
                                None, None, None, None)


def test_scheduler_with_a_metric():
    schedulers = {}

    def call(opt):
        schedulers.setdefault(id(opt), torch.optim.lr_scheduler.ReduceLROnPlateau(opt)).step(1.0)

    _raises_and_touches_nothing(transpile(_scheduled_step(call)),
                                r"ReduceLROnPlateau.step\(\) is given arguments .*outside the step",
                                None, None, None, None)


def test_hyperparameter_assigned_inside_the_step():
    def assign(opt):
        opt.param_groups[0]["lr"] = 0.5

    _raises_and_touches_nothing(transpile(_scheduled_step(assign, before_step=True)),
                                r"changes host-side state: optimizer 0 param_groups\[0\]\['lr'\] "
                                r"0.01 -> 0.5.*lr_scheduler", None, None, None, None)


def test_python_counter_on_the_module_that_indexes_is_refused():
    """A counter the step advances and uses as an index: a program per value,
    so every call would trace again; refused at the first call, undone."""
    schedule = [1.0, 0.5, 0.25, 0.125]

    def count(model, optimizer, x, y):
        optimizer.zero_grad()
        model.calls = getattr(model, "calls", 0) + 1
        loss = F.cross_entropy(model(x), y) * schedule[model.calls]
        loss.backward()
        optimizer.step()
        return loss

    model, opt, (x, y) = _setup()
    model.calls = 0
    with pytest.raises(TranspileError, match=r"changes model.calls on every call and takes one "
                                             r"value of it .*schedule\[model.calls\]"):
        transpile(count)(model, opt, x, y)
    assert model.calls == 0   # undone


def test_mode_switched_inside_the_step_is_replayed():
    """model.eval() at the end of the step: kept, and done again after every
    run, so the model is in eval mode after each call, as after the eager
    step (and the next call, in eval mode, traces for it)."""
    def evaluates(model, optimizer, x, y):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        model.eval()
        return loss

    model, opt, (x, y) = _setup()
    reference, ref_opt = copy.deepcopy((model, opt))
    step = transpile(evaluates)
    for _ in range(3):
        assert torch.equal(step(model, opt, x, y), evaluates(reference, ref_opt, x, y))
        assert not any(m.training for m in model.modules())
        model.train()
        reference.train()
    assert step.traces == 1


def test_no_backward():
    def no_backward(model, optimizer, x, y):
        optimizer.zero_grad()
        optimizer.step()

    _raises_and_touches_nothing(transpile(no_backward), "never calls loss.backward", None, None, None, None)


def test_non_tensor_output():
    _raises_and_touches_nothing(transpile(_step_returning(lambda loss: (loss, {1, 2}))),
                                "returned a set; a transpiled step may return tensors, Python "
                                "numbers and strings",
                                None, None, None, None)


def test_untraceable_optimizer_is_named():
    class Counting(torch.optim.SGD):
        """Keeps a Python counter in its state, changed every step."""

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["count"] = self.state[p].get("count", 0) + 1
            return super().step(closure)

    model, _, (x, y) = _setup()
    opt = Counting(model.parameters(), lr=0.1)
    with pytest.raises(TranspileError, match="Counting keeps non-tensor state 'count'"):
        transpile(M.classify_step)(model, opt, x, y)


def test_program_before_first_call():
    with pytest.raises(TranspileError, match="has not been called yet"):
        transpile(M.classify_step).program


def test_optimizer_that_cannot_be_traced_is_named():
    model, _, (x, y) = _setup()
    opt = torch.optim.SparseAdam(model.parameters(), lr=0.1)
    with pytest.raises(TranspileError, match=r"SparseAdam.step\(\) cannot be captured at .*optimizer.step\(\)"):
        transpile(M.classify_step)(model, opt, x, y)


def test_a_module_in_a_closure_is_the_steps_own():
    """A module the step reaches through its closure (found.py) is one of its
    modules: its gradients are left in .grad as eager leaves them."""
    results = []
    for transpiled in (True, False):
        model, opt, (x, y) = _setup()
        torch.manual_seed(1)
        head = torch.nn.Linear(4, 4)   # reached through the closure, not an argument

        def step_fn(model, optimizer, x, y):
            optimizer.zero_grad()
            loss = F.cross_entropy(head(model(x)), y)
            loss.backward()
            optimizer.step()
            return loss

        step = transpile(step_fn) if transpiled else step_fn
        results.append([step(model, opt, x, y) for _ in range(3)] + [head.weight.grad.clone()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("option,value,message", [
    ("bucket_mb", 0, "bucket_mb must be a positive number"),
    ("first_bucket_mb", -1.0, "first_bucket_mb must be a positive number"),
    ("check_every", 0, "check_every must be an integer >= 1 or None"),
    ("skip_nonfinite", "yes", "skip_nonfinite must be True or False"),
    ("backend", "tpu", "unknown backend 'tpu'; available: eager, inductor"),
    ("passes", ["average_grads", "no_such_pass"], "unknown pass 'no_such_pass'"),
    ("fuse_dtype", torch.float8_e4m3fn, r"fuse_dtype must be None or one of the floating-point "
                                        r"dtypes gloo and nccl sum \(torch.float16, "
                                        r"torch.bfloat16, torch.float32, torch.float64\)"),
    ("fuse_dtype", torch.int32, "fuse_dtype must be None or one of"),
])
def test_bad_options(option, value, message):
    # the options of the fused modes only (the default mode takes bucket_mb alone)
    mode = "fuse_all_reduce" if option in ("first_bucket_mb", "fuse_dtype") else None
    with pytest.raises(TranspileError, match=message):
        transpile(M.classify_step, mode=mode, **{option: value})


def test_passes_in_an_order_that_breaks_a_requirement():
    with pytest.raises(TranspileError, match="pass coalesce_tensors acts on the values marked "
                                             "to reduce.*but no pass before it leaves them; "
                                             "passes: coalesce_tensors, average_grads"):
        transpile(M.classify_step, passes=["coalesce_tensors", "average_grads"])
    with pytest.raises(TranspileError, match="ring_round_robin requires insert_allreduce or "
                                             "coalesce_tensors or shard_optimizer or "
                                             "gather_grads or broadcast_params or "
                                             "broadcast_buffers to run "
                                             "before it; passes run so far: capture"):
        transpile(M.classify_step, passes=["ring_round_robin"])


def test_new_parameter_group_traces_again_and_trains_it(caplog):
    import logging
    steps = []
    for transpiled in (True, False):
        torch.manual_seed(0)
        model = M.make("mlp")
        frozen = model.layers[0]
        frozen.requires_grad_(False)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        fn = transpile(M.classify_step) if transpiled else M.classify_step
        batches = M.batches("mlp", 4, 8)
        with caplog.at_level(logging.INFO, logger="transpiler"):
            for i, batch in enumerate(batches):
                if i == 2:   # unfreeze the first layer and give it to the optimizer
                    frozen.requires_grad_(True)
                    opt.add_param_group({"params": list(frozen.parameters()), "lr": 0.05})
                fn(model, opt, *batch)
        steps.append(M.state_of(model, opt))
    assert M.max_rel_error(*steps) <= 1e-6
    assert "traced classify_step (" in caplog.text and caplog.text.count("traced classify_step") == 2


def test_model_cast_after_tracing_traces_again_with_the_reason(caplog):
    import logging
    model = M.make("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = transpile(M.classify_step)
    x, y = M.batches("mlp", 1, 8)[0]
    step(model, opt, x, y)
    model.double()
    with caplog.at_level(logging.INFO, logger="transpiler"):
        step(model, opt, x.double(), y)
    assert "float32" in caplog.text and "float64" in caplog.text
    assert all(p.dtype == torch.float64 for p in model.parameters())


def test_step_raising_during_trace_names_the_line():
    def step_fn(model, optimizer, x, y):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[:, :5]), y)   # the model wants 16 features
        loss.backward()
        optimizer.step()
        return loss

    _raises_and_touches_nothing(transpile(step_fn), r"tracing .*step_fn failed at .*test_errors.py:"
                                r"\d+ \(loss = F.cross_entropy\(model\(x\[:, :5\]\), y\).*\): "
                                r"RuntimeError: .*\[8, 5\] X \[16, 32\]", None, None, None, None)


def modifies_its_batch(model, optimizer, x, y):
    x.mul_(2)
    return M.classify_step(model, optimizer, x, y)


def test_an_in_place_op_on_the_batch_is_refused_before_anything_is_written():
    model, opt, (x, y) = _setup()
    x_before, grads = x.clone(), [p.grad.clone() for p in model.parameters()]
    _raises_and_touches_nothing(transpile(modifies_its_batch),
                                r"modifies its argument 'x' in place .* compute out of place",
                                None, None, x, None)
    assert torch.equal(x, x_before)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def steps_with_a_closure(model, optimizer, x, y):
    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss
    return optimizer.step(closure)


def test_optimizer_step_with_a_closure_has_its_own_message():
    _raises_and_touches_nothing(transpile(steps_with_a_closure),
                                r"AdamW.step\(\) is given a closure at .*test_errors.py:\d+ "
                                r"\(return optimizer.step\(closure\)\).*\(LBFGS", None, None,
                                None, None)


def test_an_uninitialized_lazy_module_says_to_run_one_forward_first():
    model = torch.nn.Sequential(torch.nn.LazyLinear(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TranspileError, match=r"0.weight of Sequential is not initialized yet "
                                             r"\(a lazy module such as nn.LazyLinear\): run one "
                                             r"forward pass"):
        transpile(M.classify_step)(model, opt, *M.batches("mlp", 1, 8)[0])
    assert not opt.state


def numpy_inside(model, optimizer, x, y):
    import numpy as np
    return M.classify_step(model, optimizer, x, torch.from_numpy(np.asarray(y)[None]))


def test_an_error_in_numpy_names_the_users_line():
    _raises_and_touches_nothing(transpile(numpy_inside), r"at .*test_errors.py:\d+ "
                                r"\(return M.classify_step\(model, optimizer, x, "
                                r"torch.from_numpy", None, None, None, None)


def test_a_pass_may_be_a_partial_or_a_callable_object():
    import functools

    from passes.insert_allreduce import insert_allreduce

    class Unchanged:
        def __call__(self, program, ctx):
            pass

    model, opt, (x, y) = _setup()
    reference = copy.deepcopy(model), copy.deepcopy(opt)
    step = transpile(M.classify_step, passes=["average_grads", functools.partial(insert_allreduce),
                                              Unchanged()])
    assert torch.equal(step(model, opt, x, y), M.classify_step(*reference, x, y))
    assert "Unchanged" in step.program.history[-1].provenance


def test_a_batch_of_another_dtype_than_the_model_names_both():
    model, opt, (x, y) = _setup()
    _raises_and_touches_nothing(transpile(M.classify_step),
                                r"multiplies tensors of float32 and float64 \(addmm.default; the "
                                r"batch's floating-point tensors are torch.float64\): the batch's "
                                r"dtype must match the model's", None, None, x.double(), None)


@torch.jit.script
def scripted_gelu(x):
    """Megatron-LM's fused bias-GeLU, as a TorchScript function."""
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def scripted_step(model, opt, x, y, use_script=True):
    opt.zero_grad()
    h = model.layers[0](x)
    h = scripted_gelu(h) if use_script else F.gelu(h, approximate="tanh")
    for layer in model.layers[1:]:
        h = layer(h)
    loss = F.cross_entropy(h, y)
    loss.backward()
    opt.step()
    return loss


def test_a_torchscript_function_the_step_calls_is_refused_at_its_line():
    """TorchScript's backward rounds otherwise from its second call (its own
    autodiff): no program equals it. A call is refused at its line; a
    reference on a branch not taken is not."""
    _raises_and_touches_nothing(
        transpile(scripted_step),
        r"the step runs scripted_gelu at .*test_errors.py:\d+ .*compiled by torch.jit.script.*"
        r"Remove torch.jit.script from it", None, None, None, None)
    model, opt, (x, y) = _setup()
    reference = copy.deepcopy(model), copy.deepcopy(opt.state_dict())
    ours = transpile(scripted_step)(model, opt, x, y, False)
    ref_model = reference[0]
    ref_opt = M.make_optimizer("adamw", ref_model)
    ref_opt.load_state_dict(reference[1])
    assert torch.equal(ours, scripted_step(ref_model, ref_opt, x, y, False))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))


def test_a_torchscript_submodule_is_refused_naming_it():
    model, opt, (x, y) = _setup()
    model.layers[1] = torch.jit.script(model.layers[1])
    with pytest.raises(TranspileError, match=r"the step runs module 0 layers.1, compiled by "
                                             r"torch.jit.script"):
        transpile(M.classify_step)(model, opt, x, y)


def test_a_checkpoint_saved_inside_the_step_is_refused_before_anything_is_written(tmp_path):
    path = tmp_path / "checkpoint.pt"

    def saving_step(model, opt, x, y):
        loss = M.classify_step(model, opt, x, y)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
        return loss
    _raises_and_touches_nothing(transpile(saving_step),
                                r"calls torch.save at .*test_errors.py.*Save between calls",
                                None, None, None, None)
    assert not path.exists()
    torch.save({"saved": torch.ones(2)}, path)   # outside a trace: torch's own
    assert torch.equal(torch.load(path)["saved"], torch.ones(2))
