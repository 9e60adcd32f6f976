"""Training loss against step: torch DDP and mode decentralized over several
topologies (--experiment decentralized), or DDP's averaging, local SGD, DiLoCo
and Streaming DiLoCo (--experiment diloco), on the same model, data and
optimizer, in the same processes.

    pip install -e .[bench]      # matplotlib
    torchrun --nproc-per-node 4 examples/convergence.py [--steps 300] [--out convergence.png]
    torchrun --nproc-per-node 4 examples/convergence.py --experiment diloco --steps 600 \
        --out diloco.png

Each run starts from the same weights; every rank trains on its shard of the
same global batches. decentralized: a fixed random teacher labels Gaussian
inputs; the plot shows the training loss averaged over the ranks (each rank's
loss at its own parameters), the consensus distance of the decentralized runs
(how far the ranks' parameters are from their average; zero under DDP), and
the loss of the ranks' averaged parameters (step.global_average()) on
held-out data at the end. diloco: a small GPT learns token sequences drawn
from a fixed random Markov chain (each token has a few likely successors),
AdamW inside every mode; the plot shows the training loss averaged over the
ranks against the step and against the MiB each rank sent.
"""

import argparse
import copy
import json
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from transpiler import DiLoCo, TranspileError, topology, transpile
from transpiler.bench.bench import GPT, pyplot, train_step

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


def fits(name: str, world_size: int) -> bool:
    try:
        topology.BUILT_IN[name](world_size, world_size)
    except TranspileError:
        return False
    return True


# --experiment diloco: sync_every (local SGD's k_steps) and the modes compared
H = 8
TOKEN_MODES = {
    "fuse_all_reduce (DDP)": dict(mode="fuse_all_reduce"),
    f"local_sgd (k={H})": dict(mode="local_sgd", k_steps=H),
    f"DiLoCo (H={H})": dict(fragments=1),
    f"Streaming DiLoCo (H={H}, 2 fragments, delay 3, bf16)":
        dict(fragments=2, fragment_sync_delay=H // 2 - 1, fuse_dtype=torch.bfloat16),
}


def make_tokens(steps: int, world_size: int, batch: int, vocab: int = 64, seq: int = 32):
    """`steps` global batches of (inputs, targets) from a random Markov chain,
    the same on every rank, and a held-out batch."""
    g = torch.Generator().manual_seed(1234)
    successors = torch.randint(vocab, (vocab, 3), generator=g)
    weights = torch.tensor([0.7, 0.2, 0.1])

    def sample(n):
        tokens = torch.empty(n, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (n,), generator=g)
        for t in range(seq):
            pick = torch.multinomial(weights, n, replacement=True, generator=g)
            tokens[:, t + 1] = successors[tokens[:, t], pick]
        return tokens[:, :-1], tokens[:, 1:]
    return [sample(batch * world_size) for _ in range(steps)], sample(1024)


def run_tokens(name: str, model: nn.Module, batches, held_out, lr: float):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    options = dict(TOKEN_MODES[name])
    if "mode" in options:
        step = transpile(train_step, **options)
    else:
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        step = transpile(train_step, mode=DiLoCo(outer_optimizer=outer, sync_every=H, **options))
    losses, sent = [], []
    for x, y in batches:
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        losses.append(mean_over_ranks(step(model, optimizer, x, y).item()))
        sent.append(step.bytes_sent / 2**20)
    with torch.no_grad():
        logits = model(held_out[0])
        held = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), held_out[1].reshape(-1))
    held = mean_over_ranks(held.item())
    log.info("%-50s final train loss %.4f, held-out %.4f, %.1f MiB sent per rank", name,
             sum(losses[-20:]) / 20, held, sent[-1])
    return {"loss": losses, "sent_mib": sent, "held_out_loss": held}


def smoothed(values: list[float], window: int) -> list[float]:
    """The mean of the last `window` values at each step (fewer at the start)."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / min(window, i + 1)
            for i in range(len(values))]


def plot(path: str, results: dict, steps: int, title: str, right_axes: dict,
         right_of, window: int = 20) -> None:
    """The training loss against step on the left (smoothed over `window`
    steps), on the right what right_of(run, smoothed loss) gives as (x, y)
    (nothing where it gives None)."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (name, r) in enumerate(results.items()):
        loss = smoothed(r["loss"], window)
        left.plot(range(1, steps + 1), loss, color=f"C{i}", lw=1,
                  label=f"{name} (held-out {r['held_out_loss']:.3f})")
        curve = right_of(r, loss)
        if curve is not None:
            right.plot(*curve, color=f"C{i}", lw=1, label=name)
    left.set(xlabel="step", ylabel=f"training loss (mean over ranks, last {window} steps)",
             yscale="log")
    left.legend(fontsize=7)
    right.set(**right_axes)
    right.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16, help="per rank")
    parser.add_argument("--experiment", choices=("decentralized", "diloco"),
                        default="decentralized")
    parser.add_argument("--lr", type=float, default=None,
                        help="SGD's (decentralized, default 0.05) or AdamW's (diloco, 3e-3)")
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
    torch.manual_seed(0)
    if args.experiment == "diloco":
        batches, held_out = make_tokens(args.steps, world_size, args.batch)
        model = GPT(vocab=64, d_model=64, nhead=4, layers=2, context=32)
        results = {name: run_tokens(name, model, batches, held_out, args.lr or 3e-3)
                   for name in TOKEN_MODES}
    else:
        batches, held_out = make_data(args.steps, world_size, args.batch)
        model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                              nn.Linear(128, 10))
        names = ["ddp"] + [t for t in TOPOLOGIES if fits(t, world_size)]
        results = {name: run(name, model, batches, held_out, args.lr or 0.05) for name in names}
    if rank == 0 and args.experiment == "diloco":
        plot(args.out, results, args.steps,
             f"A small GPT on a Markov chain's tokens, {world_size} ranks, AdamW (held-out: "
             "each rank's own parameters, mean over ranks)",
             dict(xlabel="MiB sent by each rank", ylabel="training loss", xscale="log",
                  yscale="log"),
             lambda r, loss: (r["sent_mib"], loss))
    elif rank == 0:
        plot(args.out, results, args.steps,
             f"DDP and mode decentralized, {world_size} ranks, SGD with momentum (held-out: "
             "the ranks' averaged parameters after the last step)",
             dict(xlabel="step", ylabel="consensus distance", yscale="log"),
             lambda r, _: (range(1, args.steps + 1), r["consensus_distance"])
             if r["consensus_distance"] else None)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f)
        log.info("wrote %s", args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
