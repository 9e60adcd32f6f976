"""Compiled backends. inductor gives the parameters eager gives, in every mode,
on 2 CPU ranks; auto picks it on CPU; a hyperparameter change never recompiles;
a backend the device cannot run is a clear error before anything runs. The
CUDA and cudagraphs paths run where a GPU is present and skip elsewhere."""

import contextlib
import copy
import logging
import os
import re

import pytest
import torch
import torch.distributed as dist

from tests import models as M
from transpiler import TranspileError, transpile
from tests.test_passes import _captured
from transpiler.backends import compile as backends, hpu
from transpiler.runtime import compile_once
from transpiler.program.program import OutputKind

STEPS = 5
BATCH = 12
CASES = [("grad_allreduce", "adamw", {}), ("fuse_all_reduce", "sgd", {}),
         ("local_sgd", "nesterov", {"k_steps": 2})]


def _train(backend, mode, opt_name, options, rank=0, world_size=1, device="cpu"):
    model = M.make("mlp", seed=rank).to(device)
    opt = M.make_optimizer(opt_name, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
    step = transpile(M.classify_step, mode=mode, backend=backend, **options)
    for batch in M.batches("mlp", STEPS, BATCH):
        step(model, opt, *(t.to(device) for t in M.shard(batch, rank, world_size)))
        scheduler.step()
        M.change_every_hyperparameter(opt)
    return M.state_of(model, opt), step


def rank_inductor_vs_eager(mode, opt_name, options):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    frames = torch._dynamo.utils.counters["aot_autograd"]["total"]
    compiled, step = _train("inductor", mode, opt_name, options, rank, world_size)
    compiles = torch._dynamo.utils.counters["aot_autograd"]["total"] - frames
    eager, _ = _train("eager", mode, opt_name, options, rank, world_size)
    return compiled, eager, compiles, step.compiled_backend


@pytest.mark.parametrize("mode,opt_name,options", CASES, ids=[c[0] for c in CASES])
def test_inductor_equals_eager_on_ranks(mode, opt_name, options, ranks2):
    for compiled, eager, compiles, backend in ranks2.run(rank_inductor_vs_eager, mode, opt_name,
                                                         options):
        assert backend == "inductor"
        assert M.max_rel_error(compiled, eager) <= 1e-5
        # One compile per program that ran (local_sgd: local and sync): the
        # optimizer state exists before the first trace, so the first step runs
        # the steady state's program. The lr and every other hyperparameter
        # change every step without a recompile.
        assert compiles == (2 if mode == "local_sgd" else 1)


def test_auto_is_inductor_on_cpu():
    compiled, step = _train("auto", "grad_allreduce", "sgd", {})
    eager, _ = _train("eager", "grad_allreduce", "sgd", {})
    assert step.compiled_backend == "inductor"
    assert M.max_rel_error(compiled, eager) <= 1e-5


def test_new_batch_shape_recompiles_once_and_says_why(caplog):
    model = M.make("mlp")
    opt = M.make_optimizer("sgd", model)
    step = transpile(M.classify_step, backend="inductor")
    big, small = M.batches("mlp", 1, 8)[0], M.batches("mlp", 1, 4)[0]
    for batch in (big, big, big):
        step(model, opt, *batch)
    frames = torch._dynamo.utils.counters["aot_autograd"]["total"]
    with caplog.at_level(logging.INFO, logger="transpiler"):
        for batch in (small, small, big):
            step(model, opt, *batch)
    assert torch._dynamo.utils.counters["aot_autograd"]["total"] - frames == 1
    assert "float32[8, 16] on cpu -> float32[4, 16] on cpu" in caplog.text
    assert (step.traces, step.compiles) == (2, 2)   # the step's own counts say the same


def _flattening_step(model, opt, x, y):
    """A reshape: a view of a contiguous batch, a copy of any other."""
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x.reshape(x.shape[0], -1)), y)
    loss.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_batch_in_another_memory_layout_gets_a_program_of_its_own(backend, caplog):
    """contiguous, channels_last, a transposed view, then each again: each
    layout traced once (a compiled kernel asserts its input's strides; a
    reshape traced on a contiguous batch is a view) and the result eager's."""
    model, reference = M.make("mlp"), M.make("mlp")
    opts = [M.make_optimizer("sgd", m) for m in (model, reference)]
    step = transpile(_flattening_step, backend=backend)
    g = torch.Generator().manual_seed(0)
    layouts = [lambda x: x, lambda x: x.contiguous(memory_format=torch.channels_last),
               lambda x: x.transpose(2, 3).contiguous().transpose(2, 3)]
    with caplog.at_level(logging.INFO, logger="transpiler"):
        for i in range(9):
            x = layouts[i % 3](torch.randn(8, 2, 4, 2, generator=g))
            y = torch.randint(0, 4, (8,), generator=g)
            ours, theirs = step(model, opts[0], x, y), _flattening_step(reference, opts[1], x, y)
            assert torch.equal(ours, theirs) if backend == "eager" else \
                torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert step.traces == 3
    assert "(strides in the order of dims [0, 2, 3, 1])" in caplog.text
    error = M.max_rel_error(M.state_of(model, opts[0]), M.state_of(reference, opts[1]))
    assert error == 0.0 if backend == "eager" else error <= 1e-5


