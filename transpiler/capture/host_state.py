"""Host-side Python state the step reads and writes while it is traced.

The program runs without the step's Python, so what the step read on the host
is guarded (reads.py records it) and what it wrote would happen once, at the
trace, and never again. The writes the recorder saw are sorted here:

- a tensor the step computed and assigned to a host attribute (`self.aux =
  loss`, pruning's `module.weight = weight_orig * mask`) is an output of the
  program, assigned to that attribute after every call (trace.py);
- a symbolic number bound to a host attribute (`meter.val = loss.item()`, a
  counter whose place is lifted: `self.step += 1`, changed_numbers.py) is an
  output too, put there after every run as a Python number (returned.py);
- any other write (a flag set, a config value filled in, `model.train()`, a
  hook installed) is kept, and replayed on the host after every run of the
  program: a program traced after reading a value the step then wrote is only
  chosen while that value is as it was read, so the replay writes exactly what
  the step would. trace.py traces once more from the written state: a step
  that writes again there changes the host on every call: a number it read there
  is lifted (a counter, above), anything else is refused, naming the value,
  with every write undone;
- a tensor the step computed left in a container or another object's state,
  a parameter group changed, a parameter, buffer or submodule registered: refused
  and undone. (A buffer or a parameter the step reassigns is state the program
  writes back: state_writes.py.)
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
from typing import Any

import torch

from ..errors import TranspileError
from .optimizer_state import TRACE_GROUP_OPTIONS
from .constants import realize
from .guards import saved, snapshot
from .appended import Appended, AppendsSeen, appended_place
from .reads import MISSING, Recorder, Write, is_traced, place_key, put, recording
from .signature import registrations
from .user_code import step_name

log = logging.getLogger("transpiler")


# An optimizer's attributes that are no value of its step: set by an LR
# scheduler's wrapper of step() when it runs, and turned off while traced
# (scaler.traced_scalers: the scaler unscales a fused optimizer's gradients).
_NOT_STEP_VALUES = frozenset({"_opt_called", "_step_supports_amp_scaling"})


def _optimizer_values(optimizers, inputs: dict[int, torch.Tensor]) -> dict[str, Any]:
    """What an optimizer's step() could change on the host, by name: each
    param group's values (a traced stand-in of a tensor among them, `inputs`:
    optimizer_state.group_tensors_as_inputs, as that tensor), its defaults,
    and its attributes that hold plain values (a custom optimizer's counter,
    `self.global_step`)."""
    def real(value):
        if isinstance(value, tuple):
            return tuple(inputs.get(id(v), v) for v in value)
        return inputs.get(id(value), value)
    values = {}
    for oi, opt in enumerate(optimizers):
        for gi, group in enumerate(opt.param_groups):
            for key, value in group.items():
                if key != "params" and key not in TRACE_GROUP_OPTIONS:
                    values[f"optimizer {oi} param_groups[{gi}][{key!r}]"] = real(value)
        for key, value in getattr(opt, "defaults", {}).items():
            values[f"optimizer {oi} defaults[{key!r}]"] = value
        for key, value in vars(opt).items():
            if key not in _NOT_STEP_VALUES and _plain(value):
                values[f"optimizer {oi} .{key}"] = value
    return values


def _plain(value) -> bool:
    """A number, string, bool or None, or a tuple of them."""
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (int, float, str))


class HostState:
    """What one trace read and wrote on the host: `guards` (reads.Guards),
    `assigned` (tensor writes: program outputs), `numbers` (symbolic numbers
    written: program outputs) and `kept` (other writes, left in place and
    replayed after each run). Filled by finish()."""

    def __init__(self, recorder: Recorder, step_fn, modules, optimizers,
                 traced: dict[int, torch.Tensor]):
        self.recorder = recorder
        # the trace's stand-in of each parameter and buffer -> the tensor itself
        self.reals = {id(t): real for real in
                      [t for m in modules for t in [*m.parameters(), *m.buffers()]]
                      for t in [traced.get(id(real))] if t is not None}
        self.step_fn = step_fn
        self.modules, self.optimizers = modules, optimizers
        self.group_inputs: dict[int, torch.Tensor] = {}   # stand-in id -> a group's tensor
        self.optimizer_values = _optimizer_values(optimizers, self.group_inputs)
        # what a refusal puts back (their groups, redirect_optimizer does)
        self.optimizer_saved = [({k: v for k, v in vars(opt).items() if _plain(v)},
                                 dict(getattr(opt, "defaults", {}))) for opt in optimizers]
        self.traced = {id(t) for t in traced.values()}
        self.registrations = registrations()
        self.structure = _structure(modules)
        self.guards = None
        self.assigned: list[Write] = []
        self.numbers: list[Write] = []
        self.appended: list[Appended] = []   # items appended to containers: outputs
        self.kept: list[Write] = []

    def finish(self) -> None:
        """Inside the trace, once the step returned: stop recording and sort the
        writes (refusing what cannot be kept, with every write undone)."""
        self.guards, writes = self.recorder.finish()
        for w in [w for w in writes if _rederived(w)]:
            w.undo()
            writes.remove(w)
        self.numbers = [w for w in writes if _symbolic_number(w)]
        writes = [w for w in writes if w not in self.numbers]
        for w in writes:
            if not w.assigns_traced_tensor and _holds_traced(w.values()[1]):
                _realize(w, self.reals)
        appends = frozenset(p for w in writes for p in [self._place_of(w)] if p is not None) \
            - self.recorder.append_places - self.recorder.append_read.keys()
        try:
            self.appended = [a for stand in self.recorder.appending for a in stand.appended()]
            refused = AppendsSeen(appends) if appends else self._refused(writes)
        except TranspileError as exc:
            refused = exc
        if refused is not None:
            for w in reversed(writes + self.numbers):
                w.undo()
            raise refused
        self.assigned = [w for w in writes if w.assigns_traced_tensor]
        for w in self.assigned + self.numbers:   # the host keeps its value until a run gives one
            w.undo()
        self.kept = [w for w in writes if not w.assigns_traced_tensor and w.changes()]

    def _refused(self, writes: list[Write]) -> TranspileError | None:
        name = step_name(self.step_fn)
        narrow = next((w for w in self.numbers if _narrow_numpy(w.values()[0])), None)
        if narrow is not None:
            return TranspileError(
                f"{name} computes {narrow.name} from a tensor's value where it held a numpy "
                f"{type(narrow.values()[0]).__name__} ({narrow.describe()}): numpy computes "
                "that in its own width, the program in Python's float64; keep a Python float "
                "there (float(...)), or return the value from the step")
        made = next((w for w in writes if self._made_in_the_step(w.values()[1])), None)
        if made is not None:
            return TranspileError(
                f"{name} makes {type(made.values()[1]).__name__} from the model's tensors as it "
                f"runs and keeps it in {made.name} (a lazy `if self.ema is None: self.ema = "
                "copy.deepcopy(model)`): a transpiled step's modules and optimizers are fixed "
                "when it is traced; create it before the first call")
        stored = [w for w in writes if not w.assigns_traced_tensor
                  and _holds_traced(w.values()[1])]
        if stored:
            read = self.recorder.append_read.get(self._place_of(stored[0]))
            return read or TranspileError(
                f"{name} leaves a value it computed from tensors in {stored[0].name} "
                f"({stored[0].describe()}): the program runs without the step's Python, so the "
                "host cannot hold the program's own values; return the tensor from the step "
                "(and call .item() on it outside), or assign the tensor itself to an attribute "
                "(self.aux = loss)")
        if registrations() != self.registrations and _structure(self.modules) != self.structure:
            return TranspileError(
                f"{name} registers a parameter, a buffer or a submodule while it runs: a "
                "transpiled step's state is fixed when it is traced; create them before the "
                "first call (for a lazy module, run one forward pass first)")
        return self._optimizer_changed(name)

    def _place_of(self, w: Write):
        """The place of a container the step only appended to, else None."""
        return appended_place(w, place_key(w.holder, w.key))

    def _made_in_the_step(self, value) -> bool:
        """A module or an optimizer on tensors the step's modules do not hold
        (a copy made as it ran, a new optimizer on the traced parameters)."""
        if isinstance(value, torch.nn.Module):
            tensors = [*value.parameters(), *value.buffers()]
        elif isinstance(value, torch.optim.Optimizer):
            tensors = [p for g in value.param_groups for p in g["params"]]
        else:
            return False
        held = {id(t) for t in self.reals.values()}
        return any(is_traced(t) or id(t) not in held for t in tensors)

    def _restore_optimizers(self) -> None:
        """Each optimizer's attributes and defaults as they were (a refused
        step changes nothing)."""
        for opt, (attributes, defaults) in zip(self.optimizers, self.optimizer_saved):
            for key in [k for k, v in vars(opt).items() if k not in attributes and _plain(v)]:
                delattr(opt, key)
            vars(opt).update(attributes)
            if hasattr(opt, "defaults"):
                opt.defaults.clear()
                opt.defaults.update(defaults)

    def _optimizer_changed(self, name: str) -> TranspileError | None:
        """A change to an optimizer's groups, defaults or plain attributes, or
        optimizer state kept under a key that is not a parameter: refused."""
        now = _optimizer_values(self.optimizers, self.group_inputs)
        before = self.optimizer_values
        changed = [n for n in before if repr(now.get(n, MISSING)) != repr(before[n])]
        changed += [n for n in now if n not in before]
        if changed:
            first = changed[0]
            old, new = before.get(first, "absent"), now.get(first, "deleted")
            self._restore_optimizers()
            return TranspileError(
                f"{name} changes host-side state: {first} {old!r} -> {new!r}. The program runs "
                "without the step's Python, so this change would happen once, while the step "
                "is traced, and never again: set hyperparameters outside the step, or step a "
                "torch.optim.lr_scheduler after optimizer.step() inside it (the transpiled step "
                "runs it on the host after every call); an optimizer of your own keeps a count "
                "in a tensor of optimizer.state[p], as torch's do")
        for opt in self.optimizers:
            key = next((k for k in opt.state if id(k) not in self.traced), None)
            if key is not None:
                return TranspileError(
                    f"{name} steps {type(opt).__name__}, which keeps state under "
                    f"{_shown_key(key)}, not under a parameter: the program carries an "
                    "optimizer's state per parameter (optimizer.state[p]); keep it there")
        return None

    def abandon(self) -> None:
        """The trace failed: undo whatever the step wrote (once)."""
        if self.guards is None:
            self.guards, self.kept = self.recorder.finish()
        for w in reversed(self.kept):
            w.undo()
        self.kept = []


# torch's RNNs keep lists of their weights that forward rebuilds when the
# parameters are not the ones listed: the trace's stand-ins are not.
_RNN_WEIGHT_LISTS = frozenset({"_flat_weights", "_flat_weight_refs"})


def _rederived(w: Write) -> bool:
    """A write torch's own code makes because the trace swapped the parameters."""
    return w.key in _RNN_WEIGHT_LISTS and w.holder.get("_flat_weights_names") is not None


