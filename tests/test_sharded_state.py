"""Sharded state never passes for full state: under mode zero
optimizer.state_dict() refuses while the optimizer holds shards, and in every
mode a state_dict holding shards (of any world size) is refused at load, with
the optimizer left as it was; full state dicts keep loading and resuming."""

import gc
import weakref

import pytest
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from tests.test_zero import TINY_BUCKETS
from transpiler import TranspileError, transpile
from transpiler.lowering.shards import shard_of


def _as_shards(full: dict, rank: int, world_size: int) -> dict:
    """What rank's optimizer.state_dict() returned under mode zero before it
    was refused: each entry with dimensions cut to the rank's shard."""
    return {"state": {i: {k: shard_of(v, rank, world_size) if v.dim() else v.clone()
                          for k, v in entries.items()} for i, entries in full["state"].items()},
            "param_groups": full["param_groups"]}


def _snapshot(opt) -> list:
    """The optimizer's state entries (the tensors themselves and copies) and groups."""
    return [(p, k, v, v.clone()) for p, entries in opt.state.items() for k, v in entries.items()], \
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _unchanged(opt, snapshot) -> bool:
    entries, groups = snapshot
    now = [(p, k, v) for p, st in opt.state.items() for k, v in st.items()]
    return (len(now) == len(entries)
            and all(opt.state[p][k] is v and v.equal(copy) for p, k, v, copy in entries)
            and groups == [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])


def _error(fn, *args) -> str | None:
    try:
        fn(*args)
    except TranspileError as exc:
        return str(exc)
    return None


# ------------------------------------------------------------------ state_dict under zero

def rank_state_dict_under_zero():
    """Two steps in mode zero against DDP with SGD (exact on 2 ranks):
    state_dict() refuses; the full state equals DDP's optimizer's and loads
    into a single-process optimizer exactly; loaded back, the state is full
    and state_dict() works until the next step shards it."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, ref = M.make("mlp"), M.make("mlp")
    opt, ref_opt = M.make_optimizer("sgd", model), M.make_optimizer("sgd", ref)
    ddp = DDP(ref, broadcast_buffers=False)
    step = transpile(M.classify_step, mode="zero", **TINY_BUCKETS)
    batches = [M.shard(b, rank, world_size) for b in M.batches("mlp", 3, 12)]
    for b in batches[:2]:
        step(model, opt, *b)
        M.classify_step(ddp, ref_opt, *b)
    before = _snapshot(opt)
    refused = _error(opt.state_dict)
    untouched = _unchanged(opt, before)
    full = step.full_optimizer_state_dict(opt)
    single = M.make_optimizer("sgd", M.make("mlp"))
    single.load_state_dict(full)
    exact = all(single.state_dict()["state"][i][k].equal(v)
                for i, entries in ref_opt.state_dict()["state"].items() for k, v in entries.items())
    opt.load_state_dict(full)                 # full again: state_dict as usual
    reloaded = opt.state_dict()["state"]
    full_again = all(reloaded[i][k].equal(v) for i, e in full["state"].items() for k, v in e.items())
    step(model, opt, *batches[2])             # sharded again
    return refused, untouched, exact, full_again, _error(opt.state_dict)


def test_state_dict_under_zero_refuses_and_the_full_state_is_exact(ranks2):
    for refused, untouched, exact, full_again, refused_again in ranks2.run(rank_state_dict_under_zero):
        assert refused is not None and untouched
        for says in ("SGD.state_dict() would return this rank's shards",
                     "'momentum_buffer' of parameter 0 (shape (32, 16), 512 elements) is a flat "
                     "tensor of 256 elements", "on 2 ranks", "step.full_optimizer_state_dict(optimizer)",
                     "every rank", "torch.distributed.checkpoint", "sharded_optimizer_state_dict"):
            assert says in refused, (says, refused)
        assert exact and full_again
        assert refused_again is not None and "shards" in refused_again


# ------------------------------------------------------------------ loads refused

def _zero_shards(world_size: int) -> dict:
    """This rank's share of a 2-step mode zero state on `world_size` ranks, as
    state_dict() returned it: each rank cuts the same full state."""
    model = M.make("mlp")
    opt = M.make_optimizer("adamw", model)
    step = transpile(M.classify_step)   # a full state, cut as zero on world_size ranks would
    for b in M.batches("mlp", 2, 12):
        step(model, opt, *M.shard(b, dist.get_rank(), dist.get_world_size()))
    return _as_shards(step.full_optimizer_state_dict(opt), dist.get_rank() % world_size, world_size)


def rank_load_refused(mode: str, saved_on: int, first_call: bool):
    """A mode zero shard saved on `saved_on` ranks loaded into an optimizer
    of a step in `mode`: after the step's first call (refused at load), or
    before it (refused at the call, before the trace)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shards = _zero_shards(saved_on)
    model = M.make("mlp")
    opt = M.make_optimizer("adamw", model)
    # grad_allreduce has no buckets of gradients: it takes only bucket_mb
    buckets = {"bucket_mb": TINY_BUCKETS["bucket_mb"]} if mode == "grad_allreduce" else TINY_BUCKETS
    step = transpile(M.classify_step, mode=mode, **buckets)
    batches = [M.shard(b, rank, world_size) for b in M.batches("mlp", 2, 12)]
    if first_call:
        step(model, opt, *batches[0])
        before, params = _snapshot(opt), [p.detach().clone() for p in model.parameters()]
        load_error, call_error = _error(opt.load_state_dict, shards), None
    else:   # no transpiled step has seen the optimizer: its load is torch's own
        load_error = _error(opt.load_state_dict, shards)
        before, params = _snapshot(opt), [p.detach().clone() for p in model.parameters()]
        call_error = _error(step, model, opt, *batches[1])
    untouched = _unchanged(opt, before) and all(
        p.equal(q) for p, q in zip(model.parameters(), params))
    return load_error, call_error, untouched


