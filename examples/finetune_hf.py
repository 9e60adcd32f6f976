"""Fine-tune a transformers GPT-2 (a small config, random weights, nothing
downloaded) on padded batches from a torch DataLoader, transpiled; --ddp runs
the same script under torch DDP.

    torchrun --nproc-per-node 2 examples/finetune_hf.py          # transpiled, fuse_all_reduce
    torchrun --nproc-per-node 2 examples/finetune_hf.py --ddp    # the same under torch DDP

About 20 s on 2 CPU ranks (from a checkout: PYTHONPATH=. .venv/bin/torchrun ...).
The examples are token sequences of varied lengths; a DistributedSampler gives
each rank its share, and the collate function pads every batch to the same
--max-length (attention_mask 0 and labels -100 on the padding), so every batch
has one shape and the step is traced once. The two runs print the same losses.
"""

import argparse
import logging

import torch
import torch.distributed as dist
import transformers
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from transpiler import BACKENDS, MODES, transpile

log = logging.getLogger("finetune")
PAD = 0


def synthetic_examples(n: int, vocab_size: int, max_length: int) -> list[list[int]]:
    """Sequences of 8 to max_length tokens that count up modulo the vocabulary
    (skipping the pad id) from a random start: learnable, of varied length."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, max_length + 1, (n,), generator=g)
    starts = torch.randint(1, vocab_size, (n,), generator=g)
    return [[1 + (s + i) % (vocab_size - 1) for i in range(n)]
            for s, n in zip(starts.tolist(), lengths.tolist())]


def collate(examples: list[list[int]], max_length: int) -> dict[str, torch.Tensor]:
    """Pad to max_length: one shape for every batch, so one trace."""
    input_ids = torch.full((len(examples), max_length), PAD, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), max_length), dtype=torch.long)
    for row, ids in enumerate(examples):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        attention_mask[row, :len(ids)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)   # no loss on the padding
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def train_step(model, optimizer, batch):
    loss = model(**batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def train(args) -> dict:
    """Fine-tune on this rank (torch.distributed initialised). Returns this
    rank's losses by step and the final model state."""
    rank = dist.get_rank()
    torch.manual_seed(0)   # the same "pretrained" weights on every rank
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=args.vocab_size,
                                     n_positions=args.max_length, pad_token_id=PAD,
                                     bos_token_id=args.vocab_size - 1,
                                     eos_token_id=args.vocab_size - 1,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = args.epochs * args.steps_per_epoch
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 2, total_steps)

    dataset = synthetic_examples(args.steps_per_epoch * args.batch_size * dist.get_world_size(),
                                 args.vocab_size, args.max_length)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        collate_fn=lambda examples: collate(examples, args.max_length))
    if args.ddp:
        model, step = DDP(model), train_step
    else:
        step = transpile(train_step, mode=args.mode, backend=args.backend)

    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)   # a new shuffle each epoch, the same on every rank
        for batch in loader:
            loss = step(model, optimizer, batch)
            scheduler.step()
            losses.append(loss)
            if len(losses) % args.log_interval == 0:
                log.info("epoch %d step %d: loss %.6f, lr %.2e", epoch, len(losses), loss.item(),
                         scheduler.get_last_lr()[0])
    if rank == 0:
        log.info("final loss %.6f after %d steps", losses[-1].item(), len(losses))
    raw_model = model.module if args.ddp else model
    return {"losses": torch.stack(losses), "model": raw_model.state_dict()}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ddp", action="store_true", help="torch DDP instead of the transpiler")
    p.add_argument("--mode", default="fuse_all_reduce", choices=sorted(MODES))
    p.add_argument("--backend", default="eager", choices=BACKENDS)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps-per-epoch", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--max-length", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-interval", type=int, default=5)
    return p.parse_args(argv)


def main():
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}] %(message)s")
    train(args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
