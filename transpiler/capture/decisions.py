"""Decisions on tensor values: Python control flow on what a tensor holds
(`if mask.any():`, `if tokens.numel() == 0: continue`, a validation `raise`,
a loop over `nonzero()`'s rows, `.tolist()` used as sizes), which a trace on
fake tensors cannot take: it stops there, not knowing the value.

The step is then traced again on fake tensors that carry real ones (torch's
real-tensor propagation): every op also runs on copies of this call's inputs,
so each decision takes the branch this call takes in eager (the RNG is put
back after, so the program draws what eager draws). Each decision becomes a
check in the program (transpiler::decided where its value is computed, before
anything is written; the check reads the value itself, so that a compiler,
which knows what the trace assumed of it, cannot fold the check into a
constant): a later call whose values decide otherwise fails the check with
nothing written, and the step is traced again for it
(runtime/step.py); the programs of each set of decisions are kept under the same
signature (program_cache.py). The cost is one host read per decision, as
eager pays; a rank whose decision changes traces alone, which its collectives
allow only before the program's first collective (check_program).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import operator
import re
import traceback
from unittest import mock

import sympy
from sympy.printing.str import StrPrinter
import torch
import torch._functorch.config
import torch.fx as fx
from torch._subclasses import fake_utils
from torch.fx.experimental.symbolic_shapes import (CallMethodKey, GuardOnDataDependentSymNode,
                                                   ShapeEnv, _has_uninterpretable_sympy_function)
from torch.utils._sympy.symbol import SymT, symbol_is_type
from torch.fx.passes.runtime_assert import insert_deferred_runtime_asserts
from torch.utils._pytree import SequenceKey
from torch.utils._sympy import functions as sympy_functions
from torch.utils._sympy.interp import sympy_interp
from torch.utils._sympy.reference import PythonReferenceAnalysis

from ..program.collectives import WAIT
from ..errors import TranspileError
from ..program.program import draws_random
from ..program.roles import DECISION, MICRO
from .real_twins import each_op_once
from .user_code import step_name, user_line

@dataclasses.dataclass(frozen=True)
class Decision:
    """What a program assumes of a tensor value: `expr` (over its unbacked
    symbols) holds, as it did for the call it was traced on, at `where` in the
    user's code."""

    expr: str
    where: str

    def describe(self) -> str:
        return f"{self.expr}{self.where}"


