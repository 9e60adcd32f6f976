"""Backends: turn a Program into an Executable. One place where compilers plug in.

    eager       the program's graph run op by op, with in-place updates
                (transpiler/backends/reinplace.py): the reference
    inductor    the program compiled by inductor, collectives included (CPU and CUDA)
    cudagraphs  inductor, and each program captured as one CUDA graph of the
                whole step (CUDA only; transpiler/backends/cuda_graphs.py)
    hpu         Intel Gaudi: hpu_backend in eager mode, an HPU graph in lazy mode
    auto        hpu on a Gaudi device, else inductor

The compiled backends compile a variant of the program that writes each state
update into its input (a copy_ at the end, which the compiler fuses into the
kernel that computes it), so no write-back is left to the runtime: each update
whose value comes after every collective and depends on every other op that
may raise (failure_points.py), so that a failure leaves the state as it was.
The others (BatchNorm's statistics, computed in the forward pass; mode zero's
state shards, updated before the parameters are gathered) are outputs the
runtime writes back once the program has succeeded.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Callable

import torch
import torch.fx as fx

from ..capture.meta_fallback import kernels_where_meta_refuses
from ..capture.shapes import is_symbolic
from .compiler_graph import (draws_as_kernels, draws_in_eager_order, lower_in_order, packs_as_cat,
                             pool_grads_as_kernels, reshapes_in_steps, scatters_as_kernels, unscales_as_math,
                             views_as_reshapes)
from .checks_on_failure import checks_on_failure
from .cuda_graphs import WholeStepGraph, collectives_not_capturable, split_host
from ..errors import TranspileError
from .failure_points import written_safely
from ..program.program import InputKind, OutputKind, Program, graph_module, same_layout
from . import skipped_update
from .op_calls import direct
from .reinplace import reinplace
from ..world import backend_for
from ..program.roles import INPUT

log = logging.getLogger("transpiler")

BACKENDS = ("eager", "inductor", "cudagraphs", "hpu", "auto")
# The process-group backends that reduce each device's tensors, the fastest first
# (gloo reduces CUDA tensors through the host: several ranks on one GPU).
PROCESS_GROUP = {"cpu": ("gloo",), "cuda": ("nccl", "gloo"), "hpu": ("hccl",)}


@dataclasses.dataclass
class Executable:
    """run: input tensors -> output tensors. written[i]: output i is a state
    update the program already wrote into its input (no write-back needed;
    its value in the list returned by run is not used). prepare: compile for
    these inputs, before the first run (which would otherwise compile), and
    say whether the compiled program was loaded from inductor's cache; None
    where there is nothing to compile."""

    run: Callable[[list], list]
    written: list[bool]
    prepare: Callable[[list], bool] | None = None
    graph: WholeStepGraph | None = None   # cudagraphs: the program's CUDA graph
    why_not: str | None = None            # cudagraphs: why the program is not captured


def device_of(program: Program) -> torch.device:
    """The device of the program's parameters (cpu for a program without any)."""
    for node in program.placeholders:
        if node.meta[INPUT].kind is InputKind.PARAM:
            return node.meta["val"].device
    return torch.device("cpu")


def resolve(backend: str, device: torch.device) -> str:
    """The concrete backend for a program on `device`; raises if it cannot run there."""
    if backend == "auto":
        return "hpu" if device.type == "hpu" else "inductor"
    if device.type == "hpu" and backend in ("inductor", "cudagraphs"):
        raise TranspileError(f"backend={backend!r} does not run on Intel Gaudi, where the "
                             "model's parameters are: use backend='hpu' (or 'auto')")
    if backend == "cudagraphs" and device.type != "cuda":
        raise TranspileError(f"backend='cudagraphs' captures CUDA graphs, but the model's "
                             f"parameters are on {device.type}: move the model to a CUDA "
                             "device, or use backend='inductor' or 'eager'")
    if backend == "hpu" and device.type != "hpu":
        raise TranspileError(f"backend='hpu' runs on Intel Gaudi, but the model's parameters "
                             f"are on {device.type}: move the model to 'hpu', or use "
                             "backend='auto'")
    return backend


def check_process_group(device: torch.device) -> None:
    """The step's process group must be able to reduce tensors of `device`."""
    need = PROCESS_GROUP.get(device.type)
    got = backend_for(device.type)
    if need is not None and got not in need:
        raise TranspileError(
            f"the model's parameters are on {device.type} but the step's process group "
            f"uses {got!r}: initialize it with backend={need[0]!r} for {device.type} tensors "
            f"(torch.distributed.init_process_group({need[0]!r}))")


