"""A program traced over a cut list of micro-batches (capture/micro.py), run
as a loop: cut after the passes into three programs, each compiled once.

- first: what the second micro-batch's region depends on outside it, the
  first micro-batch's region (the nodes before the loop and micro-batch 0),
  and every random op before the loop (so the generator's draws keep eager's
  order: the op's number, then each micro-batch's masks);
- body: micro-batch 1's region, run k-1 times, micro-batch i's tensors where
  the trace had the second element's, the values it carries (each parameter's
  accumulated .grad, each buffer) fed back from the run before;
- last: the rest (the reductions, clipping, the update), reading the last
  body run's values. The loss the step returns is the last micro-batch's.

A program splits only where that computes what the unrolled program computes
for every k: the body reads of the first micro-batch's region only what it
carries, and nothing that depends on a collective (mode fsdp's gathers per pass,
an average at a backward() whose gradients are read before the next); it
issues no collective; nothing after the loop reads the first micro-batch's
values. Otherwise split() raises NotRollable and the step is traced unrolled.
All the program's collectives are in `last`, in the program's order, once per
step whatever k is: ranks with different k issue the same ones.
"""

from __future__ import annotations

import copy
import dataclasses

import torch.fx as fx

from ..capture.micro import Carry, NotRollable
from ..capture.slots import ArraySlot, DataSlot
from .runnable import Loop, Runnable
from ..program.program import (InputKind, InputSpec, OutputKind, OutputSpec, Program, draws_random,
                               graph_module)
from ..program.roles import CARRY, COMM, INPUT, MICRO


@dataclasses.dataclass(frozen=True)
class LoopSlot:
    """A value passed between the loop's programs, by its node's name in the
    whole program."""

    store: dict
    name: str

    def read(self, leaves):
        return self.store[self.name]


def split(runnable: Runnable, start: int, per: int) -> Loop:
    """The loop of a program traced over a cut list (its nodes tagged MICRO)
    whose elements' leaves are `per` from leaf `start` on, as three Runnables;
    NotRollable where it does not split."""
    program, slots, targets, backend = (runnable.program, runnable.slots, runnable.targets,
                                        runnable.backend)
    nodes = list(program.graph.nodes)
    body = [n for n in nodes if n.meta.get(MICRO) == 1]
    if not body:
        raise NotRollable("no operation was traced for the second micro-batch")
    in_body = set(body)
    carries = {n.meta[CARRY]: n for n in nodes if isinstance(n.meta.get(CARRY), Carry)}
    carried = {carries[c]: carries.get(dataclasses.replace(c, micro=1)) for c in carries
               if c.micro == 0}   # x0 -> x1
    for n in body:
        if COMM in n.meta:
            raise NotRollable(f"a collective ({n.name}) runs inside the loop body")
    loopy: set[fx.Node] = set()
    for n in nodes:
        if MICRO in n.meta or any(a in loopy for a in n.all_input_nodes):
            loopy.add(n)
    looping = next(i for i, n in enumerate(nodes) if MICRO in n.meta)
    # A random op traced before the loop draws before it (eager's order of the
    # generator's draws), even where only the nodes after the loop read it.
    first = _ancestors([a for n in body for a in n.all_input_nodes if a not in in_body]
                       + [n for n in nodes if n.meta.get(MICRO) == 0]
                       + [n for n in nodes[:looping] if draws_random(n)], in_body)
    last = [n for n in nodes if n.op == "call_function" and n not in first and n not in in_body]
    data = _data_leaves(program, slots, start, per)
    for n in body:
        for a in n.all_input_nodes:
            if a in in_body or a.op in ("placeholder", "get_attr"):
                if data.get(a) == 0:
                    raise NotRollable(f"the loop body reads {a.name}, the first micro-batch's")
                continue
            if a in carried:
                if carried[a] not in in_body:
                    raise NotRollable(f"the loop body reads {a.name} ({a.meta[CARRY].what.value} "
                                      f"{a.meta[CARRY].name}) but does not update it")
            elif a in loopy:
                raise NotRollable(f"the loop body reads {a.name}, a value of the first "
                                  "micro-batch other than the gradients and buffers it carries")
            elif any(COMM in x.meta for x in _ancestors([a], set())):
                raise NotRollable(f"the loop body reads {a.name}, computed by a collective")
    for n in first:
        for a in n.all_input_nodes:
            if data.get(a) == 1:
                raise NotRollable(f"{n.name}, before the loop body, reads {a.name}, "
                                  "the second micro-batch's")
    for n in last + [program.output_node]:
        for a in n.all_input_nodes:
            if a in first and a in loopy:
                raise NotRollable(f"{n.name}, after the loop, reads {a.name}, a value of the "
                                  "first micro-batch")
    first_nodes = [n for n in nodes if n in first]
    body_needs = [a for a in _externals(body, in_body) if a.op != "placeholder"]
    last_needs = _externals(last + [program.output_node], set(last))
    first_out = [a for a in _unique(body_needs + last_needs) if a in first]
    body_out = [carried[a] for a in body_needs if a in carried] + \
               [a for a in last_needs if a in in_body]
    store: dict = {}
    updated = {spec.target for spec in program.outputs if spec.kind is OutputKind.UPDATE}

    def piece(name: str, members: list[fx.Node], outs: list[fx.Node], specs, piece_targets):
        extra = [p for p in program.placeholders if p.meta[INPUT].name in updated] \
            if name == "last" else []
        sub, inputs = _subprogram(program, f"{program.name}.{name}", members, outs, specs, extra)
        index = {spec.name: i for i, spec in enumerate(program.inputs)}
        piece_slots = [slots[index[spec.name]] if spec.kind is not InputKind.LOOP
                       else LoopSlot(store, spec.name) for spec in inputs]
        return Runnable(sub, piece_slots, piece_targets, backend)

    user = OutputSpec(OutputKind.USER)
    return Loop(
        piece("first", first_nodes, first_out, [user] * len(first_out), [None] * len(first_out)),
        piece("body", body, _unique(body_out), [user] * len(_unique(body_out)),
              [None] * len(_unique(body_out))),
        piece("last", last, list(program.output_node.args[0]), program.outputs, targets),
        store,
        [[a.name] for a in first_out],
        [[x0.name for x0, x1 in carried.items() if x1 is v and x0 in body_needs]
         + ([v.name] if v in last_needs else []) for v in _unique(body_out)])


