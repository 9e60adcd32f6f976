"""Adam and AdamW as torch's default (neither capturable nor fused) computes
them: bias corrections and step size on the host, in double precision, from
each parameter's step count. Bit for bit against the eager step and against
torch DDP with its default optimizer on 2 gloo ranks; a capturable optimizer
keeps torch's capturable formulation (multi- or single-tensor), bit for bit
too."""

import contextlib
import copy
import logging

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import transpile
from transpiler.capture import compiling_flag   # lets capturable Adam run on CPU

STEPS = 5
OPTIMIZERS = {
    "adam": lambda ps, **kw: torch.optim.Adam(ps, lr=1e-2, **kw),
    "adam_l2_amsgrad": lambda ps, **kw: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-2,
                                                         amsgrad=True, **kw),
    "adamw": lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
    "adamw_amsgrad": lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1,
                                                        amsgrad=True, **kw),
}


def _equal(a: dict, b: dict) -> bool:
    assert a.keys() == b.keys()
    return all(torch.equal(a[k], b[k]) for k in a)


def _scheduled(opt):
    """lr changed before every step (and betas, whose change is a value too)."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i) ** 0.5)


def _train(opt_name, step_fn, model_name="mlp", steps=STEPS, **opt_options):
    model = M.make(model_name)
    opt = OPTIMIZERS[opt_name]([p for p in model.parameters() if p.requires_grad],
                               **opt_options)
    scheduler = _scheduled(opt)
    for batch in M.batches(model_name, steps, 8):
        step_fn(model, opt, *batch)
        scheduler.step()
    return model, opt


# ------------------------------------------------------------ one process

@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("model_name", ["mlp", "tied"])
def test_equals_eager_with_lr_changed_every_step(model_name, opt_name, caplog):
    fn = M.step_fn(model_name)
    with caplog.at_level(logging.INFO, logger="transpiler"):
        step = transpile(fn)
        ours = _train(opt_name, step, model_name)
    eager = _train(opt_name, fn, model_name)
    assert _equal(M.state_of(*ours), M.state_of(*eager))
    # lr is an input: one program for every step.
    assert len(step._cache) == 1 and caplog.text.count("traced") == 1


@pytest.mark.parametrize("opt_name", ["adam_l2_amsgrad", "adamw"])
def test_resuming_from_a_checkpoint_equals_the_unbroken_run(opt_name):
    """3 steps, a checkpoint (state_dict: step counts of 3), a fresh model and
    optimizer that load it, 3 more transpiled steps: equal to 6 eager steps."""
    batches = M.batches("mlp", 6, 8)
    model = M.make("mlp")
    opt = OPTIMIZERS[opt_name](model.parameters())
    step = transpile(M.classify_step)
    for batch in batches[:3]:
        step(model, opt, *batch)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))

    resumed = M.make("mlp", seed=5)
    resumed_opt = OPTIMIZERS[opt_name](resumed.parameters())
    resumed.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    assert all(float(s["step"]) == 3.0 for s in resumed_opt.state.values())
    step = transpile(M.classify_step)
    for batch in batches[3:]:
        step(resumed, resumed_opt, *batch)

    eager = M.make("mlp")
    eager_opt = OPTIMIZERS[opt_name](eager.parameters())
    for batch in batches:
        M.classify_step(eager, eager_opt, *batch)
    assert _equal(M.state_of(resumed, resumed_opt), M.state_of(eager, eager_opt))


def test_parameters_of_one_group_at_different_step_counts():
    """A checkpoint whose parameters of one group have different step counts
    (torch's Adam keeps one per parameter): each gets its own bias corrections,
    as in torch; one program."""
    start = M.make("mlp")
    start_opt = OPTIMIZERS["adamw"](start.parameters())
    for batch in M.batches("mlp", 2, 8):
        M.classify_step(start, start_opt, *batch)
    saved = copy.deepcopy(start_opt.state_dict())
    for index, count in ((0, 7.0), (3, 40.0)):
        saved["state"][index]["step"] = torch.tensor(count)
    runs = []
    for transpiled in (True, False):
        model = copy.deepcopy(start)
        opt = OPTIMIZERS["adamw"](model.parameters())
        opt.load_state_dict(copy.deepcopy(saved))
        step = transpile(M.classify_step) if transpiled else M.classify_step
        for batch in M.batches("mlp", 3, 8, seed=2):
            step(model, opt, *batch)
        runs.append(M.state_of(model, opt))
        if transpiled:
            assert len(step._cache) == 1
    assert _equal(*runs)
    names = [name for name, _ in start.named_parameters()]
    assert [float(runs[0][f"opt.{name}.step"]) for name in names[:4]] == [10.0, 5.0, 5.0, 43.0]


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "single_tensor"])
@pytest.mark.parametrize("opt_name", ["adam_l2_amsgrad", "adamw"])
def test_a_capturable_optimizer_keeps_the_capturable_formulation(opt_name, foreach):
    """torch's capturable update, multi-tensor or single-tensor (whose
    arithmetic differs), line for line with Python numbers."""
    runs = []
    for transpiled in (True, False):
        with contextlib.nullcontext() if transpiled else compiling_flag():
            model, opt = _train(opt_name, transpile(M.classify_step) if transpiled
                                else M.classify_step, capturable=True, foreach=foreach)
        runs.append(M.state_of(model, opt))
    assert _equal(*runs)
    # ... which rounds differently from the default one.
    assert not _equal(runs[1], M.state_of(*_train(opt_name, M.classify_step)))


def test_a_step_skipped_by_gradscaler_does_not_count(caplog):
    """torch.amp's GradScaler skips the steps whose gradients overflow (the
    scale starts at 2**127): their step count stays, and the bias corrections
    of the next steps are those of the steps taken."""
    def scaled(model, opt, x, y, scaler):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(model(x), y) * 4).backward()
        scaler.step(opt)
        scaler.update()
        return scaler._scale.clone()

    runs = []
    for transpiled in (True, False):
        model = M.make("mlp")
        opt = OPTIMIZERS["adamw"](model.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127, growth_interval=2)
        step = transpile(scaled) if transpiled else scaled
        for batch in M.batches("mlp", 6, 8):
            step(model, opt, *batch, scaler)
        runs.append(M.state_of(model, opt))
    assert _equal(*runs)
    steps = {float(v) for k, v in runs[0].items() if k.endswith(".step")}
    assert len(steps) == 1 and 0 < steps.pop() < 6   # some steps were skipped


# ------------------------------------------------------------ 2 ranks vs DDP

def rank_vs_ddp(opt_name, mode):
    """The transpiled step and DDP with the same default optimizer, in the same
    processes, lr changed every step; the state gathered whole in mode zero."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    runs = []
    for transpiled in (True, False):
        model = M.make("mlp", seed=rank if transpiled else 0)
        opt = OPTIMIZERS[opt_name](model.parameters())
        scheduler = _scheduled(opt)
        step = transpile(M.classify_step, mode=mode) if transpiled else M.classify_step
        net = model if transpiled else DDP(model)
        for batch in M.batches("mlp", STEPS, 12):
            step(net, opt, *M.shard(batch, rank, world_size))
            scheduler.step()
        state = step.full_optimizer_state_dict(opt) if mode == "zero" and transpiled \
            else opt.state_dict()
        runs.append(({k: v.detach().clone() for k, v in model.state_dict().items()},
                     state["state"]))
    return runs


@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce", "zero"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_equals_ddp_with_its_default_optimizer(opt_name, mode, ranks2):
    for (params, state), (ddp_params, ddp_state) in ranks2.run(rank_vs_ddp, opt_name, mode):
        assert _equal(params, ddp_params)
        assert state.keys() == ddp_state.keys()
        for index in state:
            assert _equal(state[index], ddp_state[index]), index