def compile_program(program: Program, backend: str) -> Executable:
    if backend == "eager":
        skipping = skipped_update.executable(program, _op_by_op)
        if skipping is not None:   # the update run or skipped on a host read, as eager's
            return Executable(*skipping)
        run, written = _op_by_op(program)
        return Executable(lambda inputs: run(*inputs), written)
    if backend == "inductor":
        return _checked(program, _with_outputs(*_updating_inputs(program),
                                               lambda gm, static: _Inductor(gm)))
    if backend == "cudagraphs":
        return _whole_step_graph(program)
    if backend == "hpu":
        from . import hpu
        gm, written = _updating_inputs(program)
        returned = [spec.kind is OutputKind.USER
                    for spec, w in zip(program.outputs, written) if not w]
        return _checked(program, _with_outputs(gm, written, hpu.compile_graph, returned=returned))
    raise TranspileError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")


def _checked(program: Program, executable: Executable) -> Executable:
    """A compiled executable that raises a decision's failed check where it
    fails for a call that decides otherwise (checks_on_failure.py)."""
    return dataclasses.replace(executable, run=checks_on_failure(program, executable.run))


def _op_by_op(program: Program) -> tuple[Callable, list[bool]]:
    """The eager backend's function of the program's inputs (reinplaced, its
    ops called directly) and which outputs it writes in place."""
    gm, written = reinplace(program)
    return direct(gm), written


# The program's node order is already scheduled for overlap (schedule_comm):
# inductor's own reordering for memory would move the gradients a bucket waits
# for after the rest of the backward pass. fallback_random: random ops (dropout's
# bernoulli, rand, randn, randint) run as ATen's kernels, in the program's order,
# so they draw the same numbers from torch's generator as the eager step and
# leave it in the same state; inductor's own RNG (Philox seeds it draws from the
# generator) would give other dropout masks than eager and, on CPU, shift every
# later draw. max_fusion_buffer_group_pairwise_attempts: inductor looks for
# fusions among the nodes that read a common buffer, each node against the next
# 64 (its default) of them; the hyperparameters (0-d tensors) are read by every
# parameter's update kernel, and checking those pairs (which would share 4
# bytes) was the largest part of its fusion search on the bench's `deep` model.
# With 8 the generated code of wide, deep and transformer is line for line the
# same, and deep compiles in 15 % less time.
_INDUCTOR_OPTIONS = {"reorder_for_peak_memory": False, "reorder_for_locality": False,
                     "fallback_random": True, "max_fusion_buffer_group_pairwise_attempts": 8}
# On CPU, inductor's layout optimization runs every convolution channels-last:
# a whole step then transposes each convolution's weight before the forward
# pass and its gradient back to the parameter's layout for the update, every
# step. On the bench's resnet18 (bf16 autocast, 48 px) the step took 126-155
# ms with it and 96 ms without, against eager's 94-105 ms.
_CPU_INDUCTOR_OPTIONS = dict(_INDUCTOR_OPTIONS, layout_optimization=False)
# On CUDA, inductor's loop reordering for fusion (loop_ordering_after_fusion)
# fails on the bench's GPT models in torch 2.11
# (AssertionError in Scheduler.reorder_loops_by_dep_pair, a fused node where it
# expects a single one); CPU code does not reorder loops that way.
_CUDA_INDUCTOR_OPTIONS = dict(_INDUCTOR_OPTIONS, loop_ordering_after_fusion=False)


