"""Training loss against step: torch DDP and mode decentralized over several
topologies, on the same model, data and optimizer, in the same processes.

    pip install -e .[bench]      # matplotlib
    torchrun --nproc-per-node 4 examples/convergence.py [--steps 300] [--out convergence.png]

Each run starts from the same weights; every rank trains on its shard of the
same global batches (a fixed random teacher labels Gaussian inputs). The plot
shows the training loss averaged over the ranks (each rank's loss at its own
parameters), the consensus distance of the decentralized runs (how far the
ranks' parameters are from their average; zero under DDP), and the loss of the
ranks' averaged parameters (step.global_average()) on held-out data at the end.
"""

import argparse
import copy
import json
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from transpiler import TranspileError, transpile
from transpiler.bench import pyplot, train_step
from transpiler.topology import BUILT_IN

log = logging.getLogger("convergence")
TOPOLOGIES = ("ring", "one-peer-exp", "complete")


def make_data(steps: int, world_size: int, batch: int):
    """`steps` global batches and a held-out set, the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g))

        def sample(n):
            x = torch.randn(n, 32, generator=g)
            return x, teacher(x).argmax(dim=1)
        return [sample(batch * world_size) for _ in range(steps)], sample(4096)


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def run(name: str, model: nn.Module, batches, held_out, lr: float):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if name == "ddp":
        trained, step = nn.parallel.DistributedDataParallel(model), train_step
    else:
        trained, step = model, transpile(train_step, mode="decentralized", topology=name)
    losses, distances = [], []
    for x, y in batches:
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        losses.append(mean_over_ranks(step(trained, optimizer, x, y).item()))
        if name != "ddp":
            distances.append(step.consensus_distance())
    if name != "ddp":
        step.global_average()
    with torch.no_grad():
        held = F.cross_entropy(model(held_out[0]), held_out[1]).item()
    log.info("%-13s final train loss %.4f, held-out loss of the average %.4f", name,
             losses[-1], held)
    return {"loss": losses, "consensus_distance": distances, "held_out_loss": held}


def fits(topology: str, world_size: int) -> bool:
    try:
        BUILT_IN[topology](world_size, world_size)
    except TranspileError:
        return False
    return True


def smoothed(values: list[float], window: int) -> list[float]:
    """The mean of the last `window` values at each step (fewer at the start)."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / min(window, i + 1)
            for i in range(len(values))]


def plot(path: str, results: dict, steps: int, world_size: int, window: int = 20) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (name, r) in enumerate(results.items()):
        label = f"{name} (held-out {r['held_out_loss']:.3f})"
        left.plot(range(1, steps + 1), smoothed(r["loss"], window), color=f"C{i}", lw=1,
                  label=label)
        if r["consensus_distance"]:
            right.plot(range(1, steps + 1), r["consensus_distance"], color=f"C{i}", lw=1,
                       label=name)
    left.set(xlabel="step", ylabel=f"training loss (mean over ranks, last {window} steps)",
             yscale="log")
    left.legend(fontsize=8)
    right.set(xlabel="step", ylabel="consensus distance", yscale="log")
    right.legend(fontsize=8)
    fig.suptitle(f"DDP and mode decentralized, {world_size} ranks, SGD with momentum "
                 "(held-out: the ranks' averaged parameters after the last step)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", default="convergence.png")
    parser.add_argument("--json", help="also write the curves here")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(message)s")
    if rank == 0:
        pyplot()   # fail now without matplotlib, not after training
    batches, held_out = make_data(args.steps, world_size, args.batch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 10))
    names = ["ddp"] + [t for t in TOPOLOGIES if fits(t, world_size)]
    results = {name: run(name, model, batches, held_out, args.lr) for name in names}
    if rank == 0:
        plot(args.out, results, args.steps, world_size)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f)
        log.info("wrote %s", args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
