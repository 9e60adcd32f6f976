"""An update that a step may skip, skipped on the host.

A program keeps an update that may be skipped (GradScaler's step on an
overflow, skip_nonfinite) branch-free: every value the update writes is
selected with where(ok, new, old), which a CUDA graph can replay. Run op by op,
that costs three passes over the model that eager does not make: the update is
computed out of place, selected, then copied back. Eager's GradScaler reads
found_inf on the host instead and skips optimizer.step(). On a backend that may
read the host (eager), the program is cut in two: the prefix computes
everything but the update (the forward and backward passes, the collectives,
ok and the scaler's update) and the update, run only where ok reads true on the
host. Each part is reinplaced on its own, so the update runs in place as eager's
optimizer does. The values are those of the select: a skipped update writes
nothing, every rank decides from its own ok as the select did, and the update
issues no collective (a program whose update does is left as it is).
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from ..program.program import (InputKind, InputSpec, OutputKind, OutputSpec, Program, draws_random,
                               graph_module, selected_update)
from ..program.roles import INPUT, SKIPPABLE


@dataclasses.dataclass
class SkipPlan:
    """ok: the 0-d bool node every skippable select reads; update: the nodes
    only the selected new values read; guarded: output index -> its select."""

    ok: fx.Node
    update: list[fx.Node]
    guarded: dict[int, fx.Node]


def plan(program: Program) -> SkipPlan | None:
    """Where the program may be cut before a skippable update; None where it
    has none, where several conditions guard it, where a select keeps a value
    that is not an input (optimizer state the step creates), or where the
    update issues a collective or draws random numbers."""
    graph = program.graph
    selects = [n for n in graph.nodes if n.meta.get(SKIPPABLE)]
    if len({n.args[0] for n in selects}) != 1 or any(n.args[2].op != "placeholder"
                                                     for n in selects):
        return None
    chosen = set(selects)
    update = selected_update(graph, chosen)
    collectives = set(program.collectives())
    if not update or any(n in collectives or draws_random(n) or n.is_impure() for n in update):
        return None
    out = program.output_node
    if any(set(n.users) != {out} for n in selects):   # local SGD's sync averages the update
        return None
    guarded = {k: v for k, v in enumerate(out.args[0]) if v in chosen}
    if len(guarded) != len(chosen):   # one select given as two outputs
        return None
    return SkipPlan(selects[0].args[0], [n for n in graph.nodes if n in update], guarded)


def split(program: Program, cut: SkipPlan) -> tuple[Program, Program, list[int], list[int]]:
    """The prefix and the update as programs of their own. The prefix takes the
    program's inputs and returns its unguarded outputs, then ok, then the
    values the update reads; the update takes the program's inputs it reads
    (at the indices returned second) and those values, and returns the guarded
    outputs (in output order) with their specs, so that reinplacing writes them
    in place. Also returned: the guarded outputs' indices."""
    graph, out = program.graph, program.output_node
    update = set(cut.update)
    outputs = list(out.args[0])
    kept = [k for k in range(len(outputs)) if k not in cut.guarded]
    # what the update reads of the prefix, and new values the prefix computes
    # (one that another output or node reads too)
    new = {s.args[1] for s in cut.guarded.values()}
    carried = [n for n in graph.nodes if n.op != "placeholder" and n not in update
               and (n in new or any(u in update for u in n.users))]

    prefix = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        if n.op == "output" or n in update or n in cut.guarded.values():
            continue
        env[n] = prefix.node_copy(n, env.__getitem__)
    prefix.output(tuple([env[outputs[k]] for k in kept] + [env[cut.ok]]
                        + [env[n] for n in carried]))
    specs = [program.outputs[k] for k in kept] + [OutputSpec(OutputKind.USER)] * (1 + len(carried))

    placeholders = program.placeholders
    read = [i for i, p in enumerate(placeholders)
            if any(u in update for u in p.users) or p in new
            or p in {s.args[2] for s in cut.guarded.values()}]
    suffix = fx.Graph()
    env = {}
    inputs = []
    for i in read:
        p = placeholders[i]
        env[p] = suffix.node_copy(p)
        inputs.append(program.inputs[i])
    for j, n in enumerate(carried):
        env[n] = suffix.placeholder(f"carried_{j}")
        env[n].meta.update(n.meta)
        spec = InputSpec(InputKind.LOOP, f"carried_{j}")
        env[n].meta[INPUT] = spec
        inputs.append(spec)
    for n in cut.update:
        env[n] = suffix.node_copy(n, env.__getitem__)
    guarded = sorted(cut.guarded)
    suffix.output(tuple(env[cut.guarded[k].args[1]] for k in guarded))
    return (Program(f"{program.name}.prefix", graph_module(program.gm, prefix),
                    list(program.inputs), specs),
            Program(f"{program.name}.update", graph_module(program.gm, suffix), inputs,
                    [program.outputs[k] for k in guarded]),
            read, guarded)


def executable(program: Program, op_by_op):
    """(run, written) of the program cut before its skippable update, each part
    run op by op (`op_by_op(program) -> (function of its inputs, written)`);
    None where it has none."""
    cut = plan(program)
    if cut is None:
        return None
    prefix, update, read, guarded = split(program, cut)
    before, before_written = op_by_op(prefix)
    after, after_written = op_by_op(update)
    n = len(program.outputs)
    kept = [k for k in range(n) if k not in cut.guarded]
    index = {p: i for i, p in enumerate(program.placeholders)}
    old = [index[cut.guarded[k].args[2]] for k in guarded]
    written = [False] * n
    for k, w in zip(kept, before_written):
        written[k] = w
    for k, w in zip(guarded, after_written):
        written[k] = w

    def run(inputs: list) -> list:
        values = [None] * n
        first = before(*inputs)
        for k, v in zip(kept, first):
            values[k] = v
        ok, carried = first[len(kept)], first[len(kept) + 1:]
        if ok.item():   # the host read eager's GradScaler.step makes
            for k, v in zip(guarded, after(*[inputs[i] for i in read], *carried)):
                values[k] = v
        else:   # the select's old values: an update not written in place writes itself back
            for k, i in zip(guarded, old):
                values[k] = inputs[i]
        return values
    return run, written
