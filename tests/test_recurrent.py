"""nn.LSTM and nn.GRU in a transpiled step (capture/recurrent.py). The LSTM:
oneDNN's fused layer on CPU, whose forward returns its workspace only with
grad mode on, whose backward misreads an input that is not contiguous, and
whose two biases share one gradient (program/averaging.py GradientReads). The
GRU: torch's composite, which computes its gates in place on strided views."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import test_zoo, zoo
from transpiler import transpile
from transpiler.errors import TranspileError
from transpiler.program.roles import PARAM, READY

LAYERS = {
    "one layer": dict(),
    "stacked, dropout": dict(num_layers=2, dropout=0.3),
    "bidirectional, batch first": dict(num_layers=2, bidirectional=True, batch_first=True),
    "projections": dict(num_layers=2, proj_size=4),
    "GRU": dict(cell=nn.GRU),
    "GRU stacked, dropout": dict(cell=nn.GRU, num_layers=3, dropout=0.3),
    "GRU bidirectional, batch first, no biases": dict(cell=nn.GRU, num_layers=2, bias=False,
                                                      bidirectional=True, batch_first=True),
}


class Tagger(nn.Module):
    """Embeddings, an LSTM, and a linear head on every step's output and on
    the last layer's final hidden states (so both outputs carry gradients)."""

    def __init__(self, cell=nn.LSTM, **lstm):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.rnn = cell(8, 8, **lstm)
        hidden = lstm.get("proj_size", 8) * (2 if lstm.get("bidirectional") else 1)
        self.head = nn.Linear(hidden, 5)
        self.final = nn.Linear(lstm.get("proj_size", 8), 5)

    def forward(self, tokens):
        out, h = self.rnn(self.embed(tokens))
        h = h[0] if isinstance(h, tuple) else h
        return self.head(out).flatten(0, 1), self.final(torch.cat([h[-2], h[-1]]) if
                                                        self.rnn.bidirectional else h[-1])


def tag_step(model, opt, tokens, tags, labels):
    opt.zero_grad()
    per_token, per_sequence = model(tokens)
    loss = (nn.functional.cross_entropy(per_token, tags.flatten())
            + nn.functional.cross_entropy(per_sequence, labels))
    loss.backward()
    opt.step()
    return loss.detach()


def batches(n: int, seed: int = 0, batch: int = 3):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        tokens = torch.randint(0, 20, (6, batch), generator=g)
        yield tokens, torch.randint(0, 5, (6, batch), generator=g), \
            torch.randint(0, 5, (batch,), generator=g)


def _batch(model, tokens, tags, labels):
    if model.rnn.batch_first:
        tokens, tags = tokens.t().contiguous(), tags.t().contiguous()
    bidirectional = 2 if model.rnn.bidirectional else 1
    return tokens, tags, labels.repeat(bidirectional)


@pytest.mark.parametrize("layer", LAYERS)
def test_a_recurrent_layer_trains_as_in_eager(layer):
    torch.manual_seed(0)
    ours = Tagger(**LAYERS[layer])
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (ours, theirs)]
    step = transpile(tag_step)
    for i, batch in enumerate(batches(3)):
        batch = _batch(ours, *batch)
        torch.manual_seed(i)   # the dropout between the layers
        loss = step(ours, opts[0], *batch)
        torch.manual_seed(i)
        assert torch.equal(loss, tag_step(theirs, opts[1], *batch)), f"call {i}"
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            assert torch.equal(p, q), f"{name} after call {i}"


def autocast_step(model, opt, tokens, tags, labels):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        per_token, per_sequence = model(tokens)
    loss = (nn.functional.cross_entropy(per_token.float(), tags.flatten())
            + nn.functional.cross_entropy(per_sequence.float(), labels))
    loss.backward()
    opt.step()
    return loss.detach()


def test_an_lstm_under_autocast_trains_as_in_eager():
    torch.manual_seed(0)
    ours = Tagger(**LAYERS["stacked, dropout"])
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    step = transpile(autocast_step)
    for i, batch in enumerate(batches(2)):
        torch.manual_seed(i)
        loss = step(ours, opts[0], *batch)
        torch.manual_seed(i)
        assert torch.equal(loss, autocast_step(theirs, opts[1], *batch)), f"call {i}"
        assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters()))


def test_a_gru_under_autocast_is_refused_at_the_users_line():
    # eager casts the composite's matrix products; the program's GRU runs
    # with autocast off
    torch.manual_seed(0)
    model = Tagger(**LAYERS["GRU"])
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TranspileError, match=r"nn.GRU under autocast.* at .*test_recurrent.py"):
        transpile(autocast_step)(model, opt, *next(batches(1)))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.compiles
@pytest.mark.parametrize("layer", ["bidirectional, batch first",
                                   "GRU bidirectional, batch first, no biases"])