def test_a_warm_inductor_cache_holds_the_program(tmp_path, monkeypatch):
    """The same program compiled again (a new process, a restarted job) is read
    from inductor's caches in TORCHINDUCTOR_CACHE_DIR (AOTAutograd's, over the
    FX graph cache), and gives the same parameters."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    keys = ("autograd_cache_miss", "fxgraph_cache_miss", "autograd_cache_hit", "fxgraph_cache_hit")

    def count():   # read anew: torch may replace the counters
        c = torch._dynamo.utils.counters
        return [c["aot_autograd"][k] if k.startswith("autograd") else c["inductor"][k]
                for k in keys]

    states, runs = [], []
    for _ in range(2):
        before = count()
        model = M.make("mlp")
        opt = M.make_optimizer("sgd", model)
        step = transpile(M.classify_step, backend="inductor")
        for batch in M.batches("mlp", 2, 8):
            step(model, opt, *batch)
        states.append(M.state_of(model, opt))
        runs.append(dict(zip(keys, (a - b for a, b in zip(count(), before)))))
    cold, warm = runs
    assert cold["autograd_cache_miss"] + cold["fxgraph_cache_miss"] >= 1, cold
    assert warm["autograd_cache_miss"] + warm["fxgraph_cache_miss"] == 0, warm
    assert warm["autograd_cache_hit"] + warm["fxgraph_cache_hit"] >= 1, warm
    assert M.max_rel_error(*states) == 0.0


def test_failed_step_leaves_state_untouched_under_inductor():
    model = M.make("tied")
    opt = M.make_optimizer("adamw", model)
    step = transpile(M.lm_step, backend="inductor")
    tokens, targets = M.batches("tied", 1, 4)[0]
    for _ in range(2):
        step(model, opt, tokens, targets)
    before = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    bad = tokens.clone()
    bad[0, 0] = 1000  # out of the embedding's range
    with pytest.raises(Exception, match="index out of bounds|out of range"):
        step(model, opt, bad, targets)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before[0].items())
    after = opt.state_dict()["state"]
    assert all(torch.equal(v, after[p][k]) for p, st in before[1]["state"].items()
               for k, v in st.items())


def rank_compiles_once_per_node(cache_dir):
    """Rank 0 (the first of the node) compiles into a fresh inductor cache,
    rank 1 loads the program from it; both train as eager does."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    rank, world_size = dist.get_rank(), dist.get_world_size()
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("transpiler")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    counters = torch._dynamo.utils.counters
    before = counters["inductor"].copy()
    try:
        with temporary_cache_dir(cache_dir):
            compiled, _ = _train("inductor", "fuse_all_reduce", "sgd", {}, rank, world_size)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    counts = {k: counters["inductor"][k] - before[k]
              for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}
    eager, _ = _train("eager", "fuse_all_reduce", "sgd", {}, rank, world_size)
    return compiled, eager, counts, [x for x in lines if x.startswith("transpiler: program 'main' ")]


def test_the_first_rank_of_a_node_compiles_the_others_load(ranks2, tmp_path):
    (compiled0, eager0, counts0, lines0), (compiled1, eager1, counts1, lines1) = \
        ranks2.run(rank_compiles_once_per_node, str(tmp_path), timeout=300)
    assert counts0 == {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 1}
    assert counts1 == {"fxgraph_cache_hit": 1, "fxgraph_cache_miss": 0}
    assert len(lines0) == 1 and re.fullmatch(
        r"transpiler: program 'main' compiled by rank 0 in [\d.]+s; loaded from inductor's "
        r"cache by rank 1 in [\d.]+s", lines0[0]), lines0
    assert lines1 == []
    assert all(torch.equal(compiled0[k], compiled1[k]) for k in compiled0)
    assert M.max_rel_error(compiled0, eager0) <= 1e-5
    assert M.max_rel_error(compiled1, eager1) <= 1e-5


