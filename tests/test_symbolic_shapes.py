"""Batches whose shapes vary: after a batch tensor's shape changes, the step is
traced once more with the batch's dimensions as symbols, and that one program
serves every size its guards allow, eager and under inductor."""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import transpile
from transpiler.bench.bench import GPT
from transpiler.capture import shapes
from transpiler.errors import TranspileError

# (batch, length) per call: both change at the second call, then each alone.
SHAPES = [(4, 8), (6, 12), (6, 5), (3, 12), (8, 16), (4, 8), (5, 7)]


def make_lm(seed: int = 0, layers: int = 2):
    torch.manual_seed(seed)
    return GPT(vocab=64, d_model=32, nhead=2, layers=layers, context=16)


def tokens(batch: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (batch, length), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _against_eager(shape_list, backend="eager", optimizer="adamw", **options):
    """The transpiled LM step and the plain one on the same calls: the largest
    difference of the losses and the final state, and the step."""
    model = make_lm()
    reference = copy.deepcopy(model)
    opts = [M.make_optimizer(optimizer, m) for m in (model, reference)]
    step = transpile(M.lm_step, backend=backend, **options)
    worst = 0.0
    for i, (b, t) in enumerate(shape_list):
        x, y = tokens(b, t, seed=i)
        ours, theirs = step(model, opts[0], x, y), M.lm_step(reference, opts[1], x, y)
        worst = max(worst, (ours - theirs).abs().item())
    worst = max(worst, M.max_rel_error(M.state_of(model, opts[0]),
                                       M.state_of(reference, opts[1])))
    return step, worst


def test_one_symbolic_program_after_the_first_change(caplog):
    with caplog.at_level(logging.INFO, logger="transpiler"):
        step, worst = _against_eager(SHAPES)
    assert worst == 0.0
    assert step._cache.builds == 2
    assert "tracing the batch's dimensions as symbols" in caplog.text
    listing = str(step.program)
    # Symbols are named after their input: the same in every process.
    assert "inputs: i64[s" in listing and "input(data 'inputs')" in listing
    assert "sym_size" in listing


def test_declared_dimensions_are_symbolic_from_the_first_call():
    step, worst = _against_eager(SHAPES, dynamic={"inputs": {0, 1}, "targets": {0, 1}})
    assert worst == 0.0 and step._cache.builds == 1
    step, worst = _against_eager(SHAPES, dynamic=True)
    assert worst == 0.0 and step._cache.builds == 1


def test_dynamic_false_traces_once_per_shape():
    step, worst = _against_eager(SHAPES, dynamic=False)
    assert worst == 0.0 and step._cache.builds == len(set(SHAPES))


def halving_step(model, opt, x, y):
    """Pairs of features averaged: the program assumes an even width."""
    opt.zero_grad()
    pairs = x.view(x.shape[0], -1, 2).mean(-1)
    loss = torch.nn.functional.cross_entropy(model(pairs.repeat(1, 2)[:, :16]), y)
    loss.backward()
    opt.step()
    return loss.detach()


def test_a_call_outside_the_guards_traces_again(caplog):
    """Widths 32 and 48 give one symbolic program, whose guards require an
    even width (the view) and a batch of at least 2 (sizes 0 and 1 are traced
    as constants): width 40 runs it; a batch of one traces once more."""
    model = M.make("mlp")
    reference = copy.deepcopy(model)
    opts = [M.make_optimizer("sgd", m) for m in (model, reference)]
    step = transpile(halving_step)
    g = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.INFO, logger="transpiler"):
        for b, width in [(8, 32), (6, 48), (5, 40), (1, 32), (1, 48)]:
            x, y = torch.randn(b, width, generator=g), torch.randint(0, 4, (b,), generator=g)
            assert torch.equal(step(model, opts[0], x, y), halving_step(reference, opts[1], x, y))
    assert M.max_rel_error(M.state_of(model, opts[0]), M.state_of(reference, opts[1])) == 0.0
    assert step._cache.builds == 3
    assert "the batch's shapes (x [1, 32], y [1]) are outside what the program traced for " \
           "(x [s" in caplog.text
    assert "(x [s17, s27], y [s17]) assumes: 2 <= x.size()[0])" in caplog.text


