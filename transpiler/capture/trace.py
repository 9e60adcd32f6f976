"""Trace the whole step (forward, backward, optimizer update) with make_fx and
make it a pure function."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import operator
import sys
from collections import defaultdict
from collections.abc import Iterator
from typing import Callable

import sympy
import torch
import torch.fx as fx
from torch.utils._python_dispatch import _disable_current_modes
import torch.utils._pytree as pytree
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import (TorchFunctionMetadataMode, get_proxy_mode, make_fx,
                                               track_tensor_tree)
from torch.nn.utils.stateless import _reparametrize_module

from . import functionalize
from ..program.averaging import mark_backward_ends
from ..errors import NoBackward, TranspileError
from .optimizers import PER_STEP, per_step_value, step_counts, updates_with_lifted_hyperparameters
from ..program.program import InputKind, InputSpec, OutputKind, Program
from ..program.roles import (BUFFER_SYNC, CARRY, COMM, DECISION, GRAD_AT, MICRO, PARAM, READY, ROLE,
                             UNUSED, Role)
from .scaler import SKIPS, guard_skipped_steps, traced_scalers
from .arguments import StepArgs, leaf_index
from .argument_writes import (ArgumentChanges, ArgumentGradSlot, ArgumentSlot,
                              CountersInArguments)
from .changed_numbers import (counted_places, leaves_written, places_read_and_written,
                              refuse_pinned)
from .ddp_wrapper import buffers_left_to_the_program
from .build import identifier, to_program
from .decisions import Decision, insert_checks, on_real_values, stopped_at_decision
from .grad_flags import FlagWrite, flags_changed
from .guards import MISSING, Guards, snapshot
from .host_iterators import pulled_stand_in
from .appended import AppendedRead, AppendOnly, AppendsSeen
from .host_arithmetic import (Decisions, NotReplayable, Replay, decisions_recorded,
                              math_on_numbers, number_input_symbol,
                              numbers_as_python_types, replay_of,
                              traced_value)
from .host_random import Draws, host_draws_recorded, source_stand_in
from .host_state import HostState, host_state_recorded, refuse_repeated
from .inputs import collect_inputs
from .markers import (
    Markers,
    assign_roles,
    backward_marker,
    last_node,
    node_of,
    optimizer_markers,
    scheduler_marker,
)
from .optimizer_state import (
    forget_state,
    formulated_groups,
    group_tensors_as_inputs,
    make_first_state,
    refuse_fused_without_kernel,
    refuse_sharding_optimizers,
    refuse_uninitialized,
    opt_params,
    redirect_optimizer,
    state_set_by_step,
)
from .micro import CutArgs, NotRollable, check_rolled, drop_unwritten_clones, loop_marker
from .numbers import (MathSlot, NotLiftable, NumberGuard, NumberSlot, ReachedNumberSlot, as_input,
                      check_lifted, conditions_unlogged, guarded_numbers, is_number,
                      read_number, take_number_guards)
from .memoized import memoized_while_traced
from .eager_kernels import eager_dispatch
from .observed_arrays import ValuesRead, is_ndarray, observed
from .outside import outside_tensors
from .kernel_layouts import results_laid_out_as_kernels
from .meta_fallback import kernels_where_meta_refuses
from .recurrent import LSTM_LAYERS, recurrent_layers_traced
from .random_layout import drawn_in_place, twin
from .rng_plan import RngPlan
from .shapes import ShapeGuards, symbolic_inputs
from .signature import named_state
from .reads import Recorder, Write, refuse_scripted_modules
from .printed import Output, Printed
from .raised import Raised, raised_by_the_step
from .finite_tests import finite_tests_as_tensor_ops
from .buffer_sync import buffer_sync_points
from .group_reads import group_reads
from .returned import Returned, arrays_returned, returned_as_read
from .saved_files import saving_refused
from .text_values import Renders, TextValues, WithoutTextValues
from .slots import (ArraySlot, AssignSlot, DataSlot, GradSlot, ParamSlot, ReachedSlot,
                    StateSlot)
from .state_writes import state_writes_kept
from .sync_batch_norm import synced_batch_norms
from ..program.collectives import WAIT
from ..world import world
from .traced_collectives import ISSUED, forget_real_values, traced_collectives, without_real_values
from .torch_rng import RngRecorder
from .value_text import shows_values, tensor_text, values_as_text
from .user_code import is_user_file, step_name, trace_error, user_line

log = logging.getLogger("transpiler")

# More backward() calls than this in one step get a warning: each is unrolled.
MANY_BACKWARDS = 8


_PROFILER_OPS = {
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
}


def _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """native_batch_norm updates the running statistics in place but its schema
    does not say so: functionalization would leave that mutation inside the
    program. _native_batch_norm_legit is the same kernel with a schema that does."""
    if running_mean is None:
        return torch.ops.aten._native_batch_norm_legit.no_stats(input, weight, bias, training,
                                                                momentum, eps)
    return torch.ops.aten._native_batch_norm_legit.default(input, weight, bias, running_mean,
                                                           running_var, training, momentum, eps)


def _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """CTC's loss with tensor lengths: its saved alphas' size depends on the
    lengths' values, which fake tensors do not hold. As its CPU kernel does,
    the lengths are read as lists (a decision on their values: one program per
    lengths) and the list overload runs, which has a meta function."""
    targets, inputs, lengths = _ctc_lengths(targets, input_lengths, target_lengths)
    return torch.ops.aten._ctc_loss.default(log_probs, targets, inputs, lengths, blank,
                                            zero_infinity)


def _ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood,
                       log_alpha, blank, zero_infinity=False):
    targets, inputs, lengths = _ctc_lengths(targets, input_lengths, target_lengths)
    return torch.ops.aten._ctc_loss_backward.default(grad, log_probs, targets, inputs, lengths,
                                                     neg_log_likelihood, log_alpha, blank,
                                                     zero_infinity)


def _ctc_lengths(targets, input_lengths, target_lengths):
    inputs = [int(n) for n in input_lengths.tolist()]
    lengths = [int(n) for n in target_lengths.tolist()]
    if targets.dim() == 1:   # concatenated (masked_select's): its size is their sum
        targets = targets.reshape(sum(lengths))
    return targets, inputs, lengths


@contextlib.contextmanager
def _ctc_lengths_as_tensors():
    """torch.nn.functional.ctc_loss with lengths as lists makes a tensor of them inside its
    kernel (to average by target length), which a fake tensor cannot hold:
    while the step is traced, such lists are given as int64 tensors, the
    overload traced above (its kernel reads them back as those lists)."""
    original = torch.nn.functional.ctc_loss

    def as_tensor(lengths):
        return torch.tensor(lengths, dtype=torch.long) if isinstance(lengths, (list, tuple)) \
            else lengths

    @functools.wraps(original)
    def ctc_loss(log_probs, targets, input_lengths, target_lengths, *args, **kwargs):
        return original(log_probs, targets, as_tensor(input_lengths), as_tensor(target_lengths),
                        *args, **kwargs)
    torch.nn.functional.ctc_loss = ctc_loss
    try:
        yield
    finally:
        torch.nn.functional.ctc_loss = original


_DECOMPOSITIONS = {torch.ops.aten.native_batch_norm.default: _batch_norm,
                   torch.ops.aten._ctc_loss.Tensor: _ctc_loss,
                   torch.ops.aten._ctc_loss_backward.Tensor: _ctc_loss_backward,
                   **LSTM_LAYERS}



@dataclasses.dataclass
class Captured:
    program: Program
    slots: list            # one per program input
    targets: list          # one per program output: None (user) or the slot written
    returned: Returned
    schedulers: list       # LR schedulers the step steps after its optimizer.step()
    cleared: list          # (name, parameter) whose .grad the step leaves None
    # Whether what the program computes depends on the .grad the parameters have
    # when the step starts (it accumulates into them, or keeps them as zeros):
    # then which parameters have one is part of the program's signature.
    reads_grads: bool
    guards: Guards         # the host values the program was traced with
    shape_guards: ShapeGuards | None   # what it assumes of symbolic batch dimensions
    # (optimizer, parameter, key) of the state made for this trace as the first
    # step would make it: forgotten again if the build fails after the trace
    made_state: list = dataclasses.field(default_factory=list)
    # traced over a cut list of micro-batches (micro.py): its first leaf and
    # leaves per micro-batch; the runtime runs the programs as loops
    rolled: tuple[int, int] | None = None
    # host values the step wrote while traced (host_state.py): kept, and
    # replayed on the host after every run of the program
    host_writes: list[Write] = dataclasses.field(default_factory=list)
    # values drawn on the host (random, numpy.random, clocks): drawn again before each run
    draws: Draws = dataclasses.field(default_factory=Draws)
    # what the host does to torch's generators around each run (torch_rng.py)
    rng: RngPlan = dataclasses.field(default_factory=RngPlan)
    # what the program assumes of tensor values, checked as it runs (decisions.py)
    decisions: list[Decision] = dataclasses.field(default_factory=list)
    # what it assumes of its lifted numbers, checked before each run (numbers.py)
    number_guards: list[NumberGuard] = dataclasses.field(default_factory=list)
    # done to the call's arguments after each run (argument_writes.py: keys
    # popped, tensors made to require grad)
    argument_edits: list = dataclasses.field(default_factory=list)
    # numpy arguments whose values it read on the host: it serves those values only
    values_read: ValuesRead | None = None
    # whether it steps an optimizer (one that does not accumulates for a later call)
    steps: bool = True
    # the exception the step raised on the values it was traced on, raised after each run
    raised: Raised | None = None
    # what it printed and logged, shown again after each later run (printed.py)
    printed: Output | None = None

    def param_names(self) -> dict[int, str]:
        """id of each parameter the program reads -> its input's name."""
        return {id(slot.tensor): spec.name for spec, slot in zip(self.program.inputs, self.slots)
                if spec.kind is InputKind.PARAM}