def _ancestors(start: list[fx.Node], stop: set[fx.Node]) -> set[fx.Node]:
    """The call_function nodes among `start` and what they read, transitively;
    NotRollable where that reaches into `stop` (the body)."""
    seen: set[fx.Node] = set()
    todo = list(start)
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function":
            continue
        if n in stop:
            raise NotRollable(f"{n.name} of the loop body is read by a node before it that is "
                              "not part of it")
        seen.add(n)
        todo += n.all_input_nodes
    return seen


def _externals(members: list[fx.Node], inside: set[fx.Node]) -> list[fx.Node]:
    """What `members` read from outside `inside` (get_attr nodes are copied)."""
    return _unique([a for n in members for a in n.all_input_nodes
                    if a not in inside and a.op != "get_attr"])


def _unique(nodes: list[fx.Node]) -> list[fx.Node]:
    return list(dict.fromkeys(nodes))


def _data_leaves(program: Program, slots: list, start: int, per: int) -> dict[fx.Node, int]:
    """The placeholders of the cut list's elements' tensors -> 0 or 1."""
    return {p: (slot.leaf - start) // per for p, slot in zip(program.placeholders, slots)
            if isinstance(slot, (DataSlot, ArraySlot)) and start <= slot.leaf < start + 2 * per}


def _subprogram(program: Program, name: str, members: list[fx.Node], outs: list[fx.Node],
                specs: list[OutputSpec], extra: list[fx.Node]) -> tuple[Program, list[InputSpec]]:
    """A program of `members` (in program order) returning `outs`: its inputs
    are the whole program's placeholders it reads (and `extra`), then the
    values it reads from the other pieces (InputKind.LOOP), in program order."""
    inside = set(members)
    reads = _externals(members, inside) + [o for o in outs if o not in inside and o.op != "get_attr"]
    position = {n: i for i, n in enumerate(program.graph.nodes)}
    placeholders = sorted(set([a for a in reads if a.op == "placeholder"] + extra), key=position.get)
    values = sorted({a for a in reads if a.op != "placeholder"}, key=position.get)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = []
    for a in placeholders + values:
        node = graph.placeholder(a.name)
        node.meta = {k: v for k, v in a.meta.items() if k in ("val", "tensor_meta", INPUT)}
        if a.op != "placeholder":
            node.meta[INPUT] = InputSpec(InputKind.LOOP, a.name)
        inputs.append(node.meta[INPUT])
        env[a] = node

    def arg(a: fx.Node) -> fx.Node:
        if a not in env:   # a constant
            env[a] = graph.node_copy(a)
        return env[a]
    for n in members:
        env[n] = graph.node_copy(n, arg)
        env[n].meta = copy.copy(n.meta)
    graph.output(tuple(arg(o) for o in outs))
    return Program(name, graph_module(program.gm, graph), inputs, list(specs)), inputs