def stopped_at_decision(exc: BaseException) -> bool:
    """Whether a failed trace stopped at a decision on a tensor value."""
    while exc is not None:
        if isinstance(exc, GuardOnDataDependentSymNode):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def on_real_values():
    """Trace with real-tensor propagation: decisions take this call's values.
    The ops run on copies of the inputs (the fake tensors' real twins); the
    random ones draw from the global generators, put back afterwards."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch._functorch.config.patch(fake_tensor_propagate_real_tensors=True), \
            torch.random.fork_rng(devices=devices), each_op_once(), \
            mock.patch.object(ShapeEnv, "_log_real_tensor_propagation", _record_non_finite), \
            mock.patch.object(fake_utils, "_check_fake_real_tensors", lambda *a, **k: None):
        # (torch's check of each fake result against the real one compares
        # symbolic storage offsets with `!=`: a decision of its own, on every
        # size it meets)
        yield


_NON_FINITE = "transpiler_non_finite"   # a shape environment's specializations to nan or inf
_NOT_FINITE = (sympy.nan, sympy.oo, -sympy.oo, sympy.zoo)


def _record_non_finite(shape_env: ShapeEnv, expr: sympy.Basic, value: sympy.Basic) -> None:
    """torch takes a number to this call's value (a float turned into text,
    `float(t.item())`) with a check that it equals the value, which sympy
    folds to false for nan (and for an infinity, if not already): no check
    would be kept, and the program would take every later value for it. Each
    such value is recorded with where it was taken (pinned by insert_checks)."""
    if value in _NOT_FINITE:
        shape_env.__dict__.setdefault(_NON_FINITE, []).append(
            (expr, value, traceback.extract_stack()))


def torch_generators() -> list:
    """torch's default generators' states (the CPU's, the current GPU's), to put
    back before a run whose decisions went otherwise is run again."""
    states = [(torch.random.set_rng_state, torch.random.get_rng_state())]
    if torch.cuda.is_initialized():
        states.append((torch.cuda.set_rng_state, torch.cuda.get_rng_state()))
    return states


def set_torch_generators(states: list) -> None:
    for set_, state in states:
        set_(state)


def insert_checks(gm: fx.GraphModule, shape_env: ShapeEnv, step_fn) -> list[Decision]:
    """Put each decision the trace took on real values into the graph as a
    check (DECISION on its node's meta), where the values it reads are
    computed; returns them in the graph's order."""
    _pin_uninterpretable(shape_env, step_fn)
    _keep_float_bounds(shape_env)
    decisions = _pin_non_finite(gm, shape_env.__dict__.pop(_NON_FINITE, []), step_fn)
    with _exact_floats():   # the checks' expressions are read from these strings
        by_expr = {str(ra.expr): ra for ras in shape_env.deferred_runtime_asserts.values()
                   for ra in ras}
        insert_deferred_runtime_asserts(gm, shape_env, step_name(step_fn))
    # The checks are in the graph now: a compiler would generate them again
    # from the shape environment, with no message but the expression.
    shape_env.deferred_runtime_asserts.clear()
    sources = _number_sources(gm)
    asserts = []
    for node in gm.graph.find_nodes(op="call_function",
                                    target=torch.ops.aten._assert_scalar.default):
        found = re.match(r"Runtime assertion failed for expression (.*) on node '", node.args[1])
        ra = by_expr.get(found.group(1)) if found else None
        where = user_line(step_fn, frames=ra.stack.summary()) if ra is not None else ""
        decision = Decision(found.group(1) if found else str(node.args[0]), where)
        # as the message states it: the expression of the assert's node may
        # already be simplified by what it asserts (a range's bound: True)
        symbols = sorted(map(str, _parsed(decision.expr, ())[0].free_symbols))
        asserts.append((node, decision, symbols))
    # A bound torch keeps of a symbol's range (`u0 >= 1`) has no line of its
    # own: the line of a decision on the same value
    lines = {symbol: d.where for _, d, symbols in asserts if d.where for symbol in symbols}
    for node, decision, symbols in asserts:
        if not decision.where:
            decision = Decision(decision.expr, next(
                (lines[s] for s in symbols if s in lines), ""))
        read = [_source(sources, symbol, decision, step_fn) for symbol in symbols]
        with gm.graph.inserting_before(node):
            check = gm.graph.call_function(
                torch.ops.transpiler.decided.default,
                ([tensor for tensor, _ in read], [how for _, how in read], decision.expr,
                 " ".join(symbols), len(decisions)))
        check.meta.update(node.meta)
        check.meta[DECISION] = decision
        cone = node.args[0]
        gm.graph.erase_node(node)
        _erase_unused(cone)
        decisions.append(decision)
    gm.recompile()
    return decisions


def _pin_non_finite(gm: fx.GraphModule, non_finite: list, step_fn) -> list[Decision]:
    """A check of each number taken as nan or an infinity (_record_non_finite),
    right after the tensor it is read from; before torch's assert insertion,
    which erases a .item() no assert reads."""
    if not non_finite:
        return []
    sources = _number_sources(gm)
    decisions, pinned = [], set()
    for expr, value, frames in non_finite:
        if expr in pinned:
            continue
        pinned.add(expr)
        which = "nan" if value is sympy.nan else str(float(value))
        decision = Decision(f"{expr} is {which}", user_line(step_fn, frames=frames))
        if not isinstance(expr, sympy.Symbol):
            raise TranspileError(
                f"{step_name(step_fn)} takes a number computed from a tensor value as {which} "
                f"({expr}){decision.where}, which the program cannot check on later calls: "
                "test it with tensor ops (torch.isfinite), or read the tensor's own value")
        tensor, _ = _source(sources, str(expr), decision, step_fn)
        with gm.graph.inserting_after(tensor):
            check = gm.graph.call_function(torch.ops.transpiler.still_non_finite.default,
                                           (tensor, which, len(decisions)))
        check.meta[DECISION] = decision
        decisions.append(decision)
    return decisions


def _keep_float_bounds(shape_env: ShapeEnv) -> None:
    """torch's insert_deferred_runtime_asserts drops a bound of one symbol by a
    number (`zuf0 <= 3.0`) as redundant, since it constrains the symbol's range
    instead, which it does for integers only: a decision on a float
    (`if t.item() > 3:`, `max(1, step - t0)`) kept no check, and the program
    held the first call's branch. Each such bound on a float is stated as
    `zuf0 - 3.0 <= 0` (unevaluated, so that a bound by 0 stays one too),
    which it keeps (for doubles x - c <= 0 exactly when x <= c: a difference
    of two finite doubles is 0 only when they are equal)."""
    for asserts in shape_env.deferred_runtime_asserts.values():
        for i, ra in enumerate(asserts):
            expr = ra.expr
            if expr.func not in (sympy.LessThan, sympy.GreaterThan) or len(expr.args) != 2:
                continue
            lhs, rhs = expr.args
            if isinstance(lhs, sympy.Number):
                lhs, rhs = rhs, lhs
                expr = expr.reversed
            if isinstance(lhs, sympy.Symbol) and isinstance(rhs, sympy.Number) \
                    and symbol_is_type(lhs, SymT.UNBACKED_FLOAT):
                # unevaluated: sympy would fold `zuf0 - 0.0 >= 0` back into the bound
                difference = sympy.Add(lhs, -rhs, evaluate=False)
                asserts[i] = dataclasses.replace(ra, expr=expr.func(difference, 0, evaluate=False))


def _exact_floats():
    """sympy prints a float to 15 digits, which a float32's value as a double
    (0.10000000149011612) does not survive: a check would fail on the call it
    was traced on. Print each as Python does, the shortest digits that read
    back as the same double (`_parsed` reads them so)."""
    return mock.patch.object(StrPrinter, "_print_Float", lambda self, f: repr(float(f)))


# How a check reads a number from a tensor: its value (.item()), or a size.
_ITEM = -1
# The ops that read a number of a tensor on the host.
_NUMBER_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.sym_size.int)


