"""Checkpoints of mode fsdp: the sharded model and optimizer state through
torch.distributed.checkpoint (each rank writes its shards), resumed bit for
bit on the same world size, before or after the step's first call, and
resharded onto another; the full state dict for a single-process model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests import models as M
from tests.test_fsdp import TINY_BUCKETS
from transpiler import TranspileError, transpile

STEPS, SAVED_AT = 4, 2


def _batches(model_name: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    return [M.shard(b, rank, world) for b in M.batches(model_name, STEPS, 12)]


def _fresh(model_name: str, opt_name: str):
    """A model (another seed), its optimizer (another learning rate: the
    checkpoint's param_groups replace it) and a step in mode fsdp."""
    model = M.make(model_name, seed=5)
    opt = M.make_optimizer(opt_name, model)
    opt.param_groups[0]["lr"] *= 3
    return model, opt, transpile(M.step_fn(model_name), mode="fsdp", **TINY_BUCKETS)


def _full_state(step, model, opt) -> dict[str, torch.Tensor]:
    """Parameters, buffers and optimizer state, full, by name (a collective)."""
    with step.unsharded():
        out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in opt.param_groups for p in g["params"]]
    for index, entries in step.full_optimizer_state_dict(opt)["state"].items():
        for key, value in entries.items():
            out[f"opt.{names[id(params[index])]}.{key}"] = value.clone()   # not the live step
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _differ(a: dict, b: dict) -> list[str]:
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not torch.equal(a[k], b[k])]


def _storage(model) -> int:
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


# ------------------------------------------------------------------ save

def rank_save(path: str, model_name: str, opt_name: str):
    """Two steps, a sharded checkpoint by DCP (each rank its shards) and the
    full state dicts on rank 0 (model.state_dict() inside step.unsharded()),
    then two more steps: the run the resumed ones must equal."""
    model = M.make(model_name)
    opt = M.make_optimizer(opt_name, model)
    step = transpile(M.step_fn(model_name), mode="fsdp", **TINY_BUCKETS)
    batches = _batches(model_name)
    for b in batches[:SAVED_AT]:
        step(model, opt, *b)
    between = _storage(model)
    dcp.save({"model": step.sharded_model_state_dict(model),
              "optim": step.sharded_optimizer_state_dict(opt)}, checkpoint_id=f"{path}/dcp")
    full_optim = step.full_optimizer_state_dict(opt)        # every rank: a collective
    with step.unsharded():                                  # every rank: it gathers
        if dist.get_rank() == 0:
            torch.save({"model": model.state_dict(), "optim": full_optim}, f"{path}/full.pt")
    saved = _full_state(step, model, opt)
    kept_released = _storage(model) == between
    for b in batches[SAVED_AT:]:
        step(model, opt, *b)
    return saved, _full_state(step, model, opt), kept_released


# ------------------------------------------------------------------ resume

def _load_dcp(path: str, step, model, opt) -> None:
    state = {"model": step.sharded_model_state_dict(model),
             "optim": step.sharded_optimizer_state_dict(opt)}
    dcp.load(state, checkpoint_id=f"{path}/dcp")
    step.load_sharded_model_state_dict(model, state["model"])
    step.load_sharded_optimizer_state_dict(opt, state["optim"])


def rank_resume(path: str, model_name: str, opt_name: str):
    """A fresh model, optimizer and step load the checkpoint and take the
    last steps: loaded before the step's first call (no shards yet), after a
    first call (into its shards), and (reference) from the full state dicts."""
    batches = _batches(model_name)
    out = {}
    for how in ("before_first_call", "after_a_call", "full_state_dict"):
        model, opt, step = _fresh(model_name, opt_name)
        if how == "after_a_call":
            step(model, opt, *batches[-1])
        if how == "full_state_dict":
            full = torch.load(f"{path}/full.pt")
            model.load_state_dict(full["model"])
            opt.load_state_dict(full["optim"])
        else:
            _load_dcp(path, step, model, opt)
        loaded = _full_state(step, model, opt)
        for b in batches[SAVED_AT:]:
            step(model, opt, *b)
        out[how] = loaded, _full_state(step, model, opt)
    return out


