"""The Program: a functional FX graph of one whole training step plus what the
runtime and the passes need to know about its inputs, outputs and nodes.

A Program is a pure function. Its placeholders are the step's state (parameters,
buffers, optimizer state), the optimizer's lifted hyperparameters and the batch;
its outputs are the step's own return values followed by the new values of the
state. Nothing inside it mutates an input: the runtime writes the new state back
once the whole program has succeeded.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch._prims_common import make_contiguous_strides_for
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from .collectives import WAIT, set_group
from .mesh import Dim, Mesh, Over
from .roles import (BUCKET, COMM, GATHERED, GRAD_AT, INPUT, MICRO, PARAM, READY, REDUCE, ROLE,
                    SKIPPABLE, Role)


class InputKind(enum.Enum):
    """What a placeholder holds (torch.export's graph signature has the same idea)."""

    PARAM = "param"
    BUFFER = "buffer"
    GRAD = "grad"       # a parameter's .grad as the step starts
    STATE = "state"     # an optimizer state entry
    HYPER = "hyper"     # a lifted optimizer hyperparameter
    SCALER = "scaler"   # a GradScaler's scale or growth tracker
    DATA = "data"       # a tensor among the step's arguments (the batch)
    NUMBER = "number"   # a Python float or int argument, lifted after its value changed
    REACHED = "reached"  # a tensor the step reads outside its arguments, through a host path
    DRAW = "draw"        # a value the step draws on the host (random, numpy.random, a clock)
    HELD = "held"       # a tensor the transpiled step itself keeps between calls
    LOOP = "loop"       # a value passed between the programs of a micro-batch loop (micro_loop.py)
    HOOK = "hook"       # a tensor of a comm hook's state, where DDP's hook keeps it (powersgd.py)


class OutputKind(enum.Enum):
    """What an output is."""

    USER = "user"       # returned to the caller
    UPDATE = "update"   # the new value of an input
    STATE = "state"     # an optimizer state entry the step created or replaced
    GRAD = "grad"       # the .grad the step leaves on a parameter
    HELD = "held"       # a value the transpiled step keeps, for its schedule or its next calls
    ASSIGNED = "assigned"  # a tensor the step assigns to a host attribute (self.aux = loss)
    HOOK = "hook"       # the new value of a comm hook's state tensor (InputKind.HOOK)


class Held(enum.Enum):
    """What a held tensor holds. The value is the tensor's name, with
    ":<param>" appended for a per-parameter one (held_name)."""

    SNAPSHOT = "snapshot"                  # a parameter at the last local SGD or DiLoCo sync
    PARAM_SHARD = "param_shard"            # this rank's shard of a parameter (mode fsdp)
    MEAN_LOSS = "local_sgd.mean_loss"      # the loss averaged over the ranks at a sync
    LR = "local_sgd.lr"                    # the learning rate at a sync
    SKIPPED = "skip_nonfinite.skipped"     # whether skip_nonfinite skipped the update
    PSEUDO_GRAD = "diloco.pseudo_grad"     # a parameter's averaged DiLoCo pseudo-gradient
    IN_FLIGHT = "in_flight"                # a bucket's sum, issued and not yet waited on


def held_name(what: Held, param: str | None = None) -> str:
    """The name a held tensor is kept (and checkpointed) under."""
    return what.value if param is None else f"{what.value}:{param}"


@dataclasses.dataclass(frozen=True)
class Hyper:
    """A lifted hyperparameter: `key` (lr, momentum, or a value derived from the
    group's on the host, optimizers.hyper_value) of param group `group` of the
    step's optimizer number `optimizer`. `ahead`: for a value derived from the
    step count (optimizers.PER_STEP), that of the update `ahead` updates after
    the call's first (mode all_gather updates once per rank; a step may update
    one optimizer several times, a critic loop)."""

    key: str
    group: int
    optimizer: int
    ahead: int = 0


@dataclasses.dataclass(frozen=True)
class HookEntry:
    """A tensor of a comm hook's state: `table[bucket]` of the state object
    (PowerSGDState.error_dict, p_memory_dict, q_memory_dict). For the Q
    memory, `projections`: the shapes of the random matrices it is first
    drawn as; `counted`: the elements before and after compression the
    bucket adds to the state's statistics per step."""

    table: str
    bucket: int
    projections: tuple = ()
    counted: tuple = ()


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """What a placeholder holds. `name` is unique in a program (the listing
    prints it); passes select inputs by the typed fields: `param` names the
    parameter of a GRAD, STATE or per-parameter HELD input, `hyper` says which
    hyperparameter a HYPER input is, `held` what a HELD input holds (the startup
    program initializes a SNAPSHOT as a copy of its parameter), `module` which
    of the step's modules holds a PARAM or BUFFER (its index among them; None
    for a parameter reached only through an optimizer)."""

    kind: InputKind
    name: str
    param: str | None = None
    hyper: Hyper | None = None
    held: Held | None = None
    hook: HookEntry | None = None
    module: int | None = None

    def __post_init__(self):
        if (self.hyper is not None) != (self.kind is InputKind.HYPER) or \
                (self.held is not None) != (self.kind is InputKind.HELD) or \
                (self.hook is not None) != (self.kind is InputKind.HOOK):
            raise ValueError(f"internal: an input of kind {self.kind} with hyper={self.hyper}, "
                             f"held={self.held} and hook={self.hook}")

    @staticmethod
    def of_held(what: Held, param: str | None = None) -> "InputSpec":
        """A held input holding `what` (of parameter `param`), named by held_name."""
        return InputSpec(InputKind.HELD, held_name(what, param), param=param, held=what)


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    """What an output is. `target`: for UPDATE the name of the input it
    replaces, for STATE the entry as "<param>:<key>", for GRAD the parameter, for
    HELD the name the step keeps it under (held_name of `held`)."""

    kind: OutputKind
    target: str | None = None
    held: Held | None = None
    param: str | None = None   # for STATE: the parameter the entry belongs to

    def __post_init__(self):
        if (self.held is not None) != (self.kind is OutputKind.HELD):
            raise ValueError(f"internal: an output of kind {self.kind} with held={self.held}")

    @staticmethod
    def of_held(what: Held, param: str | None = None) -> "OutputSpec":
        """A value kept for the schedule (of parameter `param`), named by held_name."""
        return OutputSpec(OutputKind.HELD, held_name(what, param), held=what)


@dataclasses.dataclass
class CommInfo:
    """Annotation of a collective node (and of its wait)."""

    op: str
    ring: int = 0
    bucket: int | None = None
    over: Over = Dim.WORLD         # the group of ranks it runs over
    params: tuple[str, ...] = ()   # the parameters whose gradients it carries
    nbytes: int = 0                # bytes of the whole buffer reduced, gathered or broadcast


@dataclasses.dataclass(frozen=True)
class HistoryEntry:
    pass_name: str
    provenance: str
    listing: str | None   # kept while the "transpiler" logger is at DEBUG (pipeline.record)
    fn: Callable | None = None   # the pass itself (None for capture)



def same_layout(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor of t's shape, strides, dtype and device, at
    storage offset 0 (under a fake mode: a fake one)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


def draws_random(node: fx.Node) -> bool:
    """Whether the op draws from torch's random generator (dropout's bernoulli,
    rand, randn_like): every schedule keeps such ops in the program's order,
    so they draw what the eager step draws, in its order."""
    return isinstance(node.target, torch._ops.OpOverload) \
        and torch.Tag.nondeterministic_seeded in node.target.tags


class Program:
    def __init__(self, name: str, gm: fx.GraphModule, inputs: list[InputSpec],
                 outputs: list[OutputSpec]):
        self.name = name
        self.gm = gm
        self.inputs = inputs
        self.outputs = outputs
        self.history: list[HistoryEntry] = []

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    @property
    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "placeholder"]

    @property
    def output_node(self) -> fx.Node:
        return self.graph.output_node()

    @property
    def grads(self) -> dict[str, fx.Node]:
        """Parameter name -> the node holding its (local) gradient, in the order
        the gradients are produced by the backward pass."""
        return {n.meta[PARAM]: n for n in self.graph.nodes if PARAM in n.meta}

    def ready_order(self) -> tuple[str, ...]:
        """The parameters whose gradients the last backward() accumulated, in
        the order the autograd engine accumulated them (meta["ready"])."""
        ready = sorted((n.meta[READY], n.meta[PARAM]) for n in self.graph.nodes if READY in n.meta)
        return tuple(name for _, name in ready)

    def state_of(self, param: str) -> list[InputSpec]:
        """The optimizer state inputs that belong to a parameter."""
        return [s for s in self.inputs if s.kind is InputKind.STATE and s.param == param]

    def input_node(self, name: str) -> fx.Node:
        for node in self.placeholders:
            if node.meta[INPUT].name == name:
                return node
        raise KeyError(name)

    def updated_inputs(self, *kinds: InputKind) -> list[fx.Node]:
        """The placeholders of those kinds that the step gives a new value (an
        UPDATE output), in input order."""
        updated = {spec.target for spec in self.outputs if spec.kind is OutputKind.UPDATE}
        return [n for n in self.placeholders
                if n.meta[INPUT].kind in kinds and n.meta[INPUT].name in updated]

    def to_reduce(self, by_parameters: bool = False) -> dict[str, fx.Node]:
        """Key -> node of the values a pass marked to be reduced over the ranks
        (meta["reduce"], a Reduction) and that something reads, in program
        order; by_parameters: the parameters' gradients first, in reverse order
        of the parameters (DDP's first layout), an order every rank has even
        where a rank's backward pass gives some of them no gradient
        (find_unused_parameters: the trace gives those zeros where it ends), each
        backward() averaged where it ends (Reduction.point) before the next."""
        marked = {n.meta[REDUCE].key: n for n in self.graph.nodes if REDUCE in n.meta and n.users}
        if not by_parameters:
            return marked
        rank = {s.name: i for i, s in enumerate(reversed(self.inputs)) if s.kind is InputKind.PARAM}

        def order(node: fx.Node) -> tuple:
            param = node.meta[GRAD_AT].param if GRAD_AT in node.meta else node.meta[REDUCE].key
            return node.meta[REDUCE].point or float("inf"), rank.get(param, len(rank))
        return {key: node for key, node in sorted(marked.items(), key=lambda kv: order(kv[1]))}

    def add_input(self, spec: InputSpec, like: fx.Node | torch.Tensor, name: str) -> fx.Node:
        """A new placeholder after the others, holding a tensor shaped like
        `like` (a node's value, or a fake tensor)."""
        with self.graph.inserting_after(self.placeholders[-1]):
            node = self.graph.placeholder(name)
        val = like if isinstance(like, torch.Tensor) else like.meta["val"]
        with val.fake_mode:
            node.meta["val"] = same_layout(val)
        node.meta["tensor_meta"] = _extract_tensor_metadata(node.meta["val"])
        node.meta[INPUT] = spec
        self.inputs.append(spec)
        return node

    def add_output(self, spec: OutputSpec, value: fx.Node) -> None:
        out = self.output_node
        out.args = (tuple(out.args[0]) + (value,),)
        self.outputs.append(spec)

    def copy(self, name: str) -> "Program":
        """An independent copy (graph, inputs, outputs, history) named `name`;
        node meta is copied one level deep."""
        graph = fx.Graph()
        graph.output(graph.graph_copy(self.graph, {}))
        comms: dict[int, CommInfo] = {}   # a collective and its wait share one
        for node in graph.nodes:
            if COMM in node.meta:   # mutable (ring_round_robin): each copy its own
                comm = node.meta[COMM]
                node.meta[COMM] = comms.setdefault(id(comm), dataclasses.replace(comm))
        program = Program(name, graph_module(self.gm, graph), list(self.inputs),
                          list(self.outputs))
        program.history = list(self.history)
        return program

    def collectives(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes
                if n.op == "call_function" and COMM in n.meta and n.target is not WAIT]

    def place_collectives(self, mesh: Mesh) -> None:
        """Issue each collective on the communicator of its group and ring in
        `mesh` (those the capture traced, SyncBatchNorm's, name the step's group)."""
        for node in self.collectives():
            comm = node.meta[COMM]
            set_group(node, mesh.ring(comm.over, comm.ring))

    @property
    def applied(self) -> list[str]:
        return [h.pass_name for h in self.history]

    def listing(self) -> str:
        return format_graph(self.graph)

    def __str__(self) -> str:
        last = self.history[-1].pass_name if self.history else "capture"
        loop = ("# micro-batch loop: the nodes marked `loop` run once per micro-batch after "
                "the first (k-1 times)\n" if any(n.meta.get(MICRO) == 1 for n in self.graph.nodes)
                else "")
        return f"# program: {self.name}\n# after: {last}\n{loop}{self.listing()}"



def graph_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule whose Python code is generated when it is first called or
    its code is read, not on every recompile(): passes edit a program many
    times before it runs once, and generating the code of a graph of thousands
    of nodes takes a tenth of a second. Call real_recompile() before handing it
    to a compiler that traces its forward."""
    return _LazyGraphModule(root, graph)


def new_node(graph: fx.Graph, target: Callable, args: tuple, role: Role,
             kwargs: dict | None = None, fake_mode=None, **meta: Any) -> fx.Node:
    """Create a call_function node with its role, other meta and FX's val /
    tensor_meta, computed on the fake values of its inputs (a factory, with
    none: under `fake_mode`). Insert it where the caller set the graph's
    insertion point."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    node.meta[ROLE] = role
    node.meta.update(meta)
    vals = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    if target is operator.getitem:   # an element of a list of values: nothing to dispatch
        val = target(*vals[0], **vals[1])
    else:
        fake_mode = fake_mode or _fake_mode_of(vals)
        val = _on_meta(target, vals, fake_mode)
        if val is None:
            with fake_mode:
                val = target(*vals[0], **vals[1])
    node.meta["val"] = val
    if isinstance(val, torch.Tensor):
        node.meta["tensor_meta"] = _extract_tensor_metadata(val)
    return node


def erase_unread(nodes: list[fx.Node]) -> None:
    """Erase each of `nodes` that nothing reads, then each of its inputs that
    nothing reads any more, and so on (placeholders stay)."""
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node.op == "call_function" and not node.users and not node._erased:
            todo += node.all_input_nodes
            node.graph.erase_node(node)


def keep_old_unless(program: Program, conditions: list[fx.Node | None],
                    skippable: bool = False) -> None:
    """Output k becomes where(conditions[k], new, old) where conditions[k] is a
    0-d bool node (None: unchanged). old is the output's input for an update
    (a parameter shard mode fsdp holds included: it is the parameter's value),
    and zeros for optimizer state the step creates (where SGD's momentum and
    Adam's moments and step count start). New nodes: role OPTIMIZE, placed
    before the output. `skippable`: one condition whose update a backend that
    reads the host may skip instead (the selects marked SKIPPABLE)."""
    graph, out = program.graph, program.output_node
    inputs = {spec.name: node for spec, node in zip(program.inputs, program.placeholders)}
    values = list(out.args[0])
    aten = torch.ops.aten
    with graph.inserting_before(out):
        for k, (spec, ok) in enumerate(zip(program.outputs, conditions)):
            updates = spec.kind is OutputKind.UPDATE or spec.held is Held.PARAM_SHARD
            if ok is None or not (updates or spec.kind is OutputKind.STATE):
                continue
            old = inputs[spec.target] if updates else new_node(
                graph, aten.zeros_like.default, (values[k],), Role.OPTIMIZE)
            values[k] = new_node(graph, aten.where.self, (ok, values[k], old), Role.OPTIMIZE,
                                 **({SKIPPABLE: True} if skippable else {}))
    out.args = (tuple(values),)


def selected_update(graph: fx.Graph, selects: set[fx.Node]) -> set[fx.Node]:
    """The nodes that only the new values of `selects` (keep_old_unless's
    where(ok, new, old)) read, directly or through each other: the update
    those selects keep or drop."""
    update: set[fx.Node] = set()
    for n in reversed(graph.nodes):
        if n.op == "call_function" and n.users and all(
                u in update or (u in selects and u.args[1] is n and n not in u.args[::2])
                for u in n.users):
            update.add(n)
    return update


def _on_meta(target, vals, fake_mode):
    """target's fake result computed by its meta kernel on meta tensors laid out
    as the fake inputs: what fake-tensor dispatch does, without its Python
    machinery (about 8x faster; passes create thousands of nodes), and for an
    elementwise foreach op on plain operands without running its meta kernel
    (_foreach_results). None where that is not plainly the same: not an ATen
    op, a device argument, inputs on several devices or of symbolic sizes (a
    meta tensor would decide on them), a result that is not tensors, or no
    meta kernel."""
    if not isinstance(target, torch._ops.OpOverload) or "device" in vals[1]:
        return None
    leaves = [v for v in torch.utils._pytree.tree_iter(vals) if isinstance(v, torch.Tensor)]
    devices = {v.device for v in leaves}
    if len(devices) != 1 or not all(isinstance(v, FakeTensor) and _static(v) for v in leaves):
        return None
    out = _foreach_results(target, vals)
    try:
        if out is None:
            out = target(*torch.utils._pytree.tree_map_only(FakeTensor, _meta_like, vals[0]),
                         **torch.utils._pytree.tree_map_only(FakeTensor, _meta_like, vals[1]))
    except (NotImplementedError, RuntimeError):
        return None
    results = out if isinstance(out, (list, tuple)) else [out]
    if not results or not all(isinstance(r, torch.Tensor) and r.is_meta for r in results):
        return None
    device = devices.pop()
    wrapped = [FakeTensor(fake_mode, r, device) for r in results]
    return type(out)(wrapped) if isinstance(out, (list, tuple)) else wrapped[0]


# Foreach ops that apply one elementwise op at each index of their lists (the
# out-of-place packets: `_foreach_add_` is another).
_FOREACH_ELEMENTWISE = frozenset({
    "_foreach_add", "_foreach_sub", "_foreach_mul", "_foreach_div", "_foreach_lerp",
    "_foreach_addcmul", "_foreach_addcdiv", "_foreach_sqrt", "_foreach_neg",
    "_foreach_reciprocal", "_foreach_maximum", "_foreach_minimum", "_foreach_pow",
})


def _foreach_results(target, vals) -> list[torch.Tensor] | None:
    """The meta results of an out-of-place elementwise foreach op where, at
    each index, its tensor operands share one floating dtype and are either 0-d
    or contiguous with one shape: contiguous tensors of that shape and dtype,
    what the op's meta kernel allocates (it runs in Python, once per index:
    tens of milliseconds for an optimizer's parameter list). None where any
    operand is otherwise."""
    if target.overloadpacket.__name__ not in _FOREACH_ELEMENTWISE:
        return None
    lists, single, numbers = [], [], []
    for a in list(vals[0]) + list(vals[1].values()):
        if isinstance(a, torch.Tensor):
            single.append(a)
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            lists.append(a)
        else:
            numbers += a if isinstance(a, (list, tuple)) else [a]
    if not lists or len({len(a) for a in lists}) != 1 or not all(
            type(x) in (int, float) for x in numbers):
        return None
    results = []
    for operands in zip(*lists):
        operands = operands + tuple(single)
        dtypes = {t.dtype for t in operands}
        shapes = {t.shape for t in operands if t.dim()}
        dtype = dtypes.pop()
        if dtypes or not dtype.is_floating_point or len(shapes) > 1 or not all(
                t.stride() == make_contiguous_strides_for(t.shape) for t in operands if t.dim()):
            return None
        results.append(torch.empty(shapes.pop() if shapes else (), dtype=dtype, device="meta"))
    return results


def _static(v: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in (*v.shape, *v.stride(), v.storage_offset()))


def _meta_like(v: torch.Tensor) -> torch.Tensor:
    """A meta tensor with v's dtype, shape, strides and storage offset."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(v.shape, v.stride()) if size)
    if v.numel() == 0:
        extent = 0
    storage = torch.empty(v.storage_offset() + extent, dtype=v.dtype, device="meta")
    return storage.as_strided(v.shape, v.stride(), v.storage_offset())


def _fake_mode_of(vals):
    # The first fake value will do: a foreach op's inputs list hundreds.
    for v in torch.utils._pytree.tree_iter(vals):
        mode = getattr(v, "fake_mode", None)
        if mode is not None:
            return mode
    raise ValueError("new_node needs at least one input with a fake value")


# ---------------------------------------------------------------- listing

_DTYPES = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16",
    torch.bfloat16: "bf16", torch.int64: "i64", torch.int32: "i32",
    torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "b8",
}


def _type_str(val) -> str:
    if isinstance(val, torch.Tensor):
        shape = ", ".join(str(s) for s in val.shape)
        return f"{_DTYPES.get(val.dtype, str(val.dtype))}[{shape}]"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(_type_str(v) for v in val) + ")"
    if isinstance(val, (torch.SymFloat, torch.SymInt)):   # a lifted number (capture/numbers.py)
        return "float" if isinstance(val, torch.SymFloat) else "int"
    return ""


def _target_str(target) -> str:
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        packet = target._schema.name.replace("::", ".")
        return packet if target._overloadname == "default" else f"{packet}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def _arg_str(a) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg_str(x) for x in a)
        return f"[{inner}]"
    if isinstance(a, torch.dtype):
        return _DTYPES.get(a, str(a))
    if isinstance(a, float):
        return repr(a)
    return repr(a) if isinstance(a, str) else str(a)


def _call_str(node: fx.Node) -> str:
    args = list(node.args)
    kwargs = dict(node.kwargs)
    if COMM in node.meta and isinstance(node.target, torch._ops.OpOverload):
        # Group names depend on how many groups the process created; show the ring.
        names = [a.name for a in node.target._schema.arguments]
        if "group_name" in names:
            i = names.index("group_name")
            if i < len(args):
                args.pop(i)
            kwargs.pop("group_name", None)
    parts = [_arg_str(a) for a in args] + [f"{k}={_arg_str(v)}" for k, v in kwargs.items()]
    return f"{_target_str(node.target)}({', '.join(parts)})"


def _note(node: fx.Node, frees: dict[fx.Node, list[str]]) -> str:
    notes = []
    if ROLE in node.meta:
        notes.append(str(node.meta[ROLE]))
    if node.meta.get(MICRO) == 1:
        notes.append("loop")
    if PARAM in node.meta:
        notes.append(f"grad={node.meta[PARAM]}")
    reduction = node.meta.get(REDUCE)
    if reduction is not None:
        what = "reduce" if reduction.key == node.meta.get(PARAM) else f"reduce={reduction.key}"
        notes.append(f"{what}{reduction}")
    comm = node.meta.get(COMM)
    if comm is not None:
        notes.append(f"ring={comm.ring}" if comm.over is Dim.WORLD else f"{comm.over} ring={comm.ring}")
    bucket = comm.bucket if comm is not None else node.meta.get(BUCKET)
    if bucket is not None:
        notes.append(f"bucket={bucket}")
    if node in frees:
        notes.append(f"frees={','.join(frees[node])}")
    return "  # " + " ".join(notes) if notes else ""


def _frees(graph: fx.Graph) -> dict[fx.Node, list[str]]:
    """The node after which nothing reads a gathered parameter (meta
    GATHERED) or a view of it: where the program frees it. Those read by the
    program's outputs are not freed."""
    frees: dict[fx.Node, list[str]] = {}
    for node in graph.nodes:
        if GATHERED not in node.meta:
            continue
        readers, todo = set(), [node]
        while todo:
            for user in todo.pop().users:
                readers.add(user)
                if isinstance(user.target, torch._ops.OpOverload) and user.target.is_view:
                    todo.append(user)
        last = max(readers, default=None)
        if last is not None and last.op != "output":
            frees.setdefault(last, []).append(node.meta[GATHERED])
    return frees


def format_graph(graph: fx.Graph) -> str:
    """One line per node, deterministic: no object ids, no group names."""
    lines, frees = [], _frees(graph)
    for node in graph.nodes:
        ty = _type_str(node.meta.get("val"))
        head = f"{node.name}: {ty}" if ty else node.name
        if node.op == "placeholder":
            spec = node.meta.get(INPUT)
            what = f"{spec.kind.value} {spec.name!r}" if spec else "?"
            lines.append(f"{head} = input({what})")
        elif node.op == "get_attr":
            lines.append(f"{head} = constant({node.target})")
        elif node.op == "output":
            lines.append(f"return {_arg_str(node.args[0])}")
        else:
            lines.append(f"{head} = {_call_str(node)}{_note(node, frees)}")
    return "\n".join(lines)


def format_collectives(program: Program, sent_bytes: float | None = None) -> str:
    """A table of the program's collectives in issue order. The footer sums
    their buffers and, given, the bytes a rank sends per run (which depend
    on the group sizes: collectives.sent_bytes)."""
    rows = [("#", "op", "ring", "bucket", "dtype", "tensors", "bytes", "parameters")]
    collectives = program.collectives()
    for i, node in enumerate(collectives):
        comm, val = node.meta[COMM], node.meta["val"]
        bucket = "-" if comm.bucket is None else str(comm.bucket)
        params = ", ".join(comm.params[:4]) + (f", ... ({len(comm.params)})" if len(comm.params) > 4 else "")
        ring = str(comm.ring) if comm.over is Dim.WORLD else f"{comm.over}:{comm.ring}"
        rows.append((str(i), comm.op, ring, bucket, _DTYPES.get(val.dtype, str(val.dtype)),
                     str(len(comm.params)), str(comm.nbytes), params))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    total = sum(node.meta[COMM].nbytes for node in collectives)
    sent = "" if sent_bytes is None else f"; this rank sends {sent_bytes:.0f} bytes per step"
    lines.append(f"{len(collectives)} collectives of {total} bytes in all{sent}")
    return "\n".join(lines)
