"""Mode all_gather (gather_grads, Paddle's all_gather mode): every rank gathers
every rank's gradients and applies the update once per rank's gradient in rank
order. Against a hand-written reference in plain torch, on 2 and 3 ranks."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests import models as M
from tests.test_fuse_all_reduce import SMALL
from tests.test_passes import _captured, _check_golden
from tests.test_training_loops import clip
from transpiler import PassError, TranspileError, run_passes, transpile
from transpiler.capture import flatten_args, trace_step
from transpiler.modes import MODES
from transpiler.program.roles import ROLE, Role

STEPS = 3


def test_golden_all_gather():
    program = _captured().program
    updates = sum(1 for n in program.graph.nodes if n.meta.get(ROLE, 0) & Role.OPTIMIZE)
    run_passes(program, MODES["all_gather"], SMALL)   # two ranks, two buckets
    _check_golden("all_gather", str(program))
    assert [n.meta["comm"].op for n in program.collectives()] == ["all_gather"] * 2
    # The update replayed once per rank.
    assert sum(1 for n in program.graph.nodes if n.meta.get(ROLE, 0) & Role.OPTIMIZE) \
        == 2 * updates


def reference(model_name, opt_name, clipped, world_size):
    """Plain torch in one process: each rank's gradient at the step's starting
    parameters, then optimizer.step() once per rank's gradient, in rank order."""
    model = M.make(model_name)
    opt = M.make_optimizer(opt_name, model)
    params = [p for p in model.parameters() if p.requires_grad]
    for batch in M.batches(model_name, STEPS, 12):
        grads = []
        for r in range(world_size):
            opt.zero_grad()
            x, y = M.shard(batch, r, world_size)
            out = model(x)
            F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in params])
        for r in range(world_size):
            for p, g in zip(params, grads[r]):
                p.grad = g
            if clipped:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
    return M.state_of(model, opt)


def rank_all_gather(model_name, opt_name, clipped, backend="eager"):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = M.make(model_name)
    opt = M.make_optimizer(opt_name, model)
    fn = clip if clipped else M.step_fn(model_name)
    step = transpile(fn, mode="all_gather", backend=backend, bucket_mb=2048 / 2**20,
                     first_bucket_mb=256 / 2**20)
    for batch in M.batches(model_name, STEPS, 12):
        step(model, opt, *M.shard(batch, rank, world_size))
    ops = [node.meta["comm"].op for node in step.program.collectives()]
    return M.state_of(model, opt), reference(model_name, opt_name, clipped, world_size), ops


# SGD's and AdamW's updates are torch's default ones: bit for bit.
@pytest.mark.parametrize("model_name,opt_name,clipped", [("mlp", "sgd", False),
                                                         ("tied", "adamw", False),
                                                         ("mlp", "sgd", True)])
@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_equals_the_reference(world_size, model_name, opt_name, clipped,
                                         ranks2, ranks3):
    pool = ranks2 if world_size == 2 else ranks3
    results = pool.run(rank_all_gather, model_name, opt_name, clipped)
    for ours, ref, ops in results:
        assert M.max_rel_error(ours, ref) == 0.0
        assert set(ops) == {"all_gather"} and len(ops) >= 2
    # Every rank took the same N updates.
    assert all(torch.equal(results[0][0][k], r[0][k]) for r in results[1:] for k in results[0][0])


def test_inductor_compiles_the_replays(ranks2):
    for ours, ref, _ in ranks2.run(rank_all_gather, "mlp", "adamw", True, "inductor"):
        assert M.max_rel_error(ours, ref) <= 1e-5


def test_options_all_gather_does_not_combine_with_are_refused_up_front():
    for option in (dict(verify=1), dict(skip_nonfinite=True), dict(fuse_dtype=torch.bfloat16)):
        with pytest.raises(TranspileError, match="all_gather"):
            transpile(M.classify_step, mode="all_gather", **option)


def _scaled_step(model, opt, scaler, x, y):
    opt.zero_grad()
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()


def test_a_grad_scaler_is_refused_with_what_to_use():
    """GradScaler's found_inf decides one skip and one scale update per step;
    N replays of the update have no such single decision."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    batch = (torch.randn(4, 4), torch.tensor([0, 1, 2, 0]))
    _scaled_step(model, opt, scaler, *batch)   # the momentum buffers exist
    program = trace_step(_scaled_step, flatten_args(_scaled_step, (model, opt, scaler, *batch),
                                                    {})).program
    with pytest.raises(PassError, match="GradScaler.*use mode 'fuse_all_reduce'"):
        run_passes(program, MODES["all_gather"], SMALL)