def trace_step(step_fn: Callable, step_args: StepArgs,
               state_stand_in: Callable | None = None, on_values: bool = False,
               zero_unused: bool = False) -> Captured:
    """Trace the whole step (forward, backward, optimizer update) into a Program.
    state_stand_in(param, entry): what the trace sees of an optimizer state
    entry (mode zero keeps shards; the step reads full entries). on_values:
    trace on this call's values at once (a step known to decide on them).
    zero_unused (find_unused_parameters): where a backward() ends, a parameter
    that requires a gradient and has none gets zeros, marked UNUSED, as DDP's
    bucket holds zeros for it (passes/unused_params.py).

    The optimizers' state is made first, as their first step would make it
    (make_first_state), so that the program traced on the first call is the
    one every later call runs: the state is its input, never its creation."""
    if not step_args.modules:
        raise TranspileError(
            f"{step_name(step_fn)} was called with no torch.nn.Module among its arguments: "
            "pass the model as an argument, e.g. step(model, optimizer, x, y)")
    refuse_scripted_modules(step_args.modules)
    refuse_uninitialized(step_fn, step_args.optimizers)
    refuse_fused_without_kernel(step_fn, step_args.optimizers)
    refuse_sharding_optimizers(step_fn, step_args.optimizers)
    made = make_first_state(step_args.optimizers)
    # a GradScaler's scale, made by its first scale() (scaler.scaler_slots)
    unscaled = [s for s in step_args.scalers if s.is_enabled() and s._scale is None]
    try:
        captured = _trace_until_it_traces(step_fn, step_args, state_stand_in, on_values,
                                          zero_unused)
        tried: set = set()   # places lifted once: not again where they could not stay lifted
        tried_leaves: set = set()   # the same for numbers among the arguments
        while True:
            # a number it reads and leaves changed (`self.sum += loss.item()`, a
            # counter, `state["loss"] = loss.item()` in an argument): read from an
            # input, so that one program serves every value
            lift = places_read_and_written(captured.returned.writes, captured.guards) \
                - step_args.lift_places - tried
            leaves = leaves_written(step_args, captured.returned.writes) \
                - step_args.lifted - tried_leaves
            counters = _check_converges(step_fn, step_args, state_stand_in, captured, on_values,
                                        tried) if captured.host_writes else frozenset()
            if not lift | counters | leaves:
                break
            if not counters:   # converged: the trace again makes its writes again
                for w in reversed(captured.host_writes):
                    w.undo()
            tried |= lift | counters
            tried_leaves |= leaves
            step_args.lift_places |= lift | counters
            step_args.lifted |= leaves
            captured = _trace_until_it_traces(step_fn, step_args, state_stand_in, on_values,
                                              zero_unused)
        refuse_pinned(step_fn, step_args, captured.number_guards, captured.host_writes,
                      captured.returned.writes)
    except BaseException:
        forget_state(made)
        for scaler in unscaled:
            scaler._scale = scaler._growth_tracker = None
        raise
    # State made for a parameter the step gives no gradient: its first step
    # would not have made it, and the program does not read it.
    read = {(id(slot.optimizer), id(slot.param), slot.key) for slot in captured.slots
            if isinstance(slot, StateSlot)}
    forget_state([m for m in made if (id(m[0]), id(m[1]), m[2]) not in read])
    captured.made_state = [m for m in made if (id(m[0]), id(m[1]), m[2]) in read]
    return captured




def _trace_until_it_traces(step_fn, step_args: StepArgs, state_stand_in,
                           on_values: bool = False, zero_unused: bool = False,
                           shown: bool = True) -> Captured:
    """Trace; after a failure, again with the batch's dimensions static or
    with fewer numbers lifted, where that is what failed; one that stopped at
    a decision on a tensor value, again on real values (decisions.py).
    shown: whether what the step prints while traced is shown."""
    counted: set[int] = set()   # counters among the arguments lifted by this loop
    while True:
        try:
            return _trace(step_fn, step_args, state_stand_in, on_values, zero_unused, shown)
        except Exception as exc:  # noqa: BLE001 - retraced static, or with fewer numbers lifted
            if isinstance(exc, NotRollable):
                raise
            if isinstance(exc, WithoutTextValues):
                log.info("transpiler: %s turns tensor values into text that is not only printed "
                         "(%s): tracing it again with those values decisions, a program per "
                         "value", step_name(step_fn), exc)
                step_args.values_in_text = False
                continue
            if isinstance(exc, AppendsSeen):
                log.info("transpiler: %s appends to host lists (%s): tracing it again with "
                         "them taking appends only, the values the program's outputs",
                         step_name(step_fn), exc)
                step_args.append_places |= exc.places
                continue
            if isinstance(exc, AppendedRead):
                if exc.place in step_args.append_read:
                    raise
                log.info("transpiler: %s reads a list it appends to: tracing it again with "
                         "that list as any other (%s)", step_name(step_fn), exc)
                step_args.append_places -= {exc.place}
                step_args.append_read[exc.place] = exc
                continue
            if isinstance(exc, CountersInArguments):
                counters = {leaf_index(step_args, w) for w in exc.written}
                if None in counters or counters & counted:   # one that could not stay lifted
                    raise exc.refusal from None
                counted |= counters
                log.info("transpiler: %s advances numbers in its arguments (%s): tracing it "
                         "again with them read from program inputs", step_name(step_fn), exc)
                step_args.lifted |= counters
                continue
            if isinstance(exc, _ReadMemoized):
                log.info("transpiler: %s reads a memoized value computed before the trace: "
                         "tracing it again with that cache emptied (%s)", step_name(step_fn), exc)
                continue
            if isinstance(exc, NotLiftable) and not exc.names & _lifted_names(step_args):
                raise TranspileError(
                    f"{exc}; {' and '.join(sorted(exc.names))} is a value of the optimizer of "
                    f"{step_name(step_fn)}, which the program reads from an input on every call "
                    "(an LR scheduler changes it without a new trace), so the program cannot "
                    "hold that condition: compare the value itself with a constant "
                    "(`if lr < 0.01:`), or decide outside the step") from exc
            if isinstance(exc, _ConstantDraws):
                log.info("transpiler: tracing %s with the integers it draws on the host as "
                         "symbols failed, so %s are taken as constants, a program per value "
                         "drawn: %s", step_name(step_fn), " and ".join(sorted(exc.names)), exc)
                step_args.constant_draws |= exc.names
                continue
            if isinstance(exc, _StoppedAtDecision):
                _refuse_without_values(step_fn, step_args, exc)
                log.info("transpiler: %s decides on a tensor value: tracing it again on this "
                         "call's values (%s)", step_name(step_fn), exc)
                on_values = True
                continue
            if step_args.dynamic:
                log.warning("transpiler: tracing %s with symbolic batch dimensions failed, so "
                            "it is traced once per batch shape from now on: %s",
                            step_name(step_fn), exc)
                step_args.dynamic = {}
            elif step_args.lifted or step_args.lift_places:
                _drop_lifted(step_args, exc)
            else:
                raise


def _check_converges(step_fn, step_args: StepArgs, state_stand_in, captured: Captured,
                     on_values: bool, tried: set) -> frozenset:
    """The step wrote host values while traced (a flag set once, a config value
    filled in): trace it again from the written state. If it writes nothing
    more, the writes were a lazy initialization: kept (and replayed after each
    run). If it writes numbers again where it read them (a counter, a meter's
    sum), at places not `tried` yet: those places, to lift (changed_numbers.py),
    every write undone. If it writes anything else again, refuse, with every
    write undone."""
    writes = captured.host_writes
    log.info("transpiler: %s writes host state while it is traced (%s%s); tracing it again "
             "from the written state to check that it writes nothing more", step_name(step_fn),
             writes[0].describe(), f" and {len(writes) - 1} more" if len(writes) > 1 else "")
    try:
        again = _trace_until_it_traces(step_fn, step_args, state_stand_in,   # printed once
                                       on_values or bool(captured.decisions), shown=False)
    except BaseException:
        for w in reversed(writes):
            w.undo()
        raise
    for w in reversed(again.host_writes):
        w.undo()
    again.draws.rewind()
    counters = counted_places(again.host_writes, again.guards) - step_args.lift_places - tried
    if again.host_writes:
        for w in reversed(writes):
            w.undo()
        if not counters:
            raise refuse_repeated(step_fn, writes, again.host_writes)
        log.info("transpiler: %s changes numbers on the host on every call (%s): tracing it "
                 "again with them read from program inputs, the values it leaves there the "
                 "program's outputs", step_name(step_fn), again.host_writes[0].describe())
    return counters


def _lifted_names(step_args: StepArgs) -> set[str]:
    """The names of the numbers the cache asked to lift (numbers.py); a lifted
    number not among them is an optimizer's value (group_reads.py)."""
    return {step_args.names[i] for i in step_args.lifted} | set(step_args.places_lifted)


