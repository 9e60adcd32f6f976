"""A compiled program whose call decides otherwise may fail before its checks.

A decision on a tensor value can fix a size: a loop over `nonzero()`'s rows
fixes their number (transformers' MoE layers loop over the experts hit),
ctc_loss reads its lengths, so the size of the labels' `masked_select` is
fixed with them. The program checks each decision where its value is computed
(capture/decisions.py), and a call that decides otherwise runs the program of
its own decisions. A compiler takes the size as given and asserts it where the
op returns (inductor's `assert_size_stride`, its runtime assertions on a
data-dependent size), before the check runs: the call would fail with the
compiler's assertion where the eager backend traces again.

So when a compiled program with decisions raises, its checks are run op by op
on the same inputs, with the ops they read (`checks_on_failure`). The program
is functional and takes every decision before anything is written or issued
(decisions.check_program): the checks write nothing and issue no collective. A
check that fails raises as in the eager backend's run, and the runtime runs
the program of this call's decisions; otherwise the compiler's error stands.
"""

from __future__ import annotations

import copy
from typing import Callable

from ..capture.decisions import set_torch_generators, torch_generators
from ..program.program import Program, draws_random, graph_module
from ..program.roles import DECISION
from .op_calls import direct


def checks_on_failure(program: Program, run: Callable[[list], list]) -> Callable[[list], list]:
    """`run`, a compiled program's function of its inputs, which on a failure
    raises the program's first decision check that no longer holds, if one
    does. `run` itself where the program takes no decision."""
    checks, draws = _checks(program)
    if checks is None:
        return run

    def run_checked(inputs: list) -> list:
        # the checks read what the run drew: they draw it again from the same state
        generators = torch_generators() if draws else None
        try:
            return run(inputs)
        except Exception:
            if generators is not None:
                set_torch_generators(generators)
            checks(*inputs)   # raises the check that fails, in the program's order
            raise
    return run_checked


def _checks(program: Program) -> tuple[Callable | None, bool]:
    """A function of the program's inputs that runs its decision checks and the
    ops they read, op by op; whether those ops draw random numbers."""
    if not any(DECISION in n.meta for n in program.graph.nodes):
        return None, False
    graph = copy.deepcopy(program.graph)
    checks = [n for n in graph.nodes if DECISION in n.meta]
    read, todo = set(), checks
    while todo:
        node = todo.pop()
        if node not in read:
            read.add(node)
            todo += node.all_input_nodes
    graph.output_node().args = ((),)
    for node in reversed(graph.nodes):
        if node.op in ("call_function", "get_attr") and node not in read:
            graph.erase_node(node)
    return direct(graph_module(program.gm, graph)), any(draws_random(n) for n in read)
