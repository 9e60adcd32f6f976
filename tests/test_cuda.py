"""On a CUDA device (skipped without one): the whole step as one CUDA graph
(backend="cudagraphs") captures every program of fuse_all_reduce, zero and
local SGD on nccl and equals the same programs compiled by inductor without a
graph; the eager backend equals eager in one process with every model and
optimizer; CUDA tensors on gloo (several ranks on one GPU) equal torch DDP;
teardown after captured nccl work does not hang."""

import logging
import multiprocessing

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import transpile

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.slow]

STEPS = 6


def _init_nccl(store: str) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))


@pytest.fixture
def nccl(tmp_path):
    _init_nccl(str(tmp_path / "store"))
    yield
    dist.destroy_process_group()


def _train(backend, mode, opt_name, options, replace_state_at=None):
    model = M.make("mlp").cuda()
    opt = M.make_optimizer(opt_name, model)
    step = transpile(M.classify_step, mode=mode, backend=backend, **options)
    losses = []
    for i, batch in enumerate(M.batches("mlp", STEPS, 12)):
        if i == replace_state_at:   # a state tensor that is another tensor now
            for state in opt.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.is_cuda:
                        state[key] = value.clone()
        losses.append(step(model, opt, *(t.cuda() for t in batch)))
        M.change_every_hyperparameter(opt)
    return M.state_of(model, opt), losses, step


CASES = [("fuse_all_reduce", "sgd", {}), ("fuse_all_reduce", "adamw", {}), ("zero", "adamw", {}),
         ("local_sgd", "nesterov", {"k_steps": 2}), ("grad_allreduce", "adam", {})]


@pytest.mark.parametrize("mode,opt_name,options", CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_cudagraphs_captures_every_program_and_equals_inductor(mode, opt_name, options, nccl,
                                                                caplog):
    with caplog.at_level(logging.INFO, logger="transpiler"):
        graphed, graphed_losses, step = _train("cudagraphs", mode, opt_name, options)
    compiled, losses, _ = _train("inductor", mode, opt_name, options)
    assert set(step.cuda_graphs.values()) == {"captured"}, step.cuda_graphs
    assert "captured as one CUDA graph" in caplog.text
    assert "skipping cudagraphs" not in caplog.text
    # The same kernels, replayed: equal bit for bit when both programs load the
    # same compiled code (seen on an H100 in every case). Two cold compiles may
    # autotune a reduction to another block size (seen once: 1 ulp in a
    # momentum buffer), hence the float32 rounding bound.
    assert M.max_rel_error(graphed, compiled) <= 1e-6
    # Every loss the caller kept is its own: the graph's output is copied.
    assert len({loss.data_ptr() for loss in graphed_losses}) == STEPS
    assert M.max_rel_error(dict(enumerate(graphed_losses)), dict(enumerate(losses))) <= 1e-6


@pytest.mark.parametrize("foreach", [None, False], ids=["default", "single_tensor"])
@pytest.mark.parametrize("opt_name", ["sgd", "nesterov", "adam", "adamw"])
@pytest.mark.parametrize("model_name", ["mlp", "tied", "bn", "mixed"])
def test_the_eager_backend_equals_eager_on_cuda(model_name, opt_name, foreach):
    """One process, each hyperparameter changed after every call: bit for bit
    as eager on CUDA, whose kernels round otherwise than the CPU's (the update
    reads Python numbers there: capture/optimizers.py)."""
    runs = []
    for transpiled in (True, False):
        model = M.make(model_name).cuda()
        opt = M.make_optimizer(opt_name, model, foreach=foreach)
        step = transpile(M.step_fn(model_name)) if transpiled else M.step_fn(model_name)
        for batch in M.batches(model_name, 4, 8):
            step(model, opt, *(t.cuda() for t in batch))
            M.change_every_hyperparameter(opt)
        runs.append(M.state_of(model, opt))
    M.assert_states_equal(*runs)


def test_a_replaced_state_tensor_is_captured_again(nccl, caplog):
    with caplog.at_level(logging.INFO, logger="transpiler"):
        graphed, _, step = _train("cudagraphs", "fuse_all_reduce", "sgd", {}, replace_state_at=3)
    compiled, _, _ = _train("inductor", "fuse_all_reduce", "sgd", {}, replace_state_at=3)
    assert "captured again" in caplog.text
    assert set(step.cuda_graphs.values()) == {"captured"}
    assert M.max_rel_error(graphed, compiled) <= 1e-6


def annealed_step(model, opt, x, y, k):
    """A temperature the loop anneals on the module and a branch on the call's
    counter: lifted numbers (capture/numbers.py), the branch a number guard."""
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x) / model.temperature, y)
    if k % 2 == 0:
        loss = loss * 2
    loss.backward()
    opt.step()
    return loss.detach()


def _train_annealed(backend):
    model = M.make("mlp").cuda()
    opt = M.make_optimizer("adamw", model)
    step = transpile(annealed_step, backend=backend) if backend else annealed_step
    for i, batch in enumerate(M.batches("mlp", 4, 12)):
        model.temperature = 1.0 - 0.05 * i
        step(model, opt, *(t.cuda() for t in batch), i)
    return M.state_of(model, opt), step


@pytest.mark.parametrize("backend", ["eager", "cudagraphs"])
def test_lifted_numbers_and_their_guards_on_cuda(backend, nccl):
    ours, step = _train_annealed(backend)
    theirs, _ = _train_annealed(None)
    # call 0 traced with the values, then lifted: a program per parity
    assert step._cache.builds == 3
    assert M.max_rel_error(ours, theirs) <= (0.0 if backend == "eager" else 1e-5)


def _teardown_after_capture(store: str) -> None:
    _init_nccl(store)
    _train("cudagraphs", "fuse_all_reduce", "sgd", {})
    dist.destroy_process_group()


def test_destroying_the_process_group_after_captured_nccl_work_returns(tmp_path):
    process = multiprocessing.get_context("spawn").Process(
        target=_teardown_after_capture, args=(str(tmp_path / "store"),))
    process.start()
    process.join(timeout=300)
    hung = process.is_alive()
    if hung:
        process.kill()
    assert not hung and process.exitcode == 0


def rank_cuda_on_gloo_vs_ddp(mode, opt_name):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    states = {}
    for name in ("ddp", mode, "cudagraphs"):
        model = M.make("mlp", seed=rank).cuda()   # the broadcast at the start makes them agree
        opt = M.make_optimizer(opt_name, model)
        if name == "ddp":
            def step(model, opt, *batch, ddp=DDP(model)):
                return M.classify_step(ddp, opt, *batch)
        else:
            step = transpile(M.classify_step, mode=mode,
                             backend="cudagraphs" if name == "cudagraphs" else "eager")
        for batch in M.batches("mlp", 4, 12):
            step(model, opt, *(t.cuda() for t in M.shard(batch, rank, world_size)))
        states[name] = {k: v.cpu() for k, v in M.state_of(model, opt).items()}
        if name == "cudagraphs":
            states["why_not"] = step.cuda_graphs
    return states


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_cuda_tensors_on_gloo_equal_ddp(opt_name, ranks2):
    for states in ranks2.run(rank_cuda_on_gloo_vs_ddp, "fuse_all_reduce", opt_name):
        for name in states["ddp"]:
            assert torch.equal(states["fuse_all_reduce"][name], states["ddp"][name]), name
        assert all("run on 'gloo'" in why for why in states["why_not"].values())
