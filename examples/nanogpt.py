"""nanoGPT's train.py, ported: a small GPT trained on a token file by the
transpiled step, or, with --ddp, by the same script under torch DDP.

    torchrun --nproc-per-node 2 examples/nanogpt.py             # transpiled, fuse_all_reduce
    torchrun --nproc-per-node 2 examples/nanogpt.py --ddp       # the same under torch DDP
    torchrun --nproc-per-node 2 examples/nanogpt.py --mode zero --max-iters 50   # saves at 25
    torchrun --nproc-per-node 2 examples/nanogpt.py --mode zero --init-from resume

About 15 s on 2 CPU ranks (from a checkout: PYTHONPATH=. .venv/bin/torchrun ...).
As in nanoGPT: batches drawn from train.bin/val.bin (uint16 tokens, read with
np.memmap; without --data-dir a synthetic pair is written into --out-dir),
gradient accumulation, clipping, GradScaler (enabled for float16 autocast on
CUDA only), AdamW with weight-decay groups, warm-up + cosine learning rate set
outside the step, evaluation every --eval-interval iterations, a checkpoint at
each evaluation and --init-from resume, loss and tokens/s through logging. The
two runs print the same losses: the transpiled step is DDP bit for bit.
docs/nanogpt-diff.md is the diff between the two paths.
"""

import argparse
import logging
import math
import os
import tempfile
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from transpiler import BACKENDS, MODES, transpile

