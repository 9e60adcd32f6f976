"""Model code takes the branch it takes in eager.

transformers checks torch.compiler.is_compiling() in dozens of modeling files,
torch's own modules check is_fx_tracing() and pick foreach paths by a tensor's
type. While the step is traced each of them must answer as in eager (the
optimizers' step alone runs with is_compiling() True, which keeps their step
counters as tensors), or the program computes another path than DDP's.
"""

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from tests import models as M
from transpiler import TranspileError, transpile

transformers_utils = pytest.importorskip("transformers.utils")

CHECKS = {
    "torch.compiler.is_compiling": torch.compiler.is_compiling,
    "torch.compiler.is_dynamo_compiling": torch.compiler.is_dynamo_compiling,
    "torch.compiler.is_exporting": torch.compiler.is_exporting,
    "torch._dynamo.is_compiling": lambda: torch._dynamo.is_compiling(),
    "torch.fx is_fx_tracing": lambda: torch.fx._symbolic_trace.is_fx_tracing(),
    "torch.jit.is_tracing": torch.jit.is_tracing,
    "transformers is_torchdynamo_compiling": transformers_utils.is_torchdynamo_compiling,
}


class Branching(nn.Module):
    """Scales its output by 2 on the compile-only path."""

    def __init__(self, check):
        super().__init__()
        self.check = check
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        y = self.lin(x)
        return y * 2 if self.check() else y


def _step(model, opt, x):
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad])
@pytest.mark.parametrize("check", CHECKS)
def test_model_code_takes_eagers_branch(check, optimizer):
    torch.manual_seed(0)
    ours = Branching(CHECKS[check])
    theirs = copy.deepcopy(ours)
    opts = [optimizer(m.parameters(), lr=0.1) for m in (ours, theirs)]
    step = transpile(_step)
    for i in range(3):
        x = torch.randn(4, 6)
        a, b = step(ours, opts[0], x), _step(theirs, opts[1], x)
        assert torch.equal(a, b), f"call {i}: {check} answered otherwise than in eager"
        for p, q in zip(ours.parameters(), theirs.parameters()):
            assert torch.equal(p, q)
    assert not CHECKS[check](), "left set after the call"


def test_foreach_paths_are_chosen_as_in_eager():
    """clip_grad_norm_ and the optimizers choose a foreach kernel by
    `type(t) in _foreach_supported_types`; a traced tensor is not of type
    Tensor, and is counted as one while the step is traced."""
    from torch.utils._foreach_utils import _foreach_supported_types, _has_foreach_support
    seen = {}

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            seen.setdefault("types", _has_foreach_support([self.lin.weight], torch.device("cuda")))
            return self.lin(x)

    def step(model, opt, x):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    model = Probe()
    transpile(step)(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 3))
    assert seen["types"] is True
    assert not any(issubclass(t, FakeTensor) for t in _foreach_supported_types)


class _Routed(nn.Module):
    """Two habits of MoE code (transformers' Switch Transformers): a router
    that converts its classifier to its dtype in forward (a no-op in eager:
    Module.to returns the module as it is), and experts in a ModuleDict looked
    up by a name formatted from a tensor (f"expert_{idx}" formats the value of
    a 0-d tensor)."""

    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(16, 3)
        self.experts = nn.ModuleDict({f"expert_{i}": nn.Linear(16, 4) for i in range(3)})

    def forward(self, x):
        self.classifier = self.classifier.to(torch.float32)
        best = self.classifier(x).sum(0).argmax()
        return self.experts[f"expert_{best}"](x)


def test_a_noop_conversion_and_a_name_formatted_from_a_tensor_run_as_in_eager():
    step = M.against_eager(M.classify_step, build=_Routed, calls=6)
    assert step.traces >= 2   # another expert chosen: the program of that decision


