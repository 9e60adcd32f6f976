"""Capture functionalizes the traced step by rewriting its graph
(transpiler/capture/functionalize.py) where that is exact, and by tracing it again
under torch.func.functionalize where it is not. The rewrite must give the
program the re-trace gives; the cases it refuses must fall back and still
train as eager does."""

import pytest
import torch
import torch.nn as nn

from torch.fx.experimental.proxy_tensor import make_fx

from tests import models as M
from transpiler import capture, transpile
from transpiler.capture import functionalize
from transpiler.bench.bench import GPT, TransformerLM, train_step as lm_step
from transpiler.program.roles import ROLE, Role

aten = torch.ops.aten


def _program(model, opt, step_fn, batch, retrace: bool, monkeypatch):
    with monkeypatch.context() as patch:
        if retrace:
            def refuse(graph):
                raise functionalize.Unsupported("test: trace again")
            patch.setattr(functionalize, "rewrite", refuse)
        captured = capture.trace_step(step_fn, capture.flatten_args(
            step_fn, (model, opt, *batch), {}))
    return _structure(captured.program)


def _structure(program):
    """Each node as (op, target, its arguments by position, role, gradient mark,
    type): the listing without the names, which differ in their numbering, and
    without keyword arguments given as None (a re-trace drops the ones that
    equal their default)."""
    index = {n: i for i, n in enumerate(program.graph.nodes)}
    rows = []
    for n in program.graph.nodes:
        kwargs = {k: v for k, v in n.kwargs.items() if v is not None}
        args = torch.fx.node.map_arg((n.args, kwargs), lambda a: f"%{index[a]}")
        val = n.meta.get("val")
        kind = (tuple(val.shape), val.dtype, val.stride()) if isinstance(val, torch.Tensor) \
            else None
        rows.append((n.op, str(n.target) if n.op != "placeholder" else "", str(args),
                     n.meta.get("role"), n.meta.get("param"), kind))
    return [*program.inputs], [*program.outputs], rows


