"""An update that may be skipped (GradScaler's on an overflow, skip_nonfinite)
runs or is skipped on a host read in the eager backend, in place, as eager's
optimizer does; the branch-free select stays where the update issues a
collective. That the values equal DDP's, overflowing steps included, is
tested by test_training_loops ("scaled") and test_skip_nonfinite."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.test_passes import CTX
from transpiler import run_passes, transpile
from transpiler.backends.compile import compile_program
from transpiler.capture import flatten_args, trace_step
from transpiler.modes import MODES
from transpiler.program.program import InputKind, OutputKind
from transpiler.backends.skipped_update import plan


def scaled_step(model, opt, scaler, x, y):
    opt.zero_grad()
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    scaler.unscale_(opt)
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    return x.sum()


def _setup(init_scale=2.0 ** 16, device="cpu"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler(device, init_scale=init_scale)
    x, y = torch.randn(6, 4, device=device), torch.randint(0, 3, (6,), device=device)
    scaled_step(model, opt, scaler, x, y)   # momentum buffers made: the steady-state program
    return model, opt, scaler, x, y


def _program(passes=MODES["fuse_all_reduce"]):
    args = _setup()
    program = trace_step(scaled_step, flatten_args(scaled_step, args, {})).program
    run_passes(program, passes, CTX)
    return program


def test_the_update_is_cut_off_and_written_in_place():
    program = _program()
    cut = plan(program)
    assert cut is not None
    updated = {spec.target for spec in program.outputs if spec.kind is OutputKind.UPDATE}
    kinds = {spec.name: spec.kind for spec in program.inputs}
    # every parameter and momentum buffer is guarded; the scaler's scale is not
    guarded = {program.outputs[k].target for k in cut.guarded}
    assert guarded == {t for t in updated if kinds[t] in (InputKind.PARAM, InputKind.STATE)}
    executable = compile_program(program, "eager")
    in_place = {spec.target for spec, w in zip(program.outputs, executable.written) if w}
    assert guarded <= in_place


def test_the_gradients_are_unscaled_in_place():
    """unscale_ writes the gradients and found_inf in place, as eager's
    GradScaler does; its functional form cloned every gradient first."""
    from transpiler.backends.reinplace import reinplace
    from transpiler.backends.skipped_update import split
    program = _program()
    prefix = split(program, plan(program))[0]
    targets = {n.target for n in reinplace(prefix)[0].graph.nodes}
    aten = torch.ops.aten
    assert aten._amp_foreach_non_finite_check_and_unscale_.default in targets
    assert aten._amp_foreach_non_finite_check_and_unscale.default not in targets


@pytest.mark.parametrize("passes", [MODES["local_sgd"]["sync"], MODES["zero"]],
                         ids=["local_sgd-sync", "zero"])
def test_an_update_that_feeds_a_collective_keeps_its_select(passes):
    """local SGD's sync averages the updated parameters, zero gathers the
    updated shards: skipping would skip a collective on a rank alone."""
    program = _program(passes)
    assert any(n.target is torch.ops.aten.where.self for n in program.graph.nodes)
    assert plan(program) is None


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs a CUDA device"))])
def test_an_overflowing_step_is_skipped_and_the_others_equal_eager(device):
    """One process, scales that overflow and scales that do not: bit for bit
    with eager at every call."""
    for init_scale in (2.0 ** 127, 2.0 ** 8):
        ours = _setup(init_scale, device)
        theirs = copy.deepcopy(ours)
        step = transpile(scaled_step)
        for i in range(4):
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(i)).to(device)
            step(*ours[:3], x, ours[4])
            scaled_step(*theirs[:3], x, theirs[4])
            for p, q in zip(ours[0].parameters(), theirs[0].parameters()):
                assert torch.equal(p, q), (init_scale, i)
            assert torch.equal(ours[2]._scale, theirs[2]._scale)