def _self_distilled_step(model, opt, x, y):
    """A snapshot of the model taken inside the step (a deepcopy), its
    predictions a soft target for the model's own."""
    teacher = copy.deepcopy(model)
    opt.zero_grad()
    with torch.no_grad():
        soft = teacher(x).softmax(-1)
    logits = model(x)
    loss = nn.functional.cross_entropy(logits, y) + nn.functional.kl_div(
        logits.log_softmax(-1), soft, reduction="batchmean")
    loss.backward()
    opt.step()
    return loss.detach()


def test_a_deepcopy_of_the_model_inside_the_step_runs_as_in_eager():
    # torch's deepcopy reads a tensor's data pointer, which a traced one has none of
    M.against_eager(_self_distilled_step)


def _converting_step(model, opt, x, y):
    model.half()
    return M.classify_step(model, opt, x, y)


def test_a_conversion_in_the_step_is_refused_naming_it():
    from transpiler import TranspileError
    model = _Routed()
    before = [p.detach().clone() for p in model.parameters()]
    step = transpile(_converting_step)
    with pytest.raises(TranspileError, match=r"converts _Routed's parameters"):
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), *M.batches("mlp", 1, 8)[0])
    assert all(torch.equal(p, q) and p.dtype == torch.float32
               for p, q in zip(model.parameters(), before))


def _frozen(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.requires_grad_(False)
    return module.eval()


# Frozen teachers in eval mode, called under no_grad inside the step
# (distillation, an EMA teacher): torch takes their fused fast path in eager
# (torch._native_multi_head_attention, _transformer_encoder_layer_fwd), which
# rounds otherwise than the composite path.
TEACHERS = {
    "MultiheadAttention": lambda: nn.MultiheadAttention(16, 4, batch_first=True),
    "TransformerEncoderLayer": lambda: nn.TransformerEncoderLayer(16, 4, 32, batch_first=True),
    "TransformerEncoder": lambda: nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2, enable_nested_tensor=False),
}


@pytest.mark.parametrize("teacher", TEACHERS)
def test_a_frozen_teacher_takes_torchs_fast_path_as_in_eager(teacher):
    torch.manual_seed(0)
    frozen = _frozen(TEACHERS[teacher]())

    def distill(model, opt, x):
        opt.zero_grad()
        with torch.no_grad():
            target = frozen(x, x, x, need_weights=False)[0] \
                if isinstance(frozen, nn.MultiheadAttention) else frozen(x)
        loss = (model(x) - target).square().mean()
        loss.backward()
        opt.step()
        return loss

    ours = nn.Linear(16, 16)
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    step = transpile(distill)
    for i in range(3):
        x = torch.randn(2, 6, 16)
        assert torch.equal(step(ours, opts[0], x), distill(theirs, opts[1], x)), f"call {i}"
        assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters()))
    assert not torch.overrides.has_torch_function((x,)), "left patched after the call"


def _rnn_step(model, opt, x):
    opt.zero_grad()
    out = model(x)
    out = out[0] if isinstance(out, tuple) else out
    out.square().mean().backward()
    opt.step()
    return out.detach()


# torch's recurrent layers: those the program computes as eager does, and
# those it cannot yet (refused at the user's line, nothing written)
RECURRENT = {
    "RNN": (lambda: nn.RNN(8, 20, num_layers=2, batch_first=True), None),
    "RNNCell": (lambda: nn.RNNCell(8, 20), None),
    "LSTMCell": (lambda: nn.LSTMCell(8, 20), None),
    "LSTM": (lambda: nn.LSTM(8, 20, batch_first=True), None),   # more in test_recurrent.py
    "GRU": (lambda: nn.GRU(8, 20, batch_first=True), None),
    "GRUCell": (lambda: nn.GRUCell(8, 20), None),
}


@pytest.mark.parametrize("layer", RECURRENT)
def test_recurrent_layers_equal_eager_or_are_refused(layer):
    build, refused = RECURRENT[layer]
    torch.manual_seed(0)
    ours = build()
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    step = transpile(_rnn_step)
    x = torch.randn(4, 6, 8) if "Cell" not in layer else torch.randn(4, 8)
    if refused:
        with pytest.raises(TranspileError, match=rf"{refused}.* at {re.escape(__file__)}"):
            step(ours, opts[0], x)
        assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters()))
        return
    for i in range(3):
        assert torch.equal(step(ours, opts[0], x), _rnn_step(theirs, opts[1], x)), f"call {i}"
        assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters()))