log = logging.getLogger("nanogpt")


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        layer = nn.TransformerEncoderLayer(n_embd, n_head, 4 * n_embd, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight            # weight tying, as in GPT-2
        for p in (self.wte.weight, self.wpe.weight):
            nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        logits = self.lm_head(self.ln_f(self.blocks(x, mask=mask, is_causal=True)))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def write_synthetic_tokens(data_dir: str, vocab_size: int, n_tokens: int = 50_000):
    """train.bin and val.bin as nanoGPT's prepare.py writes them (uint16): a
    token follows its predecessor by a fixed permutation nine times in ten, so
    the loss can fall."""
    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    follow, noise = rng.permutation(vocab_size), rng.integers(0, vocab_size, n_tokens)
    tokens = np.empty(n_tokens, dtype=np.uint16)
    tokens[0] = noise[0]
    for i, keep in enumerate(rng.random(n_tokens - 1) < 0.9, start=1):
        tokens[i] = follow[tokens[i - 1]] if keep else noise[i]
    split = int(0.9 * n_tokens)
    tokens[:split].tofile(os.path.join(data_dir, "train.bin"))
    tokens[split:].tofile(os.path.join(data_dir, "val.bin"))


def make_train_step(gradient_accumulation_steps: int, grad_clip: float, ctx):
    def train_step(model, optimizer, scaler, batches):
        for micro_step, (X, Y) in enumerate(batches):
            if isinstance(model, DDP):   # for --ddp only: the transpiler reduces once per step
                model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return train_step


def get_lr(it, args):
    """Linear warm-up, then cosine decay to min_lr (nanoGPT's schedule)."""
    if it < args.warmup_iters:
        return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
    if it > args.lr_decay_iters:
        return args.min_lr
    decay_ratio = (it - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return args.min_lr + coeff * (args.learning_rate - args.min_lr)


def train(args) -> dict:
    """The training loop on this rank (torch.distributed initialised). Returns
    this rank's losses by iteration (of the last micro-batch, as nanoGPT logs
    them, before the factor gradient_accumulation_steps) and the final model state."""
    ddp, master_process = args.ddp, dist.get_rank() == 0
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device, batch_size, block_size = args.device, args.batch_size, args.block_size
    gradient_accumulation_steps = args.grad_accum
    device_type = "cuda" if "cuda" in device else "cpu"
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
               "float16": torch.float16}[args.dtype]
    ctx = nullcontext() if device_type == "cpu" else torch.autocast(device_type, dtype=ptdtype)
    data_dir = args.data_dir or os.path.join(args.out_dir, "data")
    if master_process and not os.path.exists(os.path.join(data_dir, "val.bin")):
        write_synthetic_tokens(data_dir, args.vocab_size)
    dist.barrier()

    def get_batch(split, generator):
        # Re-open the memmap on every batch, as nanoGPT does (a memmap kept open leaks).
        data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
        x = torch.stack([torch.from_numpy((data[i:i + block_size]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + block_size]).astype(np.int64))
                         for i in ix])
        return x.to(device), y.to(device)

    @torch.no_grad()
    def estimate_loss():
        """Eager, outside the step; the same batches on every rank and at every
        evaluation."""
        out = {}
        model.eval()
        for split in ["train", "val"]:
            generator = torch.Generator().manual_seed(0)
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                X, Y = get_batch(split, generator)
                with ctx:
                    logits, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean()
        model.train()
        return out

    torch.manual_seed(1337 + rank)   # different on purpose: rank 0's weights are broadcast
    model = GPT(args.vocab_size, block_size, args.n_layer, args.n_head, args.n_embd).to(device)
    optimizer = model.configure_optimizers(args.weight_decay, args.learning_rate, (0.9, 0.95))
    scaler = torch.amp.GradScaler(device_type, enabled=(args.dtype == "float16"))
    iter_num, ckpt_path = 0, os.path.join(args.out_dir, "ckpt.pt")
    if args.init_from == "resume":
        checkpoint = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])   # mode zero: sharded at the next step
        scaler.load_state_dict(checkpoint["scaler"])
        iter_num = checkpoint["iter_num"]
        log.info("resumed from %s at iteration %d", ckpt_path, iter_num)

    train_step = make_train_step(gradient_accumulation_steps, args.grad_clip, ctx)
    if ddp:
        model = DDP(model)
        step = train_step
    else:
        step = transpile(train_step, mode=args.mode, backend=args.backend, micro_batches="batches")
        if args.init_from == "resume" and checkpoint["step"] is not None:   # None: saved by DDP
            step.load_state_dict(checkpoint["step"])
    raw_model = model.module if ddp else model

    tokens_per_iter = gradient_accumulation_steps * world_size * batch_size * block_size
    history = []
    t0 = time.time()
    while iter_num < args.max_iters:
        lr = get_lr(iter_num, args)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr

        if iter_num % args.eval_interval == 0:   # on every rank: the checkpoint may gather
            losses = estimate_loss()
            log.info("step %d: train loss %.4f, val loss %.4f", iter_num, losses["train"],
                     losses["val"])
            if iter_num > 0:
                # Mode zero holds the optimizer state as shards: gathered here, a
                # collective, so on every rank (DDP and the other modes: the state_dict).
                optimizer_state = (optimizer.state_dict() if ddp
                                   else step.full_optimizer_state_dict(optimizer))
                checkpoint = {
                    "model": raw_model.state_dict(),
                    "optimizer": optimizer_state,
                    "scaler": scaler.state_dict(),
                    "step": None if ddp else step.state_dict(),
                    "iter_num": iter_num,
                }
                if master_process:
                    log.info("saving checkpoint to %s", args.out_dir)
                    # Written whole, then renamed: a resumed run saves at its first
                    # iteration, while another rank may still read the file it
                    # resumed from (it keeps reading the old one).
                    torch.save(checkpoint, ckpt_path + ".tmp")
                    os.replace(ckpt_path + ".tmp", ckpt_path)

        # A seed per (iteration, rank): each rank draws its own batches, and a
        # resumed run draws the same ones.
        generator = torch.Generator().manual_seed(1337 + iter_num * world_size + rank)
        batches = [get_batch("train", generator) for _ in range(gradient_accumulation_steps)]
        loss = step(model, optimizer, scaler, batches)
        history.append(loss)

        t1 = time.time()
        dt = t1 - t0
        t0 = t1
        if iter_num % args.log_interval == 0:
            lossf = loss.item() * gradient_accumulation_steps
            first = iter_num == 0 and not ddp
            log.info("iter %d: loss %.6f, time %.0f ms, %.0f tokens/s%s", iter_num, lossf,
                     dt * 1000, tokens_per_iter / dt,
                     " (the first call traces and builds the program)" if first else "")
        iter_num += 1
    return {"losses": torch.stack(history), "model": raw_model.state_dict()}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ddp", action="store_true", help="torch DDP instead of the transpiler")
    p.add_argument("--mode", default="fuse_all_reduce", choices=sorted(MODES))
    p.add_argument("--backend", default="eager", choices=BACKENDS)
    p.add_argument("--out-dir", default=os.path.join(tempfile.gettempdir(), "nanogpt"))
    p.add_argument("--data-dir", default=None, help="holds train.bin and val.bin (uint16)")
    p.add_argument("--init-from", default="scratch", choices=["scratch", "resume"])
    p.add_argument("--max-iters", type=int, default=100)
    p.add_argument("--eval-interval", type=int, default=25)
    p.add_argument("--eval-iters", type=int, default=4)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup-iters", type=int, default=5)
    p.add_argument("--lr-decay-iters", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    return p.parse_args(argv)


def main():
    args = parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    else:
        args.device = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(args.device)
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}] %(message)s")
    train(args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