class _Inductor:
    """Inductor on the program's graph as it is: it is already whole, functional
    and ATen-level, so it goes to the compiler directly (no Dynamo re-trace, no
    guards), compiled from the real inputs (prepare, or the first call)."""

    def __init__(self, gm: fx.GraphModule):
        # Importing inductor takes seconds: done here, before a rank waits for
        # the first rank of its node to compile (compile_once.py), not after.
        import torch._inductor.compile_fx  # noqa: F401
        lower_in_order()
        self.gm = gm
        self.compiled = None

    def prepare(self, inputs: list) -> bool:
        """Compile for `inputs`; whether inductor loaded the program from its
        caches (AOTAutograd's, the FX graph cache) instead of compiling it."""
        if self.compiled is not None:
            return False
        from torch._inductor.compile_fx import compile_fx
        on_cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs)
        options = _CUDA_INDUCTOR_OPTIONS if on_cuda else _CPU_INDUCTOR_OPTIONS
        if _holds_generator(self.gm):
            # A program's own torch.Generator (capture/rng_lanes.py: draws from a
            # seed inside fork_rng) comes back from inductor's FX graph cache as a
            # copy that nothing seeds: such a program is compiled, not loaded.
            options = dict(options, fx_graph_cache=False)
        before = _cache_lookups()
        # inductor propagates fake tensors through the program as the trace
        # did: an op whose meta function refuses what its CPU kernel computes
        # (fp32 aten._grouped_mm, transformers' MoE experts) takes the kernel's result
        with _cacheable(self.gm), kernels_where_meta_refuses():
            self.compiled = compile_fx(self.gm, _examples(self.gm, inputs),
                                       config_patches=options)
        hits, misses = (after - b for after, b in zip(_cache_lookups(), before))
        return hits > 0 and misses == 0

    def __call__(self, *inputs):
        if self.compiled is None:
            self.prepare(list(inputs))
        return self.compiled(*inputs)


def _holds_generator(gm: fx.GraphModule) -> bool:
    return any(isinstance(getattr(gm, node.target, None), torch.Generator)
               for node in gm.graph.nodes if node.op == "get_attr")


def inductor_cache_on() -> bool:
    """Whether inductor keeps what it compiles on disk (its FX graph cache, in
    TORCHINDUCTOR_CACHE_DIR), where another process can load it."""
    import torch._inductor.config as config
    return config.fx_graph_cache and not config.force_disable_caches


def _cache_lookups() -> tuple[int, int]:
    """inductor's cache hits and misses so far (a miss: looked up and not
    found, or not looked up), AOTAutograd's cache (over the FX graph cache)
    and the FX graph cache's together."""
    counters = torch._dynamo.utils.counters   # read anew: torch may replace them
    aot, inductor = counters["aot_autograd"], counters["inductor"]
    return (aot["autograd_cache_hit"] + inductor["fxgraph_cache_hit"],
            sum(aot[f"autograd_cache_{k}"] + inductor[f"fxgraph_cache_{k}"]
                for k in ("miss", "bypass")))


