"""Tensors a step makes from constants alone and leaves on the host: a lazily
built loss object holding `torch.arange(n)` (ultralytics' criterion), a cache of
rotary frequencies. Eager leaves real tensors there; the trace made fake ones.
Each is computed here for real by running the ops it was traced from (none of
them reads a program input or draws a random number), and put in the fake's
place, so the host keeps what eager would. A tensor computed from an input
cannot be: the caller refuses it."""

from __future__ import annotations

import types

import torch
import torch.fx as fx
from torch.utils._python_dispatch import _disable_current_modes

from .markers import node_of
from .reads import is_traced

_DEPTH = 4


def realize(value, reals: dict, depth: int = 0):
    """The value with every traced tensor in it (its attributes, items, at a
    few levels) replaced by its real value, in place where it is held by an
    object or a list or dict; returns the value (a new tuple where one held
    such a tensor). `reals`: id of the trace's stand-in of a parameter or
    buffer -> that tensor (an RNN's list of its weights holds them). Raises
    ValueError for a tensor computed from an input."""
    if isinstance(value, torch.Tensor):
        if id(value) in reals:
            return reals[id(value)]
        return _computed(value) if is_traced(value) else value
    if depth >= _DEPTH:
        return value
    if isinstance(value, list):
        value[:] = [realize(v, reals, depth + 1) for v in value]
    elif isinstance(value, dict):
        for k, v in list(value.items()):
            value[k] = realize(v, reals, depth + 1)
    elif isinstance(value, tuple):
        items = [realize(v, reals, depth + 1) for v in value]
        if any(a is not b for a, b in zip(items, value)):
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    elif isinstance(value, torch.nn.Module):
        for kind in ("_parameters", "_buffers"):
            members = getattr(value, kind)
            for k, v in list(members.items()):
                if isinstance(v, torch.Tensor) and is_traced(v):
                    members[k] = reals.get(id(v)) or _computed(v)
        for k, v in list(vars(value).items()):
            if not k.startswith("_"):
                vars(value)[k] = realize(v, reals, depth + 1)
    elif hasattr(value, "__dict__") and not isinstance(
            value, (type, types.ModuleType, types.FunctionType, types.MethodType)):
        for k, v in list(vars(value).items()):
            vars(value)[k] = realize(v, reals, depth + 1)
    return value


def _computed(t: torch.Tensor) -> torch.Tensor:
    """The real value of a traced tensor made from constants."""
    target = node_of(t)
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()
    todo = [target]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder" or (node.op == "call_function" and _random(node)):
            raise ValueError(f"{node.name} ({node.target})")
        order.append(node)
        todo += node.all_input_nodes
    position = {n: i for i, n in enumerate(target.graph.nodes)}
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    for node in sorted(order, key=position.__getitem__):
        copies[node] = graph.node_copy(node, copies.__getitem__)
    graph.output(copies[target])
    root = target.graph.owning_module or _root_of(target)
    with _disable_current_modes(), torch.no_grad():
        return fx.GraphModule(root, graph)()


def _random(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and \
        torch.Tag.nondeterministic_seeded in node.target.tags


def _root_of(node: fx.Node):
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    return get_proxy_mode().tracer.root