def rank_compile_fails_on(failing):
    """Rank `failing`'s compiler fails on the first call: every rank raises
    before any issues the program's collectives (which would leave the other
    waiting in the first all-reduce), nothing is written; the next call
    compiles again and runs. Also: whether this rank called the compiler."""
    from torch._inductor import compile_fx as inductor
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = M.make("mlp")
    opt = M.make_optimizer("sgd", model)
    step = transpile(M.classify_step, mode="fuse_all_reduce", backend="inductor", dynamic=False)
    batch = M.shard(M.batches("mlp", 1, BATCH)[0], rank, world_size)
    before = copy.deepcopy(model.state_dict())
    real = inductor.compile_fx
    calls = []

    def compiler(*args, **kwargs):
        calls.append(rank)
        if rank == failing:
            raise RuntimeError("no C++ compiler on this rank")
        return real(*args, **kwargs)

    inductor.compile_fx = compiler
    try:
        step(model, opt, *batch)
        error = None
    except Exception as exc:  # noqa: BLE001 - what each rank saw is the result
        error = f"{type(exc).__name__}: {exc}"
    finally:
        inductor.compile_fx = real
    untouched = all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    step(model, opt, *batch)
    return error, untouched, step.check_consistency(), opt.state != {}, bool(calls)


@pytest.mark.slow
@pytest.mark.parametrize("failing", [0, 1])
def test_a_rank_that_cannot_compile_stops_every_rank(failing, ranks2):
    """Rank 0 compiles first; when it fails, rank 1 does not compile at all."""
    outcomes = ranks2.run(rank_compile_fails_on, failing, timeout=300)
    other = 1 - failing
    assert outcomes[other][0] == (f"TranspileError: rank {failing} could not compile program "
                                  "'main', so no rank runs it: TranspileError: backend "
                                  "'inductor' could not compile program 'main': RuntimeError: "
                                  "no C++ compiler on this rank. The program did not run; with "
                                  "backend='eager' the step runs op by op")
    assert outcomes[failing][0] == ("TranspileError: backend 'inductor' could not compile "
                                    "program 'main': RuntimeError: no C++ compiler on this rank. "
                                    "The program did not run; with backend='eager' the step runs "
                                    "op by op")
    assert [called for *_, called in outcomes] == [True, failing == 1]
    for _, untouched, diff, stepped, _ in outcomes:
        assert untouched and stepped
    assert outcomes[0][2] == []


def rank_node_first_rank(local_world_size):
    from transpiler.runtime import node_first
    old = os.environ.pop("LOCAL_WORLD_SIZE", None)
    if local_world_size is not None:
        os.environ["LOCAL_WORLD_SIZE"] = local_world_size
    try:
        return node_first.node_first_rank()
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        if old is not None:
            os.environ["LOCAL_WORLD_SIZE"] = old


@pytest.mark.parametrize("local_world_size,first", [(None, [0, 0]), ("1", [0, 1]),
                                                    ("2", [0, 0])])
def test_node_first_rank(local_world_size, first, ranks2):
    """From torchrun's LOCAL_WORLD_SIZE where set, else from the hostnames (one host here)."""
    assert ranks2.run(rank_node_first_rank, local_world_size) == first


def test_report_says_who_compiled_and_why():
    """Two nodes of 4: on the first, rank 1 runs a program of its own (mode
    zero's shard offsets) and rank 3 missed the cache; the second has its cache off."""
    Plan, Compiled = compile_once.Plan, compile_once.Compiled
    plans = [Plan(0, "a"), Plan(0, "b"), Plan(0, "a"), Plan(0, "a")] + [Plan(4, None)] * 4
    waits = [False, False, True, True] + [False] * 4
    outcomes = [Compiled(None, False, 9.0), Compiled(None, False, 8.5), Compiled(None, True, 0.5),
                Compiled(None, False, 9.5)] + [Compiled(None, False, 10.0 + r) for r in range(4)]
    assert compile_once.report(plans, waits, outcomes) == (
        "compiled by ranks 0, 4 in 10.00s; loaded from inductor's cache by rank 2 in 0.50s; "
        "compiled at the same time by rank 1 in 8.50s (the program differs from the one of "
        "the first rank of the node); compiled at the same time by ranks 5-7 in 13.00s "
        "(inductor's cache is off there); compiled again by rank 3 in 9.50s: not found in the "
        "cache that the first rank of the node filled (is TORCHINDUCTOR_CACHE_DIR set apart?)")


