"""What a step changes in the containers among its arguments (a batch dict, a
list of metrics, a dataclass of training state): the trace calls the step on
rebuilt containers, so each change is either made by the program in the
caller's own container after every call, as the eager step makes it, or
refused at the first call with nothing changed (capture/argument_writes.py)."""

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests import models as M
from transpiler import TranspileError, transpile


def _setup():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _batch(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"img": torch.randint(0, 255, (6, 4), generator=g, dtype=torch.uint8),
            "cls": torch.randint(0, 3, (6,), generator=g)}


def preprocess_in_step(model, opt, batch):
    """ultralytics' preprocess_batch, then transformers' compute_loss habit."""
    batch["img"] = batch["img"].float() / 255
    labels = batch.pop("cls")
    loss = F.cross_entropy(model(batch["img"]), labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    batch["loss"] = loss.detach()
    return loss


def test_tensors_set_and_keys_popped_reach_the_callers_dict_as_in_eager():
    eager, ours = _setup(), _setup()
    step = transpile(preprocess_in_step)
    for i in range(3):
        mine, theirs = _batch(i), _batch(i)
        assert torch.equal(step(*ours, mine), preprocess_in_step(*eager, theirs))
        assert mine.keys() == theirs.keys() == {"img", "loss"}
        for key in theirs:
            assert mine[key].dtype == theirs[key].dtype and torch.equal(mine[key], theirs[key])
    assert step._cache.builds == 1
    for a, b in zip(eager[0].parameters(), ours[0].parameters()):
        assert torch.equal(a, b)


def preprocess_micro_batches(model, opt, batches):
    for batch in batches:
        batch["img"] = batch["img"].float() / 255
        F.cross_entropy(model(batch["img"]), batch["cls"]).div(len(batches)).backward()
    opt.step()
    opt.zero_grad()


def test_a_write_into_each_micro_batch_is_each_ones_own():
    eager, ours = _setup(), _setup()
    step = transpile(preprocess_micro_batches, micro_batches="batches")
    mine, theirs = [_batch(i) for i in range(4)], [_batch(i) for i in range(4)]
    step(*ours, mine)
    preprocess_micro_batches(*eager, theirs)
    for m, t in zip(mine, theirs):
        assert torch.equal(m["img"], t["img"]) and m["img"].dtype == torch.float32
    for a, b in zip(eager[0].parameters(), ours[0].parameters()):
        assert torch.equal(a, b)


@dataclasses.dataclass
class TrainState:
    step: int = 0
    last_loss: torch.Tensor | None = None


def dataclass_step(model, opt, x, y, state):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    state.last_loss = loss.detach()
    return loss


def test_a_tensor_set_on_a_dataclass_argument_reaches_the_callers():
    eager, ours = _setup(), _setup()
    step = transpile(dataclass_step)
    mine, theirs = TrainState(last_loss=torch.zeros(())), TrainState(last_loss=torch.zeros(()))
    for i in range(3):
        x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
        step(*ours, x, y, mine)
        dataclass_step(*eager, x, y, theirs)
        assert torch.equal(mine.last_loss, theirs.last_loss)


def metrics_list_step(model, opt, x, y, fracs):
    """cleanrl's ppo.py: clipfracs += [(...).float().mean().item()]."""
    loss = F.cross_entropy(model(x), y)
    with torch.no_grad():
        fracs += [(loss > 0.5).float().mean().item()]
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def count_in_dict_step(model, opt, x, y, logs):
    logs["n"] = logs.get("n", 0) + 1
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def counters_step(model, opt, x, y, state, logs):
    """A flax-style train state advanced by the step (state.step += 1) and a
    dict of the last values (score_sde's state['step'] += 1)."""
    state.step += 1
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    logs["n"] += 1
    logs["loss"] = loss.item()
    logs["mean"] = logs["mean"] + (logs["loss"] - logs["mean"]) / logs["n"]
    return loss


def test_numbers_advanced_in_an_argument_are_set_in_the_callers_own_after_each_run():
    """Each counter is lifted at the first call (read from an input), and what
    the step sets is an output of the one program, set in the call's own
    dataclass and dict."""
    ours, opt = _setup()
    theirs = copy.deepcopy(ours)
    their_opt = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    held = [(TrainState(), {"n": 0, "loss": 0.0, "mean": 0.0}) for _ in range(2)]
    step = transpile(counters_step)
    for i in range(4):
        x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
        assert torch.equal(step(ours, opt, x, y, *held[0]),
                           counters_step(theirs, their_opt, x, y, *held[1]))
        assert held[0][0].step == held[1][0].step == i + 1 and held[0][1] == held[1][1]
        assert type(held[0][0].step) is int and type(held[0][1]["mean"]) is float
    assert step._cache.builds == 1


@pytest.mark.parametrize("fn, arg, match", [
    (metrics_list_step, [], r"changes its argument 'fracs' \(a list of 0 items, now 1\)"),
    (count_in_dict_step, {}, r"changes its argument 'logs' \(a dict: 'n' absent -> 1\)")])
def test_host_values_stored_in_an_argument_are_refused_with_nothing_changed(fn, arg, match):
    model, opt = _setup()
    before = copy.deepcopy(model.state_dict())
    kept = copy.deepcopy(arg)
    with pytest.raises(TranspileError, match=match + ".*Return the value from the step"):
        transpile(fn)(model, opt, torch.randn(5, 4), torch.randint(0, 3, (5,)), arg)
    assert arg == kept and not opt.state
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


WEIGHTS = [1.0, 0.5, 0.25, 0.125]


def indexing_step(model, opt, x, y, state):
    loss = F.cross_entropy(model(x), y) * WEIGHTS[state.step]
    opt.zero_grad()
    loss.backward()
    opt.step()
    state.step += 1
    return loss


def test_a_counter_in_an_argument_used_as_an_index_is_refused_with_nothing_changed():
    """A program per value of the counter: every call would trace again."""
    model, opt = _setup()
    before = copy.deepcopy(model.state_dict())
    state = TrainState()
    with pytest.raises(TranspileError, match=r"changes state on every call and takes one value "
                                             r"of it \(Eq\(state, 0\)\) at .*WEIGHTS\[state.step\]"):
        transpile(indexing_step)(model, opt, torch.randn(5, 4), torch.randint(0, 3, (5,)), state)
    assert state.step == 0 and not opt.state
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_an_input_the_caller_made_require_a_gradient_gets_it_accumulated_as_in_eager():
    """A saliency map or an adversarial step: the caller sets
    x.requires_grad_(True) and reads x.grad after the call; the same input
    given again accumulates into its .grad, as backward() does."""
    batches = M.batches("mlp", 3, 8)
    xs = [x.requires_grad_(True) for x, _ in batches]
    xs.append(xs[-1])   # the last one given twice
    twins = {id(x): x.detach().clone().requires_grad_(True) for x in xs}
    model = M.make("mlp")
    reference = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    step = transpile(M.classify_step)
    y = batches[0][1]
    for x in xs:
        theirs = twins[id(x)]
        assert torch.equal(step(model, opts[0], x, y), M.classify_step(reference, opts[1], theirs, y))
        assert torch.equal(x.grad, theirs.grad)
    assert step.traces == 1