def _number_sources(gm: fx.GraphModule) -> dict:
    """For each symbol a program's numbers are made of (by name), where its value lives:
    (a tensor node, _ITEM or a dimension). An unbacked symbol is bound where an
    op computed it (.item(), a nonzero's row count); a backed one is a size of
    an input."""
    sources = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor):
            for dim, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt) and size.node.expr.is_symbol:
                    sources.setdefault(str(size.node.expr), (node, dim))
        for symbol, path in (node.meta.get("unbacked_bindings") or {}).items():
            if node.target is torch.ops.aten._local_scalar_dense.default:
                sources[str(symbol)] = (node.args[0], _ITEM)
            elif len(path) in (2, 3) and isinstance(path[-2], CallMethodKey) \
                    and path[-2].name == "size" and isinstance(path[-1], SequenceKey) \
                    and all(isinstance(key, SequenceKey) for key in path[:-2]):
                tensor = _item(node, path[0].idx) if len(path) == 3 else node
                sources[str(symbol)] = (tensor, path[-1].idx)
    return sources


def _item(node: fx.Node, index: int) -> fx.Node:
    """A node of element `index` of a node's tuple (unique's counts), right
    after it: before any check that reads it."""
    with node.graph.inserting_after(node):
        item = node.graph.call_function(operator.getitem, (node, index))
    item.meta["val"] = node.meta["val"][index]
    return item


def _source(sources: dict, symbol, decision: Decision, step_fn) -> tuple:
    if symbol not in sources:
        raise TranspileError(
            f"{step_name(step_fn)} decides on a tensor value as {decision.describe()}, on a "
            f"number ({symbol}) the program cannot read back from a tensor: compute the "
            "decision with tensor ops (torch.where, masking), or move it outside the step")
    return sources[symbol]


