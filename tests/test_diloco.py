"""mode="diloco" against torchft's DiLoCo (torchft/local_sgd.py), the
reference implementation of DiLoCo and Streaming DiLoCo, on the same gloo ranks
with the same model, data and seeds. torchft's classes are driven directly:
its Manager is stood in for by `_Manager`, which does what DiLoCo asks of it
on the test's own process group (its allreduce sums and divides by the
number of ranks, as Manager.allreduce does; every commit succeeds, as in a
run without failures). torchft's fault tolerance (quorums, the lighthouse,
recovery of a joining replica) is outside what is compared."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from transpiler import DiLoCo, TranspileError, transpile
from transpiler.program.program import Held, OutputKind

local_sgd = pytest.importorskip("torchft.local_sgd", reason="torchft is not installed")
from torchft.work import _DummyWork  # noqa: E402

STEPS = 12


class _Manager:
    """What torchft's DiLoCo asks of its Manager, on the default process group."""

    _use_async_quorum = False

    def __init__(self, wire: torch.dtype | None = None):
        self.step, self.wire = 0, wire

    def allreduce(self, tensor, should_quantize=False):
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            sent = tensor if self.wire is None else tensor.to(self.wire)
            dist.all_reduce(sent)
            tensor.copy_(sent)
        tensor /= world
        return _DummyWork(tensor)

    def should_commit(self) -> bool:
        self.step += 1
        return True

    def current_step(self) -> int:
        return self.step

    def start_quorum(self):
        pass

    def allow_state_dict_read(self):
        pass

    def disallow_state_dict_read(self):
        pass

    def register_state_dict_fn(self, key, load_fn, save_fn):
        pass


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),
                         nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


# mode diloco's fragments of _model() (whole layers, about equal bytes):
# 2 fragments: the first three layers (1,792 bytes), the last (272 bytes)
FRAGMENTS = {1: [[0, 1, 3, 5]], 2: [[0, 1, 3], [5]]}


def _batches(rank: int, steps: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(steps)]


def _optimizers(model, inner: str, fragments: int, outer_list: bool):
    inner_opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if inner == "sgd" \
        else torch.optim.AdamW(model.parameters(), lr=1e-2)

    def outer(params):
        return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
    if outer_list:
        return inner_opt, [outer([p for i in layers for p in model[i].parameters()])
                           for layers in FRAGMENTS[fragments]]
    return inner_opt, outer(model.parameters())