def test_a_batch_first_layer_under_inductor_computes_eagers_gradients(layer):
    # the LSTM: inductor laid the transposed embeddings out as they are, and
    # the backward kernel read them as contiguous: weight_ih_l0's gradient was
    # off by 0.02 from the second call (the first runs op by op)
    torch.manual_seed(0)
    ours = Tagger(**LAYERS[layer])
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    step = transpile(tag_step, backend="inductor")
    for i, batch in enumerate(batches(3)):
        batch = _batch(ours, *batch)
        step(ours, opts[0], *batch)
        tag_step(theirs, opts[1], *batch)
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6,
                                       msg=f"{name}'s gradient at call {i}")


class CellDecoder(nn.Module):
    """A GRUCell unrolled over the sequence, its hidden state fed back (the
    translation tutorial's decoder), and a linear head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.cell = nn.GRUCell(8, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, tokens):
        h, out = torch.zeros(tokens.shape[1], 8), []
        for x in self.embed(tokens):
            h = self.cell(x, h)
            out.append(self.head(h))
        return torch.stack(out).flatten(0, 1), self.head(h)


def _ready_order_traced(model, batch) -> list[str]:
    step = transpile(tag_step)
    step(model, torch.optim.SGD(model.parameters(), lr=0.1), *batch)
    return [name for _, name in sorted((node.meta[READY], node.meta[PARAM])
                                        for node in step.program.graph.nodes if READY in node.meta)]


def _ready_order_eager(model, batch) -> list[str]:
    order = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: order.append(name))
    tag_step(model, torch.optim.SGD(model.parameters(), lr=0.1), *batch)
    return order


@pytest.mark.parametrize("layer", [*LAYERS, "GRUCell"])
def test_the_gradients_are_ready_in_the_order_eagers_engine_accumulates_them(layer):
    """DDP's reducer builds its buckets in that order; on three ranks or more a
    bucket's layout decides how each sum is rounded."""
    torch.manual_seed(0)
    model = CellDecoder() if layer == "GRUCell" else Tagger(**LAYERS[layer])
    batch = next(batches(1))
    batch = batch if layer == "GRUCell" else _batch(model, *batch)
    assert _ready_order_traced(copy.deepcopy(model), batch) == _ready_order_eager(model, batch)


def rank_tagger_vs_ddp(mode: str, layer: str) -> dict:
    """The tagger, transpiled and under DDP in the same processes, each rank
    its own batches and dropout draws: the parameters each leaves."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Tagger(**LAYERS[layer])
    reference = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    step, ddp = transpile(tag_step, mode=mode), DDP(reference)
    losses = []
    for i, batch in enumerate(batches(3, seed=rank)):
        torch.manual_seed(10 * i + rank)
        ours = step(model, opts[0], *batch)
        torch.manual_seed(10 * i + rank)
        losses.append(torch.equal(ours, tag_step(ddp, opts[1], *batch)))
    return {"losses": losses,
            "differ": [n for (n, p), q in zip(model.named_parameters(), reference.parameters())
                       if not torch.equal(p, q)]}


@pytest.mark.parametrize("layer", ["stacked, dropout", "GRU stacked, dropout"])
def test_a_recurrent_layer_trains_as_under_ddp_on_3_ranks(layer, ranks3):
    """An LSTM layer's two biases share one gradient, which autograd copies
    for the second: the copy reads the rank's own gradient, as under DDP (a
    bucket holding both could not be built while the copy was made to read
    the bucket's average)."""
    for result in ranks3.run(rank_tagger_vs_ddp, "fuse_all_reduce", layer):
        assert all(result["losses"]) and result["differ"] == []


def rank_bias_grads(mode: str) -> list[str]:
    """The layers whose two biases end the step with different gradients."""
    torch.manual_seed(0)
    model = Tagger(**LAYERS["stacked, dropout"])
    step = transpile(tag_step, mode=mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(dist.get_rank())
    step(model, opt, *next(batches(1, seed=dist.get_rank())))
    return [f"l{k}" for k in range(2) if not torch.equal(
        getattr(model.rnn, f"bias_ih_l{k}").grad, getattr(model.rnn, f"bias_hh_l{k}").grad)]


@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce"])
def test_the_biases_of_an_lstm_layer_keep_one_gradient_on_3_ranks(mode, ranks3):
    # autograd gives the second bias a copy of the first's gradient; a copy
    # of the average, averaged again as the second's own, came out an ulp off
    assert ranks3.run(rank_bias_grads, mode) == [[]] * 3


@pytest.mark.skipif(zoo.T is None, reason="transformers is not installed")
@pytest.mark.parametrize("mode", ["fsdp", "zero"])
def test_the_translation_tutorials_gru_trains_as_under_ddp_in_sharded_modes(mode, ranks2):
    # mode fsdp gives the layer gathered parameters, which require no grad:
    # at::native::gru then computes other bits (1e-6), so the program's
    # layer runs on leaves that require grad where the step's did
    run = zoo.Run(zoo.by_name("seq2seq_gru"), mode, "eager")
    outcome = test_zoo.run_on(ranks2, run, timeout=300)
    assert outcome.verdict == test_zoo.EXACT, outcome.detail