def _drop_lifted(step_args: StepArgs, exc: Exception) -> None:
    """After a failed trace with numbers lifted (numbers.py): trace the ones
    that decide control flow or a shape per value; after any other failure,
    all of them, which tells whether lifting was the cause."""
    lifted = {step_args.names[i]: i for i in step_args.lifted}
    placed = {name: key for name, key in step_args.places_lifted.items()
              if key in step_args.lift_places}
    if isinstance(exc, NotLiftable) and exc.names & (lifted.keys() | placed.keys()):
        dropped = sorted(exc.names & (lifted.keys() | placed.keys()))
        log.info("transpiler: %s decides control flow or a shape, so the step is traced once "
                 "per value of it: %s", " and ".join(dropped), exc)
        step_args.lift_places -= {placed[name] for name in dropped if name in placed}
    else:
        dropped = sorted(lifted.keys() | placed.keys())
        log.info("transpiler: tracing with %s lifted to inputs failed, tracing per value: %s",
                 " and ".join(dropped) or "numbers", exc)
        step_args.lift_places = frozenset()
    step_args.lifted -= {lifted[name] for name in dropped if name in lifted}


class _ConstantDraws(Exception):
    """A trace that drew integers on the host as symbols failed: traced
    again with them constant (a size taken from `random.randrange`)."""

    def __init__(self, names: frozenset[str], reason: str):
        super().__init__(reason)
        self.names = names


class _ReadMemoized(TranspileError):
    """A trace met a tensor that a memoizing function computed before it."""


def _refuse_without_values(step_fn, step_args: StepArgs, exc: Exception) -> None:
    """A trace on the call's values reads the parameters: mode fsdp keeps them
    as shards between steps, with no storage of their own (sharded_params.py).
    The same on every rank: the decision is where the program's structure
    needs a value, not where values differ."""
    released = next((name for m in step_args.modules for name, p in m.named_parameters()
                     if p.numel() and p.untyped_storage().nbytes() == 0), None)
    if released is not None:
        raise TranspileError(
            f"{step_name(step_fn)} decides on a tensor value in a program traced after its "
            f"first call, where the parameters ({released}) are kept as shards between the "
            "steps of mode fsdp and hold no values to trace on; decide with tensor ops "
            "(torch.where, masking), or use mode 'zero' or 'fuse_all_reduce'. "
            f"({str(exc).splitlines()[0]})") from exc


class _StoppedAtDecision(TranspileError):
    """A trace on fake tensors stopped at a decision on a tensor value."""


