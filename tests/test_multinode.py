"""Multi-node launch, for real: two torchrun agents against one.

The same 4-rank job (tests/multinode_worker.py: every mode, a few steps, gloo
on CPU) runs twice: on two torchrun agents of 2 processes each that meet
through a c10d rendezvous on 127.0.0.1 (two "nodes" on this machine, node
ranks assigned by the rendezvous, as on a cluster; the static rendezvous with
--node-rank was not needed: c10d was not flaky here), and on one agent of 4
processes (`--standalone`). Global ranks, data shards and collectives are the
same, so every rank's parameters and optimizer state must be the same, bit for
bit. The exception is a program built from the node layout (hierarchical
reduction): it sums in another order on 2x2 than on 1x4, so it is compared to
rounding, as are the hybrid sharding modes (zero and fsdp with hierarchical=True:
shards in the node, replicated across the nodes).

Every step has a deadline: the rendezvous (join and read timeouts), the
process group (the worker's --timeout) and the launch as a whole; on failure
or timeout both agents and their workers are killed and the agents' logs are
part of the failure message.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.multinode_worker import DEFAULT_MODES

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "multinode_worker.py"
LAUNCH_TIMEOUT_S = 150  # the whole launch, all agents; about 50 s on 2 cores
PG_TIMEOUT_S = 30       # the workers' process-group timeout


def _torchrun() -> str | None:
    """The torchrun of the interpreter running the tests, else the first on PATH."""
    here = Path(sys.executable).parent / "torchrun"
    return str(here) if here.exists() else shutil.which("torchrun")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # The workers import the transpiler of this tree, as pytest does.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _descendants(pid: int) -> list[int]:
    """pid's descendants, from /proc: torchrun starts its workers in sessions of
    their own, so killing an agent's process group would leave them behind.
    Without /proc (not Linux), none: the agents' SIGTERM stops them."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill(procs: list[subprocess.Popen]) -> None:
    """SIGTERM the agents (they stop their workers), then SIGKILL whatever of
    them and their workers is left after 5 s."""
    pids = [pid for p in procs if p.poll() is None for pid in [p.pid, *_descendants(p.pid)]]
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait(timeout=10)


def launch(commands: dict[str, list[str]], logs: Path, timeout: float = LAUNCH_TIMEOUT_S) -> dict:
    """Run the agents' commands side by side, each logging to logs/NAME.log;
    return their logs. Any agent failing, or the deadline passing, kills them
    all and fails with the tail of every log."""
    procs: dict[str, subprocess.Popen] = {}
    files = {name: open(logs / f"{name}.log", "w") for name in commands}
    failure = None
    try:
        for name, cmd in commands.items():
            procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdin=subprocess.DEVNULL,
                                           stdout=files[name], stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs.values()):
            failed = [n for n, p in procs.items() if p.poll() not in (None, 0)]
            if failed:
                failure = f"agent {failed[0]} exited with {procs[failed[0]].returncode}"
                break
            if time.monotonic() > deadline:
                failure = f"the launch took over {timeout:.0f} s"
                break
            time.sleep(0.2)
        failed = [n for n, p in procs.items() if p.poll() not in (None, 0)]
        if failure is None and failed:
            failure = f"agent {failed[0]} exited with {procs[failed[0]].returncode}"
    finally:
        _kill(list(procs.values()))
        for f in files.values():
            f.close()
    text = {name: (logs / f"{name}.log").read_text() for name in commands}
    if failure:
        errors = [line for t in text.values() for line in t.splitlines()
                  if "Error:" in line or "differs from this rank" in line]
        tails = "\n".join(f"--- {name}.log (last 3000 chars)\n{t[-3000:]}" for name, t in text.items())
        pytest.fail(f"{failure}; first errors:\n" + "\n".join(errors[:6])
                    + f"\nagents' logs:\n{tails}", pytrace=False)
    return text


def multinode_commands(torchrun: str, out: Path, worker_args=((), ())) -> dict[str, list[str]]:
    """Two agents of 2 processes each, one c10d rendezvous; agent node0 hosts
    its store (is_host, as the first node of a cluster would), node ranks are
    the rendezvous's to assign."""
    endpoint, run_id = f"127.0.0.1:{_free_port()}", f"multinode-{uuid.uuid4().hex[:8]}"
    return {f"node{i}": [
        torchrun, "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--rdzv-conf", f"is_host={'true' if i == 0 else 'false'},join_timeout=60,read_timeout=60",
        "--local-addr", "127.0.0.1", "--max-restarts", "0",
        str(WORKER), str(out), "--timeout", str(PG_TIMEOUT_S), *worker_args[i],
    ] for i in range(2)}


def standalone_command(torchrun: str, out: Path, worker_args=()) -> list[str]:
    return [torchrun, "--standalone", "--nproc-per-node", "4",
            str(WORKER), str(out), "--timeout", str(PG_TIMEOUT_S), *worker_args]


def max_rel_error(xs: list[dict], ys: list[dict]) -> float:
    """The largest difference of any tensor of any rank, relative to the
    tensor's largest magnitude."""
    return max(((x[k].double() - y[k].double()).abs().max()
                / y[k].double().abs().max().clamp_min(1e-12)).item()
               for x, y in zip(xs, ys) for k in x)


