"""A param group's value that is a tensor: `lr=torch.tensor(0.01)`, as
torch.compile's optimizer recipes set it so that a scheduler's change needs
no recompile; betas as tensors. The traced update reads it as a program input
read from the group on every call (optimizer_state.group_tensors_as_inputs),
its layout alone in the signature: a scheduler that fills it anew traces
nothing again, and the update is eager's bit for bit. Before, the value was
read while traced: Adam's single-tensor update baked `value=nan` into the
program, and each new lr traced again."""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import transpile

T = torch.tensor
CASES = {
    "sgd_momentum": (torch.optim.SGD, lambda: dict(lr=T(0.1), momentum=0.9)),
    "sgd": (torch.optim.SGD, lambda: dict(lr=T(0.1))),
    "adam_tensor_betas": (torch.optim.Adam, lambda: dict(lr=T(0.01), betas=(T(0.9), T(0.99)))),
    "adamw": (torch.optim.AdamW, lambda: dict(lr=T(0.01), weight_decay=0.1)),
    "adamw_fused": (torch.optim.AdamW, lambda: dict(lr=T(0.01), weight_decay=0.1, fused=True)),
    "rmsprop": (torch.optim.RMSprop, lambda: dict(lr=T(0.01))),
    "nadam": (torch.optim.NAdam, lambda: dict(lr=T(0.01))),
}


def _train(case, step, model=None, rank=0, world_size=1, calls=5):
    cls, options = CASES[case]
    model = model if model is not None else M.make("mlp")
    opt = cls(model.parameters(), **options())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)   # fills the lr tensor
    for batch in M.batches("mlp", calls, 8):
        step(model, opt, *M.shard(batch, rank, world_size))
        scheduler.step()
    return opt


@pytest.mark.parametrize("case", list(CASES))
def test_a_tensor_lr_filled_by_a_scheduler_equals_eager_and_traces_once(case):
    step = transpile(M.classify_step)
    ours = M.make("mlp")
    opt = _train(case, step, ours)
    theirs = M.make("mlp")
    M.assert_states_equal(M.state_of(ours, opt),
                          M.state_of(theirs, _train(case, M.classify_step, theirs)))
    # the first call's program creates the state lazily where no formulation
    # makes it first; none traces again for a new lr
    assert step._cache.builds <= 2
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(CASES[case][1]()["lr"] * 0.7 ** 5)


def rank_vs_ddp(case, mode):
    rank = dist.get_rank()
    runs = []
    for transpiled in (True, False):
        model = M.make("mlp")
        net = model if transpiled else DDP(model)
        step = transpile(M.classify_step, mode=mode) if transpiled else M.classify_step
        opt = _train(case, lambda m, o, *b: step(net, o, *b), model, rank, 2)
        runs.append(M.state_of(model, opt))
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sgd_momentum", "adamw"])
def test_equals_ddp_on_2_ranks(case, ranks2):
    for ours, ddp in ranks2.run(rank_vs_ddp, case, "fuse_all_reduce"):
        M.assert_states_equal(ours, ddp)
