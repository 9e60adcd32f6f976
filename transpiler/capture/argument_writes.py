"""What the step writes into the containers among its arguments.

The trace calls the step with its arguments rebuilt around the traced inputs
(arguments.py): new lists, dicts and dataclass objects, so that a write into
one never reaches the caller's. The program runs without the step's Python,
so such a write would be lost on every call, silently. Each container is
compared after the traced step with what it held before:

- a dict key (or a dataclass field) the step set to a tensor (ultralytics'
  `batch['img'] = batch['img'].float() / 255`) is an output of the program,
  written into the same place of the call's own arguments after every run
  (ArgumentSlot), as the step would;
- a dict key the step removed (transformers' `labels = inputs.pop("labels")`)
  is removed from the call's own dict after every run (KeyRemoved);
- a tensor argument the step makes require a gradient (StyleGAN2's R1 penalty:
  `real_img.requires_grad = True`) requires one after every run, with the
  .grad the step's backward() left on it, a program output (GradEnabled);
- a number the step computed and set there (`state['step'] += 1` with the
  counter lifted, `state.loss = loss.item()`) is an output of the program, set
  in the call's own container after every run (ArgumentNumber); a number it
  advances from the one it read (a counter in a dict or a dataclass among the
  arguments) is lifted first (CountersInArguments: numbers.py), so that the
  program computes it from its input;
- any other change (an item appended to a list, a host value stored) is
  refused, naming the argument and the change: the program cannot compute
  host values.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, Iterator

import torch

from ..errors import TranspileError
from .numbers import is_number
from .reads import MISSING, shown
from .scaler import GradScaler
from .slots import misfit_in, not_a_tensor
from .user_code import step_name

# Containers whose items the program cannot set: any change to one is refused.
_SEQUENCES = (list, collections.deque, set)
# (kind, key) steps from the arguments' root to a container
Path = tuple[tuple[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class Written:
    """A place in a container of the step's arguments: container[key] (an
    attribute for a dataclass), the container at `path`."""

    path: Path
    key: Any
    field: bool   # a dataclass field (setattr), not an item

    @property
    def name(self) -> str:
        return _name(self.path) + (f".{self.key}" if self.field else f"[{self.key!r}]")

    def container(self):
        """The container in the running call's arguments."""
        container = _CALL.get().root
        for kind, key in self.path:
            container = getattr(container, key) if kind == "field" else container[key]
        return container


@dataclasses.dataclass(frozen=True)
class ArgumentNumber:
    """A symbolic number the step set in a container of its arguments: an
    output of the program (returned.py), set in the running call's own."""

    written: Written
    after: Any   # the trace's symbolic number

    def put_back(self, value) -> None:
        _put(self.written, value)


class CountersInArguments(TranspileError):
    """The step advances numbers it read in its arguments' containers (a
    counter in a dict or a dataclass): trace again with them lifted."""

    def __init__(self, written: list[Written], refusal: TranspileError):
        super().__init__(str(refusal))
        self.written, self.refusal = written, refusal


@dataclasses.dataclass(frozen=True)
class KeyRemoved:
    """A dict key the step removed from its arguments."""

    written: Written

    def apply(self) -> None:
        """The key removed from the running call's dict, as the step removed it."""
        self.written.container().pop(self.written.key, None)


@dataclasses.dataclass(frozen=True)
class GradEnabled:
    """A tensor argument (leaf `leaf`) the step made require a gradient."""

    leaf: int
    name: str

    def tensor(self) -> torch.Tensor:
        return _CALL.get().leaves[self.leaf]

    def apply(self) -> None:
        self.tensor().requires_grad_(True)


def _leaf_object(value) -> bool:
    return isinstance(value, (torch.nn.Module, torch.optim.Optimizer, GradScaler, torch.Tensor))