def _trace(step_fn: Callable, step_args: StepArgs, state_stand_in: Callable | None,
           on_values: bool = False, zero_unused: bool = False, shown: bool = True) -> Captured:
    modules, optimizers = step_args.modules, step_args.optimizers
    inputs = collect_inputs(step_args, state_stand_in)
    # the step counts the call starts from, for the values of later updates
    counts = {(id(slot.optimizer), slot.group): step_counts(slot.optimizer, slot.group)
              for spec, slot in zip(inputs.specs, inputs.slots)
              if spec.kind is InputKind.HYPER and slot.key in PER_STEP}
    markers = Markers()
    created: list[tuple[torch.optim.Optimizer, torch.Tensor, str]] = []
    returned: list[Returned] = []
    hosts: list[HostState] = []
    arg_writes = ArgumentChanges()   # what it sets in its arguments' containers
    values_read: dict[int, str] = {}   # numpy arguments read on the host: leaf -> name
    left: list[torch.Tensor] = []      # parameters the step leaves a .grad
    cleared: list[tuple[str, torch.Tensor]] = []   # ... and those it leaves none
    kept: list[torch.Tensor] = []      # ones it gives a gradient without dropping .grad first
    flags: list[FlagWrite] = []        # ones whose requires_grad it changes
    raised: list[Raised] = []          # what the step raised on this call's values

    def flat(*values):
        traced: dict[int, torch.Tensor] = {}
        leaves = list(step_args.leaves)
        hypers: dict[tuple, torch.Tensor] = {}
        hyper_inputs: dict[tuple, tuple] = {}   # (id of a param group, key) -> its input
        scaled: dict[tuple, torch.Tensor] = {}
        state: dict[int, dict] = defaultdict(dict)
        for spec, slot, value in zip(inputs.specs, inputs.slots, values):
            if spec.kind in (InputKind.PARAM, InputKind.BUFFER):
                if slot.tensor.requires_grad:
                    value = value.detach().requires_grad_(True)
                traced[id(slot.tensor)] = value
            elif spec.kind is InputKind.STATE:
                state[id(slot.optimizer)].setdefault(id(slot.param), {})[slot.key] = value
            elif spec.kind is InputKind.HYPER:
                hypers[(id(slot.optimizer), slot.group, slot.key)] = value
                hyper_inputs[(id(slot.optimizer.param_groups[slot.group]), slot.key)] = \
                    (spec, slot, value)
            elif spec.kind is InputKind.GRAD:
                traced[id(slot.param)].grad = value
            elif spec.kind is InputKind.SCALER:
                scaled[(id(slot.scaler), slot.attr)] = value
            elif isinstance(slot, ArraySlot):   # converted: its input; read: its values kept
                leaves[slot.leaf] = observed(leaves[slot.leaf], functools.partial(
                    values_read.setdefault, slot.leaf, spec.name))
                arrays[id(leaves[slot.leaf])] = value
            elif isinstance(slot, NumberSlot):
                leaves[slot.leaf] = read_number(value, spec.name, symbols,
                                                slot.number(step_args.leaves))
            else:
                leaves[slot.leaf] = value
        for leaf, tensor in inputs.state_leaves.items():
            leaves[leaf] = traced[id(tensor)]

        def later_hyper(group: dict, key: str, ahead: int) -> torch.Tensor:
            """The input of a value derived from the step count for the group's
            update `ahead` updates after its first in this call."""
            spec, slot, value = hyper_inputs[(id(group), key)]
            # this call's value, as the runtime reads it (from the counts the
            # call starts from: the optimizer holds the trace's own now)
            return late.placeholder(
                dataclasses.replace(spec, name=f"{spec.name}+{ahead}",
                                    hyper=dataclasses.replace(spec.hyper, ahead=ahead)),
                dataclasses.replace(slot, ahead=ahead),
                lambda: torch.tensor(per_step_value(group, counts[(id(slot.optimizer), slot.group)],
                                                    key, ahead),
                                     dtype=value.dtype, device=value.device))

        formulated = formulated_groups(optimizers, traced, hypers)
        late.begin(traced, torch._guards.detect_fake_mode(values))
        host = HostState(Recorder(late.stand_in, {id(m) for module in modules
                                                  for m in module.modules()},
                                  step_args.lift_places, late.number),
                         step_fn, modules, optimizers, traced)
        hosts.append(host)
        _copy_tensor_hooks(inputs, traced, host.recorder)
        accumulated = _accumulation_order(inputs, traced)
        hooks_before = _tensor_hooks(inputs, traced)
        attributes_before = {i: set(vars(t)) for i, t in traced.items()}

        def grads_now():
            return {inputs.param_names[i]: node_of(t.grad) for i, t in traced.items()
                    if t.grad is not None}

        reached = _once_per_forward(step_fn, markers, modules, inputs) \
            if world()[0] > 1 else (lambda names: None)
        zeroed: dict[int, tuple[torch.Tensor, int]] = {}   # param id -> its zeros, their version

        def zero_unused_grads():
            """Where a backward() ends, zeros for each parameter it gave no
            gradient; one a later backward() accumulates into is used."""
            for i, t in traced.items():
                if i in zeroed and (t.grad is not zeroed[i][0] or t.grad._version != zeroed[i][1]):
                    del zeroed[i]
                elif zero_unused and t.requires_grad and t.grad is None \
                        and i in inputs.param_names:
                    t.grad = torch.zeros_like(t)
                    zeroed[i] = (t.grad, t.grad._version)
        real_state = {id(opt): opt.state for opt in optimizers}
        real_params = {id(opt): opt_params(opt) for opt in optimizers}
        with contextlib.ExitStack() as stack:
            for module in modules:
                mapping = {n: traced[id(t)] for n, t in named_state(module)}
                # stack_weights: a module shared under two paths is restored last in, first out
                # (else the second path's swap, which returned the stand-in, puts it back)
                stack.enter_context(_reparametrize_module(module, mapping, tie_weights=True,
                                                          stack_weights=True))
            real_of = {id(traced[id(slot.tensor)]): slot.tensor for slot in inputs.slots
                       if isinstance(slot, ParamSlot) and id(slot.tensor) in traced}

            def read_elsewhere(stand_in: torch.Tensor) -> str | None:
                real = real_of.get(id(stand_in))
                return next((s.name for s in host.recorder.swaps if s.real is real), None)
            stack.enter_context(state_writes_kept(step_fn, modules,
                                                  {id(t) for t in traced.values()},
                                                  read_elsewhere))
            for opt in optimizers:
                stack.enter_context(redirect_optimizer(opt, traced, state[id(opt)]))
            host.group_inputs.update(group_tensors_as_inputs(optimizers, late.stand_in))
            stack.enter_context(updates_with_lifted_hyperparameters(formulated, later_hyper))
            # make_fx turns autocast's cache of casts off; eager casts a
            # parameter used twice in one autocast region once (both uses' gradients
            # add up in the low precision), so the trace does too
            stack.enter_context(_autocast_cache(cache_casts))
            stack.enter_context(_seen_as_in_eager())
            stack.enter_context(values_as_text(marked, {
                id(traced[id(p)]) for p in inputs.params
                if isinstance(p, torch.nn.Parameter) and id(p) in traced}))
            stack.enter_context(arrays_returned(step_fn))
            stack.enter_context(finite_tests_as_tensor_ops())
            gru_orders = stack.enter_context(recurrent_layers_traced())
            stack.enter_context(synced_batch_norms())
            stack.enter_context(buffers_left_to_the_program())
            stack.enter_context(traced_collectives())
            stack.enter_context(kernels_where_meta_refuses())
            stack.enter_context(_ctc_lengths_as_tensors())
            stack.enter_context(results_laid_out_as_kernels())
            stack.enter_context(_without_anomaly_mode(step_fn))
            stack.enter_context(saving_refused(step_fn))
            # torch.compile inside the step (a compiled model, module or function) is
            # traced as the code it compiles: the program computes what that code does
            # in eager, and backend='inductor' compiles the whole step
            stack.enter_context(torch.compiler.set_stance("force_eager"))
            stack.enter_context(rng.recording(on_values))
            stack.enter_context(backward_marker(markers, grads_now, zero_unused_grads, reached))
            stack.enter_context(optimizer_markers(markers, optimizers, modules))
            stack.enter_context(buffer_sync_points(markers, modules))
            reads = stack.enter_context(group_reads(optimizers, late.number, step_name(step_fn)))
            stack.enter_context(scheduler_marker(markers, optimizers, step_fn, reads.scheduled))
            stack.enter_context(traced_scalers(step_args.scalers, scaled, optimizers, node_of,
                                               step_name(step_fn)))
            if isinstance(step_args, CutArgs):
                watches.append(stack.enter_context(loop_marker(modules, grads_now)))
            drawing = stack.enter_context(host_draws_recorded(step_fn, draws, late.drawn))
            stack.enter_context(decisions_recorded(taken))
            stack.enter_context(math_on_numbers(late.computed))
            stack.enter_context(numbers_as_python_types())
            host.recorder.append_places = step_args.append_places
            host.recorder.append_read = step_args.append_read
            host.recorder.append_only = functools.partial(AppendOnly, step_fn=step_fn)
            host.recorder.stand_ins += [functools.partial(source_stand_in, drawing),
                                        functools.partial(pulled_stand_in, step_fn),
                                        printed.stream_stand_in]
            stack.enter_context(host_state_recorded(host))
            _reach_roots(host.recorder, step_fn, step_args)
            for i, (name, leaf) in enumerate(zip(step_args.names, leaves)):
                if not isinstance(leaf, torch.Tensor):   # an iterator, a file
                    leaves[i] = host.recorder.stand_in_for(leaf, name) or leaf
            handled = sys.exc_info()[1]
            try:
                result = step_args.call(step_fn, leaves, arg_writes)
            except BaseException as exc:
                # on this call's values, the step's own raise ends its program (raised.py)
                if not (on_values and raised_by_the_step(exc, handled)):
                    raise
                raised.append(Raised.of(exc))
                result = None
            _check_no_new_tensor_hooks(step_fn, hooks_before, _tensor_hooks(inputs, traced))
            _check_no_tensor_attributes(step_fn, inputs, traced, attributes_before)
            for spec, slot in zip(inputs.specs, inputs.slots):
                if isinstance(slot, DataSlot) and isinstance(leaves[slot.leaf], torch.Tensor):
                    arg_writes.grad_enabled(slot.leaf, spec.name, leaves[slot.leaf],
                                            step_args.leaves[slot.leaf])
            for i, (zeros, _) in zeroed.items():   # no backward() gave it a gradient
                node_of(zeros).meta[UNUSED] = inputs.param_names[i]
            reads.restore()   # before the host-state check: the step's own writes stay
            host.finish()
            flags.extend(flags_changed(inputs.params, traced, inputs.param_names))
            late.check_no_grads(step_fn)
            if raised and markers.backwards and world()[0] > 1:
                raise TranspileError(
                    f"{step_name(step_fn)} raises {raised[0].describe()} after backward() on "
                    f"this call's values{user_line(step_fn, raised[0].traceback)}: DDP has "
                    "averaged the gradients by then, which a program that stops there before "
                    "its first collective cannot do; raise before backward(), or skip the "
                    "update with transpile(..., skip_nonfinite=True)")
            # the gradients the last backward() leaves, averaged where it ends; a
            # call whose optimizers take no step leaves the local sum (accumulation
            # across calls, as under no_sync)
            if markers.steps or not optimizers:
                markers.reduced = dict(markers.grads)
            shown = tuple(marked.values) if marked is not None else ()
            # written back after each run: numbers left on the host, items appended there
            numbers = (*host.numbers, *host.appended, *arg_writes.numbers)
            returned.append(Returned.of(result, step_name(step_fn), shown, numbers,
                                        late.numpy_type))
            out_leaves = returned[-1].outputs(result, shown, tuple(w.after for w in numbers))
            new_state = []
            for opt in optimizers:
                for p in real_params[id(opt)]:
                    for key, value in state_set_by_step(opt, traced[id(p)],
                                                         state[id(opt)].get(id(p), {}),
                                                         real_state[id(opt)].get(p, {})):
                        created.append((opt, p, key))
                        new_state.append(value)
            names = {id(t): inputs.param_names[i] for i, t in traced.items()
                     if i in inputs.param_names}
            for order in gru_orders:   # as eager's engine accumulates them (recurrent.py)
                in_eager_order(accumulated, [names[i] for i in order if i in names])
            ready = {name: k for k, name in enumerate(accumulated)}   # in the last backward()
            for name, node in markers.reduced.items():
                node.meta[PARAM] = name
                if name in ready:
                    node.meta[READY] = ready[name]
            grads = []
            given = {name for end in markers.ends for name in end}   # by a backward()
            for p in inputs.params:
                tp = traced[id(p)]
                if tp.grad is not None and tp.grad.layout is not torch.strided:
                    raise TranspileError(
                        f"{step_name(step_fn)} gives {inputs.param_names[id(p)]} a sparse "
                        "gradient (nn.Embedding(sparse=True), F.embedding(sparse=True)): a "
                        "program carries dense tensors only; use sparse=False (an optimizer "
                        "such as SparseAdam then takes dense Adam's place)")
                if tp.grad is not None:
                    left.append(p)
                    grads.append(tp.grad)
                else:
                    cleared.append((inputs.param_names[id(p)], p))
                # one the step gives a gradient, onto the .grad it started with
                # (whether or not a zero_grad() at its end drops it after)
                if tp.requires_grad and id(tp) not in markers.reset \
                        and (tp.grad is not None or inputs.param_names[id(p)] in given):
                    kept.append(p)
            return (tuple(out_leaves) + tuple(new_state) + tuple(grads)
                    + tuple(w.after for w in host.assigned) + tuple(t for _, t in arg_writes.set)
                    + tuple(g for _, g in arg_writes.grads))

    arrays: dict[int, torch.Tensor] = {}   # id of a numpy argument -> its traced input
    values, tracing_mode = ((symbolic_inputs(inputs, step_args.dynamic), "symbolic")
                            if step_args.dynamic else (list(inputs.values), "fake"))
    symbols: dict = {}   # the symbol of each lifted number -> its name
    late = _LateInputs(inputs, arrays, symbolic=tracing_mode == "symbolic", symbols=symbols,
                       places=step_args.places_lifted, constant_draws=step_args.constant_draws)
    taken = Decisions()   # the conditions the trace takes on symbolic numbers
    cache_casts = torch.is_autocast_cache_enabled()
    draws = Draws()
    watches: list = []   # the micro-batch loop's (micro.py), when the list is cut
    rng = RngRecorder(step_fn, inputs, symbols)
    printed = Printed(step_fn)
    # values the step's own code prints, outputs filled into the text (text_values.py)
    marked = TextValues(unmarked=late.clock_symbols) if step_args.values_in_text else None
    try:
        # The traced module's Python code is never run (it becomes a Program):
        # a lazy module does not generate it.
        with _use_lazy_graph_module(True), \
                outside_tensors(step_fn, arrays, _group_tensors(optimizers),
                                _outside_hint(step_args)) as check_outside, \
                memoized_while_traced() as caches, \
                eager_dispatch(tracing_mode == "symbolic"), \
                (on_real_values() if on_values else conditions_unlogged()), printed:
            gm = make_fx(flat, decomposition_table=_DECOMPOSITIONS, tracing_mode=tracing_mode,
                         _allow_non_fake_inputs=True)(*values)
    except Exception as exc:  # noqa: BLE001 - every tracing failure becomes a clear error
        if hosts:
            hosts[0].abandon()
        draws.rewind()
        if isinstance(exc, (AppendsSeen, AppendedRead)):   # traced again at once
            raise
        integers = late.integer_draws - step_args.constant_draws
        if integers and not isinstance(exc, TranspileError):
            raise _ConstantDraws(integers, f"{type(exc).__name__}: {exc}") from exc
        drawn = guarded_numbers(exc, late.draw_symbols)
        if drawn:
            raise TranspileError(
                f"{step_name(step_fn)} decides on a value it draws on the host "
                f"({sorted(drawn)[0]}){user_line(step_fn, exc.__traceback__)}: the program "
                "replays the draw on every call but cannot take another branch for it; draw "
                "outside the step and pass the value (or the decision) as an argument, or draw "
                "with torch (torch.rand(()) < p, torch.distributions)") from exc
        error = exc if isinstance(exc, TranspileError) else trace_error(step_fn, exc, markers.stepping)
        guarded = late.sources_of(guarded_numbers(exc, symbols))
        if guarded:
            raise NotLiftable(guarded, str(error)) from exc
        if not on_values and tracing_mode == "fake" and stopped_at_decision(exc):
            raise _StoppedAtDecision(str(error)) from exc   # what it printed: printed again
        if marked is not None and marked.values:   # (its text holds markers)
            raise WithoutTextValues(f"{type(exc).__name__}: {exc}") from exc
        if shown:
            printed.show(files=False)   # a failed step writes no file: nothing changed
        if error is exc:
            raise
        raise error from exc

    host = hosts[0]
    renders = None
    try:
        if marked is not None and marked.values:
            try:
                if watches:
                    raise WithoutTextValues("printed inside a micro-batch loop rolled up")
                marked.check_shown(printed.texts())
            except WithoutTextValues:
                draws.rewind()
                raise
            renders = Renders(tuple(marked.renders))   # shown after the run, filled in
        elif shown:
            printed.show()
        number_guards = _number_guards(step_fn, step_args, inputs, late, draws, symbols,
                                       on_values, taken) + late.draw_value_guards
        decisions = insert_checks(gm, late.fake_mode.shape_env, step_fn) if on_values else []
        if not (markers.backwards or raised or decisions):
            # (a branch a decision takes may skip backward(), as eager does: `if
            # torch.isnan(loss): return`, a program of the forward only)
            _check_markers(step_fn, markers)
        returned_as_read(gm.graph, returned[0])
        try:
            check_outside(gm)
        except TranspileError as exc:
            if not caches.read_before:
                raise
            caches.forget_read()
            draws.rewind()
            raise _ReadMemoized(str(exc)) from exc
        if step_args.lifted or step_args.places_lifted:
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            try:
                check_lifted(gm, {node: spec.name for node, spec in zip(placeholders, inputs.specs)
                                  if spec.kind is InputKind.NUMBER}, _lifted_names(step_args))
            except NotLiftable as exc:
                raise NotLiftable(late.sources_of(exc.names), str(exc)) from exc
        _check_matmul_dtypes(step_fn, gm, step_args)
        if watches and arg_writes:
            raise NotRollable("the step changes the containers among its arguments: traced "
                              "unrolled, each micro-batch's change is its own")
        if watches:
            check_rolled(watches[0], gm.graph)
            drop_unwritten_clones(gm.graph)
        elif len(markers.backwards) > MANY_BACKWARDS:
            log.warning("transpiler: %s calls backward() %d times: the program unrolls every "
                        "micro-batch, so it grows and traces in proportion; for many micro-batches "
                        "pass transpile(micro_batches=...) the list it loops over, or accumulate "
                        "across calls (README, Training loops)",
                        step_name(step_fn), len(markers.backwards))
        assign_roles(gm.graph, markers)
        # Every backward() comes before the first optimizer.step() (markers refuse
        # one after it): all but the last may be averaged where they end.
        mark_backward_ends(markers.ends[:-1] if markers.steps else [])
        _drop_profiler_nodes(gm.graph)
        try:
            with results_laid_out_as_kernels():   # the out-of-place twins' layouts
                functionalize.rewrite(gm.graph)
            fgm = gm
        except functionalize.Unsupported as why:
            log.debug("transpiler: functionalizing %s by tracing again: %s", step_name(step_fn), why)
            try:
                with on_real_values() if decisions else contextlib.nullcontext():
                    fgm = _functionalize(gm, values + late.values, tracing_mode)
            except Exception as exc:
                if not decisions:
                    raise
                raise TranspileError(
                    f"{step_name(step_fn)} decides on a tensor value{decisions[0].where}, and "
                    f"tracing it again on this call's values failed: {type(exc).__name__}: "
                    f"{str(exc).splitlines()[0]}. Decide with tensor ops (torch.where, "
                    "masking), or move the decision outside the step") from exc
        if watches:   # the getitems of a multi-output op rewritten out of place
            for node in fgm.graph.nodes:
                if node.target is operator.getitem and MICRO in node.args[0].meta:
                    node.meta.setdefault(MICRO, node.args[0].meta[MICRO])
        rng_plan = rng.plan(fgm, rolled=bool(watches))
        program, slots, targets = to_program(
            fgm, inputs, returned[0].num_outputs, created, left,
            [(w.name, AssignSlot(w.holder, w.key)) for w in host.assigned]
            + [(w.name, ArgumentSlot(w)) for w, _ in arg_writes.set]
            + [(f"{e.name}.grad", ArgumentGradSlot(e)) for e, _ in arg_writes.grads])
        values = dict(zip((spec.name for spec in inputs.specs), inputs.values))
        _check_arguments_unwritten(step_fn, program, targets, values)
        _check_reached_apart(step_fn, program, slots)
        _check_layouts_kept(step_fn, program)
        guard_skipped_steps(program, _optimizer_of(targets, optimizers))
        reads_grads = bool(kept) or any(spec.kind is InputKind.GRAD for spec in program.inputs)
        for flag in flags:   # as the step's Python left them, as its other host writes
            flag.redo()
        return Captured(program, slots, targets, returned[0], markers.schedulers, cleared,
                        reads_grads, host.guards, ShapeGuards.of(program, slots),
                        rolled=(step_args.start, step_args.per) if watches else None,
                        host_writes=host.kept + flags, draws=draws, rng=rng_plan,
                        decisions=decisions, number_guards=number_guards,
                        argument_edits=arg_writes.edits,
                        values_read=ValuesRead.of(values_read, step_args.leaves),
                        steps=bool(markers.steps), raised=raised[0] if raised else None,
                        printed=printed.output(renders))
    except BaseException:
        host.abandon()
        raise




