"""Mode fsdp with the training-loop idioms (tests/test_training_loops.py's step
functions): clipping by the global norm over the sharded gradients, loss
scaling with skipped steps, micro-batches, schedulers inside and outside the
step, skip_nonfinite, bf16 on the wire and inductor; against torch DDP with its
defaults running the same step in the same processes, and against mode zero
(fsdp is zero's program with the parameters kept as shards), 2 gloo ranks."""

from __future__ import annotations

import contextlib
import copy
from math import inf
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from tests import test_training_loops as loops
from tests.test_zero import TINY_BUCKETS, _model_state, _state_error, poisonable_step
from transpiler import transpile
from transpiler.errors import PassError


class Run(NamedTuple):
    """What one run of an idiom ends with."""

    params: dict           # parameters and buffers
    state: dict            # the full optimizer state
    outputs: list          # what each step returned
    lr: float
    collectives: tuple[int, int] | None   # transpiled: (reductions, all-gathers)


class DDPEveryBackward(DDP):
    """DDP averaging at every backward(), micro-batches included (the idioms
    call no_sync() on all but the last micro-batch; here it does nothing)."""

    def no_sync(self):
        return contextlib.nullcontext()


def _then_scheduler(step):
    """The step, then the optimizer's scheduler stepped by the training loop."""
    def call(model, opt, *args):
        out = step(model, opt, *args)
        opt.test_scheduler.step()
        return out
    call.step_fn = getattr(step, "step_fn", step)
    return call


def _collectives(step) -> tuple[int, int]:
    """The reductions (gloo lowers each bucket's reduce-scatter to an
    all-reduce) and the buckets all-gathered (each once per pass that reads
    it) in the step's program."""
    comms = [node.meta["comm"] for node in step.program.collectives()]
    return (sum(c.op in ("all_reduce", "reduce_scatter") for c in comms),
            len({c.bucket for c in comms if c.op == "all_gather"}))


