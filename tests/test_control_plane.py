"""The control plane (settings, program digests, parameter checksums, verify's
verdicts) runs on a gloo group of its own, so a transpiled step runs on ranks
whose default group cannot take CPU tensors, as with init_process_group("nccl").

There is no GPU here, so the default group is a stand-in for nccl: it carries
the data plane the programs issue (all-reduce and broadcast, forwarded to gloo)
and refuses every all-gather of a CPU tensor with the error a nccl
default group raises. Only the control exchanges all-gather, so on the old
code (control exchanges on the default group) the first build raises on every
rank.
"""

import datetime
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import models as M
from transpiler.backends import compile as backends
from transpiler import transpile
from transpiler.runtime.control_plane import control_group

NCCL_LIKE = "nccl_like"
PG_TIMEOUT = datetime.timedelta(seconds=20)
WAIT_S = 120


class NcclLike(dist.ProcessGroup):
    """A default group that runs the data plane on gloo and, like nccl,
    cannot all-gather CPU tensors."""

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        # world_timeout() reads the user's timeout from the device's backend, as from nccl's
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM,
                               self._gloo)

    def getBackendName(self):
        return NCCL_LIKE

    def allreduce(self, *args):
        return self._gloo.allreduce(*args)

    def broadcast(self, *args):
        return self._gloo.broadcast(*args)

    def _refuse(self, *args):
        raise RuntimeError("No backend type associated with device type cpu")

    allgather = _allgather_base = allgather_coalesced = allgather_into_tensor_coalesced = _refuse


def _rank(rank, store_path, out_dir):
    torch.set_num_threads(1)
    dist.Backend.register_backend(NCCL_LIKE, NcclLike, devices=["cpu"])
    backends.PROCESS_GROUP["cpu"] = (NCCL_LIKE,)  # on a GPU, the program's device asks for nccl
    dist.init_process_group(NCCL_LIKE, init_method=f"file://{store_path}", rank=rank,
                            world_size=2, timeout=PG_TIMEOUT)
    try:
        torch.save(_train_and_check(rank), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _train_and_check(rank):
    model = M.make("mlp", seed=rank)   # the startup broadcast makes the ranks agree
    opt = M.make_optimizer("sgd", model)
    # verify=1 exchanges a verdict, check_every=1 checksums after every step
    step = transpile(M.classify_step, mode="fuse_all_reduce", verify=1, check_every=1)
    for batch in M.batches("mlp", 2, 12):
        step(model, opt, *M.shard(batch, rank, 2))
    params = [p.detach().clone() for p in model.parameters()]
    if rank == 1:
        with torch.no_grad():
            model.layers[1].bias[0] += 1e-7
    group = control_group()
    return {"params": params, "diverged": step.check_consistency(),
            "control": (dist.get_backend(group), group is control_group(),
                        group._get_backend(torch.device("cpu")).options._timeout.total_seconds())}


@pytest.mark.slow   # spawns two ranks
def test_a_step_runs_where_the_default_group_cannot_take_cpu_tensors(tmp_path):
    ranks = mp.start_processes(_rank, args=(str(tmp_path / "store"), str(tmp_path)),
                               nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + WAIT_S
    try:
        while not ranks.join(timeout=1):   # raises with a failed rank's traceback
            assert time.monotonic() < deadline, f"the ranks did not finish within {WAIT_S}s"
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert all(torch.equal(a, b) for a, b in zip(rank0["params"], rank1["params"]))
    for result in (rank0, rank1):
        assert result["control"] == ("gloo", True, PG_TIMEOUT.total_seconds())
        assert result["diverged"] == ["layers.1.bias: ranks 1 differ from rank 0"]


def test_a_gloo_default_group_is_its_own_control_group(tmp_path):
    for i in range(2):   # each default group gets its own: a stale one is never returned
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store{i}",
                                rank=0, world_size=1)
        try:
            assert control_group() is dist.group.WORLD
        finally:
            dist.destroy_process_group()

