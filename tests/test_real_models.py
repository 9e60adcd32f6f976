"""Real model code nobody here wrote: transformers' GPT-2 and Llama from small
configs (random weights, no download), trained with a realistic step
(micro-batches, clipping by the global norm, a scheduler inside the step,
zero_grad after the step) against torch DDP running the same step function in
the same processes. Skipped when transformers is not installed (it is part of
the test extra)."""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import transpile

transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ, VOCAB, MICRO = 4, 8, 16, 96, 2


def _model(family: str):
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB,
                                         n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=VOCAB, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config)


def lm_step(model, opt, tokens):
    chunks = tokens.chunk(MICRO)
    total = 0
    for i, chunk in enumerate(chunks):
        sync = i == len(chunks) - 1
        with (model.no_sync() if isinstance(model, DDP) and not sync else contextlib.nullcontext()):
            logits = model(chunk[:, :-1]).logits
            loss = F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten()) / MICRO
            loss.backward()
        total = total + loss.detach()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    opt.test_scheduler.step()
    opt.zero_grad(set_to_none=True)
    return total, norm


def _optimizer(name, model):
    """SGD and AdamW with torch's defaults (AdamW's default formulation is the
    transpiled update's too)."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def _train(family, opt_name, step_fn, wrap, rank, world_size):
    model = _model(family)
    opt = _optimizer(opt_name, model)
    opt.test_scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
    net = wrap(model)
    g = torch.Generator().manual_seed(1)
    outputs = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out = step_fn(net, opt, tokens.chunk(world_size)[rank])
        outputs.append(torch.stack([t.detach() for t in out]))
    return M.state_of(model, opt), torch.stack(outputs)


def rank_lm_vs_ddp(family, opt_name):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ours = _train(family, opt_name, transpile(lm_step, mode="fuse_all_reduce"), lambda m: m,
                  rank, world_size)
    ddp = _train(family, opt_name, lm_step, DDP, rank, world_size)
    return ours, ddp


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_language_model_equals_ddp(family, opt_name, ranks2):
    for (ours, our_out), (ddp, ddp_out) in ranks2.run(rank_lm_vs_ddp, family, opt_name):
        assert M.max_rel_error(ours, ddp) == 0.0
        assert torch.equal(our_out, ddp_out)
