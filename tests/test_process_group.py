"""transpile(..., process_group=pg): the step data parallel over a group of the
job's ranks, as DDP(process_group=pg), while the other ranks do something else
(transpiler/world.py). On 4 gloo ranks split into two groups of 2, each group
trains its own model on its own data at the same time, against DDP with the
same group in the same processes, bit for bit; a group whose other ranks sit
idle trains too (nothing is created over ranks outside it)."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join as DDPJoin
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import TranspileError, transpile

STEPS = 3
BATCH = 8


def _my_group() -> tuple[int, dist.ProcessGroup]:
    """This rank's group of [[0, 1], [2, 3]] (every rank creates both) and its index."""
    mine, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    return dist.get_rank() // 2, mine


def _model_state(model) -> dict:
    """Parameters and buffers (the optimizer's state stands behind the
    parameters it updated; modes zero and fsdp keep it in shards)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def rank_groups_vs_ddp(mode: str, hook: bool):
    """Group 0 trains the MLP, group 1 the BatchNorm net (its buffers broadcast
    from its first rank, rank 2), each rank from its own seed (the start
    broadcast from the group's first rank aligns them), AdamW; then an
    evaluation forward. The same with DDP(process_group=its group)."""
    index, group = _my_group()
    name = ("mlp", "bn")[index]
    rank, size = dist.get_rank(group), group.size()
    batches = [M.shard(b, rank, size) for b in M.batches(name, STEPS, BATCH, seed=1 + index)]
    held_out = batches[0][0] + 1
    options = {"comm_hook": (group, default_hooks.allreduce_hook)} if hook else {}

    model = M.make(name, seed=dist.get_rank())
    opt = M.make_optimizer("adamw", model)
    step = transpile(M.classify_step, mode=mode, process_group=group, **options)
    losses = [step(model, opt, *b).detach() for b in batches]
    with step.unsharded() if mode == "fsdp" else contextlib.nullcontext():
        ours = _model_state(model), M.evaluated(model, held_out)
    rings = {n.args[-1] for n in step.program.collectives() if isinstance(n.args[-1], str)}

    model = M.make(name, seed=dist.get_rank())
    opt = M.make_optimizer("adamw", model)
    ddp = DDP(model, process_group=group)
    if hook:
        ddp.register_comm_hook(group, default_hooks.allreduce_hook)
    ddp_losses = [M.classify_step(ddp, opt, *b).detach() for b in batches]
    evaluated = M.evaluated(ddp, held_out)   # DDP's wrapper broadcasts the group's first buffers
    theirs = _model_state(model), evaluated
    return ours, theirs, losses, ddp_losses, rings, group.group_name


def _assert_groups_equal_ddp(results):
    for (ours, evaluated), (theirs, ddp_evaluated), losses, ddp_losses, rings, name in results:
        M.assert_states_equal(ours, theirs)
        assert torch.equal(evaluated, ddp_evaluated)
        assert torch.equal(torch.stack(losses), torch.stack(ddp_losses))
        assert rings == {name}   # every collective on the step's group
    # the groups trained apart, each its own model; rank 2's buffers on rank 3 too
    assert results[0][0][0].keys() != results[2][0][0].keys()
    M.assert_states_equal(results[2][0][0], results[3][0][0])


@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce", "zero", "fsdp"])
def test_two_groups_each_equal_ddp_over_its_group(mode, ranks4):
    _assert_groups_equal_ddp(ranks4.run(rank_groups_vs_ddp, mode, False))


def test_a_comm_hook_over_the_group_equals_ddp_with_it(ranks4):
    _assert_groups_equal_ddp(ranks4.run(rank_groups_vs_ddp, "fuse_all_reduce", True))


def _logged(group):
    """The classification step returning its loss summed over `group` (a
    collective in the step, as a script logs its loss)."""
    def logged_step(model, opt, x, y):
        logged = M.classify_step(model, opt, x, y).detach().clone()
        dist.all_reduce(logged, group=group)
        return logged
    return logged_step


def rank_beside_idle_ranks():
    """Ranks 0 and 1 train over their group while ranks 2 and 3 only check
    that a group they are not in is refused: uneven inputs under join()
    (rank 0 has one batch more) with check_every=1 against DDP's Join, then a
    step that all-reduces its loss over the group, with verify=1, against the
    same step under DDP; SyncBatchNorm over the group."""
    index, group = _my_group()
    first_two = dist.new_group([0, 1])   # a collective of every rank
    if index == 1:
        with pytest.raises(TranspileError, match="not in this group"):
            transpile(M.classify_step, process_group=first_two)
        return None
    with pytest.raises(TranspileError, match="not with hierarchical"):
        transpile(M.classify_step, process_group=group, hierarchical=True)
    rank = dist.get_rank(group)
    batches = [M.shard(b, rank, 2) for b in M.batches("mlp", 3 - rank, BATCH)]

    model = M.make("mlp", seed=rank)
    opt = M.make_optimizer("sgd", model)
    step = transpile(M.classify_step, mode="fuse_all_reduce", process_group=group,
                     check_every=1)
    with step.join():
        for b in batches:
            step(model, opt, *b)
    reference = M.make("mlp", seed=rank)
    ref_opt = M.make_optimizer("sgd", reference)
    ddp = DDP(reference, process_group=group)
    with DDPJoin([ddp]):
        for b in batches:
            M.classify_step(ddp, ref_opt, *b)
    joined = _model_state(model), _model_state(reference)

    logged = transpile(_logged(group), mode="fuse_all_reduce", process_group=group, verify=1)
    losses = [logged(model, opt, *b) for b in batches[:2]]
    ref_losses = [_logged(group)(ddp, ref_opt, *b) for b in batches[:2]]
    unlogged = transpile(_logged(None), mode="fuse_all_reduce", process_group=group)
    with pytest.raises(TranspileError, match="only a collective over that group is traced"):
        unlogged(model, opt, *batches[0])

    unsynced = torch.nn.SyncBatchNorm.convert_sync_batchnorm(M.make("bn"))
    with pytest.raises(TranspileError, match="SyncBatchNorm over the process group"):
        transpile(M.classify_step, process_group=group)(
            unsynced, M.make_optimizer("sgd", unsynced), *batches[0])
    synced = torch.nn.SyncBatchNorm.convert_sync_batchnorm(M.make("bn"), group)
    transpile(M.classify_step, process_group=group, broadcast_buffers=False)(
        synced, M.make_optimizer("sgd", synced), *batches[0])
    return (joined, (_model_state(model), _model_state(reference)), losses, ref_losses,
            _model_state(synced))


def test_a_group_trains_while_the_other_ranks_do_not_take_part(ranks4):
    """Nothing is created over ranks outside the group: a collective of the
    default group (a new communicator, a control exchange) would wait for
    ranks 2 and 3, which have returned, until the pool's timeout."""
    results = ranks4.run(rank_beside_idle_ranks, timeout=120)
    assert results[2] is None and results[3] is None
    for (joined, ref_joined), (after, ref_after), losses, ref_losses, _ in results[:2]:
        M.assert_states_equal(joined, ref_joined)
        M.assert_states_equal(after, ref_after)
        assert torch.equal(torch.stack(losses), torch.stack(ref_losses))
    M.assert_states_equal(results[0][0][0], results[1][0][0])   # the join ended with one model
    # SyncBatchNorm over the group: the same statistics on both ranks, from
    # different batches, without a broadcast of the buffers
    M.assert_states_equal(results[0][4], results[1][4])


def test_process_group_needs_torch_distributed():
    with pytest.raises(TranspileError, match="init_process_group"):
        transpile(M.classify_step, process_group=object())
