"""The programs built for each signature of the step's arguments: a call with
a signature seen before, whose guarded host values (capture/guards.py) are as
they were at the trace, runs what was built for it; anything else builds again.
A batch tensor seen with a second shape makes the batch's dimensions symbolic
(capture/shapes.py): the signature then leaves their sizes out, and the
program's shape guards say whether a call's sizes fit it.
The programs kept are bounded, as torch.compile bounds its recompiles: past the
bound the least recently used is dropped, with a warning that names what keeps
changing."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

import torch

from ..capture import Returned, StepArgs, describe_change, grad_signature, signature
from ..capture.argument_objects import CallArguments, tracing_for
from ..capture.guards import Guards
from ..capture.host_random import Draws
from ..capture.printed import Output
from ..capture.numbers import is_number
from ..capture.observed_arrays import ValuesRead, is_ndarray
from ..capture.raised import Raised
from ..capture.reads import place_key
from ..capture.rng_plan import RngPlan
from ..capture.shapes import ShapeGuards
from ..capture.signature import batch_shapes
from ..errors import TranspileError
from .runnable import Runnable

log = logging.getLogger("transpiler")

# Programs kept per step (torch.compile's recompile limit is 8 too).
CACHE_LIMIT = 8


@dataclasses.dataclass
class Built:
    """Everything built for one signature of the arguments."""

    programs: dict[str, Runnable]
    startup: Runnable | None   # broadcast from rank 0, then initialize the held tensors
    refresh: Runnable | None   # initialize the held tensors only
    returned: Returned
    state_key: tuple   # identity of the parameters and buffers it runs on
    backend: str       # the concrete backend its programs compile with
    schedulers: list   # LR schedulers stepped on the host after each call
    cleared: list      # (name, parameter) whose .grad each call leaves None
    reads_grads: bool  # whether which parameters have a .grad is part of the key
    guards: Guards     # host values its programs were traced with
    # (name, parameter) of those kept as shards between steps (mode fsdp)
    sharded_params: list = dataclasses.field(default_factory=list)
    shape_guards: ShapeGuards | None = None   # what it assumes of symbolic batch sizes
    # host values the step wrote while traced, written again after every run
    host_writes: list = dataclasses.field(default_factory=list)
    draws: Draws | None = None   # values it draws on the host, drawn again before each run
    rng: RngPlan = dataclasses.field(default_factory=RngPlan)   # around each run
    # optimizer state made for the trace (capture.trace_step), until a run succeeds
    made_state: list = dataclasses.field(default_factory=list)
    # what its programs assume of tensor values (capture/decisions.py)
    decisions: list = dataclasses.field(default_factory=list)
    # what they assume of lifted numbers, checked on the host (capture/numbers.py)
    number_guards: list = dataclasses.field(default_factory=list)
    # done to the call's arguments after each run (capture/argument_writes.py)
    argument_edits: list = dataclasses.field(default_factory=list)
    # numpy arguments whose values the trace read on the host (capture/observed_arrays.py)
    values_read: ValuesRead | None = None
    steps: bool = True   # whether it steps an optimizer (unreduced.py)
    raised: Raised | None = None   # raised after each run, as the step did (capture/raised.py)
    printed: Output | None = None  # shown again after each run (capture/printed.py)

    def fits(self, leaves) -> bool:
        """Whether a call with this signature may run these programs (its
        number guards read this call's host draws: drawn to look, put back)."""
        if self.draws and self.number_guards:
            self.draws.peek()
        return not self.guards.changed() and (
            self.shape_guards is None or self.shape_guards.holds(leaves)) and (
            self.values_read is None or self.values_read.holds(leaves)) and all(
            g.holds(leaves) for g in self.number_guards)

    def misfit(self, leaves) -> str:
        """Why a call does not fit, in one line."""
        if self.values_read is not None and not self.values_read.holds(leaves):
            return self.values_read.describe(leaves)
        failed = next((g for g in self.number_guards if not g.holds(leaves)), None)
        if failed is not None:
            return failed.describe(leaves)
        return self.guards.changed() or self.shape_guards.describe(leaves)


@dataclasses.dataclass(frozen=True)
class _WithGrads:
    """The key of a program that depends on which parameters have a .grad when
    the call starts (one that accumulates onto it, or reads it): never equal
    to a signature alone, even where no parameter had one."""
    sig: tuple
    grads: tuple


class ProgramCache:
    """Built programs by signature (capture.signature), each with its guards.
    Where the programs read the .grad the step starts with, the key also says
    which parameters have one (capture.grad_signature); only those signatures
    pay for computing it."""

    def __init__(self, limit: int = CACHE_LIMIT, dynamic: bool | dict | None = None):
        self._built: dict[tuple | _WithGrads, list[Built]] = {}
        self._order: list[tuple[tuple, Built]] = []   # least recently used first
        self._reads_grads: set[tuple] = set()   # signatures keyed with their grads
        # the call's arguments, where its guards and inputs read an argument's object
        self.arguments = CallArguments()
        self.limit = limit
        self.build_seconds = 0.0
        self.builds = 0
        self.last_built: tuple | None = None   # the full signature last built for
        # Names of number arguments fed as inputs, and of those that cannot be
        # (their value decides control flow or a shape): capture/numbers.py.
        self.lifted: set[str] = set()
        self.per_value: set[str] = set()
        # The same for numbers read outside the arguments, by place (reads.place_key):
        # the places lifted, and the name of each traced per value.
        self.lifted_places: set[tuple] = set()
        self.per_value_places: dict[tuple, str] = {}
        # Places of the lists and deques the step appends to (capture/appended.py).
        self.appended_places: set[tuple] = set()
        # Batch dimensions traced as symbols (capture/shapes.py): those declared
        # (transpile(dynamic={name: dims})), or every one (dynamic=True, or
        # automatically after a batch shape changes unless dynamic=False).
        self.declared: dict[str, frozenset[int]] = (
            {name: frozenset(dims) for name, dims in dynamic.items()}
            if isinstance(dynamic, dict) else {})
        self.every_dim = dynamic is True
        self.automatic = dynamic is not False
        self._checked = not self.declared

    def __len__(self) -> int:
        return len(self._order)

    @property
    def may_turn_symbolic(self) -> bool:
        """Whether a change of the batch's shapes would trace it symbolic."""
        return self.automatic and not self.every_dim and not self.declared

    def find(self, step_args: StepArgs) -> Built | None:
        """What was built for these arguments, if anything: no building."""
        return self._lookup(step_args)[2]

    def get(self, step_args: StepArgs, build: Callable[[StepArgs, str], Built]) -> Built:
        """What was built for these arguments; build(step_args, why) builds it
        when there is none, `why` saying in one line what is new."""
        sig, entries, found = self._lookup(step_args)
        if found is not None:
            if self._order[-1][1] is not found:
                at = next(i for i, (_, b) in enumerate(self._order) if b is found)
                self._order.append(self._order.pop(at))
            return found
        if entries:
            why = entries[-1].misfit(step_args.leaves) + self._lift_changed_places(
                step_args, entries[-1])
        elif self.last_built is None:
            why = "first call"
        else:
            full = sig + grad_signature(step_args)
            why = describe_change(self.last_built, full) \
                + self._lift_changed_numbers(step_args) + self._symbolic_batch(step_args, full) \
                + self._lift_changed_places(step_args, self._order[-1][1])
        return self._build(step_args, build, why)

    def redecide(self, step_args: StepArgs, build: Callable[[StepArgs, str], Built],
                 tried: list[Built], why: str) -> Built:
        """What was built for these arguments with other decisions on tensor
        values (capture/decisions.py) than those `tried` on this call, or built
        now from its values; put first among the entries of its signature."""
        _, entries, _ = self._lookup(step_args)
        found = next((b for b in entries if b not in tried and b.fits(step_args.leaves)), None)
        if found is None:
            log.info("transpiler: %s: tracing the step for this call's decisions", why)
            found = self._build(step_args, build, f"{why} on this call")
        for entries in self._built.values():
            if found in entries:
                entries.remove(found)
                entries.insert(0, found)
        return found

    def _build(self, step_args: StepArgs, build: Callable[[StepArgs, str], Built],
               why: str) -> Built:
        start = time.perf_counter()
        requested, requested_places = step_args.lifted, step_args.lift_places
        symbolic = bool(step_args.dynamic)
        grads = grad_signature(step_args)   # as the call found them (building makes some)
        with tracing_for(self.arguments):
            built = build(step_args, why)
        dropped = {step_args.names[i] for i in requested - step_args.lifted}
        self.lifted -= dropped
        self.lifted |= {step_args.names[i] for i in step_args.lifted - requested}   # counters
        self.per_value |= dropped
        names = {key: name for name, key in step_args.places_lifted.items()}
        for key in requested_places - step_args.lift_places:
            self.lifted_places.discard(key)
            self.per_value_places[key] = names.get(key, "a number")
        self.lifted_places |= step_args.lift_places - requested_places   # counters (trace.py)
        self.appended_places |= step_args.append_places   # (capture/appended.py)
        if symbolic and not step_args.dynamic:   # its symbolic trace failed (trace.py)
            self.declared, self.every_dim, self.automatic = {}, False, False
        # Building made the optimizers' state the first step would make
        # (capture.trace_step): the key is the signature later calls have,
        # of the state the step was traced from (before its host writes).
        for write in reversed(built.host_writes):
            write.undo()
        sig = signature(step_args)
        for write in built.host_writes:
            write.redo()
        self.last_built = sig + grads
        if built.reads_grads:
            self._reads_grads.add(sig)
        key = _WithGrads(sig, grads) if built.reads_grads else sig
        self._built.setdefault(key, []).append(built)
        self._order.append((key, built))
        self.builds += 1
        if len(self._order) > self.limit:
            old_key, old = self._order.pop(0)
            self._built[old_key].remove(old)
            log.warning("transpiler: the step has been traced %d times; %d programs are kept, "
                        "the least recently used was dropped. The last trace was for: %s. A "
                        "number used only in arithmetic (an argument, a module's attribute, a "
                        "config's field, a global) is fed as an input after its first change; "
                        "one that decides shapes or control flow (%s) traces once per value: "
                        "keep it fixed, or compute with it in tensor ops; any other value that "
                        "changes every call belongs in a tensor (an argument, or a buffer of "
                        "the model)", self.builds, self.limit, why,
                        ", ".join(sorted(self.per_value | set(self.per_value_places.values())))
                        or "none here")
        self.build_seconds += time.perf_counter() - start
        return built

    def _lookup(self, step_args: StepArgs) -> tuple:
        """(signature, the entries built for it, the one that fits or None). The
        entries of programs that read the .grad the step starts with are kept
        under the signature with which parameters have one; the others, under
        the signature alone, fit whatever the .grad."""
        step_args.lifted = frozenset(i for i, (name, leaf) in enumerate(zip(step_args.names,
                                                                            step_args.leaves))
                                     if name in self.lifted and is_number(leaf))
        step_args.lift_places = frozenset(self.lifted_places)
        step_args.append_places = frozenset(self.appended_places)
        if not self._checked:
            _check_declared(self.declared, step_args)
            self._checked = True
        step_args.dynamic = self._symbolic(step_args)
        self.arguments.leaves = step_args.leaves
        sig = signature(step_args)
        entries = self._built.get(sig, [])
        if sig in self._reads_grads:
            entries = self._built.get(_WithGrads(sig, grad_signature(step_args)), []) + entries
        return sig, entries, next((b for b in entries if b.fits(step_args.leaves)), None)

    def _symbolic(self, step_args: StepArgs) -> dict[int, frozenset[int]]:
        """Leaf index -> the dimensions of that batch tensor to trace as symbols."""
        dims = {}
        for i, (name, leaf) in enumerate(zip(step_args.names, step_args.leaves)):
            if _is_batch(leaf):
                these = frozenset(range(leaf.ndim)) if self.every_dim else self.declared.get(name)
                if these:
                    dims[i] = these
        return dims

    def _symbolic_batch(self, step_args: StepArgs, full: tuple) -> str:
        """After a batch tensor's first change of shape: every dimension of the
        batch becomes symbolic for the build (capture/shapes.py). Says so, for the log."""
        if not self.automatic or self.every_dim or not batch_shapes(self.last_built, full):
            return ""
        self.every_dim = True
        step_args.dynamic = self._symbolic(step_args)
        return "; tracing the batch's dimensions as symbols, one program for every size"

    def _lift_changed_numbers(self, step_args: StepArgs) -> str:
        """Lift the number arguments whose value is new since the last build
        (capture/numbers.py): the build traces them as inputs. Says so, for the log."""
        before = dict(self.last_built)
        lifting = frozenset(
            i for i, (name, leaf) in enumerate(zip(step_args.names, step_args.leaves))
            if is_number(leaf) and i not in step_args.lifted and name not in self.per_value
            and is_number(before.get(("input", name))) and before[("input", name)] != leaf)
        if lifting:
            step_args.lifted |= lifting
            self.lifted |= {step_args.names[i] for i in lifting}
        return "".join(f"; lifting {step_args.names[i]} to a program input" for i in sorted(lifting))


    def _lift_changed_places(self, step_args: StepArgs, built: Built) -> str:
        """Lift the numbers read outside the arguments whose value changed
        since `built` was traced (capture/numbers.py). Says so, for the log."""
        changed = [g for g in built.guards.changed_numbers()
                   if place_key(g.holder, g.key) not in self.per_value_places]
        keys = {place_key(g.holder, g.key) for g in changed}
        self.lifted_places |= keys
        step_args.lift_places |= keys
        return "".join(f"; lifting {g.name} to a program input" for g in changed)


def _is_batch(leaf) -> bool:
    """A tensor or a numpy array among the step's arguments."""
    return isinstance(leaf, torch.Tensor) or is_ndarray(leaf)


def _check_declared(declared: dict[str, frozenset[int]], step_args: StepArgs) -> None:
    """transpile(dynamic={name: dims}) must name batch tensors and their dimensions."""
    batch = {name: leaf.ndim for name, leaf in zip(step_args.names, step_args.leaves)
             if _is_batch(leaf)}
    for name, dims in declared.items():
        if name not in batch:
            raise TranspileError(
                f"transpile(dynamic=...) names {name!r}, which is not a batch tensor among the "
                f"step's arguments; those are: {', '.join(batch) or 'none'}")
        wrong = sorted(d for d in dims if not isinstance(d, int) or not 0 <= d < batch[name])
        if wrong:
            raise TranspileError(
                f"transpile(dynamic=...) names dimension {wrong[0]} of {name!r}, which has "
                f"{batch[name]} dimensions (0 to {batch[name] - 1})")
