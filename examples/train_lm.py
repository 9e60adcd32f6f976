"""A language-model training loop as people write it, transpiled unchanged.

    torchrun --nproc-per-node 2 examples/train_lm.py [--steps 30] [--micro-batches 4]
                                                     [--mode fuse_all_reduce]
                                                     [--backend eager|inductor]

The step accumulates gradients over micro-batches, scales the loss with
torch.amp.GradScaler (enabled where fp16 needs it, on CUDA; a pass-through on
CPU), unscales and clips the gradients by their global norm, steps AdamW and a
warm-up + cosine learning-rate schedule; the model is a
small causal transformer built from torch's layers, on synthetic token
sequences. Halfway it saves a checkpoint; at the end it restores that checkpoint
into fresh objects, trains the second half again and checks that the result is
bit for bit the uninterrupted run.
"""

import argparse
import logging
import math
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from transpiler import MODES, transpile
from transpiler.backends import BACKENDS

VOCAB, SEQ, DIM = 64, 32, 64


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        layer = nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=4 * DIM, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight             # tied, as in GPT-2

    def forward(self, tokens):
        n = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        return self.head(self.blocks(self.embed(tokens) + self.pos[:n], mask=mask, is_causal=True))


def make_train_step(scheduler, micro_batches: int, max_norm: float):
    def train_step(model, optimizer, scaler, tokens):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for chunk in tokens.chunk(micro_batches):
            logits = model(chunk[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten()) / micro_batches
            scaler.scale(loss).backward()
            total = total + loss.detach()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)  # skipped, on every rank alike, if a gradient overflowed
        scaler.update()
        scheduler.step()        # run by the transpiled step on the host after every call
        return total, norm
    return train_step


def warmup_cosine(total_steps: int, warmup: int):
    def factor(i):
        if i < warmup:
            return (i + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (i - warmup) / max(1, total_steps - warmup)))
    return factor


def batches(steps: int, batch: int):
    """Sequences that follow a fixed random permutation of the vocabulary (so the
    loss can fall), the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    follow = torch.randperm(VOCAB, generator=g)
    for _ in range(steps):
        seq = [torch.randint(0, VOCAB, (batch,), generator=g)]
        for _ in range(SEQ):
            seq.append(follow[seq[-1]])
        yield torch.stack(seq, dim=1)


def build(args, seed: int):
    torch.manual_seed(seed)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.steps, 5))
    scaler = torch.amp.GradScaler("cuda" if torch.cuda.is_available() else "cpu",
                                  enabled=torch.cuda.is_available())
    step = transpile(make_train_step(scheduler, args.micro_batches, max_norm=1.0),
                     mode=args.mode, backend=args.backend)
    return model, optimizer, scheduler, scaler, step


def train(args, model, optimizer, scaler, step, start: int, stop: int, rank: int,
          world_size: int):
    for i, tokens in enumerate(batches(stop, args.batch * world_size)):
        if i < start:
            continue
        loss, norm = step(model, optimizer, scaler, tokens.chunk(world_size)[rank])
        if rank == 0 and (i % 5 == 0 or i == stop - 1):
            print(f"step {i:3d}  loss {loss.item():.4f} (rank 0)  grad norm {norm.item():.3f}  "
                  f"lr {optimizer.param_groups[0]['lr']:.5f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--mode", default="fuse_all_reduce", choices=sorted(MODES))
    parser.add_argument("--backend", default="eager", choices=BACKENDS)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}] %(message)s")
    half = args.steps // 2

    model, optimizer, scheduler, scaler, step = build(args, seed=rank)   # rank 0's is broadcast
    train(args, model, optimizer, scaler, step, 0, half, rank, world_size)
    # The optimizer's full state (mode zero holds shards: gathered, a collective
    # on every rank; optimizer.state_dict() refuses them).
    checkpoint = {"model": model.state_dict(),
                  "optimizer": step.full_optimizer_state_dict(optimizer),
                  "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                  "step": step.state_dict()}
    path = os.path.join(tempfile.gettempdir(), f"train_lm.{os.getppid()}.rank{rank}.pt")
    torch.save(checkpoint, path)
    train(args, model, optimizer, scaler, step, half, args.steps, rank, world_size)
    if rank == 0:
        print(step.explain(), flush=True)

    if rank == 0:
        print(f"resuming from the checkpoint of step {half}", flush=True)
    resumed = torch.load(path)
    os.remove(path)
    model2, optimizer2, scheduler2, scaler2, step2 = build(args, seed=rank)
    model2.load_state_dict(resumed["model"])
    optimizer2.load_state_dict(resumed["optimizer"])
    scheduler2.load_state_dict(resumed["scheduler"])
    scaler2.load_state_dict(resumed["scaler"])
    step2.load_state_dict(resumed["step"])
    train(args, model2, optimizer2, scaler2, step2, half, args.steps, rank, world_size)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 model2.state_dict().values()))
    if rank == 0:
        print(f"resumed run {'equals' if same else 'DIFFERS FROM'} the uninterrupted one "
              "bit for bit", flush=True)
    dist.destroy_process_group()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