# torch.from_numpy itself: outside.py converts arrays through it while tracing.
_FROM_NUMPY = torch.from_numpy


def _number_guards(step_fn, step_args: StepArgs, inputs, late: "_LateInputs", draws: Draws,
                   symbols: dict, on_values: bool, taken: Decisions) -> list:
    """What the program assumes of its lifted numbers and of the numbers it
    draws on the host (numbers.take_number_guards): a call whose values decide
    otherwise runs another program. A decision on a draw that the host cannot
    evaluate exactly is refused: a draw has a new value on every call."""
    guarded = {**symbols, **late.draw_names}
    if not guarded:
        return []
    slots = {spec.name: slot for spec, slot in zip(inputs.specs, inputs.slots)
             if spec.kind in (InputKind.NUMBER, InputKind.DRAW)}
    try:
        return take_number_guards(late.fake_mode.shape_env, guarded, slots, step_args.leaves,
                                  lambda ra: user_line(step_fn, frames=ra.stack.summary()),
                                  on_values, taken)
    except NotLiftable as exc:
        exc.names = late.sources_of(exc.names)
        drawn = [(what, symbol in late.clock_symbols) for symbol, what in late.draw_symbols.items()
                 if late.draw_names[symbol] in exc.names]
        if not drawn:
            raise
        draws.rewind()
        clock = next((what for what, is_clock in drawn if is_clock), None)
        if clock is not None:
            raise TranspileError(
                f"{step_name(step_fn)} turns a time it measures inside the step ({clock}) into "
                f"text or a decision: {exc}. The program runs without the step's Python, and "
                "every clock the step reads is read before the program runs, so such a time "
                "would not be the step's: time the call from outside the step "
                "(start = time.perf_counter(); step(...); time.perf_counter() - start)") from exc
        drawn = [what for what, _ in drawn]
        raise TranspileError(
            f"{step_name(step_fn)} decides on a value it draws on the host ({drawn[0]}) by a "
            f"condition the host cannot evaluate as the step's Python does: {exc}. Compare the "
            "drawn value itself (`if random.random() < p`), draw outside the step and pass "
            "the decision as an argument, or draw with torch (torch.rand(()) < p)") from exc


