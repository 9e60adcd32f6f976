"""The step's arguments, flattened into leaves: modules, optimizers and
GradScalers are leaves, tensors are the batch."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from .argument_writes import ArgumentChanges, changes, snapshot
from .reads import is_traced
from .scaler import GradScaler


@dataclasses.dataclass
class StepArgs:
    """The step's arguments, flattened: modules and optimizers are leaves."""

    names: list[str]       # a readable name per leaf
    leaves: list[Any]
    spec: pytree.TreeSpec
    bound: inspect.BoundArguments | None
    # Leaves that are Python numbers fed as program inputs (numbers.py); the
    # trace drops those it cannot lift.
    lifted: frozenset[int] = frozenset()
    # Places outside the arguments (reads.place_key) whose numbers are fed as
    # program inputs (numbers.py), and the input's name -> its place, as the
    # last trace lifted them; the trace drops those it cannot lift.
    lift_places: frozenset[tuple] = frozenset()
    places_lifted: dict[str, tuple] = dataclasses.field(default_factory=dict)
    # Places (reads.place_key) of lists and deques the step appends values it
    # computes to: traced taking appends only (appended.py)
    append_places: frozenset[tuple] = frozenset()
    # ... and of those it also reads: each is a container as any other, and
    # appending the program's values there is refused with this read's error
    append_read: dict[tuple, Exception] = dataclasses.field(default_factory=dict)
    # Names of the integers the step draws on the host (host_random.py) that the
    # trace takes as constants, each guarded by its value: set when a trace with
    # them symbolic failed (one used as a size)
    constant_draws: frozenset[str] = frozenset()
    # Leaf index -> the dimensions of that batch tensor traced as symbols (shapes.py).
    dynamic: dict[int, frozenset[int]] = dataclasses.field(default_factory=dict)
    # (name, object) of the modules, optimizers and GradScalers the step
    # reaches outside its arguments (found.py), read again for this call
    found: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    # argument name (or position) -> the caller's value: where the program
    # sets what the step set in the arguments' containers (argument_writes.py)
    root: dict = dataclasses.field(default_factory=dict)
    # Whether the trace marks the tensor values the step's code prints
    # (text_values.py); off once a trace with marks failed, for this call
    values_in_text: bool = True

    @property
    def modules(self) -> list[torch.nn.Module]:
        return _unique(x for x in self._objects() if isinstance(x, torch.nn.Module))

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return _unique(x for x in self._objects() if isinstance(x, torch.optim.Optimizer))

    @property
    def scalers(self) -> list[GradScaler]:
        return _unique(x for x in self._objects() if isinstance(x, GradScaler))

    def _objects(self):
        yield from self.leaves
        for _, value in self.found:
            yield value

    def call(self, step_fn, leaves, writes: ArgumentChanges | None = None):
        """step_fn on the arguments rebuilt around `leaves`. With `writes`
        (while traced): what the step changed in their containers is added to
        it, a change no program can make refused (argument_writes.py)."""
        values = pytree.tree_unflatten(leaves, self.spec)
        if self.bound is None:
            args, kwargs = values
            before = snapshot(_root(args, kwargs)) if writes is not None else None
            result = step_fn(*args, **kwargs)
        else:
            for name, value in zip(self.bound.arguments, values):
                self.bound.arguments[name] = value
            before = snapshot(dict(self.bound.arguments)) if writes is not None else None
            result = step_fn(*self.bound.args, **self.bound.kwargs)
        if writes is not None:
            changes(step_fn, before, is_traced, writes)
        return result


def _root(args: tuple, kwargs: dict) -> dict:
    return {**dict(enumerate(args)), **kwargs}


def leaf_index(step_args: StepArgs, written) -> int | None:
    """The index among the leaves of the value at a place of the arguments'
    containers (argument_writes.Written), or None where it is no leaf: the
    arguments rebuilt with each leaf's index in its place, walked to it."""
    values = pytree.tree_unflatten(list(range(len(step_args.leaves))), step_args.spec)
    container = dict(zip(step_args.bound.arguments, values)) if step_args.bound is not None \
        else _root(*values)
    try:
        for kind, key in [*written.path, ("field" if written.field else "item", written.key)]:
            container = getattr(container, key) if kind == "field" else container[key]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None
    return container if type(container) is int else None


def is_leaf(x) -> bool:
    """Modules, optimizers and GradScalers are leaves; a container pytree does
    not know yet (a dataclass, a Mapping such as transformers' BatchEncoding)
    is made known to it, so that its tensors are inputs like a dict's."""
    if isinstance(x, (torch.nn.Module, torch.optim.Optimizer, GradScaler)):
        return True
    if type(x) not in pytree.SUPPORTED_NODES:
        _register_container(type(x))
    return False


def _register_container(cls: type) -> None:
    if dataclasses.is_dataclass(cls):
        pytree.register_dataclass(cls)
    elif issubclass(cls, Mapping):
        pytree.register_pytree_node(cls, _flatten_mapping,
                                    lambda values, keys: cls(dict(zip(keys, values))))


def _flatten_mapping(mapping: Mapping) -> tuple[list, tuple]:
    keys = tuple(mapping.keys())
    return [mapping[k] for k in keys], keys


def signature_of(step_fn) -> inspect.Signature | None:
    """The step's parameters, read once per transpiled step (None for a
    callable inspect cannot read: its arguments are then named by position)."""
    try:
        return inspect.signature(step_fn)
    except (TypeError, ValueError):
        return None


def flatten_args(step_fn, args, kwargs, parameters=...) -> StepArgs:
    """The call's arguments as leaves; `parameters`: signature_of(step_fn),
    when the caller keeps it (read here where not given)."""
    if parameters is ...:
        parameters = signature_of(step_fn)
    try:
        bound = parameters.bind(*args, **kwargs) if parameters is not None else None
    except TypeError:
        bound = None
    if bound is None:
        leaves, spec = pytree.tree_flatten((args, kwargs), is_leaf=is_leaf)
        return StepArgs([f"arg{i}" for i in range(len(leaves))], leaves, spec, None,
                        root=_root(args, kwargs))
    leaves, spec = pytree.tree_flatten(list(bound.arguments.values()), is_leaf=is_leaf)
    names = []
    for name, arg_spec in zip(bound.arguments, spec.children()):
        n = arg_spec.num_leaves
        names += [name] if n == 1 else [f"{name}_{i}" for i in range(n)]
    return StepArgs(names, leaves, spec, bound, root=dict(bound.arguments))


def _unique(items):
    seen, out = set(), []
    for x in items:
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out