def containers(values: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every mutable container in the arguments (dicts, Mappings, lists,
    deques, sets, dataclass objects), with its path, outermost first."""
    if _leaf_object(values) or isinstance(values, (str, bytes)):
        return
    if isinstance(values, (dict, Mapping)):
        yield path, values
        for k, v in list(values.items()):
            yield from containers(v, path + (("item", k),))
    elif isinstance(values, set):   # a pytree leaf: the caller's own set
        yield path, values
    elif isinstance(values, (list, tuple, collections.deque)):
        if not isinstance(values, tuple):
            yield path, values
            values = list(values) if isinstance(values, collections.deque) \
                else list.copy(values)   # not its own iteration (micro.Rolled records that)
        for i, v in enumerate(values):
            yield from containers(v, path + (("item", i),))
    elif dataclasses.is_dataclass(values) and not isinstance(values, type):
        yield path, values
        for f in dataclasses.fields(values):
            yield from containers(getattr(values, f.name, None), path + (("field", f.name),))


def _items(container) -> dict:
    if isinstance(container, (dict, Mapping)):
        return dict(container.items())
    if isinstance(container, list):
        return dict(enumerate(list.copy(container)))
    if isinstance(container, collections.deque):
        return dict(enumerate(container))
    if isinstance(container, set):
        return dict.fromkeys(container, True)
    return {f.name: getattr(container, f.name, MISSING) for f in dataclasses.fields(container)}


def snapshot(values) -> list[tuple[Path, Any, dict]]:
    """What each container of the arguments holds (its items, shallow)."""
    return [(path, c, _items(c)) for path, c in containers(values)]


@dataclasses.dataclass
class ArgumentChanges:
    """What the traced step changed in its arguments' containers."""

    set: list[tuple[Written, torch.Tensor]] = dataclasses.field(default_factory=list)
    numbers: list[ArgumentNumber] = dataclasses.field(default_factory=list)
    # done to the call's arguments after each run: KeyRemoved, GradEnabled
    edits: list = dataclasses.field(default_factory=list)
    grads: list[tuple[GradEnabled, torch.Tensor]] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.set or self.edits)

    def grad_enabled(self, leaf: int, name: str, traced: torch.Tensor, real: torch.Tensor):
        """A tensor argument whose stand-in `traced` requires a gradient after
        the step: where `real` did not, it does after every run; either way
        the .grad the step's backward() leaves on it is an output, accumulated
        into the call's tensor as backward() accumulates (an input the caller
        made require a gradient for a saliency map or an adversarial step)."""
        if not traced.requires_grad:
            return
        enabled = GradEnabled(leaf, name)
        if not real.requires_grad:
            self.edits.append(enabled)
        if traced.grad is not None:
            self.grads.append((enabled, traced.grad))


def changes(step_fn, before: list[tuple[Path, Any, dict]], traced: Any,
            into: ArgumentChanges) -> None:
    """Add to `into` the tensors and symbolic numbers the traced step set in
    the containers of its arguments (`before`: their snapshot), each with its
    value, and the dict keys it removed; raise CountersInArguments for the
    numbers it advanced from those it read, and a TranspileError on any other
    change. `traced(t)`: whether t is a tensor the trace computes."""
    counters: list[Written] = []
    refusal = None   # what a counter that cannot be lifted is refused with
    for path, container, old in before:
        new = _items(container)
        is_dict = isinstance(container, (dict, Mapping))
        removed = [k for k in old if k not in new]
        changed = [k for k in new if old.get(k, MISSING) is not new[k]]
        if not removed and not changed:
            continue
        kinds = {k: _kind(old.get(k, MISSING), new[k], traced) for k in changed}
        if isinstance(container, _SEQUENCES) or (removed and not is_dict) \
                or None in kinds.values():
            error = _refused(step_fn, path, container, old, new, removed, changed)
            if isinstance(container, set):   # the caller's own: as it was
                container.clear()
                container.update(old)
            raise error
        into.set += [(Written(path, k, not is_dict), new[k]) for k in changed
                     if kinds[k] is _Set.TENSOR]
        into.numbers += [ArgumentNumber(Written(path, k, not is_dict), new[k]) for k in changed
                         if kinds[k] is _Set.NUMBER]
        advanced = [k for k in changed if kinds[k] is _Set.COUNTER]
        if advanced and refusal is None:
            refusal = _refused(step_fn, path, container, old, new, [], advanced)
        counters += [Written(path, k, not is_dict) for k in advanced]
        into.edits += [KeyRemoved(Written(path, k, False)) for k in removed]
    if counters:
        raise CountersInArguments(counters, refusal)