class _LateInputs:
    """Program inputs found while the step runs: the tensors (and numpy
    arrays) it reads outside its arguments through a host path (reads.py), and
    the values it draws on the host (host_random.py). Each becomes a
    placeholder added to the graph being built, read through that path (or
    drawn again) on every call; the step gets a fake tensor of the trace's mode
    in its place (for an array, torch.from_numpy gives it: outside.py)."""

    def __init__(self, inputs, arrays: dict, symbolic: bool, symbols: dict, places: dict,
                 constant_draws: frozenset[str] = frozenset()):
        self.inputs, self.arrays, self.symbolic = inputs, arrays, symbolic
        self.computed_from: dict[str, set[str]] = {}   # a math input's name -> the numbers it reads
        self.numpy_types: dict = {}   # the symbol of a numpy function's input -> its result's type
        self.values: list[torch.Tensor] = []   # what a second trace is given for them
        self._by_id: dict[int, tuple] = {}     # id of a real tensor -> (it, stand-in, name)
        self.draw_symbols: dict = {}           # symbol of a drawn number -> the draw
        self.draw_names: dict = {}             # symbol of a drawn number -> its input's name
        self.clock_symbols: set = set()        # of those, the clocks' (time.perf_counter())
        self.integer_draws: frozenset[str] = frozenset()   # names of the integers drawn
        self.constant_draws = constant_draws   # of those, the ones traced as constants
        self.draw_value_guards: list[NumberGuard] = []   # their values, guarded
        self.symbols = symbols   # symbol of a lifted number -> its input's name
        self.places = places     # a lifted number's input's name -> its place (reads.place_key)

    def begin(self, traced: dict[int, torch.Tensor], fake_mode) -> None:
        self.traced, self.fake_mode = traced, fake_mode

    def stand_in(self, real, name: str, place):
        if isinstance(real, torch.Tensor) and id(real) in self.traced:
            return self.traced[id(real)]   # a parameter or buffer of the step's modules
        found = self._by_id.get(id(real))
        if found is None:
            tensor = _FROM_NUMPY(real) if is_ndarray(real) else real
            fake = self.placeholder(InputSpec(InputKind.REACHED, self._unique(name)),
                                    ReachedSlot(place), lambda: tensor)
            found = self._by_id[id(real)] = (real, fake, name)
            if is_ndarray(real):
                self.arrays[id(real)] = fake
        return real if is_ndarray(real) else found[1]

    def number(self, value, name: str, place, key: tuple | None = None,
               slot: type = ReachedNumberSlot):
        """The traced value of a number the step reads through a host path
        (numbers.py: one whose value changed before, known to the cache by
        `key`; group_reads.py: an optimizer's value): a symbolic number."""
        spec = InputSpec(InputKind.NUMBER, self._unique(name))
        fake = self.placeholder(spec, slot(place), functools.partial(as_input, value))
        if key is not None:
            self.places[spec.name] = key
        return read_number(fake, spec.name, self.symbols, value)

    def drawn(self, value, name: str, what: str, slot):
        """The traced value of a host draw (host_random.py): a symbolic number,
        or for an array the array itself (torch.from_numpy gives its input)."""
        if is_ndarray(value):
            fake = self.placeholder(InputSpec(InputKind.DRAW, name), slot,
                                    functools.partial(slot.read, None))
            self.arrays[id(value)] = fake
            return value
        if isinstance(value, int):
            self.integer_draws |= {name}
            if name in self.constant_draws:   # a program per value drawn
                symbol = sympy.Symbol(name)
                self.draw_value_guards.append(
                    NumberGuard(sympy.Eq(symbol, value), ((symbol, name, slot),),
                                f", drawn by {what},"))
                return value
        fake = self.placeholder(InputSpec(InputKind.DRAW, name), slot,
                                functools.partial(slot.read, None))
        number = fake.item()
        self.draw_symbols[number.node.expr] = what
        self.draw_names[number.node.expr] = name
        if slot.draws.draws[slot.index].clock:
            self.clock_symbols.add(number.node.expr)
        # a condition on it takes this call's value: a number guard, a program per outcome
        number.node.shape_env.set_real_tensor_prop_unbacked_vals(number.node.expr, value)
        return number

    def computed(self, fn: Callable, arguments: tuple):
        """The traced value of a function of math (or numpy's) on symbolic
        numbers (host_arithmetic.math_on_numbers): a number computed on the
        host for each call from the inputs its arguments are computed from;
        None where an argument reads anything else."""
        names = {**self.symbols, **self.draw_names}
        try:
            replays = tuple(replay_of(a, lambda n: _known(number_input_symbol(n), names))
                            if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool))
                            else tuple(a) if isinstance(a, list) else a for a in arguments)
        except NotReplayable:
            return None
        by_name = {spec.name: slot for spec, slot in zip(self.inputs.specs, self.inputs.slots)}
        read = sorted(set().union(*(r.symbols for r in replays if isinstance(r, Replay))), key=str)
        slot = MathSlot(fn, replays, tuple((s, by_name[names[s]]) for s in read))
        try:   # each input's value for the call traced (its place may hold the step's write)
            value = slot.of({s: traced_value(self.fake_mode.shape_env, s) for s in read})
        except (ArithmeticError, ValueError):
            return None   # math raises on this value: it raises as the step runs it
        if not is_number(float(value) if _numpy_float(value) else value):
            return None
        module = "np" if getattr(fn, "__module__", None) == "numpy" else "math"
        spec = InputSpec(InputKind.NUMBER, self._unique(f"{module}_{fn.__name__}"))
        self.computed_from[spec.name] = self.sources_of({names[s] for s in read})
        fake = self.placeholder(spec, slot, functools.partial(as_input, value))
        number = read_number(fake, spec.name, self.symbols, value)
        if _numpy_float(value):
            self.numpy_types[number.node.expr] = type(value)
        return number

    def numpy_type(self, number):
        """The numpy scalar type the step's Python gives a symbolic number
        computed from a numpy function's result (returned.Returned.of), or
        None: its operations replayed on the traced values, each numpy
        function's result as its own type."""
        if not self.numpy_types or not isinstance(number, (torch.SymFloat, torch.SymInt)):
            return None
        try:
            replay = replay_of(number, number_input_symbol)
            env = {s: traced_value(self.fake_mode.shape_env, s) for s in replay.symbols}
            env.update({s: self.numpy_types[s](env[s]) for s in env if s in self.numpy_types})
            value = replay.evaluate(env)
        except (NotReplayable, KeyError, ArithmeticError, ValueError):
            return None
        return type(value) if _numpy_float(value) else None

    def sources_of(self, names: set[str]) -> set[str]:
        """`names`, each math input among them replaced by the numbers it is
        computed from (what a failed lifting names)."""
        return set().union(*(self.computed_from.get(n, {n}) for n in names)) if names else set()

    def placeholder(self, spec: InputSpec, slot, value: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A new program input, placed after the others; its fake tensor.
        value() makes its tensor for this call, outside the trace's modes: a
        tensor made under them is a fake one, whose real twin (what a trace on
        values computes with) holds no value."""
        with _disable_current_modes():
            tensor = value()
        fake = self.fake_mode.from_tensor(tensor, static_shapes=True)
        tracer = get_proxy_mode().tracer
        proxy = tracer.create_proxy("placeholder", identifier("r_", spec.name), (), {})
        proxy.node.meta["val"] = fake
        track_tensor_tree(fake, proxy, constant=None, tracer=tracer)
        placeholders = [n for n in tracer.graph.nodes if n.op == "placeholder"]
        placeholders[-2].append(proxy.node)   # inputs come first
        self.inputs.specs.append(spec)
        self.inputs.slots.append(slot)
        self.inputs.values.append(tensor)
        self.values.append(fake if self.symbolic else tensor)
        return fake

    def _unique(self, name: str) -> str:
        taken = {spec.name for spec in self.inputs.specs}
        n, candidate = 1, name
        while candidate in taken:
            n += 1
            candidate = f"{name}_{n}"
        return candidate

    def check_no_grads(self, step_fn) -> None:
        """A gradient computed for a tensor read outside the arguments would be
        accumulated into its .grad by the eager step: refused."""
        for real, fake, name in self._by_id.values():
            if isinstance(fake, torch.Tensor) and fake.grad is not None:
                raise TranspileError(
                    f"{step_name(step_fn)} computes a gradient for {name}, a tensor it reads "
                    "outside its arguments and its optimizers' parameters: pass the module that "
                    "holds it as an argument of the step (its parameters are then trained and "
                    "reduced), or read it under torch.no_grad() (or detach it)")


def _numpy_float(value) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.floating) and value.ndim == 0


def _known(symbol, names: dict):
    return symbol if symbol in names else None


def _copy_tensor_hooks(inputs, traced: dict[int, torch.Tensor], recorder: Recorder) -> None:
    """A parameter's own hooks (register_hook, register_post_accumulate_grad_hook)
    run on its traced stand-in as on it: on the local gradient, before the
    reduction, as under DDP. They are guarded like module hooks."""
    for p in inputs.params:
        name = inputs.param_names[id(p)]
        for attr, register in _TENSOR_HOOKS:
            hooks = getattr(p, attr, None)
            recorder.hooks.add(f"{name}.{attr}", functools.partial(getattr, p, attr, None), hooks)
            for key, hook in (hooks or {}).items():
                getattr(traced[id(p)], register)(hook)
                recorder.reach(hook, f"{name}.{attr}[{key}]")


_TENSOR_HOOKS = (("_backward_hooks", "register_hook"),
                 ("_post_accumulate_grad_hooks", "register_post_accumulate_grad_hook"))


def _tensor_hooks(inputs, traced: dict[int, torch.Tensor]) -> dict[tuple[str, str], set]:
    """(parameter, how it was registered) -> the keys of its stand-in's hooks."""
    return {(inputs.param_names[i], register): set(getattr(t, attr, None) or ())
            for i, t in traced.items() if i in inputs.param_names
            for attr, register in _TENSOR_HOOKS}


def _once_per_forward(step_fn, markers: Markers, modules, inputs) -> Callable[[set], None]:
    """On several ranks, a check for each backward(): every module of the step
    whose parameters it reaches ran a forward (its own or a submodule's) since
    a backward() last reached them. DDP reduces a module's gradients in the
    first backward() after each of its forwards; a second backward() of the
    same forward (`l1.backward(retain_graph=True); l2.backward()`) adds each
    rank's own gradients to the averaged ones, and the replicas drift apart:
    refused."""
    owner = {inputs.param_names[id(t)]: m for m in modules for _, t in named_state(m)
             if id(t) in inputs.param_names}
    reached_before: set[int] = set()

    def reached(names: set) -> None:
        for module in {id(owner[n]): owner[n] for n in names if n in owner}.values():
            if id(module) in reached_before and id(module) not in markers.forwarded:
                raise TranspileError(
                    f"backward(){user_line(step_fn)} reaches the parameters of "
                    f"{type(module).__name__} again with no forward through it since the "
                    "backward() before: DDP averages a module's gradients once per forward, "
                    "so this backward()'s gradients would stay each rank's own and the "
                    "replicas would drift apart. Sum the losses into one backward() "
                    "((loss1 + loss2).backward()), or run the module's forward again for "
                    "the second loss")
            markers.forwarded.discard(id(module))
            reached_before.add(id(module))
    return reached


def _check_no_new_tensor_hooks(step_fn, before: dict, after: dict) -> None:
    """A hook the step registered on a parameter would be registered on its
    traced stand-in alone, and run in no program: refused (a hook it removes
    again, within the call, is fine)."""
    new = next((key for key, hooks in after.items() if hooks - before[key]), None)
    if new is not None:
        name, register = new
        raise TranspileError(
            f"{step_name(step_fn)} registers a hook on parameter {name} ({register}) and "
            "keeps it past the call: the program runs the hooks the parameter had when it was "
            "traced, and registering one on every call would stack them as eager does. "
            "Register it once outside the step, before the call (a hook added between calls "
            "traces again with it)")


def _check_no_tensor_attributes(step_fn, inputs, traced: dict[int, torch.Tensor],
                                before: dict[int, set]) -> None:
    """A plain value the step leaves in an attribute of a parameter or a buffer
    (`p.updates = p.updates + 1`) would be left on its traced stand-in alone:
    refused. (A tensor there, or None, is the step's own per-call data, as
    Opacus' `grad_sample`, which its hooks set and its optimizer reads.)"""
    hooks = {attr for attr, _ in _TENSOR_HOOKS}
    for i, t in traced.items():
        new = sorted(k for k in set(vars(t)) - before.get(i, set()) - hooks
                     if snapshot(vars(t)[k]) not in (MISSING, None))
        if new and i in inputs.param_names:
            raise TranspileError(
                f"{step_name(step_fn)} sets attribute {new[0]!r} on {inputs.param_names[i]}: "
                "the step runs on stand-ins of the model's tensors while it is traced, so the "
                "attribute would be set on a stand-in, never on the tensor itself; keep such "
                "values in a dict keyed by the parameter's name, or on its module")


def _accumulation_order(inputs, traced: dict[int, torch.Tensor]) -> list[str]:
    """The names of the parameters, appended as the autograd engine
    accumulates each one's gradient while the step is traced: the order
    DDP's reducer sees them ready in, and rebuilds its buckets by."""
    order: list[str] = []
    for i, t in traced.items():
        if i in inputs.param_names and t.requires_grad:
            t.register_post_accumulate_grad_hook(
                functools.partial(_append_name, order, inputs.param_names[i]))
    return order


def _append_name(order: list[str], name: str, _param) -> None:
    order.append(name)


def in_eager_order(accumulated: list[str], eager: list[str]) -> None:
    """Put the names `eager` into that order, in the places they hold in
    `accumulated` (each name's last one: where a backward() ends)."""
    places = sorted(max(i for i, n in enumerate(accumulated) if n == name)
                    for name in eager if name in accumulated)
    for place, name in zip(places, [n for n in eager if n in accumulated]):
        accumulated[place] = name


def _reach_roots(recorder: Recorder, step_fn, step_args: StepArgs) -> None:
    """What the step can read from: its modules, its arguments that are
    objects, and the step itself (its globals and closure; the self of a
    bound method; a callable object; a partial's arguments)."""
    found = {id(value): name for name, value in step_args.found}
    modules = step_args.modules
    for mi, module in enumerate(modules):
        recorder.root_module(module, found.get(id(module))
                             or (f"model{mi}" if len(modules) > 1 else "model"))
    for i, (name, leaf) in enumerate(zip(step_args.names, step_args.leaves)):
        recorder.reach_argument(i, leaf, name)
    recorder.reach(step_fn, step_name(step_fn))
    for oi, opt in enumerate(step_args.optimizers):
        # an optimizer's own values are the signature's and inputs; the globals
        # its step() reads (and writes) are the step's, like any code it runs
        recorder.reach(inspect.unwrap(type(opt).step), f"{type(opt).__name__}.step")


@contextlib.contextmanager
def _without_anomaly_mode(step_fn):
    """torch.autograd's anomaly detection checks every backward output for NaN
    on the host, which a program cannot do: the step is traced without it (the
    values are the same), and the log says so."""
    if not torch.is_anomaly_enabled():
        yield
        return
    log.warning("transpiler: %s runs with torch.autograd's anomaly detection on; the "
                "program computes the same values but does not check its backward pass for "
                "NaN (run the eager step to debug one)", step_name(step_fn))
    with torch.autograd.set_detect_anomaly(False):
        yield


@contextlib.contextmanager
def _autocast_cache(enabled: bool):
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(enabled)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)