def test_cudagraphs_on_a_cpu_model_is_a_clear_error():
    model = M.make("mlp")
    opt = M.make_optimizer("sgd", model)
    before = copy.deepcopy(model.state_dict())
    step = transpile(M.classify_step, backend="cudagraphs")
    with pytest.raises(TranspileError, match="backend='cudagraphs' captures CUDA graphs, but "
                                             "the model's parameters are on cpu"):
        step(model, opt, *M.batches("mlp", 1, 4)[0])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.skipif(hpu.present(), reason="the Gaudi stack is installed")
def test_hpu_without_the_gaudi_stack_says_to_install_it():
    with pytest.raises(TranspileError, match="needs the Intel Gaudi software stack"):
        transpile(M.classify_step, backend="hpu")


class _FakeGaudi:
    """The part of habana_frameworks.torch that an HPU graph replay uses. Like
    an HPU graph, a replay computes into the output tensors of the capture."""

    def __init__(self):
        self.hpu = self
        self.replay_of = None

    def HPUGraph(self):
        return self

    def Stream(self):
        return None

    def stream(self, _):
        return contextlib.nullcontext()

    def capture_begin(self):
        pass

    def capture_end(self):
        pass

    def replay(self):
        graph = self.replay_of
        for out, value in zip(graph.outputs, graph.gm(*graph.inputs)):
            out.copy_(value)


def _loss_and_doubled(w, x):
    return (w * x).sum(), w * 2


def test_hpu_graph_replay_returns_fresh_values_to_the_caller():
    gaudi = _FakeGaudi()
    replay = gaudi.replay_of = hpu._GraphReplay(gaudi, torch.fx.symbolic_trace(_loss_and_doubled),
                                                static=[True, True], returned=[True, False])
    w, x = torch.ones(3), torch.ones(3)
    loss, doubled = replay(w, x)
    w.mul_(2)   # static inputs are read where they are
    next_loss, next_doubled = replay(w, x)
    # The loss the caller kept from the first step is still the first step's.
    assert (loss.item(), next_loss.item()) == (3.0, 6.0)
    # What the runtime writes to its place before the next replay is not copied.
    assert next_doubled is doubled and torch.equal(doubled, w * 2)


def test_hpu_backend_says_which_outputs_are_returned(monkeypatch):
    seen = {}

    def compile_graph(gm, static, returned):
        seen["returned"] = returned
        return gm
    monkeypatch.setattr(hpu, "compile_graph", compile_graph)
    program = _captured().program
    backends.compile_program(program, "hpu")
    kinds = [spec.kind for spec in program.outputs if spec.kind is not OutputKind.UPDATE]
    assert seen["returned"] == [kind is OutputKind.USER for kind in kinds]
    assert seen["returned"][0] and not all(seen["returned"])


