"""Turn the functionalized graph into a Program: named, annotated inputs, the
trailing write-backs made outputs."""

from __future__ import annotations

import keyword
import re

import torch
import torch.fx as fx

from ..errors import TranspileError
from ..program.program import InputKind, OutputKind, OutputSpec, Program, graph_module
from ..program.roles import CARRY, GRAD_AT, INPUT, PARAM, READY
from .inputs import Inputs
from .numbers import OptimizerValueSlot
from .slots import GradSlot, StateSlot

_DETACH = torch.ops.aten.detach.default
_COPY_ = torch.ops.aten.copy_.default
_T = torch.ops.aten.t.default


def identifier(prefix: str, name: str) -> str:
    ident = re.sub(r"\W", "_", name).strip("_") or "v"
    ident = f"{prefix}{ident}"
    return ident + "_" if keyword.iskeyword(ident) else ident


_PREFIX = {InputKind.PARAM: "p_", InputKind.BUFFER: "b_", InputKind.GRAD: "g_",
           InputKind.STATE: "s_", InputKind.HYPER: "h_", InputKind.SCALER: "sc_",
           InputKind.DATA: "", InputKind.NUMBER: "", InputKind.REACHED: "r_",
           InputKind.DRAW: "d_"}


def _bypass(graph: fx.Graph, node: fx.Node, value: fx.Node) -> None:
    """Replace `node` by `value`, which computes the same thing, keeping its marks."""
    node.replace_all_uses_with(value, propagate_meta=False)
    for key in (PARAM, READY, GRAD_AT, CARRY):
        if key in node.meta:
            value.meta.setdefault(key, node.meta[key])
    graph.erase_node(node)


def to_program(gm: fx.GraphModule, inputs: Inputs, n_user: int, created,
               left: list[torch.Tensor], assigned: list) -> tuple[Program, list, list]:
    """Turn the functionalized graph into a Program: name and annotate the
    placeholders, drop detaches, make the trailing write-backs outputs and drop
    the gradients and optimizer state the step starts with where it does not
    read them. Returns the program, the slot of each input and the target of
    each output."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, inputs.specs):
        node._rename(identifier(_PREFIX[spec.kind], spec.name))
        node.meta[INPUT] = spec
    for node in list(graph.nodes):
        # detach(x) is x in a graph without autograd, and so is t(t(x)), which
        # the backward pass of every Linear layer produces.
        if node.op != "call_function":
            continue
        if node.target is _DETACH:
            _bypass(graph, node, node.args[0])
        elif node.target is _T and getattr(node.args[0], "target", None) is _T:
            inner = node.args[0]
            _bypass(graph, node, inner.args[0])
            if not inner.users:
                graph.erase_node(inner)
    index = {n: i for i, n in enumerate(placeholders)}
    updates: dict[int, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is _COPY_ and node.args[0] in index:
            if node.users:
                raise TranspileError("internal: a write-back copy_ is used inside the program")
            updates[index[node.args[0]]] = node.args[1]
            graph.erase_node(node)
    out = graph.output_node()
    results = list(out.args[0])
    specs = [OutputSpec(OutputKind.USER)] * n_user
    targets: list = [None] * n_user
    for (opt, p, key), value in zip(created, results[n_user:]):
        name = inputs.param_names[id(p)]
        specs.append(OutputSpec(OutputKind.STATE, f"{name}:{key}", param=name))
        targets.append(StateSlot(opt, p, key))
    read = {id(slot.param) for spec, slot in zip(inputs.specs, inputs.slots)
            if spec.kind is InputKind.GRAD}
    for p in left:   # the .grad the step leaves (its output covers any write-back)
        specs.append(OutputSpec(OutputKind.GRAD, inputs.param_names[id(p)]))
        targets.append(GradSlot(p, in_place=id(p) in read))
    for name, slot in assigned:
        specs.append(OutputSpec(OutputKind.ASSIGNED, name))
        targets.append(slot)
    for i in sorted(updates):
        if inputs.specs[i].kind is not InputKind.GRAD:
            results.append(updates[i])
            specs.append(OutputSpec(OutputKind.UPDATE, inputs.specs[i].name))
            targets.append(inputs.slots[i])
    out.args = (tuple(results),)
    graph.eliminate_dead_code()
    kept = []
    for node, spec, slot in zip(placeholders, inputs.specs, inputs.slots):
        if (spec.kind in (InputKind.GRAD, InputKind.STATE, InputKind.REACHED)
                or isinstance(slot, OptimizerValueSlot)) and not node.users:
            graph.erase_node(node)
        else:
            kept.append((spec, slot))
    _constants_first(graph)
    graph.lint()
    return (Program("main", graph_module(gm, graph), [s for s, _ in kept], specs),
            [s for _, s in kept], targets)


def _constants_first(graph: fx.Graph) -> None:
    """The constants (get_attr) right after the inputs, where a pass that moves
    the ops reading them (schedule_updates moves an update to its bucket) finds
    them defined."""
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for node in [n for n in graph.nodes if n.op == "get_attr"]:
        if node is not first:
            first.prepend(node)
