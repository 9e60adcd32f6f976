"""Functionalizing the traced step's graph by rewriting it, where that is exact.

The traced step mutates tensors in place: the optimizer updates parameters and
state, BatchNorm its statistics, a module may use an in-place activation. A
program is a pure function of its inputs. torch.func.functionalize gets there
by tracing the whole graph again under fake tensors, which costs about as much
as the first trace. Most steps need much less: where no other alias of a
mutated tensor (a view of it, or the view it is) is read after the mutation,
each in-place op is its out-of-place twin, whose result stands for the tensor
in every later use, and a mutated input is written back (copy_) at the end, as
functionalization writes it. An op that writes several arguments (torch's
fused optimizer kernels, GradScaler's unscale and scale update) has a twin
that returns each of them anew, in order.

`rewrite` checks that on the whole graph first (plan) and edits it only then;
where it does not hold it leaves the graph untouched and says why, and the
caller traces again under functionalization.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from ..program.program import draws_random, new_node
from ..program.roles import ROLE
from .kernel_layouts import laid_out_alike

aten = torch.ops.aten
# Ops whose result is their input itself: a mutation of either is seen by both.
_SAME = {aten.detach.default, aten.alias.default}


def written_arguments(target) -> list[int]:
    """The positions of the arguments an op writes to."""
    return [i for i, a in enumerate(target._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


def mutated_index(target) -> int | None:
    """The position of the one argument an op writes to, or None if it writes
    to none; -1 where it writes to several or to one that is not its first."""
    written = written_arguments(target)
    if not written:
        return None
    return 0 if written == [0] else -1


def _is_view(target) -> bool:
    return target not in _SAME and any(r.alias_info is not None for r in target._schema.returns)


# In-place ops whose out-of-place twin has another overload name (dropout's draw).
_RENAMED = {aten.bernoulli_.float: aten.bernoulli.p, aten.pow_.Scalar: aten.pow.Tensor_Scalar,
            aten.pow_.Tensor: aten.pow.Tensor_Tensor}
# Ops that write some arguments besides their results, and the functional op
# that returns those results, then each argument's new value (what torch's
# functionalization calls in their place): BatchNorm's statistics.
_FUNCTIONAL = {aten._native_batch_norm_legit.default:
               aten._native_batch_norm_legit_functional.default}


def _twin(target):
    """The out-of-place overload of an in-place one (add_.Tensor -> add.Tensor)
    taking the same arguments, or None; None too for the ops that change a
    tensor's shape or strides in place (t_, resize_, set_), which every view of
    it would see."""
    if target in _RENAMED:
        return _RENAMED[target]
    if target in _FUNCTIONAL:
        return _FUNCTIONAL[target]
    name = target._schema.name.split("::")[-1]
    if not name.endswith("_") or torch.Tag.inplace_view in target.tags:
        return None
    packet = getattr(aten, name[:-1], None)
    overload = target._overloadname
    if packet is None or overload not in packet.overloads():
        return None
    twin = getattr(packet, overload)
    same = [(a.name, str(a.type)) for a in twin._schema.arguments] == \
           [(a.name, str(a.type)) for a in target._schema.arguments]
    return twin if same and mutated_index(twin) is None else None


def relaid_twin(target, args: tuple, kwargs: dict):
    """For `target(*args, **kwargs)`, an in-place op on the tensor args[0]
    (fake, the functional wrappers taken off), whose out-of-place twin lays
    its result out otherwise than args[0] (masked_fill_ on a transposed
    tensor with a broadcast mask): that twin; else None. A functionalizing
    trace runs such an op as args[0].copy_(twin(...)), which keeps the
    layout eager's in-place op keeps."""
    if not isinstance(target, torch._ops.OpOverload) or mutated_index(target) != 0 \
            or torch.Tag.nondeterministic_seeded in target.tags \
            or not args or not isinstance(args[0], torch.Tensor):
        return None   # (a random op would draw: random_layout.py keeps its layout)
    twin = _twin(target)
    if twin is None or target in _FUNCTIONAL or len(twin._schema.returns) != 1:
        return None
    with torch.utils._python_dispatch._disable_current_modes():   # not traced
        result = twin(*args, **kwargs)
    return None if laid_out_alike(result, args[0]) else twin