def _step(model, opt):
    def train_step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss
    return train_step


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(inner="sgd", sync_every=4, fragments=1, delay=0, alpha=0.0, outer_list=False,
         wire=None, steps=STEPS, backend="eager"):
    """(ours, torchft's): the losses and the model's state after `steps` steps."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    results = []
    for ours in (True, False):
        model = _model()
        inner_opt, outer_opt = _optimizers(model, inner, fragments, outer_list)
        step = _step(model, inner_opt)
        if ours:
            step = transpile(step, mode=DiLoCo(
                outer_optimizer=outer_opt, sync_every=sync_every, fragments=fragments,
                fragment_sync_delay=delay, fragment_update_alpha=alpha, fuse_dtype=wire),
                backend=backend)
            losses = [step(x, y) for x, y in _batches(rank, steps)]
        else:
            parts = [nn.ModuleList([model[i] for i in layers]) for layers in FRAGMENTS[fragments]]
            with local_sgd.DiLoCo(_Manager(wire), parts, inner_opt, outer_opt, sync_every,
                                  fragment_sync_delay=delay, fragment_update_alpha=alpha):
                losses = [step(x, y) for x, y in _batches(rank, steps)]
        results.append((torch.stack(losses), _state(model)))
    return results


def _assert_equal(results):
    (our_losses, ours), (their_losses, theirs) = results
    assert torch.equal(our_losses, their_losses), (our_losses, their_losses)
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), \
            (name, (ours[name] - theirs[name]).abs().max().item())


def _assert_close(results, tolerance=1e-6):
    (our_losses, ours), (their_losses, theirs) = results
    assert torch.allclose(our_losses, their_losses, rtol=tolerance, atol=0)
    for name in theirs:
        assert torch.allclose(ours[name].double(), theirs[name].double(), rtol=0,
                              atol=tolerance), name


# ------------------------------------------------------------------ one process

@pytest.mark.parametrize("inner", ["sgd", "adamw"])
def test_one_process_equals_torchft(inner):
    _assert_equal(_run(inner))


def test_one_process_streaming_equals_torchft():
    _assert_equal(_run("adamw", fragments=2, delay=1, alpha=0.5, outer_list=True))


def test_one_outer_optimizer_steps_only_the_synced_fragment():
    """One outer optimizer over every fragment trains as one per fragment:
    its step sees a .grad on the synced fragment's parameters alone. (torchft's
    DiLoCo given one outer optimizer also steps the other fragments with the
    gradients their inner step left; the comparisons give it one per fragment.)"""
    options = dict(sync_every=4, fragments=2, fragment_sync_delay=1)
    states = []
    for outer_list in (False, True):
        model = _model()
        inner_opt, outer_opt = _optimizers(model, "adamw", 2, outer_list)
        step = _diloco_step(model, inner_opt, outer_opt, **options)
        for x, y in _batches(0, 9):
            step(x, y)
        states.append((torch.zeros(1), _state(model)))
    _assert_equal(states)


def _diloco_step(model, inner_opt, outer_opt, **options):
    return transpile(_step(model, inner_opt), mode=DiLoCo(outer_optimizer=outer_opt, **options))


def test_the_programs_average_one_fragment_each():
    model = _model()
    inner_opt, outer_opt = _optimizers(model, "sgd", 2, outer_list=False)
    step = _diloco_step(model, inner_opt, outer_opt, sync_every=4, fragments=2)
    x, y = _batches(0, 1)[0]
    step(x, y)
    averaged = {name: [spec.target.split(":", 1)[1] for spec in step.programs[name].outputs
                       if spec.kind is OutputKind.HELD and spec.held is Held.PSEUDO_GRAD]
                for name in ("local", "sync0", "sync1")}
    names = [n for n, _ in model.named_parameters()]
    assert averaged == {"local": [], "sync0": names[:6], "sync1": names[6:]}


def _resumed_while_pending(steps_before: int = 5, steps_after: int = 5) -> None:
    """A checkpoint taken between a fragment's average and its outer step
    (fragment_sync_delay: on several ranks while its sums are in flight) holds
    the averaged pseudo-gradients: the resumed run is the uninterrupted one,
    bit for bit."""
    options = dict(sync_every=4, fragments=2, fragment_sync_delay=1)
    rank = dist.get_rank() if dist.is_initialized() else 0
    batches = _batches(rank, steps_before + steps_after)

    def start():
        model = _model()
        inner_opt, outer_opt = _optimizers(model, "adamw", 2, outer_list=False)
        return model, inner_opt, outer_opt, _diloco_step(model, inner_opt, outer_opt, **options)

    model, inner_opt, outer_opt, step = start()
    for x, y in batches[:steps_before]:
        step(x, y)
    saved = copy.deepcopy({"model": model.state_dict(), "inner": inner_opt.state_dict(),
                           "outer": outer_opt.state_dict(), "step": step.state_dict()})
    assert step.schedule.pending or any(k.startswith("in_flight") for k in saved["step"]["held"]), \
        "the checkpoint is to be taken with an average pending"
    for x, y in batches[steps_before:]:
        step(x, y)
    model2, inner2, outer2, step2 = start()
    model2.load_state_dict(saved["model"])
    inner2.load_state_dict(saved["inner"])
    outer2.load_state_dict(saved["outer"])
    step2.load_state_dict(saved["step"])
    for x, y in batches[steps_before:]:
        step2(x, y)
    _assert_equal([(torch.zeros(1), _state(model2)), (torch.zeros(1), _state(model))])


def test_resumed_mid_period_continues_exactly():
    _resumed_while_pending()


@pytest.mark.parametrize("options, message", [
    (dict(outer_optimizer=None), "mode diloco needs outer_optimizer="),
    (dict(outer_optimizer="sgd"), "mode diloco needs outer_optimizer="),
    (dict(sync_every=6, fragments=4), "must be a multiple of fragments=4"),
    (dict(sync_every=4, fragments=2, fragment_sync_delay=2), "must be less than sync_every"),
    (dict(fragment_update_alpha=1.5), r"must be a number in \[0, 1\]"),
])
def test_bad_options_are_refused(options, message):
    outer = torch.optim.SGD(_model().parameters(), lr=0.7)
    with pytest.raises(TranspileError, match=message):
        DiLoCo(**{"outer_optimizer": outer, **options})


@pytest.mark.parametrize("outer, message", [
    (lambda model: torch.optim.SGD(list(model.parameters())[:-1], lr=0.7),
     "holds no parameter '5.bias', which the step updates"),
    (lambda model: torch.optim.SGD([*model.parameters(), nn.Parameter(torch.ones(2))], lr=0.7),
     "holds 1 tensor"),
])
def test_an_outer_optimizer_over_other_tensors_is_refused_before_anything_runs(outer, message):
    model = _model()
    inner_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _state(model)
    step = _diloco_step(model, inner_opt, outer(model), sync_every=2)
    with pytest.raises(TranspileError, match=message):
        step(*_batches(0, 1)[0])
    _assert_equal([(torch.zeros(1), _state(model)), (torch.zeros(1), before)])


def test_more_fragments_than_layers_are_refused():
    model = _model()
    inner_opt, outer_opt = _optimizers(model, "sgd", 1, outer_list=False)
    step = _diloco_step(model, inner_opt, outer_opt, sync_every=5, fragments=5)
    with pytest.raises(TranspileError, match="4 layer"):
        step(*_batches(0, 1)[0])


@pytest.mark.parametrize("options, message", [
    (dict(check_every=5), "check_every follows DDP's semantics"),
    (dict(skip_nonfinite=True), "skip_nonfinite follows DDP's semantics"),
    (dict(backend="cudagraphs"), "a CUDA graph's replay does not carry"),
])
def test_options_it_does_not_combine_with_are_refused(options, message):
    model = _model()
    inner_opt, outer_opt = _optimizers(model, "sgd", 2, outer_list=False)
    mode = DiLoCo(outer_optimizer=outer_opt, sync_every=4, fragments=2, fragment_sync_delay=1)
    with pytest.raises(TranspileError, match=message):
        transpile(_step(model, inner_opt), mode=mode, **options)


# -------------------------------------------------------------------- two ranks

def _compared(config):
    """Bit for bit; under inductor (whose kernels round otherwise) within 1e-6."""
    results = _run(**config)
    if config.get("backend", "eager") == "eager":
        _assert_equal(results)
    else:
        _assert_close(results)
    return results[0][1]


@pytest.mark.parametrize("config", [
    dict(inner="sgd"),
    dict(inner="adamw"),
    dict(inner="adamw", fragments=2, outer_list=True),
    dict(inner="sgd", fragments=2, delay=1, alpha=0.5, outer_list=True),
    dict(inner="adamw", fragments=2, delay=1, wire=torch.bfloat16, outer_list=True),
    dict(inner="sgd", fragments=2, delay=1, alpha=0.5, outer_list=True, backend="inductor"),
], ids=["diloco-sgd", "diloco-adamw", "streaming", "streaming-delay-alpha", "streaming-bf16",
        "streaming-delay-inductor"])
def test_equals_torchft_on_two_ranks(config, ranks2):
    states = ranks2.run(_compared, config)
    # the ranks' parameters agree after an outer step of every fragment, their buffers
    # (BatchNorm's statistics, never averaged) do not
    ours = states[0]
    assert not torch.equal(ours["1.running_mean"], states[1]["1.running_mean"])


@pytest.mark.compiles
def test_inductor_within_rounding_of_torchft():
    """Under inductor the step's kernels round differently: SGD inner steps
    (AdamW makes a step of lr of the rounding noise in the gradient of the
    bias before the BatchNorm) stay within 1e-6 of torchft's."""
    _assert_close(_run("sgd", fragments=2, delay=1, alpha=0.5, outer_list=True, steps=9,
                       backend="inductor"))



def test_resumed_with_sums_in_flight_continues_exactly(ranks2):
    ranks2.run(_resumed_while_pending)
