"""Train a small MLP on synthetic data with the transpiled step, on every rank.

    torchrun --nproc-per-node 2 examples/train.py [--steps 20] [--mode grad_allreduce]
                                                  [--k-steps 4]  (local_sgd)
                                                  [--backend eager|inductor|auto]

Each rank trains on its own shard of every batch; the transpiled step all-reduces
the gradients (or, in local_sgd, averages the parameters every k steps), so all
ranks hold the same model at the end.
"""

import argparse
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from transpiler import BACKENDS, MODES, transpile


def train_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mode", default="grad_allreduce", choices=sorted(MODES))
    parser.add_argument("--nrings", type=int, default=2)
    parser.add_argument("--k-steps", type=int, default=4, help="local_sgd: steps per average")
    parser.add_argument("--backend", default="eager", choices=BACKENDS)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}] %(message)s")

    torch.manual_seed(rank)  # different on purpose: the startup program broadcasts rank 0's
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    local = {"k_steps": args.k_steps} if args.mode == "local_sgd" else {}
    step = transpile(train_step, mode=args.mode, nrings=args.nrings, backend=args.backend,
                     check_every=10, **local)

    data = torch.Generator().manual_seed(1234)  # the same global batches on every rank
    teacher = torch.randn(32, 4, generator=data)
    for i in range(args.steps):
        x = torch.randn(16 * world_size, 32, generator=data)
        y = (x @ teacher).argmax(dim=1)
        loss = step(model, optimizer, x.chunk(world_size)[rank], y.chunk(world_size)[rank])
        scheduler.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if rank == 0:
            print(f"step {i:3d}  loss {mean_loss.item() / world_size:.4f}  "
                  f"lr {scheduler.get_last_lr()[0]:.4f}", flush=True)
        if i == 1 and rank == 0:
            print(step.program, flush=True)

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    if rank == 0:
        worst = max((g - flat).abs().max().item() for g in gathered)
        verdict = "agree" if worst == 0 else "DISAGREE"
        print(f"parameters {verdict} on all {world_size} ranks "
              f"(max difference {worst:g} over {flat.numel()} values)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