def _with_defaults(node: fx.Node) -> dict:
    """The node's kwargs, and the defaults of the arguments it leaves out,
    which a renamed twin may not have (bernoulli_(self, p=0.5) -> bernoulli.p)."""
    kwargs = dict(node.kwargs)
    for i, arg in enumerate(node.target._schema.arguments):
        if i >= len(node.args) and arg.name not in kwargs and arg.has_default_value():
            kwargs[arg.name] = arg.default_value
    return kwargs


@dataclasses.dataclass
class _Plan:
    root: dict[fx.Node, fx.Node]        # node -> the tensor it is (itself, or what it aliases whole)
    twins: dict[fx.Node, object]        # in-place node -> its out-of-place overload
    written: dict[fx.Node, list[int]]   # in-place node -> the positions of what it writes


class Unsupported(Exception):
    """The graph cannot be rewritten exactly; the message says why."""


def _plan(graph: fx.Graph) -> _Plan:
    position = {n: i for i, n in enumerate(graph.nodes)}
    root: dict[fx.Node, fx.Node] = {}
    base: dict[fx.Node, fx.Node] = {}     # view -> the tensor it views
    twins: dict[fx.Node, object] = {}
    written_by: dict[fx.Node, list[int]] = {}
    mutations: dict[fx.Node, list[int]] = {}   # tensor -> positions where it is mutated

    def tensors(arg) -> list[fx.Node]:
        return list(arg) if isinstance(arg, (list, tuple)) else [arg]

    for node in graph.nodes:
        root[node] = node
        if node.op != "call_function":
            continue
        target = node.target
        if target is operator.getitem:
            source = node.args[0]
            if source in base:              # an element of split()/unbind(): a view
                base[node] = base[source]
            continue
        if not isinstance(target, torch._ops.OpOverload):
            if not any(isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes):
                continue   # arithmetic on sizes and values (a decision's check: capture/decisions.py)
            raise Unsupported(f"{node.name} calls {target}, not an aten op")
        written = written_arguments(target)
        if not written:
            if target in _SAME:
                root[node] = root[node.args[0]]
            elif _is_view(target):
                source = root[node.args[0]]
                base[node] = base.get(source, source)
            continue
        twin = _twin(target)
        if twin is None:
            raise Unsupported(f"{node.name} ({target}) has no out-of-place twin")
        if written != [0] and not _returns_each(node, twin, written):
            raise Unsupported(f"{node.name} ({target}) writes to several arguments, "
                              "not each one its twin returns")
        if draws_random(node) and not node.args[0].meta["val"].is_contiguous():
            # the twin allocates by a rule of its own: drawn on the target's
            # layout by the functionalizing trace (capture/random_layout.py)
            raise Unsupported(f"{node.name} ({target}) draws into a tensor that is not contiguous")
        twins[node], written_by[node] = twin, written
        for tensor in (t for i in written for t in tensors(node.args[i])):
            r = root[tensor]
            if r in base and _sole_view(r, base[r]):
                del base[r]   # nothing else sees its base: a tensor of its own
            if r in base:
                raise Unsupported(f"{node.name} ({target}) writes through a view")
            mutations.setdefault(r, []).append(position[node])
        if written[0] == 0 and not isinstance(node.args[0], (list, tuple)):
            root[node] = root[node.args[0]]   # add_ returns its (now new) self
    last_read: dict[fx.Node, int] = {}
    for node in graph.nodes:
        for user in node.users:
            r = root[node]
            last_read[r] = max(last_read.get(r, -1), position[user])
    for view, b in base.items():
        end = last_read.get(root[view], -1)
        if any(position[view] < p < end for p in mutations.get(b, ())):
            raise Unsupported(f"{view.name}, a view, is read after {b.name} is mutated")
    return _Plan(root, twins, written_by)


def _returns_each(node: fx.Node, twin, written: list[int]) -> bool:
    """Whether an op that writes to several arguments (torch's fused
    optimizer kernels: the parameters, gradients and state; GradScaler's
    unscale: the gradients and found_inf) writes tensors or lists of them given
    positionally, each of which its twin returns anew, in their order."""
    def returned(arg, r) -> bool:
        if isinstance(arg, (list, tuple)):
            return str(r.type) == "List[Tensor]"
        return isinstance(arg, fx.Node) and str(r.type) == "Tensor"
    own = _own_results(node.target)
    return len(twin._schema.returns) == own + len(written) and all(
        i < len(node.args) and returned(node.args[i], r)
        for i, r in zip(written, twin._schema.returns[own:]))


