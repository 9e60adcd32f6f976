"""transpile(micro_batches="batches"): a loop over a list of micro-batches
traced over two of them and run rolled (capture/micro.py, micro_loop.py),
against torch DDP with no_sync on the same step function, the eager step, and
the unrolled trace it falls back to."""

import contextlib
import logging
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from tests.test_passes import _check_golden
from transpiler import TranspileError, transpile

STEPS = 3
MICRO_ROWS = 4   # rows per micro-batch on a rank


def _sync_last(model, batches, i):
    """DDP reduces only the last micro-batch's backward; the transpiled step
    does so by itself (len() is read only under DDP)."""
    if isinstance(model, DDP) and i < len(batches) - 1:
        return model.no_sync()
    return contextlib.nullcontext()


def accumulate(model, opt, batches):
    for i, (x, y) in enumerate(batches):
        with _sync_last(model, batches, i):
            loss = F.cross_entropy(model(x), y) / 4
            loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def scaled(model, opt, batches, scaler):
    """nanoGPT's loop: GradScaler, unscale, clip, scaler.step, update."""
    for i, (x, y) in enumerate(batches):
        with _sync_last(model, batches, i):
            loss = F.cross_entropy(model(x), y) / 4
            scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return loss.detach(), norm


def mean_over_len(model, opt, batches):
    """len() of the list: the short list would divide by 2."""
    for i, (x, y) in enumerate(batches):
        with _sync_last(model, batches, i):
            (F.cross_entropy(model(x), y) / len(batches)).backward()
    opt.step()
    opt.zero_grad()


def reads_grads(model, opt, batches):
    """Reads the gradients between backward() calls: averaged at each one
    (DDP without no_sync), a collective inside the loop body."""
    norms = []
    for x, y in batches:
        F.cross_entropy(model(x), y).backward()
        norms.append(torch.stack([p.grad.norm() for p in model.parameters()]).sum())
    opt.step()
    opt.zero_grad()
    return torch.stack(norms).sum()


def _batches(k: int, seed: int, rows: int = MICRO_ROWS):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 16, generator=g), torch.randint(0, 4, (rows,), generator=g))
            for _ in range(k)]


def _run(step, model, opt, k: int, seed: int, scaler=None):
    outputs = []
    for s in range(STEPS):
        out = step(model, opt, _batches(k, 100 * seed + s), *([scaler] if scaler else []))
        outputs.append([t.detach().clone() for t in torch.utils._pytree.tree_leaves(out)])
    return outputs


def _scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=1)


def _equal(a: dict, b: dict) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


def rank_vs_ddp(fn_name: str, opt_name: str, ks: tuple[int, ...]):
    """The transpiled step and DDP with no_sync on the same step function and
    micro-batches (rank r loops over ks[r] of them); what differs, by name."""
    rank = dist.get_rank()
    fn = {"accumulate": accumulate, "scaled": scaled, "reads_grads": reads_grads}[fn_name]
    k = ks[rank]
    runs = []
    for make_step in (lambda: transpile(fn, mode="fuse_all_reduce", micro_batches="batches"),
                      lambda: fn):
        # DDP broadcasts the buffers before every forward outside no_sync,
        # the transpiled step once per step: reads_grads, which cannot use
        # no_sync, runs without BatchNorm
        model = M.make("mlp" if fn is reads_grads else "bn", seed=0)
        opt = M.make_optimizer(opt_name, model)
        step = make_step()
        scaler = _scaler() if fn is scaled else None
        net = DDP(model) if step is fn else model
        outputs = _run(step, net, opt, k, rank, scaler)
        state = M.state_of(M.as_next_forward_sees(net) if net is not model else model, opt)
        if scaler:
            state["scale"] = scaler._scale.clone()
        runs.append((state, outputs, step))
    (ours, our_out, step), (theirs, their_out, _) = runs
    differs = _equal(ours, theirs) + [f"output {i}" for i, (a, b) in enumerate(zip(our_out, their_out))
                                      if not all(torch.equal(x, y) for x, y in zip(a, b))]
    return differs, "micro-batch loop" in str(step.program), step._cache.builds


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_rolled_equals_ddp_no_sync_bit_for_bit(opt_name, ranks2):
    for ks in ((1, 1), (2, 2), (7, 7), (3, 5)):
        for differs, rolled, builds in ranks2.run(rank_vs_ddp, "accumulate", opt_name, ks):
            assert differs == [], (ks, differs)
            assert rolled == (min(ks) > 2), ks   # 2 or fewer: traced as they are
            assert builds == 1