def _realize(w: Write, reals: dict) -> None:
    """Tensors made from constants alone in what the step wrote (a lazily built
    object's table): their real values in place of the trace's (constants.py)."""
    try:
        if w.in_place:
            container = w.holder.get(w.key, MISSING)
            realize(container, reals)
            w.after = saved(container)
        else:
            w.after = realize(w.after, reals)
            put(w.holder, w.key, w.after)
    except ValueError:
        pass   # computed from an input: refused (_refused)


def _structure(modules) -> tuple:
    """The names of every parameter, buffer and submodule of the step's modules."""
    return tuple((id(m), tuple(m._parameters), tuple(m._buffers), tuple(m._modules))
                 for module in modules for m in module.modules())


def _narrow_numpy(value) -> bool:
    """A numpy scalar that numpy computes with in another width than Python's."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.generic) \
        and type(value) not in (numpy.float64, numpy.int64, numpy.bool_)


def _symbolic_number(w: Write) -> bool:
    """A number the program computes (a `.item()`, arithmetic on a lifted
    number) bound to a host place: an output of the program, put there after
    each run (returned.py)."""
    return not w.in_place and isinstance(w.after, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _holds_traced(value, depth: int = 0) -> bool:
    """A tensor or a number the program computes (a .item() of one)."""
    if isinstance(value, torch.Tensor):
        return is_traced(value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if depth > 4 or value is MISSING:
        return False
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_traced(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(_holds_traced(v, depth + 1) for v in value.values())
    if isinstance(value, torch.nn.Module):
        return any(_holds_traced(t) for t in [*value._parameters.values(),
                                              *value._buffers.values()] if t is not None) \
            or _holds_traced(vars(value), depth + 1)
    if hasattr(value, "__dict__") and not isinstance(
            value, (type, types.ModuleType, types.FunctionType, types.MethodType)):
        return _holds_traced(vars(value), depth + 1)
    return False


@contextlib.contextmanager
def host_state_recorded(state: HostState):
    """Record while the step runs; on a failure, undo what it wrote."""
    with recording(state.recorder):
        try:
            yield state
        except BaseException:
            state.abandon()
            raise


def refuse_repeated(step_fn, first: list[Write], again: list[Write]) -> TranspileError:
    """The error for a step that writes the host again when traced from the
    state its first trace left."""
    w = again[0]
    before = next((f for f in first if f.holder is w.holder and f.key == w.key), None)
    return TranspileError(
        f"{step_name(step_fn)} changes host-side state on every call: "
        f"{(before or w).describe()}"
        + (f", then {w.change()}" if before is not None else "")
        + (f" (and {len(again) - 1} more)" if len(again) > 1 else "")
        + ". The program runs without the step's Python, so such a change would happen "
        "once, while the step is traced, and never again: change such values outside the step; "
        "keep a counter or a value forward computes in a tensor buffer (register_buffer) "
        "that the step updates, or return it from the step")


def _shown_key(key) -> str:
    return repr(key) if snapshot(key) is not MISSING else f"a {type(key).__name__}"