def _own_results(target) -> int:
    """How many of an in-place op's results are new tensors (BatchNorm's
    output and saved statistics), not the arguments it writes: its twin
    returns those first."""
    return sum(r.alias_info is None for r in target._schema.returns)


def _sole_view(view: fx.Node, b: fx.Node) -> bool:
    """Whether `view` is the only use of the intermediate `b` it views, through
    a chain of views each the only use of the one before (a gradient that
    autograd transposed or reshaped, accumulated into by a later backward()
    or written through p.grad.data): writing it changes nothing another
    alias reads."""
    node = view
    while node is not b:
        parent = node.args[0] if node.args else None
        if not isinstance(parent, fx.Node) or list(parent.users) != [node]:
            return False
        node = parent
    return b.op == "call_function"


def _after_own_results(node: fx.Node, new: fx.Node) -> fx.Node:
    """The last read of `node`'s or `new`'s results (getitem) in the run of
    them after `new` (`node`, which it replaces, passed over), else `new`."""
    last, follower = new, new.next
    while follower is node or (follower.op == "call_function"
                               and follower.target is operator.getitem
                               and follower.args[0] in (node, new)):
        if follower is not node:
            last = follower
        follower = follower.next
    return last


def rewrite(graph: fx.Graph) -> None:
    """Make the graph functional in place: in-place ops become their
    out-of-place twins, later uses read the new values, and each mutated
    placeholder gets a trailing copy_ of its final value. Raises Unsupported
    (the graph untouched) where that would not be exact."""
    plan = _plan(graph)
    if not plan.twins:
        return
    current: dict[fx.Node, fx.Node] = {}   # tensor -> the node of its latest value

    def latest(a: fx.Node) -> fx.Node:
        return current.get(plan.root.get(a, a), a)

    output = graph.output_node()
    for node in list(graph.nodes):
        if node.op not in ("call_function", "output"):
            continue
        written = plan.written.get(node, [0])
        mutated = [node.args[i] for i in written] if node.args else None   # before the latest values
        node.args = fx.node.map_arg(node.args, latest)
        node.kwargs = fx.node.map_arg(node.kwargs, latest)
        twin = plan.twins.get(node)
        if twin is None:
            continue
        meta = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
        role = meta.pop(ROLE)
        with graph.inserting_before(node):
            kwargs = _with_defaults(node) if node.target in _RENAMED else dict(node.kwargs)
            new = new_node(graph, twin, node.args, role, kwargs, **meta)
            new._rename(twin.overloadpacket.__name__)   # as make_fx names it: _foreach_mul
            if len(written) > 1:   # a result (a list of them) per argument written
                if plan.root[node] is not node:
                    plan.root[new] = plan.root[node]   # _amp_update_scale_ returns its self
                own = _own_results(node.target)   # the op's own results come first
                for k, arg in enumerate(mutated):
                    # after the reads of its own results, where a functionalizing trace reads it
                    with graph.inserting_after(_after_own_results(node, new)):
                        results = new_node(graph, operator.getitem, (new, own + k), role)
                    if not isinstance(arg, (list, tuple)):
                        current[plan.root[arg]] = results
                        continue
                    for i, tensor in enumerate(arg):
                        item = new_node(graph, operator.getitem, (results, i), role)
                        current[plan.root[tensor]] = item
            elif isinstance(mutated[0], (list, tuple)):
                for i, tensor in enumerate(mutated[0]):
                    item = new_node(graph, operator.getitem, (new, i), role)
                    current[plan.root[tensor]] = item
            else:
                if not laid_out_alike(new.meta["val"], node.args[0].meta["val"]):
                    # The out-of-place op lays its result out otherwise than the
                    # tensor the in-place op wrote (masked_fill_ on a transposed
                    # tensor): the result copied into that layout, which eager's
                    # later views and random draws were traced on.
                    new = new_node(graph, aten.copy.default, (node.args[0], new), role, **meta)
                # Users of the in-place op's result read the tensor it updated,
                # at its latest value wherever they are.
                tensor = plan.root[node]
                current[tensor], plan.root[new] = new, tensor
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    with graph.inserting_before(output):
        for node in graph.nodes:
            if node.op == "placeholder" and node in current:
                graph.call_function(aten.copy_.default, (node, current[node]))