@contextlib.contextmanager
def _seen_as_in_eager():
    """What model and torch code may branch on, as eager has it while the step
    runs: torch.fx's is_fx_tracing() False (make_fx's tracer sets it), so is
    nn.MultiheadAttention's check for make_fx (in eval mode without grad it
    takes its fused fast path in eager, which rounds otherwise), and a
    traced tensor's type among those that take torch's foreach paths
    (clip_grad_norm_ and the optimizers pick them by `type(t) in ...`), and a
    0-d tensor formatted as its value (f"expert_{idx}": Tensor.__format__
    formats the value of a plain tensor only), a decision on that value, and
    copy.deepcopy of a traced tensor (a state_dict copied inside the step, as
    Reptile's weights_before): a clone, where torch's protocol reads the
    storage's data pointer, which a traced tensor has none of."""
    from torch.fx import _symbolic_trace
    from torch.nn.modules import activation
    from torch.utils._foreach_utils import _foreach_supported_types as foreach_types
    before = _symbolic_trace._is_fx_tracing_flag
    _symbolic_trace._is_fx_tracing_flag = False
    foreach_types.append(FakeTensor)
    torch.Tensor.__format__ = _format_as_in_eager
    make_fx_tracing = activation._is_make_fx_tracing
    activation._is_make_fx_tracing = torch.compiler.is_exporting
    torch.overrides.has_torch_function = _has_torch_function_as_in_eager
    torch.Tensor.__deepcopy__ = _deepcopy_as_in_eager
    try:
        yield
    finally:
        _symbolic_trace._is_fx_tracing_flag = before
        foreach_types.remove(FakeTensor)
        torch.Tensor.__format__ = _FORMAT
        activation._is_make_fx_tracing = make_fx_tracing
        torch.overrides.has_torch_function = _HAS_TORCH_FUNCTION
        torch.Tensor.__deepcopy__ = _DEEPCOPY


_FORMAT = torch.Tensor.__format__
_DEEPCOPY = torch.Tensor.__deepcopy__


def _deepcopy_as_in_eager(self, memo):
    if type(self) is not FakeTensor or not self.is_leaf:
        return _DEEPCOPY(self, memo)
    if id(self) not in memo:
        with torch.no_grad():
            copied = self.clone().requires_grad_(self.requires_grad)
        if self.grad is not None:
            copied.grad = _deepcopy_as_in_eager(self.grad, memo)
        memo[id(self)] = copied
    return memo[id(self)]
_HAS_TORCH_FUNCTION = torch.overrides.has_torch_function


def _has_torch_function_as_in_eager(args) -> bool:
    """torch.overrides.has_torch_function, not counting the mode make_fx's
    tracer keeps (it records metadata; eager has no mode): nn.MultiheadAttention
    and nn.TransformerEncoderLayer check it before their fast path."""
    if not _HAS_TORCH_FUNCTION(args):
        return False
    modes = torch.overrides._get_current_function_mode_stack()
    if not all(isinstance(m, TorchFunctionMetadataMode) for m in modes):
        return True
    return bool(torch.overrides._get_overloaded_args(
        [a for a in args if isinstance(a, torch.Tensor)]))


def _format_as_in_eager(self, format_spec):
    caller = sys._getframe(1).f_code.co_filename
    if isinstance(self, FakeTensor) and self.dim() == 0:
        return tensor_text(self, caller, format_spec)
    if not format_spec and shows_values(self) and is_user_file(caller):   # f"{logits}"
        return tensor_text(self, caller)
    return _FORMAT(self, format_spec)


def _group_tensors(optimizers) -> set[int]:
    """ids of the tensors among param-group values (a tensor lr): the
    signature compares them by value."""
    return {id(v) for opt in optimizers for group in opt.param_groups for v in group.values()
            if isinstance(v, torch.Tensor)}


# Kernels that refuse operands of two dtypes at run time, where fake tensors
# (their meta functions) let the trace through.
_SAME_DTYPE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
               torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default,
               torch.ops.aten.convolution.default}