def _erase_unused(node) -> None:
    """The nodes that computed a replaced check's expression, now read by
    nothing (the host reads among them too: a .item() the check does itself)."""
    todo = [node]
    while todo:
        n = todo.pop()
        if isinstance(n, fx.Node) and not n.users and n.op == "call_function" \
                and not draws_random(n) and (not isinstance(n.target, torch._ops.OpOverload)
                                             or n.target in _NUMBER_READS):
            todo += n.all_input_nodes
            n.graph.erase_node(n)


# Functions torch's assert insertion fails to turn into graph nodes (its
# reference analysis branches on a traced value: an int's true division,
# `min(1.0, (n.item() + 1) / 5)`; round()), pinned as the uninterpretable ones.
_NOT_REIFIED = (sympy_functions.IntTrueDiv, sympy_functions.RoundToInt,
                sympy_functions.RoundDecimal)


def _pin_uninterpretable(shape_env: ShapeEnv, step_fn) -> None:
    """A decision whose expression torch cannot put into a graph (a float
    computed from a value, `1.0 / t.item()` passed to an op as a number, is
    specialized to this call's float) would be dropped by
    insert_deferred_runtime_asserts, and the program would keep the number
    whatever later calls hold. It becomes a pin of each value it reads to
    this call's: any other value traces again."""
    for ras in shape_env.deferred_runtime_asserts.values():
        for i, ra in reversed(list(enumerate(ras))):
            if not (_has_uninterpretable_sympy_function(ra.expr) or ra.expr.has(*_NOT_REIFIED)):
                continue
            pins = []
            for symbol in sorted(ra.expr.free_symbols, key=str):
                value = shape_env.real_tensor_prop_unbacked_vals.get(symbol)
                if value is None:
                    raise TranspileError(
                        f"{step_name(step_fn)} decides on a tensor value as {ra.expr}"
                        f"{user_line(step_fn, frames=ra.stack.summary())}, which the program "
                        "cannot check: compute it with tensor ops, or move it outside the step")
                pins.append(dataclasses.replace(ra, expr=sympy.Eq(symbol, value)))
            ras[i:i + 1] = pins


class _Checked(Exception):
    """Raised by a decision's check (transpiler::decided) that no longer holds."""

    def __init__(self, index: int):
        super().__init__(f"decision {index} went the other way")
        self.index = index


@torch.library.custom_op("transpiler::decided", mutates_args=())
def _decided(values: list[torch.Tensor], reads: list[int], expr: str, symbols: str,
             index: int) -> None:
    """A decision's check: whether `expr` holds for the numbers read from
    `values` (.item(), or a size; named by `symbols`, space-separated) as it
    did when the program was traced. A custom op that reads its numbers
    itself, so that a compiler, which knows what the trace assumed of them,
    cannot fold the check into a constant; and a compiled program raises what
    an eager one does."""
    numbers = [v.item() if how == _ITEM else v.size(how) for v, how in zip(values, reads)]
    if not _holds(expr, tuple(symbols.split()), tuple(numbers)):
        raise _Checked(index)


@_decided.register_fake
def _(values, reads, expr, symbols, index):
    return None


def _holds(expr: str, symbols: tuple[str, ...], numbers: tuple) -> bool:
    parsed, names = _parsed(expr, symbols)
    env = {names[name]: int(n) if isinstance(n, bool) else n for name, n in zip(symbols, numbers)}
    return bool(sympy_interp(PythonReferenceAnalysis, env, parsed))


@functools.lru_cache(maxsize=None)
def _parsed(expr: str, symbols: tuple[str, ...]):
    """`expr` as sympy (torch's functions in it), and its symbols by name."""
    names = {name: sympy.Symbol(name) for name in symbols}
    functions = {name: getattr(sympy_functions, name) for name in sympy_functions.__all__}
    # a float's digits read as Python reads them, to the same double (sympy's
    # own reading rounds twice: about 2% of doubles come back another)
    exact = {"Float": lambda digits: sympy.Float(float(digits))}
    return sympy.sympify(expr, locals={**functions, **names, **exact}), names


torch.fx.node.has_side_effect(torch.ops.transpiler.decided.default)