def rank_idiom(fn_name, opt_name="sgd", backend="eager", outside=False):
    """An idiom of test_training_loops under mode fsdp and mode zero, under DDP
    (no_sync() on all but the last micro-batch, as the idiom says) and under
    DDP averaging at every backward(): parameters, full optimizer state,
    outputs, the learning rate and (transpiled) the collectives per step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    fn = loops.STEP_FNS[fn_name]
    runs = {}
    for how in ("fsdp", "zero", "ddp", "ddp_every_backward"):
        model = M.make("mlp")
        opt = loops._with_scheduler(M.make_optimizer(opt_name, model))
        if how in ("fsdp", "zero"):
            step = transpile(fn, mode=how, backend=backend, **TINY_BUCKETS)
            net = model
        else:
            step, net = fn, (DDP if how == "ddp" else DDPEveryBackward)(model)
        outputs = loops._run(_then_scheduler(step) if outside else step, net, opt,
                             world_size, rank)
        if how in ("fsdp", "zero"):
            with step.unsharded() if how == "fsdp" else contextlib.nullcontext():
                params = _model_state(model)
            state = step.full_optimizer_state_dict(opt)["state"]
            collectives = _collectives(step)
        else:
            params, state, collectives = _model_state(model), opt.state_dict()["state"], None
        runs[how] = Run(params, state, outputs, opt.param_groups[0]["lr"], collectives)
    return runs


def _output_error(ours: list, theirs: list) -> float:
    """The largest relative difference of the steps' outputs (a step that
    overflowed under loss scaling returns a NaN norm: NaN on both sides)."""
    worst = 0.0
    for a_step, b_step in zip(ours, theirs, strict=True):
        for a, b in zip(a_step, b_step, strict=True):
            assert torch.equal(a.isnan(), b.isnan()), (a, b)
            a, b = a[~a.isnan()].double(), b[~b.isnan()].double()
            if a.numel():
                worst = max(worst, ((a - b).abs() / b.abs().clamp_min(1e-12)).max().item())
    return worst


def _errors(ours: Run, theirs: Run) -> float:
    """The largest relative error of parameters, optimizer state and outputs;
    the learning rates equal."""
    assert ours.lr == theirs.lr
    return max(M.max_rel_error(ours.params, theirs.params),
               _state_error(ours.state, theirs.state),
               _output_error(ours.outputs, theirs.outputs))


# (idiom, optimizer, bound against DDP). Clipping sums the squares of each
# rank's shards and all-reduces the partial sums: another order than torch's
# norm of the per-parameter norms, so equal to float32 rounding. Without it,
# bit for bit: on 2 ranks the sums are DDP's (a + b).
IDIOMS = [("clip", "sgd", 1e-6), ("scaled", "sgd", 1e-6), ("scaled", "adamw", 1e-6),
          ("accumulate", "sgd", 0.0), ("scheduler_inside", "sgd", 0.0),
          ("everything", "sgd", 1e-6), ("everything", "adamw", 1e-6)]


@pytest.mark.parametrize("fn_name,opt_name,bound", IDIOMS)
def test_idioms_equal_ddp(fn_name, opt_name, bound, ranks2):
    for runs in ranks2.run(rank_idiom, fn_name, opt_name):
        assert _errors(runs["fsdp"], runs["ddp"]) <= bound
        # Keeping the parameters as shards changes no number of mode zero's.
        assert _errors(runs["fsdp"], runs["zero"]) == 0.0
        # DDP with its defaults averages at every backward(); summing the
        # micro-batches' gradients first differs from it by the rounding of
        # the intermediate averages.
        assert _errors(runs["fsdp"], runs["ddp_every_backward"]) <= max(bound, 1e-6)
        reductions, gathers = runs["fsdp"].collectives
        if fn_name == "accumulate":
            # Micro-batches: each bucket reduce-scattered once per step, after
            # the last backward(), as DDP under no_sync() does.
            assert reductions == gathers


def test_loss_scaling_skips_the_overflowing_steps(ranks2):
    """The scale starts at 2**127: the first step overflows, every rank skips
    it (the norm it returns is NaN) and halves the scale, as DDP does."""
    for runs in ranks2.run(rank_idiom, "scaled"):
        outputs = runs["fsdp"].outputs
        norms, scales = [out[0] for out in outputs], [out[1].item() for out in outputs]
        assert norms[0].isnan() and scales[0] == 2.0 ** 126
        assert not norms[-1].isnan()
        assert scales == [out[1].item() for out in runs["ddp"].outputs]


def test_scheduler_stepped_outside_the_step(ranks2):
    for runs in ranks2.run(rank_idiom, "zero_grad_after_step", "sgd", "eager", True):
        assert runs["fsdp"].lr == 0.1 * (1.0 / (1 + loops.STEPS))   # every step of the loop
        assert _errors(runs["fsdp"], runs["ddp"]) == 0.0


def _held(step) -> dict:
    return {k: v.clone() for k, v in step._held.tensors.items()}


def rank_skip_nonfinite():
    """Five steps of fsdp with skip_nonfinite, the third with an infinite
    gradient on the last rank only; DDP on the four others."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = [M.shard(b, rank, world_size) for b in M.batches("mlp", 5, 12)]
    model, ref = M.make("mlp"), M.make("mlp")
    opt, ref_opt = M.make_optimizer("adamw", model), M.make_optimizer("adamw", ref)
    ddp = DDP(ref)
    step = transpile(poisonable_step, mode="fsdp", skip_nonfinite=True, **TINY_BUCKETS)
    snapshots = []
    for i, batch in enumerate(batches):
        bad = i == 2 and rank == world_size - 1
        step(model, opt, *batch, torch.tensor(inf if bad else 0.0))
        if i in (1, 2):   # before and after the bad step
            with step.unsharded():
                params = _model_state(model)
            snapshots.append((params, step.full_optimizer_state_dict(opt)["state"],
                              _held(step)))
        if i != 2:
            poisonable_step(ddp, ref_opt, *batch, torch.tensor(0.0))
    with step.unsharded():
        params = _model_state(model)
    return (snapshots, step.skipped_steps, params, step.full_optimizer_state_dict(opt)["state"],
            _model_state(ref), ref_opt.state_dict()["state"])


def test_skip_nonfinite_leaves_every_rank_untouched(ranks2):
    results = ranks2.run(rank_skip_nonfinite)
    for snapshots, skipped, params, state, ref, ref_state in results:
        assert skipped == 1
        (before, before_state, before_held), (after, after_state, after_held) = snapshots
        assert M.max_rel_error(after, before) == 0.0
        assert _state_error(after_state, before_state) == 0.0
        # The parameter shards (and every other held tensor) too.
        assert before_held.keys() == after_held.keys()
        assert all(torch.equal(after_held[k], v) for k, v in before_held.items())
        # As if the bad batch had never been seen: DDP on the others.
        assert M.max_rel_error(params, ref) == 0.0
        assert _state_error(state, ref_state) == 0.0
    assert M.max_rel_error(results[0][2], results[1][2]) == 0.0