CASES = {
    "mlp_sgd": lambda: (M.make("mlp"), "sgd", M.classify_step, M.batches("mlp", 1, 8)[0]),
    "tied_adamw": lambda: (M.make("tied"), "adamw", M.lm_step, M.batches("tied", 1, 8)[0]),
    "bn_nesterov": lambda: (M.make("bn"), "nesterov", M.classify_step, M.batches("bn", 1, 8)[0]),
    "transformer_adam": lambda: (TransformerLM(layers=1), "adam", lm_step,
                                 (torch.randint(0, 1000, (2, 8)),) * 2),
    "gpt_sgd": lambda: (GPT(layers=1, context=8), "sgd", lm_step,
                        (torch.randint(0, 1000, (2, 8)),) * 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rewrite_gives_the_retraced_program(case, monkeypatch):
    """Node for node, with each node's strides, for SGD with and without Nesterov, Adam,
    AdamW, BatchNorm's statistics, tied and frozen parameters, attention."""
    torch.manual_seed(0)
    model, opt_name, step_fn, batch = CASES[case]()
    opt = M.make_optimizer(opt_name, model)
    rewritten = _program(model, opt, step_fn, batch, False, monkeypatch)
    retraced = _program(model, opt, step_fn, batch, True, monkeypatch)
    assert rewritten == retraced


class WritesThroughAView(nn.Module):
    """Adds 1 to the first column of its activations in place: a write through
    a view, which the rewrite refuses."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc(x) * 2
        h[:, 0].add_(1.0)
        return h


class ReadsAStaleView(nn.Module):
    """Takes a view of a tensor, mutates the tensor, then reads the view: it
    sees the new values, which only a real functionalization tracks."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc(x) * 2
        first = h[:, :2]
        h.mul_(3.0)
        return torch.cat([h, first], dim=1)


@pytest.mark.parametrize("cls", [WritesThroughAView, ReadsAStaleView])
def test_refused_graphs_are_traced_again_and_train_as_eager(cls, monkeypatch):
    graphs = []
    with monkeypatch.context() as patch:
        def plan(graph):
            try:
                return original(graph)
            except functionalize.Unsupported as exc:
                graphs.append(str(exc))
                raise
        original = functionalize._plan
        patch.setattr(functionalize, "_plan", plan)
        states = []
        for transpiled in (True, False):
            torch.manual_seed(0)
            model = cls()
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            step = transpile(M.classify_step) if transpiled else M.classify_step
            for batch in M.batches("mlp", 3, 8):
                step(model, opt, batch[0], batch[1] % 4)
            states.append(M.state_of(model, opt))
    assert len(graphs) == 1, graphs   # refused once, on the first call's trace
    assert ("writes through a view" if cls is WritesThroughAView else "is read after") in graphs[0]
    assert M.max_rel_error(*states) == 0.0


def test_twins():
    assert functionalize._twin(aten.add_.Tensor) is aten.add.Tensor
    assert functionalize._twin(aten._foreach_addcmul_.Scalar) is aten._foreach_addcmul.Scalar
    assert functionalize._twin(aten.copy_.default) is aten.copy.default
    assert functionalize._twin(aten.add.Tensor) is None
    # Changing shapes or strides in place is not a value's update.
    assert functionalize._twin(aten.resize_.default) is None
    assert functionalize._twin(aten.t_.default) is None


def _rewritten(fn, *example):
    gm = make_fx(fn, tracing_mode="fake")(*example)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta[ROLE] = Role.FORWARD
    functionalize.rewrite(gm.graph)
    gm.recompile()
    return gm


def test_an_alias_read_after_two_updates_reads_the_last():
    """d is x itself (detach): read after x is updated twice, it is the second
    update's value; x's final value is written back."""
    def step(x, z):
        x.add_(1.0)
        d = x.detach()
        x.mul_(2.0)
        return d + z

    x, z = torch.randn(4), torch.randn(4)
    gm = _rewritten(step, x.clone(), z)
    assert not any(n.target in (aten.add_.Tensor, aten.mul_.Tensor) for n in gm.graph.nodes)
    writes = [n for n in gm.graph.nodes if n.target is aten.copy_.default]
    assert len(writes) == 1     # x, once, at the end
    ours, theirs = x.clone(), x.clone()
    assert torch.equal(gm(ours, z), step(theirs, z))
    assert torch.equal(ours, theirs)


def test_a_view_read_after_its_base_changes_is_refused():
    def step(x):
        first = x[:2]
        x.mul_(3.0)
        return first + 1

    gm = make_fx(step, tracing_mode="fake")(torch.randn(4))
    before = str(gm.graph)
    with pytest.raises(functionalize.Unsupported, match="is read after"):
        functionalize.rewrite(gm.graph)
    assert str(gm.graph) == before    # untouched


def test_a_view_that_is_the_only_use_of_its_base_is_written_as_a_tensor():
    """autograd's gradient of a Linear weight is t(t(mm)): a later backward()
    accumulates into it in place, and fairseq's multiply_grads scales it
    through p.grad.data. Nothing else reads mm, so the rewrite applies (the
    re-trace lost the gradient's mark: it was not averaged on 2 ranks)."""
    def step(a, b, c):
        g = torch.mm(a, b).t().t()
        g.add_(c)
        g.detach().mul_(0.5)
        return g

    a, b, c = torch.randn(3, 4), torch.randn(4, 5), torch.randn(3, 5)
    gm = _rewritten(step, a, b, c)
    assert not any(n.target in (aten.add_.Tensor, aten.mul_.Tensor) for n in gm.graph.nodes)
    assert torch.equal(gm(a, b, c), step(a, b, c))


def test_a_write_through_a_view_of_a_base_read_elsewhere_is_refused():
    def step(a, b):
        m = torch.mm(a, b)
        g = m.t()
        g.add_(1.0)
        return m.sum()

    gm = make_fx(step, tracing_mode="fake")(torch.randn(3, 4), torch.randn(4, 5))
    with pytest.raises(functionalize.Unsupported, match="writes through a view"):
        functionalize.rewrite(gm.graph)