def _check_matmul_dtypes(step_fn, gm: fx.GraphModule, step_args: StepArgs) -> None:
    """A batch of another dtype than the model's (float64 from numpy, say)
    is refused at the first call with both dtypes, not at the program's run."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _SAME_DTYPE:
            dtypes = [a.meta["val"].dtype for a in node.all_input_nodes
                      if isinstance(a.meta.get("val"), torch.Tensor)]
            if len(set(dtypes)) > 1:
                batch = {str(leaf.dtype) for leaf in step_args.leaves
                         if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()}
                raise TranspileError(
                    f"{step_name(step_fn)} multiplies tensors of "
                    f"{' and '.join(str(d).replace('torch.', '') for d in dict.fromkeys(dtypes))} "
                    f"({node.target.__name__}; the batch's floating-point tensors are "
                    f"{', '.join(sorted(batch)) or 'none'}): the batch's dtype must match the "
                    "model's: convert it (x.to(torch.float32)) or the model, or run the forward "
                    "under torch.autocast")


def _check_arguments_unwritten(step_fn, program: Program, targets: list, values: dict) -> None:
    """An in-place op on a batch tensor would change the caller's tensor in
    eager; the program writes only state: refused before anything runs. A
    tensor it reads through a host path and changes in place is written back
    into that tensor after each run (ReachedSlot), unless it shares memory
    with another input (`values`: each input's tensor, by name): the program
    computes each input's update alone."""
    for spec, target in zip(program.outputs, targets):
        if isinstance(target, ReachedSlot):
            array = is_ndarray(target.place.read())
            shared = None if array else _sharing_memory(target.read(None), spec.target, values)
            if array or shared is not None:
                raise TranspileError(
                    f"{step_name(step_fn)} modifies {spec.target!r} in place, a "
                    f"{'numpy array' if shared is None else 'tensor'} it reads outside its "
                    "arguments" + ("" if shared is None else f" that shares memory with {shared}")
                    + ": register it as a buffer of a module passed to the step "
                    "(register_buffer), or compute out of place")
        if isinstance(target, (DataSlot, ArraySlot)):
            raise TranspileError(
                f"{step_name(step_fn)} modifies its argument {spec.target!r} in place (an "
                "in-place op such as x.mul_(2) or x[mask] = 0 on the batch): a transpiled step "
                "does not write its batch arguments back; compute out of place (x = x * 2), or "
                "clone the argument first (x = x.clone())")


def _check_reached_apart(step_fn, program: Program, slots: list) -> None:
    """A tensor the step reads through a host path that shares memory with
    state the program updates (a flat buffer whose views are the parameters or
    their .grad) is read once, before the update; eager reads that memory as
    the update leaves it: refused before anything runs."""
    written = {spec.target for spec in program.outputs if spec.kind is OutputKind.UPDATE} \
        | {f"{spec.target}.grad" for spec in program.outputs if spec.kind is OutputKind.GRAD}
    state = {spec.name: slot.read(None) for spec, slot in zip(program.inputs, slots)
             if spec.name in written and isinstance(slot, (ParamSlot, GradSlot, StateSlot))}
    state = {name: v for name, v in state.items() if isinstance(v, torch.Tensor)}
    for spec, slot in zip(program.inputs, slots):
        value = slot.read(None) if isinstance(slot, ReachedSlot) else None
        if isinstance(value, torch.Tensor) and not is_ndarray(slot.place.read()):
            shared = _sharing_memory(value, spec.name, state)
            if shared is not None:
                raise TranspileError(
                    f"{step_name(step_fn)} reads {spec.name!r} outside its arguments, a tensor "
                    f"that shares memory with {shared}, which the step updates: the program "
                    "reads it as the call starts, where eager reads that memory as the update "
                    "leaves it; read the parameters or their .grad themselves, or keep the "
                    "buffer apart from them")


def _sharing_memory(tensor: torch.Tensor, name: str, values: dict) -> str | None:
    """The name of another input (`values`: name -> its tensor) whose memory
    `tensor` shares."""
    mine = tensor.untyped_storage().data_ptr()
    return next((other for other, v in values.items() if other != name
                 and isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() == mine),
                None)


def _check_layouts_kept(step_fn, program: Program) -> None:
    """A state tensor the step gives another shape or dtype in place (resize_,
    set_: a quantization observer's per-channel scale) is refused before any
    run: the write-back keeps every tensor's layout."""
    placeholders = {spec.name: node for spec, node in zip(program.inputs, program.placeholders)}
    for spec, value in zip(program.outputs, program.output_node.args[0]):
        old = placeholders.get(spec.target) if spec.kind is OutputKind.UPDATE else None
        if old is None or not isinstance(value, fx.Node):
            continue
        before, after = old.meta.get("val"), value.meta.get("val")
        if isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and (
                tuple(before.shape) != tuple(after.shape) or before.dtype != after.dtype):
            raise TranspileError(
                f"{step_name(step_fn)} changes the layout of {spec.target} in place "
                f"({str(before.dtype).replace('torch.', '')}{list(before.shape)} -> "
                f"{str(after.dtype).replace('torch.', '')}{list(after.shape)}, e.g. with "
                "resize_): a transpiled step writes its state back in place, keeping each "
                "tensor's shape and dtype; give the buffer its final shape before the first "
                "call (for quantization observers, run one forward pass of the prepared model "
                "first)")


def _outside_hint(step_args: StepArgs) -> str:
    """What to do about a tensor from outside the arguments."""
    pulled = [name for name, leaf in zip(step_args.names, step_args.leaves)
              if isinstance(leaf, (Iterator, torch.utils.data.DataLoader))]
    if pulled:
        return (f"The argument {pulled[0]!r} is an iterator or a loader: pull each batch "
                "outside the step (x, y = next(it)) and pass its tensors as arguments")
    return ("Pass the batch and every module the step uses as arguments, e.g. step(model, "
            "optimizer, x, y), and keep a module's tensors in parameters or buffers "
            "(register_buffer)")


def _optimizer_of(targets: list, optimizers) -> list[int | None]:
    """For each output's target: the index of the optimizer that writes it (a
    parameter it updates, its state), else None."""
    index = {id(opt): oi for oi, opt in enumerate(optimizers)}
    of_param = {id(p): index[id(opt)] for opt in optimizers for p in opt_params(opt)}
    return [index[id(t.optimizer)] if isinstance(t, StateSlot)
            else of_param.get(id(t.tensor)) if isinstance(t, ParamSlot) else None
            for t in targets]


def _check_markers(step_fn, markers: Markers):
    if not markers.backwards:
        raise NoBackward(f"{step_name(step_fn)} never calls loss.backward(): a training "
                         "step computes a loss, calls backward() and optimizer.step()")


def _drop_profiler_nodes(graph: fx.Graph):
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node.target in _PROFILER_OPS:
            for user in list(node.users):
                graph.erase_node(user)
            graph.erase_node(node)




_CARRIED = (PARAM, READY, SKIPS, GRAD_AT, CARRY, UNUSED, COMM, BUFFER_SYNC)   # meta on a value's node


class _RoleCarrier(fx.Interpreter):
    """Runs the traced graph under functionalization and gives each node it
    creates in the new graph the role (and gradient mark) of the node it came
    from; the loss and the seed keep their LOSS role on the node of their value."""

    def run_node(self, n):
        before = last_node()
        result = super().run_node(n)
        if n.op != "call_function":
            return result
        node = before.next
        while node.op != "root":
            node.meta.setdefault(ROLE, n.meta[ROLE])
            for key in (MICRO, DECISION):
                if key in n.meta:
                    node.meta.setdefault(key, n.meta[key])
            node = node.next
        if any(key in n.meta for key in _CARRIED) or n.meta[ROLE] & Role.LOSS:
            # The node of the value itself: a getitem of a multi-output op is
            # created with that op and took its role above.
            node = node_of(_unwrapped(result))
            for key in _CARRIED:
                if key in n.meta:
                    node.meta[key] = n.meta[key]
            if n.meta[ROLE] & Role.LOSS:
                node.meta[ROLE] = n.meta[ROLE]
        return result

    def call_function(self, target, args, kwargs):
        if drawn_in_place(target, args):   # drawn on the target's layout, as eager draws
            return args[0].copy_(twin(target)(*args, **kwargs))
        relaid = functionalize.relaid_twin(
            target, *pytree.tree_map_only(torch.Tensor, _unwrapped, (args, kwargs)))
        if relaid is not None:   # written in the target's layout, as eager writes it
            return args[0].copy_(relaid(*args, **kwargs))
        if target in ISSUED or target is WAIT:   # nothing issued while traced (traced_collectives)
            with without_real_values(_unwrapped(args[0])):
                result = super().call_function(target, args, kwargs)
            forget_real_values(_unwrapped(result))
            return result
        return super().call_function(target, args, kwargs)


def _unwrapped(t):
    """The traced tensor behind a functional one."""
    if isinstance(t, FunctionalTensor):
        t = t.elem
    return torch._from_functional_tensor(t) if torch._is_functional_tensor(t) else t


def _functionalize(gm: fx.GraphModule, values, tracing_mode: str) -> fx.GraphModule:
    """Trace the graph again under functionalization: its ops out of place, a
    mutated input written back (copy_) at the end. torch's Python
    functionalization (FunctionalTensorMode, as AOTAutograd's) keeps every op
    the graph calls; torch.func.functionalize would run the Python
    decomposition some ops register as their meta function
    (binary_cross_entropy_with_logits), which rounds otherwise than eager's kernel."""
    def run(*args):
        with torch._C._ExcludeDispatchKeyGuard(
                torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)), \
                FunctionalTensorMode():
            wrapped = [FunctionalTensor.to_functional(a) if isinstance(a, torch.Tensor) else a
                       for a in args]
            outputs = _RoleCarrier(gm).run(*wrapped)
            # a tensor written through a view of it (torch's Adam on a complex
            # parameter: view_as_real(exp_avg).lerp_) holds the write once synced
            for w in (*wrapped, *pytree.tree_leaves(outputs)):
                if isinstance(w, FunctionalTensor):
                    torch._sync(w)
            outputs = pytree.tree_map_only(FunctionalTensor, _unwrapped, outputs)
            mutated = [(a, _unwrapped(w)) for a, w in zip(args, wrapped)
                       if isinstance(w, FunctionalTensor)
                       and torch._functionalize_has_data_mutation(w.elem)]
        for arg, new in mutated:
            arg.copy_(new)
        return outputs
    with kernels_where_meta_refuses(), results_laid_out_as_kernels(), \
            eager_dispatch(tracing_mode == "symbolic"):   # as the first trace ran them
        gm = make_fx(run, tracing_mode=tracing_mode,
                     _allow_non_fake_inputs=True)(*[v.detach() for v in values])
    for node in gm.graph.nodes:   # the sizes of symbolic inputs, read as they are wrapped
        if node.op == "call_function":
            node.meta.setdefault(ROLE, Role.FORWARD)
    return gm