@torch.library.custom_op("transpiler::still_non_finite", mutates_args=())
def _still_non_finite(value: torch.Tensor, which: str, index: int) -> None:
    """The check of a number taken as nan or an infinity (_record_non_finite):
    the tensor's value (.item()) is still that."""
    number = value.item()
    if not (math.isnan(number) if which == "nan" else number == float(which)):
        raise _Checked(index)


@_still_non_finite.register_fake
def _(value, which, index):
    return None


torch.fx.node.has_side_effect(torch.ops.transpiler.still_non_finite.default)


def changed(exc: BaseException, decisions: list[Decision]) -> Decision | None:
    """The decision whose check failed in `exc`, if that is what failed a run."""
    while exc is not None:
        if isinstance(exc, _Checked) and exc.index < len(decisions):
            return decisions[exc.index]
        exc = exc.__cause__ or exc.__context__
    return None


def traced_otherwise(decision: Decision) -> TranspileError:
    """The error for a check that fails on the call it was traced on."""
    return TranspileError(
        f"the step's decision on a tensor value {decision.describe()} went otherwise "
        "as it ran than as it was traced on the same call's values: the trace and the run "
        "compute the value differently (a decision on a random draw does: the trace's real "
        "tensors draw other numbers; so does one on a value that a compiler's kernels round "
        "otherwise than eager's, near its threshold: backend='eager' computes eager's "
        "values). Decide with tensor ops (torch.where, masking), or move the decision "
        "outside the step")


def hoist_checks(program) -> None:
    """Each decision's check, with the nodes that compute what it reads, moved
    up to right after the last value it needs: a decision on a value the step
    reads after a collective but that does not depend on it (MoCo's queue
    pointer, read after its keys' all-gather) is taken before the program
    issues anything. The program is functional, so moving pure nodes earlier
    changes no value; a chain that draws random numbers or reads a
    collective's result stays where it is, and no check moves above the one
    before it (which may guard what it reads: a loop's row count before a row)."""
    graph = program.graph
    if any(MICRO in n.meta for n in graph.nodes):
        return   # a micro-batch loop's nodes keep their places (micro_loop.py cuts by them)
    collectives = set(program.collectives())
    previous = None   # checks keep their order: an earlier one guards what a later one reads
    for check in [n for n in graph.nodes if DECISION in n.meta]:
        cone, todo = set(), [check]
        while todo:
            n = todo.pop()
            if n in cone or n.op != "call_function" or (previous is not None and n < previous):
                continue
            cone.add(n)
            todo += n.all_input_nodes
        if not any(n in collectives or n.target is WAIT or draws_random(n)
                   or (n is not check and n.is_impure()) for n in cone):
            for n in sorted(cone):
                anchor = max([*n.all_input_nodes, *([previous] if previous else [])], default=None)
                if anchor is not None and anchor.next is not n and anchor < n:
                    anchor.append(n)
        previous = check


def check_program(program, decisions: list[Decision], backend: str, step_fn) -> None:
    """Refuse a program whose decisions a rank could not take again alone: on
    a CUDA graph (no host read), or after the program's first collective (a
    rank whose decision changes traces again and runs its new program while
    the others wait in their collectives: it would issue that one twice)."""
    if decisions and backend == "cudagraphs":
        raise TranspileError(
            f"{decisions[0].describe()}: the step decides on a tensor value, which a CUDA "
            "graph cannot read on the host: use backend 'inductor', or decide with tensor "
            "ops (torch.where, masking)")
    collectives, issued, name = set(program.collectives()), None, program.name
    for node in program.graph.nodes:
        if issued is None and node in collectives:
            issued = node
        decision = node.meta.get(DECISION)
        if decision is not None and issued is not None:
            raise TranspileError(
                f"{step_name(step_fn)} decides on a tensor value{decision.where} after program "
                f"{name!r} has issued a collective ({issued.name}): a rank whose decision "
                "changes could not run its step again alone. Decide before the backward "
                "(in mode fsdp, before the forward's first parameter gather), decide with tensor "
                "ops (torch.where, masking), or move the decision outside the step")