class _Set(enum.Enum):
    """What the step set at a place of its arguments' containers."""
    TENSOR = "a tensor it computed"
    NUMBER = "a symbolic number"
    COUNTER = "a number advanced from the number it read"


def _kind(old, new, traced) -> _Set | None:
    """What the step set; None: anything else (refused)."""
    if isinstance(new, torch.Tensor) and traced(new):
        return _Set.TENSOR
    if isinstance(new, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _Set.NUMBER
    if is_number(old) and is_number(new):
        return _Set.COUNTER
    return None


def _refused(step_fn, path, container, old, new, removed, changed) -> TranspileError:
    return TranspileError(
        f"{step_name(step_fn)} changes its argument {_name(path)} "
        f"({_change(container, old, new, removed, changed)}): the program runs "
        "without the step's Python, so the change would be made once, when the step "
        "is traced, and never again. Return the value from the step instead (any "
        "pytree of tensors), or change the argument outside the step")


def _change(container, old: dict, new: dict, removed: list, changed: list) -> str:
    what = type(container).__name__
    if isinstance(container, _SEQUENCES):
        return f"a {what} of {len(old)} items, now {len(new)}"
    if removed:
        return f"a {what}: {removed[0]!r} removed"
    k = next((k for k in changed if not isinstance(new[k], torch.Tensor)), changed[0])
    return f"a {what}: {k!r} {shown(old.get(k, MISSING))} -> {shown(new[k])}"


def _name(path: Path) -> str:
    if not path:
        return "(the arguments)"
    (_, first), rest = path[0], path[1:]
    if isinstance(first, int):   # a positional argument without a name
        text = f"#{first}"
    else:
        text = repr(first).strip("'")
    for kind, key in rest:
        text += f".{key}" if kind == "field" else f"[{key!r}]"
    return repr(text)


def _put(written: Written, value) -> None:
    """value set at a place of the running call's own arguments."""
    container = written.container()
    if written.field:   # a frozen dataclass's field the step set with object.__setattr__
        frozen = dataclasses.is_dataclass(container) and container.__dataclass_params__.frozen
        (object.__setattr__ if frozen else setattr)(container, written.key, value)
    else:
        container[written.key] = value


# The arguments of the call whose program is running: where ArgumentSlot and GradSlot write.
_CALL: contextvars.ContextVar = contextvars.ContextVar("arguments of the running call")


@contextlib.contextmanager
def arguments_of(step_args):
    """While a call's programs run and write back: its arguments (StepArgs)."""
    token = _CALL.set(step_args)
    try:
        yield
    finally:
        _CALL.reset(token)


@dataclasses.dataclass(frozen=True)
class ArgumentSlot:
    """Where the step set a tensor in a container of its arguments: the
    program's output is set there, in the running call's own arguments."""

    written: Written

    def misfit(self, value) -> str | None:
        return not_a_tensor(value)

    def write(self, value):
        _put(self.written, value)

    def mirror(self, memo: dict):
        return None   # the eager step's copy sets its own


@dataclasses.dataclass(frozen=True)
class ArgumentGradSlot:
    """The .grad the step leaves on a tensor argument it made require one."""

    enabled: GradEnabled

    def misfit(self, value) -> str | None:
        return not_a_tensor(value)

    def write(self, value):
        tensor = self.enabled.tensor()
        tensor.requires_grad_(True)
        if tensor.grad is not None and misfit_in(tensor.grad, value) is None:
            tensor.grad.add_(value)   # as backward() accumulates into it
        else:
            tensor.grad = value

    def mirror(self, memo: dict):
        return None   # the eager step's copy sets its own
