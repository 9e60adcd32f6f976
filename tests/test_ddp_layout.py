"""Bit for bit with DDP on any number of ranks: fuse_all_reduce lays its
buckets out as DDP's reducer does (passes/coalesce_tensors.py), so gloo's ring
all-reduce adds each element over 3, 4 or 8 ranks in DDP's order. DDP's first
iteration reduces each dtype's gradients in one bucket, in the parameters'
order; then it rebuilds its buckets in the order the gradients became ready
(a 1 MB first bucket, 25 MB after). The layouts are read from DDP itself (a
comm hook that records each bucket's parameters), and the training against
DDP with its defaults running the same step in the same processes."""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import transpile

STEPS = 5


def deep_mlp() -> nn.Module:
    """Six 256-wide layers with LayerNorm: 1.6 MB of gradients, two buckets once rebuilt."""
    layers = []
    for _ in range(6):
        layers += [nn.Linear(256, 256), nn.LayerNorm(256), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(256, 4))


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=32)
    return GPT2LMHeadModel(config)


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         hidden_size=64, intermediate_size=128, vocab_size=128,
                         max_position_embeddings=32)
    return LlamaForCausalLM(config)


def frozen_first_layer() -> nn.Module:
    """The deep MLP with its first layer frozen: DDP buckets none of it."""
    model = deep_mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model


MODELS = {"deep_mlp": deep_mlp, "gpt2": gpt2, "llama": llama, "frozen": frozen_first_layer}
LANGUAGE_MODELS = ("gpt2", "llama")


def _batches(name: str, rank: int) -> list[tuple]:
    g = torch.Generator().manual_seed(1 + rank)   # each rank its own batches
    if name in LANGUAGE_MODELS:
        return [(torch.randint(0, 128, (4, 16), generator=g),) for _ in range(STEPS)]
    return [(torch.randn(8, 256, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(STEPS)]


def step(model, opt, *batch):
    if len(batch) == 1:   # a language model: the labels are the inputs
        loss = model(input_ids=batch[0], labels=batch[0]).loss
    else:
        loss = F.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _make(name: str, optimizer: str):
    torch.manual_seed(0)
    model = MODELS[name]()
    return model, M.make_optimizer(optimizer, model)


def rank_layouts(name: str):
    """DDP's buckets at its first and second step (a hook that records each
    bucket's parameters, then all-reduces as DDP's default), and the
    transpiled step's in its "first" and "main" programs; each a sorted list
    of buckets, a bucket the list of its parameters' names in buffer order."""
    model, opt = _make(name, "sgd")
    names = {id(p): n for n, p in model.named_parameters()}
    seen = []

    def recording(state, bucket):
        seen.append([names[id(p)] for p in bucket.parameters()])
        return default_hooks.allreduce_hook(state, bucket)
    ddp = DDP(model)
    ddp.register_comm_hook(None, recording)
    theirs = []
    for batch in _batches(name, dist.get_rank())[:2]:
        step(ddp, opt, *batch)
        theirs.append(sorted(seen))
        seen.clear()

    model, opt = _make(name, "sgd")
    transpiled = transpile(step, mode="fuse_all_reduce")
    for batch in _batches(name, dist.get_rank())[:2]:
        transpiled(model, opt, *batch)
    ours = [sorted(list(c.meta["comm"].params) for c in transpiled.programs[p].collectives()
                   if c.meta["comm"].params) for p in ("first", "main")]
    return ours, theirs


def rank_trained(name: str, optimizer: str, mode: str = "fuse_all_reduce"):
    """Parameters, optimizer state (zero, fsdp: the parameters stand for it)
    and losses after STEPS steps: the transpiled step, then DDP with its defaults."""
    batches = _batches(name, dist.get_rank())
    model, opt = _make(name, optimizer)
    transpiled = transpile(step, mode=mode)
    losses = torch.stack([transpiled(model, opt, *b) for b in batches])
    with transpiled.unsharded() if mode == "fsdp" else contextlib.nullcontext():
        ours = M.states_compared([(model, opt)], sharded=mode in ("zero", "fsdp"))[0], losses
    model, opt = _make(name, optimizer)
    ddp = DDP(model)
    losses = torch.stack([step(ddp, opt, *b) for b in batches])
    return ours, (M.states_compared([(model, opt)], sharded=mode in ("zero", "fsdp"))[0], losses)


@pytest.mark.parametrize("name", ["deep_mlp", "gpt2"])
def test_buckets_are_ddps_at_its_first_and_later_steps(name, ranks3):
    ours, theirs = ranks3.run(rank_layouts, name)[0]
    assert ours == theirs
    assert ours[0] != ours[1]   # not vacuous: the layout changes after the first step


def _assert_trained_alike(results):
    for (ours, losses), (theirs, ddp_losses) in results:
        M.assert_states_equal(ours, theirs)
        assert torch.equal(losses, ddp_losses)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_deep_mlp_equals_ddp_on_3_ranks(optimizer, ranks3):
    _assert_trained_alike(ranks3.run(rank_trained, "deep_mlp", optimizer))


def test_deep_mlp_equals_ddp_on_8_ranks(ranks8):
    _assert_trained_alike(ranks8.run(rank_trained, "deep_mlp", "sgd"))


@pytest.mark.parametrize("name", ["gpt2", "llama", "frozen"])
def test_models_equal_ddp_on_3_ranks(name, ranks3):
    _assert_trained_alike(ranks3.run(rank_trained, name, "adamw"))


@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_sharded_modes_on_3_ranks_within_a_rounding_of_ddp(mode, ranks3):
    """zero and fsdp reduce-scatter buckets of their own layout (each
    parameter padded to a multiple of the ranks): over 3 ranks a gradient's
    sum rounds in another order than DDP's, one last bit; 5 SGD steps stay
    within 1e-6 (measured 3.5e-7; AdamW, which divides by the gradient's own
    magnitude, 1.7e-5)."""
    for (ours, losses), (theirs, ddp_losses) in ranks3.run(rank_trained, "deep_mlp", "sgd", mode):
        assert M.max_rel_error(ours, theirs) <= 1e-6
        assert M.max_rel_error({"loss": losses}, {"loss": ddp_losses}) <= 1e-6