@pytest.mark.parametrize("device,group,message", [
    ("cpu", "nccl", "on cpu but the step's process group uses 'nccl': initialize it "
                    "with backend='gloo'"),
    ("cuda", "mpi", "on cuda but the step's process group uses 'mpi': initialize it "
                    "with backend='nccl'"),
    ("cuda", "cpu:gloo,cuda:mpi", "uses 'mpi'"),
])
def test_process_group_must_match_the_device(device, group, message, monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_backend", lambda _=None: group)
    with pytest.raises(TranspileError, match=message):
        backends.check_process_group(torch.device(device))


def test_process_group_matching_the_device_passes(monkeypatch):
    for device, group in [("cpu", "gloo"), ("cuda", "nccl"), ("cuda", "gloo"),
                          ("cpu", "cpu:gloo,cuda:nccl")]:
        monkeypatch.setattr(torch.distributed, "get_backend", lambda _=None, group=group: group)
        backends.check_process_group(torch.device(device))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("backend", ["inductor", "cudagraphs", "auto"])
def test_cuda_backend_equals_eager(backend):
    compiled, step = _train(backend, "grad_allreduce", "adamw", {}, device="cuda")
    eager, _ = _train("eager", "grad_allreduce", "adamw", {}, device="cuda")
    assert M.max_rel_error(compiled, eager) <= 1e-5
    assert step.compiled_backend == ("inductor" if backend == "auto" else backend)


@pytest.mark.parametrize("opt_name,foreach", [("sgd", False), ("nesterov", False), ("adam", False),
                                              ("adamw", False), ("adamw", True)])
def test_optimizers_compile(opt_name, foreach):
    # The trace takes every optimizer's foreach formulation whatever the user
    # chose, so the single-tensor and foreach variants compile alike.
    states = []
    for backend in ("inductor", "eager"):
        model = M.make("mlp")
        opt = M.make_optimizer(opt_name, model, foreach=foreach)
        step = transpile(M.classify_step, backend=backend)
        for batch in M.batches("mlp", 3, BATCH):
            step(model, opt, *batch)
        states.append(M.state_of(model, opt))
    assert M.max_rel_error(*states) <= 1e-5


def _update_graph(device_reads_count: bool):
    """p (CUDA) -= lr * p, and the step count (CPU) += 1, each written in place;
    optionally the CUDA update also reads the new count."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    mode = FakeTensorMode()

    def fake(device):
        return FakeTensor(mode, torch.empty((), device="meta"), torch.device(device))

    graph, aten = torch.fx.Graph(), torch.ops.aten
    p, count, lr = (graph.placeholder(n) for n in ("p", "count", "lr"))
    for node, device in ((p, "cuda"), (count, "cpu"), (lr, "cuda")):
        node.meta["val"] = fake(device)
    new_count = graph.call_function(aten.add.Tensor, (count, 1))
    new_count.meta["val"] = fake("cpu")
    graph.call_function(aten.copy_.default, (count, new_count)).meta["val"] = fake("cpu")
    scale = new_count if device_reads_count else lr
    step = graph.call_function(aten.mul.Tensor, (p, scale))
    step.meta["val"] = fake("cuda")
    graph.call_function(aten.copy_.default, (p, step)).meta["val"] = fake("cuda")
    graph.output((step, new_count))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_host_work_is_split_off_the_cuda_graph():
    # torch's default Adam counts its steps in a CPU tensor: a CUDA graph would
    # replay without incrementing it, so that work runs on the host each call.
    from transpiler.backends.cuda_graphs import split_host
    split = split_host(_update_graph(device_reads_count=False))
    assert split.crossing is None
    host_ops = [n.target for n in split.host.graph.nodes if n.op == "call_function"]
    device_ops = [n.target for n in split.device.graph.nodes if n.op == "call_function"]
    assert host_ops == [torch.ops.aten.add.Tensor, torch.ops.aten.copy_.default]
    assert device_ops == [torch.ops.aten.mul.Tensor, torch.ops.aten.copy_.default]
    assert split.outputs == [(False, 0), (True, 0)]


def test_device_code_reading_a_changing_host_value_is_not_captured():
    from transpiler.backends.cuda_graphs import split_host
    split = split_host(_update_graph(device_reads_count=True))
    assert split.host is None and "reads add_tensor, a CPU value that changes" in split.crossing


def test_device_code_reading_a_lifted_number_is_not_captured():
    # A lifted number (capture/numbers.py) is read from a CPU tensor each call:
    # a CUDA graph would keep the kernel argument of its capture.
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from transpiler.backends.cuda_graphs import split_host
    mode = FakeTensorMode(shape_env=ShapeEnv())
    graph, aten = torch.fx.Graph(), torch.ops.aten
    p, w = graph.placeholder("p"), graph.placeholder("w")
    p.meta["val"] = FakeTensor(mode, torch.empty(3, device="meta"), torch.device("cuda"))
    w.meta["val"] = FakeTensor(mode, torch.empty((), dtype=torch.float64, device="meta"),
                               torch.device("cpu"))
    number = graph.call_function(aten._local_scalar_dense.default, (w,))
    number.meta["val"] = mode.shape_env.create_unbacked_symfloat()
    scaled = graph.call_function(aten.mul.Tensor, (p, number))
    scaled.meta["val"] = p.meta["val"]
    graph.output((scaled,))
    split = split_host(torch.fx.GraphModule(torch.nn.Module(), graph))
    assert split.host is None and "reads _local_scalar_dense" in split.crossing