def rank_bf16_wire(mode):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = M.make("mlp")
    opt = M.make_optimizer("sgd", model)
    step = transpile(loops.everything, mode=mode, fuse_dtype=torch.bfloat16, **TINY_BUCKETS)
    outputs = loops._run(step, model, loops._with_scheduler(opt), world_size, rank)
    wire = {(node.meta["comm"].op, node.meta["val"].dtype) for node in step.program.collectives()}
    with step.unsharded() if mode == "fsdp" else contextlib.nullcontext():
        params = _model_state(model)
    return params, step.full_optimizer_state_dict(opt)["state"], outputs, wire


def test_bf16_on_the_wire_rounds_as_mode_zero_does(ranks2):
    fsdp, zero = ranks2.run(rank_bf16_wire, "fsdp"), ranks2.run(rank_bf16_wire, "zero")
    for (params, state, outputs, wire), (zero_params, zero_state, zero_outputs, _) in \
            zip(fsdp, zero):
        # Gradients in bf16 (gloo's reduce-scatter is an all-reduce; the
        # clipping's partial norms are all-reduced in float32); the parameters
        # gathered in their own dtype, never rounded.
        assert wire == {("all_reduce", torch.bfloat16), ("all_reduce", torch.float32),
                        ("all_gather", torch.float32)}
        assert M.max_rel_error(params, zero_params) == 0.0
        assert _state_error(state, zero_state) == 0.0
        assert _output_error(outputs, zero_outputs) == 0.0


@pytest.mark.slow   # compiles four programs
def test_inductor_equals_ddp(ranks2):
    for runs in ranks2.run(rank_idiom, "everything", "sgd", "inductor"):
        assert _errors(runs["fsdp"], runs["ddp"]) <= 1e-5


def ema_step(model, ema, optimizer, x, y):
    """An EMA of the model updated inside the step after optimizer.step()
    (timm's ModelEmaV3.update, torch's AveragedModel.update_parameters)."""
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 0.1)
    return loss


def _ema_setup(momentum: float):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    ema = copy.deepcopy(model).requires_grad_(False)
    return model, ema, torch.optim.SGD(model.parameters(), 0.1, momentum=momentum)


def _ema_batch(i: int, rank: int):
    g = torch.Generator().manual_seed(10 * i + rank)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def rank_ema_after_update(momentum: float) -> list[str]:
    rank = dist.get_rank()
    ours, theirs = _ema_setup(momentum), _ema_setup(momentum)
    ddp = DDP(theirs[0])
    step = transpile(ema_step, mode="zero")
    differ = []
    for i in range(3):
        step(*ours, *_ema_batch(i, rank))
        ema_step(ddp, *theirs[1:], *_ema_batch(i, rank))
        differ += [f"call {i}: {n}" for (n, p), q in zip(
            [*ours[0].named_parameters(), *[("ema." + n, p) for n, p in ours[1].named_parameters()]],
            [*theirs[0].parameters(), *theirs[1].parameters()]) if not torch.equal(p, q)]
    return differ


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_an_ema_updated_after_the_step_equals_ddp_in_mode_zero(momentum, ranks2):
    # it read the update computed whole from the rank's own gradient: 6e-4 off
    # DDP without momentum; with momentum (a state kept as shards) a crash
    assert ranks2.run(rank_ema_after_update, momentum) == [[], []]


def rank_fsdp_refuses_ema() -> bool:
    ours = _ema_setup(0.9)
    before = [p.detach().clone() for m in ours[:2] for p in m.parameters()]
    with pytest.raises(PassError,
                       match=r"reads m0\.\S+ after optimizer.step\(\) updated it.*use mode zero"):
        transpile(ema_step, mode="fsdp")(*ours, *_ema_batch(0, dist.get_rank()))
    return all(torch.equal(p, q) for p, q in zip(before, [p for m in ours[:2]
                                                           for p in m.parameters()]))


def test_mode_fsdp_refuses_a_parameter_read_after_its_update(ranks2):
    assert ranks2.run(rank_fsdp_refuses_ema) == [True, True]
