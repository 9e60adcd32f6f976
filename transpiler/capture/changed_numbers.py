"""Numbers the step changes on the host on every call: which to lift.

A number the step reads and leaves changed (a counter, `self.global_step +=
1`; a meter, `self.sum += loss.item() * n`; a counter in a dataclass or a dict
among its arguments) would make every call's program another one if read by
value. trace.py lifts it at the first call (numbers.py: read from an input on
every call) and traces again, so that what the step leaves there is a symbolic
number: an output of the one program, put back after every run (returned.py).

- places_read_and_written: host places the step wrote a symbolic number to
  after reading a number there by value;
- counted_places: host places it wrote a plain number to again when traced
  from the written state (host_state.py's convergence check), after reading one;
- leaves_written: number leaves among the arguments it set a symbolic number at;
- refuse_pinned: such a number whose program holds for one of its values only
  (`batches[self.i]`, `W[state.i]`, `if self.step == 0`): every call would
  trace again.
"""

from __future__ import annotations

import sympy

from ..errors import TranspileError
from .argument_writes import ArgumentNumber
from .arguments import StepArgs, leaf_index
from .guards import Check, Guards
from .numbers import NumberGuard, NumberSlot, is_number
from .reads import Write, place_key
from .user_code import step_name


def places_read_and_written(writes, guards: Guards) -> frozenset:
    """The places (reads.place_key) of the host writes among `writes` (the
    trace's symbolic numbers, returned.Returned.writes) where the step read a
    number by value."""
    return frozenset(place_key(w.holder, w.key) for w in writes
                     if isinstance(w, Write) and _read_there(w, guards))


def counted_places(writes: list[Write], guards: Guards) -> frozenset:
    """The places of the plain numbers among `writes` where the step read a
    number by value (`self.n += 1`)."""
    return frozenset(place_key(w.holder, w.key) for w in writes
                     if not w.in_place and is_number(w.values()[1]) and _read_there(w, guards))


def leaves_written(step_args: StepArgs, writes) -> set[int]:
    """The number leaves of the arguments where the step set a symbolic number."""
    return {i for w in writes if isinstance(w, ArgumentNumber)
            for i in [leaf_index(step_args, w.written)]
            if i is not None and is_number(step_args.leaves[i])}


def _read_there(w: Write, guards: Guards) -> bool:
    """Whether the step read a number by value from the place it wrote."""
    return is_number(w.values()[0]) and any(g.holder is w.holder and g.key == w.key
                                            and g.check is Check.VALUE for g in guards.guards)


def refuse_pinned(step_fn, step_args: StepArgs, number_guards: list[NumberGuard],
                  host_writes: list[Write], writes) -> None:
    """Refuse, with `host_writes` undone, where a number guard takes one value
    of a lifted number the step changes (`writes`: the trace's symbolic
    numbers, returned.Returned.writes): its program holds for that value
    alone, so every call would trace again."""
    places = {place_key(w.holder, w.key) for w in writes if isinstance(w, Write)}
    leaves = {leaf_index(step_args, w.written) for w in writes if isinstance(w, ArgumentNumber)}
    for guard in number_guards:
        expr = guard.expr
        if not isinstance(expr, sympy.Eq) or not any(isinstance(side, sympy.Symbol)
                                                     for side in expr.args):
            continue
        pinned = [name for symbol, name, slot in guard.slots if symbol in expr.args
                  and (step_args.places_lifted.get(name) in places
                       or isinstance(slot, NumberSlot) and slot.leaf in leaves)]
        if pinned:
            for w in reversed(host_writes):
                w.undo()
            raise TranspileError(
                f"{step_name(step_fn)} changes {pinned[0]} on every call and takes one value of "
                f"it ({guard.condition()}){guard.where}: a program holds for that value alone, "
                "so every call would trace the step again. Keep such a counter outside the step "
                "(pass it as an argument, or pull the batch before the call), or decide on a "
                "range of it (`if step < warmup`, `step % k == 0`)")