def differences(a: dict, b: dict, rtol: dict | None = None) -> list[str]:
    """Where two runs' states differ: every rank's parameters and optimizer
    state, bit for bit, or within rtol[mode] (relative to the largest
    magnitude) for the modes rtol names; empty if nowhere."""
    rtol = rtol or {}
    out = []
    for mode in sorted(a.keys() | b.keys()):
        if mode not in a or mode not in b:
            out.append(f"{mode}: in one run only")
            continue
        for rank, (x, y) in enumerate(zip(a[mode], b[mode], strict=True)):
            for key in sorted(x.keys() | y.keys()):
                if key not in x or key not in y or x[key].shape != y[key].shape:
                    out.append(f"{mode} rank {rank} {key}")
                elif mode in rtol:
                    u, v = x[key].double(), y[key].double()
                    if (u - v).abs().max() > rtol[mode] * v.abs().max().clamp_min(1e-12):
                        out.append(f"{mode} rank {rank} {key}")
                elif not torch.equal(x[key], y[key]):
                    out.append(f"{mode} rank {rank} {key}")
    return out


@pytest.fixture(scope="module")
def torchrun() -> str:
    import torch.distributed as dist

    path = _torchrun()
    if path is None:
        pytest.skip("torchrun is not installed next to this Python or on PATH")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    return path


# The hybrid sharding modes (tests/test_hsdp.py) run in the same launch: its
# agents' start-up is most of its time.
HYBRID = ("zero+hierarchical", "fsdp+hierarchical")
FLAT = ("fuse_all_reduce", "grad_allreduce", "local_sgd")


@pytest.fixture(scope="module")
def launched(torchrun, tmp_path_factory):
    """Both jobs, side by side (one would leave a core idle while it waits):
    their saved results and the agents' logs."""
    d = tmp_path_factory.mktemp("multinode")
    multi, single = d / "multinode.pt", d / "standalone.pt"
    args = ("--modes", ",".join(DEFAULT_MODES + HYBRID))
    commands = multinode_commands(torchrun, multi, (args, args))
    commands["standalone"] = standalone_command(torchrun, single, args)
    logs = launch(commands, d)
    return torch.load(multi), torch.load(single), logs


def test_two_agents_equal_one(launched):
    """2 nodes x 2 processes (c10d rendezvous) and 1 node x 4 processes train the
    same: every mode, every rank, parameters and optimizer state bit for bit."""
    a, b, logs = launched
    for name in ("node0", "node1"):
        print(f"--- {name}:", *[l for l in logs[name].splitlines() if "RANK=" in l], sep="\n")

    # It was a two-node job: two agents of 2 ranks each, node ranks 0 and 1;
    # the reference was one node of 4.
    assert [e["LOCAL_WORLD_SIZE"] for e in a["env"]] == ["2"] * 4
    assert sorted(e["GROUP_RANK"] for e in a["env"]) == ["0", "0", "1", "1"]
    assert {e["GROUP_WORLD_SIZE"] for e in a["env"]} == {"2"}
    assert [e["LOCAL_WORLD_SIZE"] for e in b["env"]] == ["4"] * 4
    assert set(FLAT) <= set(a["states"])
    assert a["states"].keys() == b["states"].keys()

    # Where the same programs ran (the same collectives, in the same order, on
    # the same global ranks) the results are bit-identical. A program built
    # from the node layout (a hierarchical all-reduce over a nodes x local-ranks
    # mesh from LOCAL_WORLD_SIZE: 2x2 here, 1x4 in the reference) sums in
    # another order: equal to rounding, so such a mode is compared within 1e-6.
    hierarchical = {mode: 1e-6 for mode in a["listings"] if a["listings"][mode] != b["listings"][mode]}
    for mode in hierarchical:
        print(f"{mode}: programs differ between the launches; max relative error "
              f"{max_rel_error(a['states'][mode], b['states'][mode]):.2g}")
    assert differences(a["states"], b["states"], hierarchical) == []
    # Flat programs are the same on both launches, and bit-identical.
    assert not set(FLAT) & hierarchical.keys()

    # The comparison sees a one-ulp change in one value of one rank.
    perturbed = {mode: [dict(s) for s in states] for mode, states in b["states"].items()}
    bias = perturbed["local_sgd"][3]["model.2.bias"].clone()
    bias[0] = torch.nextafter(bias[0], torch.tensor(float("inf")))
    perturbed["local_sgd"][3]["model.2.bias"] = bias
    assert differences(a["states"], perturbed, hierarchical) == ["local_sgd rank 3 model.2.bias"]


def test_two_agents_shard_in_the_node_and_train_as_one_node(launched):
    """Hybrid sharding on 2 agents x 2 processes (shards of 2, replicated across
    the 2 nodes) against 1 agent x 4 (one node: shards of 4, flat) on the same
    global ranks and batches: the full parameters and optimizer state of every
    rank equal to rounding (the sums are ordered by the nodes)."""
    a, b, _ = launched
    for mode in HYBRID:
        hybrid, flat = a["listings"][mode]["main"], b["listings"][mode]["main"]
        assert "across" in hybrid and "across" not in flat   # the hierarchy ran on 2 nodes only
        print(f"{mode}: max relative error {max_rel_error(a['states'][mode], b['states'][mode]):.2g}")
    states = lambda run: {mode: run["states"][mode] for mode in HYBRID}   # noqa: E731
    assert differences(states(a), states(b), dict.fromkeys(HYBRID, 1e-6)) == []