@pytest.mark.parametrize("model_name, opt_name", [("tied", "adamw"), ("bn", "sgd")])
def test_dcp_resume_equals_an_unbroken_run_bit_for_bit(model_name, opt_name, tmp_path, ranks2):
    """Tied, frozen and unused parameters (tied: AdamW), BatchNorm buffers (SGD)."""
    saves = ranks2.run(rank_save, str(tmp_path), model_name, opt_name)
    assert all(kept_released for _, _, kept_released in saves)   # saving gathers nothing
    assert any(f.name.endswith(".distcp") for f in (tmp_path / "dcp").iterdir())
    # The buffers (BatchNorm's statistics) are rank 0's, as under DDP, which
    # broadcasts them from rank 0 before each forward pass.
    buffers = {f"model.{name}" for name, _ in M.make(model_name).named_buffers()}
    for (saved, unbroken, _), resumed in zip(saves, ranks2.run(rank_resume, str(tmp_path),
                                                               model_name, opt_name)):
        saved = {k: saves[0][0][k] if k in buffers else v for k, v in saved.items()}
        for how, (loaded, final) in resumed.items():
            assert _equal(loaded, saved), (how, _differ(loaded, saved))
            assert _equal(final, unbroken), (how, _differ(final, unbroken))


def rank_dcp_vs_full_state(path: str):
    """On this world size: the two ranks' checkpoint loaded through DCP
    (resharded), and its full state dicts, each then trained."""
    out = rank_resume(path, "tied", "adamw")
    return {how: out[how] for how in ("before_first_call", "after_a_call")}, out["full_state_dict"]


def test_a_checkpoint_of_two_ranks_resumes_on_three(tmp_path, ranks2, ranks3):
    """DCP reshards: the state loaded on 3 ranks is the one saved on 2, and
    training on equals resuming from the full state dicts on 3 ranks, bit for
    bit (3 divides none of the sizes: the shards are padded)."""
    saved = ranks2.run(rank_save, str(tmp_path), "tied", "adamw")[0][0]
    for resumed, (full_loaded, full_final) in ranks3.run(rank_dcp_vs_full_state, str(tmp_path)):
        assert _equal(full_loaded, saved)
        for how, (loaded, final) in resumed.items():
            assert _equal(loaded, saved), (how, _differ(loaded, saved))
            assert _equal(final, full_final), how


def test_the_full_state_dict_loads_into_a_single_process_model(tmp_path, ranks2):
    saved = ranks2.run(rank_save, str(tmp_path), "tied", "adamw")[0][0]
    full = torch.load(tmp_path / "full.pt")
    model = M.make("tied", seed=5)
    model.load_state_dict(full["model"])
    opt = M.make_optimizer("adamw", model)
    opt.load_state_dict(full["optim"])
    assert all(torch.equal(v, saved[f"model.{k}"]) for k, v in model.state_dict().items())
    names = {id(p): n for n, p in model.named_parameters()}
    state = {f"opt.{names[id(p)]}.{k}": v for p, st in opt.state.items() for k, v in st.items()}
    assert state and all(torch.equal(v, saved[k]) for k, v in state.items())
    assert set(state) == {k for k in saved if k.startswith("opt.")}


# ------------------------------------------------------------------ refused

def rank_load_refused(path: str, which: str):
    """A state that does not fit the model, loaded after a call: refused on
    every rank before anything is gathered or written."""
    model, opt, step = _fresh("tied", "adamw")
    step(model, opt, *_batches("tied")[0])
    state = step.sharded_model_state_dict(model)
    if which == "missing":
        del state["hidden.bias"]
    else:   # a full state dict where the sharded one belongs
        with step.unsharded():
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    before = _full_state(step, model, opt)
    held = {k: v.clone() for k, v in step._held.tensors.items()}
    try:
        step.load_sharded_model_state_dict(model, state)
        error = None
    except TranspileError as exc:
        error = str(exc)
    untouched = _equal(_full_state(step, model, opt), before) and _equal(step._held.tensors, held)
    return error, untouched


@pytest.mark.parametrize("which, says", [
    ("missing", "missing ['hidden.bias']"),
    ("full", "of another layout ['unused', 'frozen', 'embed.weight', 'hidden.weight', "
             "'hidden.bias', 'out.weight']")])
def test_a_state_that_does_not_fit_is_refused_untouched(which, says, tmp_path, ranks2):
    for error, untouched in ranks2.run(rank_load_refused, str(tmp_path), which):
        assert error is not None and says in error, error
        assert "nothing was loaded" in error and "sharded_model_state_dict" in error
        assert untouched