def _cacheable(gm: fx.GraphModule):
    """What lets inductor's FX graph cache hold the program: it keys an entry's
    guards on a shape environment, which it reads from the tracing context that
    Dynamo would have set (without one it bypasses the cache). The shapes stay
    static: no input is given a source, so none becomes a symbol. A program
    holding a lifted number (capture/numbers.py) or a data-dependent size keeps
    the shape environment of its trace, where that symbol lives: inductor's
    retrace binds its own symbol for it to that one (in a fresh environment its
    own would be named as the trace's, and the binding refused)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    symbolic = next((v.fake_mode for v in _placeholder_values(gm) if is_symbolic(v)), None)
    if symbolic is not None:
        return tracing(TracingContext(symbolic))
    traced = next(filter(None, (_shape_env_of(node) for node in gm.graph.nodes)), None)
    fake_mode = FakeTensorMode(shape_env=traced or ShapeEnv())
    return tracing(TracingContext(fake_mode))


def _shape_env_of(node: fx.Node):
    """The shape environment of the trace where `node` holds a symbol: a
    symbolic number, or a data-dependent size (masked_select's, nonzero's,
    even one a decision fixed)."""
    value = node.meta.get("val")
    if isinstance(value, (torch.SymFloat, torch.SymInt)):
        return value.node.shape_env
    if is_symbolic(value) or (node.meta.get("unbacked_bindings")
                              and isinstance(value, torch.Tensor)):
        return value.fake_mode.shape_env
    return None


def _placeholder_values(gm: fx.GraphModule) -> list:
    return [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]


def _examples(gm: fx.GraphModule, inputs: list) -> list:
    """What inductor compiles the program for, inside _cacheable's tracing
    context: for a batch input with symbolic dimensions (capture/shapes.py)
    its fake tensor from the trace, so that the code is generated for every
    size its guards allow, not for this call's; for every other tensor a fake
    one of the context's mode with static sizes (given a real tensor, AOTAutograd
    would make each of its sizes a symbol of the context's shape environment:
    dynamic kernels, and a convolution's output size that its float arithmetic
    cannot bind), of a view into a larger tensor (a rank's chunk of a global
    batch) at offset 0, so that every rank compiles the same code (one compile
    per node)."""
    from torch._guards import TracingContext
    fake_mode = TracingContext.get().fake_mode
    return [v if is_symbolic(v)
            else fake_mode.from_tensor(same_layout(x) if x.storage_offset() else x,
                                       static_shapes=True)
            if isinstance(x, torch.Tensor) else x
            for v, x in zip(_placeholder_values(gm), inputs)]


def _with_outputs(gm: fx.GraphModule, written: list[bool], compile_graph, **options) -> Executable:
    # Parameters, buffers, optimizer state and held tensors keep their addresses
    # from call to call: a captured graph may use them in place.
    gm.real_recompile()   # compilers trace the generated forward
    compiled = compile_graph(gm, _static(gm), **options)

    def run(inputs):
        returned = iter(compiled(*inputs))
        return [None if w else next(returned) for w in written]
    return Executable(run, written, compiled.prepare if isinstance(compiled, _Inductor) else None)


def _static(gm: fx.GraphModule) -> list[bool]:
    """Per input: whether it keeps its address from call to call (parameters,
    buffers, optimizer state, held tensors), so that a captured graph may use it
    in place."""
    return [n.meta[INPUT].kind in (InputKind.PARAM, InputKind.BUFFER, InputKind.STATE,
                                   InputKind.HELD)
            for n in gm.graph.nodes if n.op == "placeholder"]


def _whole_step_graph(program: Program) -> Executable:
    """The program's device part compiled by inductor and captured as one CUDA
    graph; the CPU work that depends on its inputs run op by op before it."""
    gm, written = _updating_inputs(program)
    split = split_host(gm)
    split.device.real_recompile()   # compilers trace the generated forward
    placeholders = [n for n in split.device.graph.nodes if n.op == "placeholder"]
    static = _static(split.device)
    inductor = _Inductor(split.device)
    why_not = split.crossing or collectives_not_capturable(split.device)
    graph = None
    if why_not is None:
        writes = {n.args[0] for n in split.device.graph.nodes
                  if n.op == "call_function" and n.target is torch.ops.aten.copy_.default}
        kinds = [spec.kind for spec, w in zip(program.outputs, written) if not w]
        fresh = [kinds[k] is OutputKind.USER
                 for k, (on_host, _) in enumerate(split.outputs) if not on_host]
        graph = WholeStepGraph(inductor, static, [p in writes for p in placeholders], fresh,
                               program.name)
    else:
        log.warning("transpiler: program %r is not captured as a CUDA graph: %s; it runs "
                    "compiled by inductor", program.name, why_not)
    device = graph or inductor

    def run(inputs):
        host = split.host(*inputs) if split.host is not None else ()
        device_outputs = device(*inputs)
        returned = iter([(host if on_host else device_outputs)[i] for on_host, i in split.outputs])
        return [None if w else next(returned) for w in written]
    return Executable(run, written, inductor.prepare, graph, why_not)


def _updating_inputs(program: Program) -> tuple[fx.GraphModule, list[bool]]:
    """A copy of the program that writes each `update` output it may write
    safely (failure_points.written_safely) into its input (copy_ at the end)
    and returns the other outputs; for each output of the program, whether it
    is written that way."""
    graph = copy.deepcopy(program.graph)
    placeholders = {spec.name: n for spec, n in
                    zip(program.inputs, [n for n in graph.nodes if n.op == "placeholder"])}
    out = graph.output_node()
    safe = written_safely(graph)
    kept, written = [], []
    with graph.inserting_before(out):
        for spec, value in zip(program.outputs, out.args[0]):
            target = placeholders[spec.target] if spec.kind is OutputKind.UPDATE else None
            in_place = target is not None and (value is target or value in safe)
            if not in_place:
                kept.append(value)
            elif value is not target:
                graph.call_function(torch.ops.aten.copy_.default, (target, value))
            written.append(in_place)
    out.args = (tuple(kept),)
    packs_as_cat(graph)
    views_as_reshapes(graph)
    reshapes_in_steps(graph)
    draws_in_eager_order(graph)
    draws_as_kernels(graph)
    pool_grads_as_kernels(graph)
    scatters_as_kernels(graph)
    unscales_as_math(graph)
    graph.lint()
    return graph_module(program.gm, graph), written