@pytest.mark.parametrize("mode", ["zero", "fuse_all_reduce", "grad_allreduce"])
@pytest.mark.parametrize("saved_on", [2, 3])
def test_a_shard_is_refused_at_load_in_every_mode(mode, saved_on, ranks2):
    for load_error, _, untouched in ranks2.run(rank_load_refused, mode, saved_on, True):
        assert load_error is not None and untouched
        for says in ("AdamW.load_state_dict() refused, the optimizer's state is unchanged",
                     f"is a flat tensor of {-(-512 // saved_on)} elements",
                     f"one rank's shard of mode zero's state on {saved_on} ranks",
                     "this run has 2 ranks", "step.full_optimizer_state_dict(optimizer)"):
            assert says in load_error, (says, load_error)


@pytest.mark.parametrize("mode", ["zero", "fuse_all_reduce"])
def test_a_shard_loaded_before_the_first_call_is_refused_before_anything_runs(mode, ranks2):
    for load_error, call_error, untouched in ranks2.run(rank_load_refused, mode, 2, False):
        assert load_error is None
        assert call_error is not None and untouched
        assert "AdamW holds state that does not fit its parameters" in call_error
        assert "one rank's shard of mode zero's state on 2 ranks" in call_error


# ------------------------------------------------------------------ the step dropped

def rank_step_dropped():
    """The refusal goes with the optimizer: after the step in mode zero is
    dropped, state_dict() still refuses; a step in another mode refuses the
    shards at its first call; a new step in mode zero takes them over."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = M.make("mlp")
    opt = M.make_optimizer("adamw", model)
    step = transpile(M.classify_step, mode="zero", **TINY_BUCKETS)
    batches = [M.shard(b, rank, world_size) for b in M.batches("mlp", 3, 12)]
    for b in batches[:2]:
        step(model, opt, *b)
    full = step.full_optimizer_state_dict(opt)
    dropped = weakref.ref(step)
    del step
    gc.collect()
    refused = _error(opt.state_dict)
    before = _snapshot(opt)
    other_mode = _error(transpile(M.classify_step, mode="fuse_all_reduce"), model, opt, *batches[2])
    untouched = _unchanged(opt, before)
    again = transpile(M.classify_step, mode="zero", **TINY_BUCKETS)
    taken_over = again.full_optimizer_state_dict(opt)
    same = all(taken_over["state"][i][k].equal(v) for i, e in full["state"].items()
               for k, v in e.items())
    return dropped() is None, refused, other_mode, untouched, same


def test_the_refusal_outlives_the_step_and_zero_takes_the_shards_over(ranks2):
    for freed, refused, other_mode, untouched, same in ranks2.run(rank_step_dropped):
        assert freed   # the optimizer's hooks do not keep the step alive
        assert refused is not None and "would return this rank's shards" in refused
        assert other_mode is not None and "left by a step in mode zero" in other_mode
        assert untouched and same


# ------------------------------------------------------------------ one process

def test_full_state_loads_and_state_dict_works_outside_zero():
    """A hooked optimizer of a step in the default mode: its full state_dict
    is torch's and reloads; a flattened entry is refused at load."""
    model = M.make("mlp")
    opt = M.make_optimizer("adamw", model)
    step = transpile(M.classify_step)
    for b in M.batches("mlp", 2, 8):
        step(model, opt, *b)
    full = opt.state_dict()
    assert full["state"][0]["exp_avg"].shape == (32, 16)
    opt.load_state_dict(full)
    before = _snapshot(opt)
    message = _error(opt.load_state_dict, _as_shards(full, 0, 2))
    assert message is not None and "shard of mode zero's state on 2 ranks" in message
    assert "this run has 1 rank)" in message
    assert _unchanged(opt, before)