def test_a_failed_symbolic_trace_falls_back_to_one_program_per_shape(monkeypatch, caplog):
    def refuse(*_):
        raise RuntimeError("no symbolic tracing here")
    monkeypatch.setattr("transpiler.capture.trace.symbolic_inputs", refuse)
    with caplog.at_level(logging.WARNING, logger="transpiler"):
        step, worst = _against_eager(SHAPES)
    assert worst == 0.0 and step._cache.builds == len(set(SHAPES))
    assert "traced once per batch shape from now on: no symbolic tracing here" in caplog.text
    assert caplog.text.count("with symbolic batch dimensions failed") == 1


def dict_step(model, opt, batch):
    """A container as the batch, as a tokenizer's output is."""
    return M.lm_step(model, opt, batch["input_ids"], batch["labels"])


def test_a_dict_batch_of_varying_shapes():
    model = make_lm()
    reference = copy.deepcopy(model)
    opts = [M.make_optimizer("adamw", m) for m in (model, reference)]
    step = transpile(dict_step)
    for i, (b, t) in enumerate(SHAPES):
        x, y = tokens(b, t, seed=i)
        batch = {"input_ids": x, "labels": y}
        assert torch.equal(step(model, opts[0], batch), dict_step(reference, opts[1], batch))
    assert M.max_rel_error(M.state_of(model, opts[0]), M.state_of(reference, opts[1])) == 0.0
    assert step.traces == 2


