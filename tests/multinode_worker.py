"""One rank of the multi-node test (tests/test_multinode.py), launched by torchrun.

    torchrun ... tests/multinode_worker.py OUT [--steps 6] [--modes grad_allreduce,...]
                                               [--timeout 30]

Trains a small model built from torch's own layers with the transpiled step in
each mode, from the same seeds and on the same global batches whatever the
launch, so that a 4-rank job on two torchrun agents and the same job on one
agent must end with the same parameters and optimizer state. Every rank prints
what torchrun told it (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, ...);
rank 0 checks that all ranks hold bit-identical parameters (and optimizer
state, but in local_sgd, where each rank keeps its own momentum) after each
mode and saves, with torch.save to OUT: every rank's state per mode, rank 0's
program listings (the collectives that were run) and every rank's launch
environment.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.models import classify_step as train_step
from transpiler import transpile

MODES = ("grad_allreduce", "fuse_all_reduce", "local_sgd")
# fuse_all_reduce runs with hierarchical=True too (reduce-scatter in the node,
# all-reduce across nodes, all-gather in the node, over a nodes x
# LOCAL_WORLD_SIZE mesh): 2x2 on two agents, one node of 4 (so flat) on one.
# One variant only, for the time it takes; --modes takes "MODE+hierarchical"
# for any mode.
DEFAULT_MODES = MODES + ("fuse_all_reduce+hierarchical",)
# What torchrun sets per worker; LOCAL_WORLD_SIZE and GROUP_RANK differ between
# one agent of 4 processes and two agents of 2.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "GROUP_WORLD_SIZE", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT")
K_STEPS = 3  # local_sgd averages every 3 steps: 6 steps end on a sync


def make_model_and_optimizer(mode: str, rank: int):
    # Seeded by rank on purpose: the startup program broadcasts rank 0's weights.
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 3))
    if mode == "fuse_all_reduce":  # optimizer state with a step counter, too
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer


def state_of(model: nn.Module, optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in optimizer.state.items():
        for k, v in st.items():
            out[f"opt.{names[id(p)]}.{k}"] = torch.as_tensor(v).detach().clone()
    return out


def final_state(step, mode: str, model: nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """state_of as one process holds it: mode zero's and fsdp's shards gathered
    (their layout follows the nodes). Collectives: every rank calls it."""
    if mode not in ("zero", "fsdp"):
        return state_of(model, optimizer)
    full = step.full_optimizer_state_dict(optimizer)["state"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = {id(p): n for n, p in model.named_parameters()}
    with step.unsharded() if mode == "fsdp" else contextlib.nullcontext():
        out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, entries in full.items():
        for k, v in entries.items():
            out[f"opt.{names[id(params[i])]}.{k}"] = torch.as_tensor(v).detach().clone()
    return out


def train(mode: str, steps: int, rank: int, world_size: int):
    """`steps` steps of the transpiled step in `mode` ("MODE" or "MODE+hierarchical")."""
    mode, _, variant = mode.partition("+")
    model, optimizer = make_model_and_optimizer(mode, rank)
    options = {"k_steps": K_STEPS} if mode == "local_sgd" else {}
    if variant == "hierarchical":
        options["hierarchical"] = True
    step = transpile(train_step, mode=mode, **options)
    data = torch.Generator().manual_seed(1234)  # the same global batches on every rank
    for _ in range(steps):
        x = torch.randn(8 * world_size, 12, generator=data)
        y = torch.randint(0, 3, (8 * world_size,), generator=data)
        step(model, optimizer, x.chunk(world_size)[rank], y.chunk(world_size)[rank])
    listings = {name: str(p) for name, p in sorted(step.programs.items())}
    return final_state(step, mode, model, optimizer), listings


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=2 * K_STEPS)
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES))
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="process-group timeout, s: a lost peer fails the job, never hangs it")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    env = {k: os.environ.get(k) for k in LAUNCH_VARS}
    print(f"[rank {rank}] " + " ".join(f"{k}={v}" for k, v in env.items()), flush=True)

    results = {"env": [None] * world_size, "states": {}, "listings": {}}
    dist.all_gather_object(results["env"], env)
    for mode in args.modes.split(","):
        start = time.perf_counter()
        state, listings = train(mode, args.steps, rank, world_size)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, state)
        # local_sgd averages parameters only: each rank keeps its own momentum.
        shared = [k for k in state if not mode.startswith("local_sgd") or k.startswith("model.")]
        for r, other in enumerate(gathered):
            differ = [k for k in shared if not torch.equal(other[k], state[k])]
            if differ:
                raise SystemExit(f"[rank {rank}] {mode}: rank {r} differs from this rank in {differ}")
        results["states"][mode], results["listings"][mode] = gathered, listings
        if rank == 0:
            print(f"[rank 0] {mode}: {len(shared)} of {len(state)} tensors agree on all "
                  f"{world_size} ranks ({time.perf_counter() - start:.1f} s)", flush=True)
    if rank == 0:
        torch.save(results, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