def test_scaler_and_clip_equal_ddp_bit_for_bit(ranks2):
    for differs, rolled, _ in ranks2.run(rank_vs_ddp, "scaled", "adamw", (7, 7)):
        assert differs == []
        assert rolled


def test_collective_inside_the_body_falls_back_to_unrolled(ranks2):
    for differs, rolled, _ in ranks2.run(rank_vs_ddp, "reads_grads", "sgd", (3, 3)):
        assert differs == []
        assert not rolled


def _eager_and_ours(fn, ks, micro_batches="batches"):
    """The eager step and the transpiled one over calls with ks[i] micro-batches."""
    results = []
    for step in (fn, transpile(fn, micro_batches=micro_batches)):
        model = M.make("bn", seed=0)
        opt = M.make_optimizer("adamw", model)
        outs = [step(model, opt, _batches(k, i)) for i, k in enumerate(ks)]
        results.append((M.state_of(model, opt), outs, step))
    (eager, eager_out, _), (ours, our_out, step) = results
    assert _equal(ours, eager) == []
    for a, b in zip(our_out, eager_out):
        assert (a is None and b is None) or torch.equal(a, b)
    return step


def test_one_trace_serves_every_k():
    step = _eager_and_ours(accumulate, (7, 40, 3, 7))
    assert step._cache.builds == 1
    assert "micro-batch loop" in str(step.program)


def test_trace_does_not_grow_with_k():
    sizes = [len(_eager_and_ours(accumulate, (k,)).program.graph.nodes) for k in (3, 9)]
    assert sizes[0] == sizes[1]


def draws_before_the_loop(model, opt, batches):
    """A number drawn before the loop and read only after it, dropout in the
    loop: eager draws the number first, then each micro-batch's mask."""
    jitter = torch.rand(())
    for x, y in batches:
        loss = F.cross_entropy(F.dropout(model(x), 0.5), y) / 4
        loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach() + jitter


def test_random_draws_keep_eager_order():
    results = []
    for step in (draws_before_the_loop, transpile(draws_before_the_loop,
                                                   micro_batches="batches")):
        model = M.make("bn", seed=0)
        opt = M.make_optimizer("adamw", model)
        torch.manual_seed(7)
        outs = [step(model, opt, _batches(k, i)) for i, k in enumerate((5, 5, 3))]
        results.append((M.state_of(model, opt), outs, torch.rand(())))
    (eager, eager_out, eager_next), (ours, our_out, our_next) = results
    assert _equal(ours, eager) == []
    assert all(torch.equal(a, b) for a, b in zip(our_out, eager_out))
    assert torch.equal(our_next, eager_next)   # the generator left where eager leaves it
    assert "micro-batch loop" in str(step.program)


def test_len_of_the_list_falls_back_to_unrolled(caplog):
    with caplog.at_level(logging.INFO, logger="transpiler"):
        step = _eager_and_ours(mean_over_len, (3, 5))
    assert "traced unrolled" in caplog.text and "len()" in caplog.text
    assert "micro-batch loop" not in str(step.program)
    assert step._cache.builds == 2   # one per k (the cut trace, refused, builds nothing)


@pytest.mark.parametrize("batches, message", [
    ("not a list", "must be a non-empty list or tuple"),
    ([(torch.randn(4, 16), torch.zeros(4, dtype=torch.long)),
      (torch.randn(3, 16), torch.zeros(3, dtype=torch.long))], "micro-batch 1 differs"),
    ([(torch.randn(4, 16), 3)], "holds a int"),
])
def test_bad_list_refused_untouched(batches, message):
    model = M.make("bn", seed=0)
    opt = M.make_optimizer("adamw", model)
    before = M.state_of(model, opt)
    with pytest.raises(TranspileError, match=message):
        transpile(accumulate, micro_batches="batches")(model, opt, batches)
    assert _equal(before, M.state_of(model, opt)) == [] and not opt.state


def test_unknown_argument_refused():
    model = M.make("bn", seed=0)
    opt = M.make_optimizer("sgd", model)
    with pytest.raises(TranspileError, match="names no argument.*model, opt, batches"):
        transpile(accumulate, micro_batches="micro")(model, opt, _batches(3, 0))


def test_golden_rolled_listing():
    torch.manual_seed(0)
    model = M.MLP([4, 3])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = transpile(accumulate, micro_batches="batches")
    step(model, opt, [(torch.randn(2, 4), torch.tensor([0, 2])) for _ in range(3)])
    _check_golden("micro_batches_rolled", str(step.program))
    assert pathlib.Path(__file__).parent.joinpath("golden", "micro_batches_rolled.txt").exists()