@pytest.mark.parametrize("dynamic, message", [
    ({"tokens": {0}}, "names 'tokens', which is not a batch tensor among the step's "
                      "arguments; those are: inputs, targets"),
    ({"inputs": {2}}, "names dimension 2 of 'inputs', which has 2 dimensions (0 to 1)"),
])
def test_declared_dimensions_are_checked_before_anything_runs(dynamic, message):
    model = make_lm()
    before = M.state_of(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = transpile(M.lm_step, dynamic=dynamic)
    with pytest.raises(TranspileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), *tokens(2, 4, 0))
    assert M.max_rel_error(M.state_of(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                           before) == 0.0


def test_dynamic_must_name_dimensions():
    with pytest.raises(TranspileError, match="dynamic must be None, True, False or a mapping"):
        transpile(M.lm_step, dynamic={"inputs": "0"})


def test_is_symbolic_reads_the_trace_not_the_size():
    assert not shapes.is_symbolic(torch.zeros(3, 4))


@pytest.mark.compiles
def test_symbolic_program_under_inductor():
    # SGD: the attention's key bias has no gradient but rounding noise, which
    # Adam would scale up to full-size steps of different signs.
    step, worst = _against_eager(SHAPES, backend="inductor", optimizer="sgd")
    assert worst < 1e-4
    assert step._cache.builds == 2
    assert step._executor.compile_seconds > 0


def varying_vs_ddp(mode: str):
    """Every call a new (batch, length), and rank 1 a shorter batch than rank
    0 at every call, as a last batch of an epoch would be: transpiled and
    under DDP with its defaults, in the same processes."""
    rank = dist.get_rank()
    model = make_lm()
    reference = copy.deepcopy(model)
    opts = [M.make_optimizer("adamw", m) for m in (model, reference)]
    step, ddp = transpile(M.lm_step, mode=mode), DDP(reference)
    for i, (b, t) in enumerate(SHAPES):
        x, y = tokens(b - rank, t, seed=10 * i + rank)
        ours, theirs = step(model, opts[0], x, y), M.lm_step(ddp, opts[1], x, y)
        assert torch.equal(ours, theirs), (i, ours, theirs)
    with step.unsharded() if mode == "fsdp" else contextlib.nullcontext():
        ours, theirs = M.states_compared(zip((model, reference), opts),
                                         sharded=mode in ("zero", "fsdp"))
    return step._cache.builds, M.max_rel_error(ours, theirs)


@pytest.mark.parametrize("mode", ["fuse_all_reduce", "zero", "fsdp"])
def test_varying_shapes_equal_ddp(mode, ranks2):
    assert ranks2.run(varying_vs_ddp, mode) == [(2, 0.0), (2, 0.0)]


def compiled_once_per_node_for_every_size(cache_dir):
    """dynamic=True under inductor, rank 1 with a shorter batch than rank 0 at
    every call, a view into the global batch at an offset: one program,
    compiled by rank 0 for its symbols and loaded from inductor's cache by
    rank 1, serves every call on both ranks."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    rank = dist.get_rank()
    model = make_lm(layers=1)   # compiled cold: one layer has every kernel kind
    opt = M.make_optimizer("sgd", model)
    step = transpile(M.lm_step, mode="fuse_all_reduce", backend="inductor", dynamic=True)
    counters = torch._dynamo.utils.counters
    before = counters["inductor"].copy()
    with temporary_cache_dir(cache_dir):
        for i, (b, t) in enumerate(SHAPES[:3]):
            # this rank's rows of a global batch: rank 1's a view at an offset
            x, y = tokens(2 * b, t, seed=i)
            step(model, opt, x[rank * b:(rank + 1) * b - rank], y[rank * b:(rank + 1) * b - rank])
    return (step.traces, step.compiles,
            {k: counters["inductor"][k] - before[k] for k in ("fxgraph_cache_hit",
                                                               "fxgraph_cache_miss")})


def test_a_symbolic_program_is_compiled_once_per_node(ranks2, tmp_path):
    assert ranks2.run(compiled_once_per_node_for_every_size, str(tmp_path), timeout=400) == [
        (1, 1, {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 1}),
        (1, 1, {"fxgraph_cache_hit": 1, "fxgraph_cache_miss": 0})]


def first_call_then_decided(change_on: tuple[int, ...]):
    """backend inductor, dynamic=None: the first call runs op by op; at the
    second the ranks in `change_on` bring a new batch size. Trains as DDP
    (within inductor's rounding); returns what each rank compiled and whether
    it built alone."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("transpiler")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)   # setLevel: it clears the logger's cached isEnabledFor
    model = M.make("mlp")
    reference = copy.deepcopy(model)
    opts = [M.make_optimizer("sgd", m) for m in (model, reference)]
    step, ddp = transpile(M.classify_step, mode="fuse_all_reduce", backend="inductor"), \
        DDP(reference)
    compiled = []
    try:
        for i, batch in enumerate(M.batches("mlp", 4, 16)):
            x, y = M.shard(batch, rank, world_size)
            if i >= 1 and rank in change_on:
                x, y = x[:5], y[:5]
            step(model, opts[0], x, y)
            M.classify_step(ddp, opts[1], x, y)
            compiled.append(step.compiles)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    alone = any("running on without an exchange" in line for line in lines)
    return step.traces, compiled, alone, M.max_rel_error(
        M.state_of(model, opts[0]), M.state_of(reference, opts[1]))


@pytest.mark.parametrize("change_on, expected", [
    ((), [(1, [0, 1, 1, 1], False)] * 2),            # compiled together at the 2nd call
    ((0, 1), [(2, [0, 1, 1, 1], False)] * 2),        # only the symbolic program, together
    ((0,), [(2, [0, 1, 1, 1], True), (1, [0, 1, 1, 1], False)]),   # each its own, alone
])
def test_the_first_program_compiles_at_the_second_call(change_on, expected, ranks2):
    results = ranks2.run(first_call_then_decided, change_on, timeout=400)
    assert [r[:3] for r in results] == expected
    assert all(r[3] <= 1e-5 for r in results), results
