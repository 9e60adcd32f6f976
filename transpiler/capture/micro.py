"""Micro-batch loops traced once, run rolled (transpile(micro_batches="name")).

The argument named by micro_batches is a list (or tuple) of k micro-batches of
equal structure and signature. For k >= 3 the step is traced with the list cut
to its first two elements (cut_arguments), passed as a Rolled list, so the trace
and its compile cost two micro-batches whatever k is; the signature keys on the
cut list, so every k >= 3 runs the same programs. While the step iterates over
the Rolled list, loop_marker tags the nodes created for element i with
meta[MICRO] = i, and marks the per-micro-batch state at the end of each element
(meta[CARRY], a Carry): every parameter's .grad, and every buffer, cloned there
into a node of its own (a buffer the step never writes loses its clones again:
drop_unwritten_clones). micro_loop.py later cuts each program into the part
before the second micro-batch, its region (the body, run k-1 times with the
carried values fed back) and the rest.

Any use of the list other than one plain iteration (len(), indexing, slicing,
`in`, a second loop) would compute something else on the short list than on
the whole one: the trace raises NotRollable and the runtime traces the whole
list unrolled instead, saying why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import inspect
from collections import OrderedDict
from typing import Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..errors import TranspileError
from ..program.roles import CARRY, MICRO
from .arguments import StepArgs, is_leaf
from .markers import last_node, node_of
from .user_code import user_line


class NotRollable(Exception):
    """The micro-batch loop cannot run rolled (the message says why): the step
    is traced again over the whole list."""


class Carried(enum.Enum):
    """What a loop carries from one micro-batch to the next."""

    GRAD = "grad"       # a parameter's accumulated .grad
    BUFFER = "buffer"   # a buffer the forward writes (BatchNorm's statistics)


@dataclasses.dataclass(frozen=True)
class Carry:
    """On the node holding per-micro-batch state where micro-batch `micro`
    ends (-1: where the loop begins): `what` of `name`."""

    what: Carried
    name: str
    micro: int


class Rolled(list):
    """The cut list of micro-batches the step is traced with. Iterating it
    marks where each element's nodes begin (the active _Watch); any other use
    is recorded, since the short list would give it another result."""

    def __iter__(self):
        watch = _active[0]
        if watch is None:
            yield from list.copy(self)
            return
        if watch.iterated:
            watch.used("a second iteration")
        watch.iterated = True
        for i, element in enumerate(list.copy(self)):
            watch.enter(i)
            yield element
        watch.enter(None)


def _recording(name: str) -> Callable:
    original = getattr(list, name)

    def method(self, *args, **kwargs):
        if _active[0] is not None:
            _active[0].used(_USES.get(name, name))
        return original(self, *args, **kwargs)
    method.__name__ = name
    return method


_USES = {"__len__": "len()", "__getitem__": "indexing or slicing", "__contains__": "`in`",
         "__reversed__": "reversed()", "__bool__": "its truth value"}
for _name in ("__len__", "__getitem__", "__contains__", "__reversed__", "index", "count",
              "copy", "__add__", "__mul__", "__eq__", "__ne__"):
    setattr(Rolled, _name, _recording(_name))
Rolled.__hash__ = None
pytree.register_pytree_node(Rolled, lambda x: (list.copy(x), None),
                            lambda values, _: Rolled(values))

# The watch of the trace in progress (one trace at a time per process).
_active: list = [None]


@dataclasses.dataclass
class _Watch:
    grads_now: Callable[[], dict]
    buffers: list          # (qualified name, [(module, key)]) of every buffer of the step's modules
    uses: list[str] = dataclasses.field(default_factory=list)
    starts: list[fx.Node] = dataclasses.field(default_factory=list)   # the node before element i
    stop: fx.Node | None = None
    iterated: bool = False
    current: int | None = None

    def used(self, what: str) -> None:
        self.uses.append(f"{what}{user_line(None)}")

    def enter(self, i: int | None) -> None:
        """Element i begins (None: the loop is over): the state where the
        current one ends is marked."""
        if self.current is not None:
            self._mark_ends(self.current)
        elif i == 0:   # the loop writes its own copies: the buffers' inputs stay as they were
            self._clone_buffers(-1)
        self.current = i
        if i is None:
            self.stop = last_node()
        else:
            self.starts.append(last_node())

    def _mark_ends(self, micro: int) -> None:
        for name, node in self.grads_now().items():
            node.meta.setdefault(CARRY, Carry(Carried.GRAD, name, micro))
        self._clone_buffers(micro)

    def _clone_buffers(self, micro: int) -> None:
        for name, places in self.buffers:
            module, key = places[0]
            clone = module._buffers[key].clone()
            for module, key in places:
                module._buffers[key] = clone
            node_of(clone).meta[CARRY] = Carry(Carried.BUFFER, name, micro)


@contextlib.contextmanager
def loop_marker(modules, grads_now: Callable[[], dict]):
    """While the step is traced: mark its iteration over the Rolled list.
    Yields the watch; check_rolled then tags the graph."""
    buffers: dict[int, tuple[str, list]] = {}
    for mi, module in enumerate(modules):
        for prefix, sub in module.named_modules():
            for key, t in sub._buffers.items():
                if t is not None:
                    name = f"{prefix}.{key}" if prefix else key
                    buffers.setdefault(id(t), (name, []))[1].append((sub, key))
    watch = _Watch(grads_now, list(buffers.values()))
    _active[0] = watch
    try:
        yield watch
    finally:
        _active[0] = None


def check_rolled(watch: _Watch, graph: fx.Graph) -> None:
    """After the trace: NotRollable where the list was used otherwise than by
    one whole iteration; else tag every node created for element i with
    meta[MICRO] = i."""
    if watch.uses:
        raise NotRollable(f"the step uses the list of micro-batches otherwise than by iterating "
                          f"over it once ({', '.join(dict.fromkeys(watch.uses))}): on the "
                          "shortened list that would compute something else")
    if watch.stop is None or len(watch.starts) != 2:
        raise NotRollable("the step does not iterate over the whole list of micro-batches")
    bounds = {node: i for i, node in enumerate(watch.starts)}
    micro = None
    for node in graph.nodes:
        if micro is not None and node.op == "call_function":
            node.meta[MICRO] = micro
        if node in bounds:
            micro = bounds[node]
        if node is watch.stop:
            micro = None


def drop_unwritten_clones(graph: fx.Graph) -> None:
    """The clones loop_marker made of a buffer the step never writes (a
    causal mask) give way to the buffer's input again, and its write-back
    (a copy_ of it onto itself) goes: the program does not update it."""
    chains: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        carry = node.meta.get(CARRY)
        if isinstance(carry, Carry) and carry.what is Carried.BUFFER:
            chains.setdefault(carry.name, []).append(node)
    written = _written_bases(graph)
    for clones in chains.values():
        source = clones[0].args[0]
        if source.op != "placeholder" or written & {source, *clones}:
            continue
        for clone in reversed(clones):
            clone.replace_all_uses_with(source)
            graph.erase_node(clone)
        for user in list(source.users):
            if user.target is torch.ops.aten.copy_.default and user.args == (source, source):
                graph.erase_node(user)


def _written_bases(graph: fx.Graph) -> set[fx.Node]:
    """The nodes an in-place op writes to, directly or through a view."""
    base: dict[fx.Node, fx.Node] = {}
    written = set()
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        schema = node.target._schema
        if any(r.alias_info is not None for r in schema.returns) and node.args \
                and isinstance(node.args[0], fx.Node):
            base[node] = base.get(node.args[0], node.args[0])
        for arg, value in zip(schema.arguments, node.args):
            if arg.alias_info is not None and arg.alias_info.is_write:
                for v in (value if isinstance(value, (list, tuple)) else [value]):
                    if isinstance(v, fx.Node):
                        written.add(base.get(v, v))
    return written


@dataclasses.dataclass
class CutArgs(StepArgs):
    """The step's arguments with the list of micro-batches cut to its first two
    elements (a Rolled list): what the trace and the signature see. `full` is
    the call's own; its leaves i >= start + 2 * per are this one's
    i - (k - 2) * per."""

    full: StepArgs | None = None
    start: int = 0   # the list's first leaf
    per: int = 0     # leaves per micro-batch
    k: int = 0       # micro-batches of the call

    def layout(self, leaves: list, i: int) -> list:
        """The call's leaves as the programs read them: micro-batch i where
        the trace had its second element (the first stays micro-batch 0's)."""
        a, per = self.start, self.per
        return leaves[:a + per] + leaves[a + i * per:a + (i + 1) * per] + leaves[a + self.k * per:]


def cut_arguments(step_fn, step_args: StepArgs, name: str) -> CutArgs | None:
    """The arguments with the list `name` cut (None where it has 2 elements or
    fewer: traced as it is). A TranspileError for an argument that is not a
    list of micro-batches of equal structure and signature."""
    from .user_code import step_name
    bound = step_args.bound
    if bound is None or name not in bound.arguments:
        params = ", ".join(bound.arguments) if bound is not None else "none bound"
        raise TranspileError(f"micro_batches={name!r} names no argument of {step_name(step_fn)} "
                             f"(its arguments: {params}): name the parameter that receives "
                             "the list of micro-batches")
    value = bound.arguments[name]
    if not isinstance(value, (list, tuple)) or not value:
        raise TranspileError(f"micro_batches={name!r}: the argument must be a non-empty list or "
                             f"tuple of micro-batches, got {type(value).__name__}: pass the "
                             "micro-batches as a list, e.g. [(x0, y0), (x1, y1), ...]")
    shapes = [_element_signature(name, i, e) for i, e in enumerate(value)]
    for i, s in enumerate(shapes[1:], 1):
        if s != shapes[0]:
            raise TranspileError(
                f"micro_batches={name!r}: micro-batch {i} differs from micro-batch 0 "
                f"({_describe(s)} against {_describe(shapes[0])}); a rolled loop runs one "
                "program for every micro-batch, so they must have equal structure, shapes and "
                "dtypes: pad them to one shape, or leave micro_batches unset")
    k = len(value)
    if k <= 2:
        return None
    names = list(bound.arguments)
    position = names.index(name)
    start = sum(len(pytree.tree_leaves(v, is_leaf=is_leaf)) for v in list(bound.arguments.values())[:position])
    per = len(shapes[0][1])
    values = list(bound.arguments.values())
    values[position] = Rolled(value[:2])
    leaves, spec = pytree.tree_flatten(values, is_leaf=is_leaf)
    leaf_names = step_args.names[:start + 2 * per] + step_args.names[start + k * per:]
    cut_bound = inspect.BoundArguments(bound.signature, OrderedDict(bound.arguments))
    return CutArgs(leaf_names, leaves, spec, cut_bound, found=step_args.found, full=step_args,
                   start=start, per=per, k=k)


def _element_signature(name: str, i: int, element) -> tuple:
    leaves, spec = pytree.tree_flatten(element, is_leaf=is_leaf)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise TranspileError(
                f"micro_batches={name!r}: micro-batch {i} holds a {type(leaf).__name__}; each "
                "micro-batch must be a tensor or a pytree (tuple, list, dict) of tensors")
    return spec, tuple((t.shape, t.dtype, t.device) for t in leaves)


def _describe(sig: tuple) -> str:
    return ", ".join(f"{str(d).replace('torch.', '')}{list(s)}" for s, d, _ in sig[1]) \
        or "no tensors"