def _packed_rnn_step(model, opt, x, lengths):
    """The classic NLP habit: the padded batch packed by its lengths."""
    opt.zero_grad()
    packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                               enforce_sorted=False)
    out, _ = model(packed)
    nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0].square().mean().backward()
    opt.step()


def test_a_batch_packed_by_its_lengths_is_refused_at_the_users_line():
    torch.manual_seed(0)
    model = nn.RNN(8, 20, batch_first=True)
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TranspileError, match=rf"pack_padded_sequence sizes .* at "
                                             rf"{re.escape(__file__)}.*pad the batch"):
        transpile(_packed_rnn_step)(model, opt, torch.randn(4, 6, 8), torch.tensor([6, 3, 5, 2]))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class _FrozenBackbone(nn.Module):
    """A backbone in eval mode with frozen BatchNorm statistics (fine-tuning a
    head) before a trained head."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        with torch.no_grad():
            self.backbone(torch.randn(32, 8) * 3 + 1)   # statistics of their own
        self.backbone.eval().requires_grad_(False)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.backbone(x))


class _Tokens(nn.Module):
    """Two token ids per sample from its features (Embedding's input)."""

    def forward(self, x):
        return (x[:, :2].abs() * 7).long().clamp(max=19)


# Layers that change their own weights or buffers in the forward pass
LAYERS = {
    "spectral_norm": lambda: nn.Sequential(
        nn.utils.parametrizations.spectral_norm(nn.Linear(8, 16)), nn.ReLU(), nn.Linear(16, 3)),
    "weight_norm": lambda: nn.Sequential(
        nn.utils.parametrizations.weight_norm(nn.Linear(8, 16)), nn.ReLU(), nn.Linear(16, 3)),
    "embedding_max_norm": lambda: nn.Sequential(
        _Tokens(), nn.Embedding(20, 8, max_norm=1.0), nn.Flatten(), nn.Linear(16, 3)),
    "frozen_batch_norm": _FrozenBackbone,
}


def _classify(model, opt, x, y):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("layer", LAYERS)
def test_layers_that_write_themselves_equal_eager(layer):
    torch.manual_seed(0)
    ours = LAYERS[layer]()
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
            for m in (ours, theirs)]
    step = transpile(_classify)
    for i in range(3):
        x, y = torch.randn(4, 8), torch.randint(3, (4,))
        assert torch.equal(step(ours, opts[0], x, y), _classify(theirs, opts[1], x, y)), f"call {i}"
        assert all(torch.equal(p, q) for p, q in zip(ours.state_dict().values(),
                                                     theirs.state_dict().values())), f"call {i}"


@torch.compile
def _gelu_matmul(a, w):
    return F.gelu(a @ w)


class _CompiledInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.w = nn.Parameter(torch.randn(32, 32) * 0.1)
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        return self.out(_gelu_matmul(F.dropout(torch.relu(self.fc(x)), 0.1), self.w))


def test_a_torch_compiled_model_is_traced_as_the_code_it_compiles():
    """nanoGPT's `model = torch.compile(model)`, with a compiled function in its
    forward: the program computes what the uncompiled model computes (its
    dropout from torch's generator), with no compile of dynamo's own."""
    torch.manual_seed(0)
    model = _CompiledInside()
    reference = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    step = transpile(M.classify_step)
    compiled = torch.compile(model)
    torch._dynamo.reset()
    for i, (x, y) in enumerate(M.batches("mlp", 3, 8)):
        torch.manual_seed(i)
        ours = step(compiled, opts[0], x, y)
        torch.manual_seed(i)
        with torch.compiler.set_stance("force_eager"):
            theirs = M.classify_step(reference, opts[1], x, y)
        assert torch.equal(ours, theirs), i
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert step.traces == 1
    assert torch._dynamo.utils.counters["stats"]["calls_captured"] == 0
