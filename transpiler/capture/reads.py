"""Reads and writes of host objects, observed while the step is traced.

A trace bakes into the program every plain Python value the step reads: a
module's float attribute, a config's field, a global, a closure cell. So each
read is recorded where it was found and becomes a guard (guards.py). Reads are
observed, not guessed from the code: for the duration of the trace the classes
of the objects the step reaches read and write through recording methods
(installed on the class and removed after, so instances keep their type), and
every attribute the traced Python reads from a reached object, at any depth and
whoever reads it (the step, a module's forward, torch's own code, a property),
is recorded with its value as read. An object is reached when it is a root (the
step's modules, an argument that is an object, the self of a bound-method step,
a callable step object, a partial's arguments) or was read from a reached place
(an attribute, a global, a closure cell, an item of a container read). Reads
through a class are not observable: a user's class reached has the values of
its attributes recorded (methods and other descriptors left out). The
globals and closure cells of every function reached (one read as a value, a
method of a reached object, a hook) are recorded from the names its code loads.

What is read decides the guard: a plain value is compared by value (a float or
int whose value changed since an earlier trace is instead read from a program
input filled through its place, numbers.py: its type is guarded), an object
by identity (and its own reads are recorded), a container item by item; a
tensor (or numpy array) found on such a path is put back by a traced stand-in,
a program input read through the same path on every call (`stand_in`, given by
trace.py) and guarded by its layout. Writes to reached objects are recorded
too, through __setattr__ and, by comparing each one's __dict__ after the trace,
straight into it (functools.cached_property); finish() reports them
(host_state.py decides what is kept). Module hooks
the step runs are recorded in a HookGuard. Code of torch, of the standard
library, of numpy and of this package is not walked for globals: they do not
change (torch's global module hooks are recorded explicitly). Every read of
an environment variable (os.environ's __getitem__, which os.getenv, .get and
`in` go through) is recorded too, as a guard on its value or its absence.
"""

from __future__ import annotations

import collections
import dataclasses
import dis
import enum
import functools
import logging
import os
import sys
import threading
import types
from typing import Any, Callable

import torch
from torch.optim import optimizer as torch_optimizer

from .argument_objects import (EVERY_ATTRIBUTE, ArgumentLeaves, InPlace, instance_dict,
                               read_in_place, stores, traced_arguments)
from .host_arithmetic import NumberFunction, traced_isinstance
from .numbers import is_number
from ..errors import TranspileError
from .user_code import is_library, user_line
from .guards import (CONTAINERS, LARGE, MISSING, Check, Guard, Guards, HookGuard, contents,
                     restore, saved, show, snapshot)

_ACTIVE: list = [None]   # the Recorder of the trace in progress
_RECORDING = "_transpiler_records"   # marks the methods installed on a class
# marks a method the trace installs on an object of the step for the trace
# alone (markers.py's zero_grad): a read of it is not the step's
TRACE_ONLY = "_transpiler_trace_only"

# torch.nn.Module's own attributes: its parameters, buffers and submodules
# (their layout is the signature's, capture/signature.py), its hooks (a
# HookGuard) and its other bookkeeping, which no forward reads.
MODULE_BOOKKEEPING = (frozenset(vars(torch.nn.Module())) - {"training"}) | {"_compiled_call_impl"}
_MODULE_MEMBERS = ("_parameters", "_buffers", "_modules")
_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                 "_backward_pre_hooks")
_OPTIMIZER_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks",
                 "_global_backward_hooks", "_global_backward_pre_hooks")

def _library_class(cls: type) -> bool:
    """Whether a class is not the user's (a script's or a notebook's __main__ is)."""
    if cls.__module__ == "__main__":
        return False
    return is_library(getattr(sys.modules.get(cls.__module__), "__file__", None) or "")


def _users(hook) -> bool:
    """Whether a hook is the user's code (not torch's, not this package's own:
    those the trace registers to follow the optimizer's step)."""
    code = getattr(getattr(hook, "__func__", hook), "__code__", None)
    return code is not None and not is_library(code.co_filename)


def _not_reached_into() -> tuple[type, ...]:
    """Objects whose reads are not recorded: tensors and arrays (inputs or
    constants), optimizers, schedulers and GradScalers (their values are the
    signature's and inputs), logging's objects (their caches change as they
    log), exceptions."""
    numpy = sys.modules.get("numpy")
    return (torch.Tensor, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
            torch.amp.GradScaler, logging.Logger, logging.Handler, logging.Manager, BaseException,
            type, types.ModuleType) + ((numpy.ndarray, numpy.random.RandomState,
                                        numpy.random.Generator) if numpy else ())


# ----- places a value is read from: a dict, or one of these accessors --------


class Cell:
    """A closure cell, read like a dict of one entry."""

    __slots__ = ("cell",)

    def __init__(self, cell):
        self.cell = cell

    def get(self, key, default=None):
        try:
            return self.cell.cell_contents
        except ValueError:   # an empty cell
            return default

    def put(self, key, value) -> None:
        if value is MISSING:
            del self.cell.cell_contents
        else:
            self.cell.cell_contents = value


class Attr:
    """An attribute computed by its object (a slot, a custom __getattr__),
    read again with getattr."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def get(self, key, default=None):
        try:
            return getattr(self.obj, key)
        except AttributeError:
            return default

    def put(self, key, value) -> None:
        if value is MISSING:
            object.__delattr__(self.obj, key)
        else:
            object.__setattr__(self.obj, key, value)

    def shadows(self, key) -> bool:
        """Whether put(key, value) would shadow a computed attribute (stores())."""
        return not stores(self.obj, key)


class Defaults:
    """A function's default argument values by position."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def get(self, key, default=None):
        defaults = self.fn.__defaults__ or ()
        return defaults[key] if key < len(defaults) else default

    def put(self, key, value) -> None:
        defaults = list(self.fn.__defaults__)
        defaults[key] = value
        self.fn.__defaults__ = tuple(defaults)


class Items:
    """A list's or a tuple's items by index."""

    __slots__ = ("seq",)

    def __init__(self, seq):
        self.seq = seq

    def get(self, key, default=None):
        return self.seq[key] if -len(self.seq) <= key < len(self.seq) else default

    def put(self, key, value) -> None:
        self.seq[key] = value


class ClassAttrs:
    """A class's own namespace (a class attribute read through an instance)."""

    __slots__ = ("cls",)

    def __init__(self, cls):
        self.cls = cls

    @property
    def mapping(self):
        return self.cls.__dict__

    def get(self, key, default=None):
        return self.cls.__dict__.get(key, default)

    def put(self, key, value) -> None:
        if value is MISSING:
            type.__delattr__(self.cls, key)
        else:
            type.__setattr__(self.cls, key, value)


def put(holder, key, value) -> None:
    """Write (or, with MISSING, delete) holder[key]."""
    if isinstance(holder, (dict, os._Environ)):
        if value is MISSING:
            holder.pop(key, None)
        else:
            holder[key] = value
    else:
        holder.put(key, value)


_BEHIND = {Cell: lambda h: h.cell, Attr: lambda h: h.obj, Defaults: lambda h: h.fn,
           Items: lambda h: h.seq, ClassAttrs: lambda h: h.cls}


def place_key(holder, key) -> tuple:
    """holder[key] identified across traces (where a number is lifted,
    numbers.py): an argument's object by its place among the arguments,
    anything else by the object it is read from."""
    if isinstance(holder, InPlace):
        return (InPlace, holder.leaf, holder.path, holder.computed, key)
    behind = _BEHIND.get(type(holder))
    return (type(holder), id(holder if behind is None else behind(holder)), key)


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a tensor the step reads outside its arguments is found: holder[key],
    then the items `path` of the containers in it. Read again on every call."""

    holder: Any
    key: Any
    path: tuple = ()

    def read(self):
        value = self.holder.get(self.key, MISSING)
        for k in self.path:
            value = value[k]
        return value


@dataclasses.dataclass(eq=False)
class Write:
    """A value the traced step changed on the host: holder[key] rebound from
    `before` to `after` (MISSING: absent), or, `in_place`, a container at
    holder[key] changed in place, `before` and `after` its saved() items."""

    name: str
    holder: Any
    key: Any
    before: Any
    after: Any
    in_place: bool = False
    # an attribute its object's __getattr__ computes, changed by writes elsewhere
    # (into the dict it reads from): those writes undo and redo it; putting a
    # value in its place would shadow it
    derived: bool = False

    def undo(self) -> None:
        if self.derived:
            return
        restore(self.before) if self.in_place else put(self.holder, self.key, self.before)

    def redo(self) -> None:
        if self.derived:
            return
        restore(self.after) if self.in_place else put(self.holder, self.key, self.after)

    def put_back(self, value) -> None:
        """A run's value of what the step wrote (returned.py: a number it computed)."""
        put(self.holder, self.key, value)

    def values(self) -> tuple[Any, Any]:
        if self.in_place:
            return self.before[0][1], self.after[0][1]
        return self.before, self.after

    def changes(self) -> bool:
        """Whether it changes a value (not only rebinds it to an equal one)."""
        before, after = self.values()
        if before is after:
            return False
        if MISSING in (before, after) or isinstance(after, torch.Tensor):
            return True
        return contents(before) != contents(after)

    def change(self) -> str:
        before, after = self.values()
        return f"{shown(before)} -> {shown(after)}"

    def describe(self) -> str:
        return f"{self.name} {self.change()}"

    @property
    def assigns_traced_tensor(self) -> bool:
        """A tensor the step computed, assigned to the host (self.aux = loss)."""
        return not self.in_place and isinstance(self.after, torch.Tensor) and is_traced(self.after)


def _computed(holder, key) -> bool:
    """Whether holder[key] is an attribute its object's __getattr__ computes
    (it stores no such attribute itself)."""
    return isinstance(holder, (Attr, InPlace)) and holder.shadows(key)


def shown(value) -> str:
    """How a written value is shown: a tensor by its layout, a number the
    program computes (a `.item()`) as such, in a container too."""
    if value is MISSING:
        return "absent"
    if isinstance(value, torch.Tensor):
        return f"a tensor {str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return "<a tensor's value>"
    if type(value) in (list, tuple) and any(
            isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) for v in value):
        items = ", ".join(shown(v) for v in value[-3:])
        return f"[{'..., ' if len(value) > 3 else ''}{items}]"
    return show(value)


def is_traced(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor) or torch._is_functional_tensor(t)


@dataclasses.dataclass(eq=False)
class _Swap:
    """A tensor put back by its stand-in for the trace."""

    name: str
    holder: Any
    key: Any
    real: Any
    stand: Any
    shadow: bool   # the stand-in shadows a computed attribute: deleted, not replaced

    @property
    def restored(self):
        """What puts the real value back."""
        return MISSING if self.shadow else self.real


# ----- the recording methods installed on classes ---------------------------


def _active():
    """The recorder, where this read is the step's: one is recording, not
    inside its own reads, and on the thread that traces (the methods are the
    class's: another thread's reads, a loader's, are its own)."""
    rec = _ACTIVE[0]
    return rec if rec is not None and rec.live and rec.thread == threading.get_ident() else None


def _getattribute(original):
    def __getattribute__(self, name):
        rec = _active()
        if rec is None:
            return original(self, name)
        try:
            value = original(self, name)
        except AttributeError:
            if not hasattr(type(self), "__getattr__"):
                rec.missing(self, name)
            raise
        return rec.attribute(self, name, value)
    setattr(__getattribute__, _RECORDING, True)
    return __getattribute__


def _getattr(original):
    def __getattr__(self, name):
        rec = _active()
        if rec is None:
            return original(self, name)
        rec.live = False   # what the object does to find it is not the step's read
        try:
            value = original(self, name)
        except AttributeError:
            rec.live = True
            rec.missing(self, name)
            raise
        finally:
            rec.live = True
        return rec.computed(self, name, value)
    setattr(__getattr__, _RECORDING, True)
    return __getattr__


def _users_setter(cls: type, name: str, original) -> bool:
    """Whether setting `name` on an object of `cls` runs the user's code: a
    __setattr__ of theirs, or a property (a data descriptor) with their setter.
    What that code reads and writes is the step's, observed as the step's own."""
    if _users(original):
        return True
    found = next((vars(c)[name] for c in cls.__mro__ if name in vars(c)), None)
    setter = getattr(found, "fset", None) or getattr(type(found), "__set__", None)
    return setter is not None and _users(setter)


def _setattr(original):
    def __setattr__(self, name, value):
        rec = _active()
        if rec is None or id(self) not in rec.known or _users_setter(type(self), name, original):
            return original(self, name, value)
        holder, before = rec.before_write(self, name)
        rec.live = False
        try:
            original(self, name, value)
        finally:
            rec.live = True
        rec.wrote(self, holder, name, before)
    setattr(__setattr__, _RECORDING, True)
    return __setattr__


def _delattr(original):
    def __delattr__(self, name):
        rec = _active()
        if rec is None or id(self) not in rec.known:
            return original(self, name)
        holder, before = rec.before_write(self, name)
        rec.live = False
        try:
            original(self, name)
        finally:
            rec.live = True
        rec.wrote(self, holder, name, before)
    setattr(__delattr__, _RECORDING, True)
    return __delattr__


_WRAPPERS = (("__getattribute__", _getattribute), ("__getattr__", _getattr),
             ("__setattr__", _setattr), ("__delattr__", _delattr))


class _Patches:
    """The recording methods installed on classes, removed by restore()."""

    def __init__(self):
        self._installed: list[tuple[type, str, Any]] = []
        self._done: dict[type, bool] = {}
        self._modules: list[tuple[types.ModuleType, type]] = []

    def ensure(self, cls: type) -> bool:
        """Make instances of cls record; False where the class cannot be
        changed (a builtin or extension type)."""
        ok = self._done.get(cls)
        if ok is not None:
            return ok
        installed = []
        try:
            for name, make in _WRAPPERS:
                current = getattr(cls, name, None)
                if current is None or getattr(current, _RECORDING, False):
                    continue
                entry = cls.__dict__.get(name, MISSING)
                type.__setattr__(cls, name, make(current))
                installed.append((cls, name, entry))
            ok = True
        except (TypeError, AttributeError):
            for c, n, entry in reversed(installed):
                _reset(c, n, entry)
            installed, ok = [], False
        self._installed += installed
        self._done[cls] = ok
        return ok

    def module(self, module: types.ModuleType) -> None:
        """Make a module object record: its class becomes a recording subclass
        (a module's class may be changed to any subclass of ModuleType)."""
        cls = type(module)
        recording = _MODULE_CLASSES.get(cls)
        if recording is None:
            recording = _MODULE_CLASSES[cls] = type(cls.__name__, (cls,), {
                name: make(getattr(cls, name)) for name, make in _WRAPPERS
                if name != "__getattr__" or hasattr(cls, name)})
        module.__class__ = recording
        self._modules.append((module, cls))

    def restore(self) -> None:
        for cls, name, entry in reversed(self._installed):
            _reset(cls, name, entry)
        self._installed.clear()
        for module, cls in reversed(self._modules):
            module.__class__ = cls
        self._modules.clear()


# A recording subclass per class of module objects (made once).
_MODULE_CLASSES: dict[type, type] = {}


def _reset(cls, name, entry) -> None:
    if entry is MISSING:
        type.__delattr__(cls, name)
    else:
        type.__setattr__(cls, name, entry)


@functools.lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> frozenset[str]:
    """The names the code (and the code nested in it) loads or stores as globals."""
    names = {ins.argval for ins in dis.get_instructions(code)
             if ins.opname in ("LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return frozenset(names)


# ----- the recorder ----------------------------------------------------------


# Reads of an object that take all its attributes (vars(), copy.copy, pickle).
_WHOLE_READS = frozenset({"__dict__", "__getstate__"})


class Recorder:
    """What one trace reads and writes on the host."""

    def __init__(self, stand_in: Callable[[Any, str, Place], Any],
                 argument_modules: set[int], lift: frozenset = frozenset(),
                 number_stand_in: Callable[[Any, str, Place, tuple], Any] | None = None):
        self.stand_in = stand_in
        self.thread = threading.get_ident()   # the thread whose reads are the step's
        # places (place_key) whose numbers the trace reads from a program input
        # (numbers.py), and what gives it the symbolic number it reads there
        self.lift, self.number_stand_in = lift, number_stand_in
        self.argument_modules = argument_modules   # ids of the step's modules and submodules
        self.known: dict[int, tuple[Any, str]] = {}   # reached objects: id -> (object, name)
        self.guards: dict[tuple[int, Any], Guard] = {}
        self.hooks = HookGuard()
        self.swaps: list[_Swap] = []
        self.writes: dict[tuple[int, Any], Write] = {}
        self.live = True
        # what the trace gives the step in place of an object whose state lives in C
        # (a numpy generator: host_random.py; an iterator: host_iterators.py; a
        # file: printed.py): each returns its stand-in for (value, name), or None
        self.stand_ins: list[Callable[[Any, str], Any]] = []
        # places (place_key) of lists and deques the step appends values it
        # computes to, and what stands in for one there (appended.py)
        self.append_places: frozenset = frozenset()
        self.append_read: dict = {}   # place -> the read that made it a plain container again
        self.append_only: Callable[[Any, str, tuple], Any] | None = None
        self.appending: list = []
        self._read: set[tuple[int, str]] = set()   # (object, attribute) recorded
        self._scanned: set[int] = set()            # functions whose globals are recorded
        self._cells: dict[int, Cell] = {}
        self._patches = _Patches()
        self._classes: dict[tuple[type, str], Any] = {}
        self._class_holders: dict[type, ClassAttrs] = {}
        self._not_reached = _not_reached_into()
        # objects read in place (argument_objects.py): id -> (argument leaf, attribute path)
        self.arguments = traced_arguments()
        self._in_place: dict[int, tuple[int, tuple]] = {}
        self._pinned: dict[int, Guard] = {}   # arguments guarded by identity after all
        # each reached object's __dict__ as it was reached: a write straight into
        # it (functools.cached_property, vars(obj)[k] = v) passes no __setattr__
        self._dicts: dict[int, dict] = {}
        # ... and the namespace of each user's class of an object reached
        self._class_dicts: dict[int, tuple[type, dict]] = {}
        module_globals = vars(torch.nn.modules.module)
        for name in _GLOBAL_HOOKS:
            hooks = module_globals[name]
            self.hooks.add(f"torch.nn.modules.module.{name}",
                           functools.partial(module_globals.get, name), hooks)
            for key, hook in hooks.items():
                self.reach(hook, f"{name}[{key}]")
        # the optimizers' global step hooks (which hooks there are is the signature's)
        for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
            for key, hook in vars(torch_optimizer)[name].items():
                if _users(hook):
                    self.reach(hook, f"torch.optim.optimizer.{name}[{key}]")

    # -- roots and reached objects

    def reach(self, value, name: str) -> None:
        """Record what can be read from an object the step reaches (no guard
        on where it came from: that is the caller's)."""
        if value is None or id(value) in self.known or isinstance(value, (str, bytes)):
            return
        if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
            self._function(value, name)
            return
        if isinstance(value, CONTAINERS):
            return
        if isinstance(value, type):   # a user's class: its values (not an enum's constants)
            if not _library_class(value) and not issubclass(value, enum.Enum):
                self.known[id(value)] = (value, name)
                self._class_values(value, name)
            return
        if isinstance(value, types.ModuleType):   # a user's module: its attributes
            if not is_library(getattr(value, "__file__", None) or ""):
                self.known[id(value)] = (value, name)
                self._patches.module(value)
            return
        if isinstance(value, torch.optim.Optimizer):   # not reached into, but its step's hooks
            for attr in _OPTIMIZER_HOOKS:
                for key, hook in getattr(value, attr, {}).items():
                    if _users(hook):
                        self.reach(hook, f"{name}.{attr}[{key}]")
        if isinstance(value, self._not_reached):
            return
        self.known[id(value)] = (value, name)
        for klass in type(value).__mro__:   # written unobserved: `type(self).count += 1`
            if id(klass) not in self._class_dicts and not _library_class(klass):
                self._class_dicts[id(klass)] = (klass, dict(vars(klass)))
        members = instance_dict(value)
        if members is not None:
            self._dicts[id(value)] = dict(members)
        if isinstance(value, torch.nn.Module):
            self._patches.ensure(torch.nn.Module)
            for prefix, sub in value.named_modules():   # what its code reaches through _modules
                if sub is not value:
                    self.reach(sub, f"{name}.{prefix}")
        if self._patches.ensure(type(value)):
            call = getattr(type(value), "__call__", None)
            if isinstance(call, types.FunctionType):
                self._function(call, f"{name}.__call__")
        elif hasattr(value, "__wrapped__"):   # a C wrapper of a function (lru_cache)
            self.reach(value.__wrapped__, name)
        elif instance_dict(value) is not None and not callable(value):
            # reads not observable (a builtin type's instance): all its attributes
            if id(value) in self._in_place:   # a namespace argument: read in place
                holder = self._members(value)
                self._guard(f"{name} (its attributes)", holder, EVERY_ATTRIBUTE, Check.CONTENTS,
                            dict(instance_dict(value)))
                for key, v in list(instance_dict(value).items()):
                    self._items(holder, key, (), v, f"{name}.{key}")
                return
            self._guard(f"{name} (its attributes)", _Vars(value), "vars", Check.CONTENTS,
                        dict(instance_dict(value)))
            for key, v in list(instance_dict(value).items()):
                self.reach(v, f"{name}.{key}")

    def reach_argument(self, leaf: int, value, name: str) -> None:
        """An argument leaf of the step; an object is read in place."""
        if self.arguments is not None and read_in_place(value):
            # another argument too (read through that one), or one whose reads
            # are not recorded (a scheduler: stepped on the host, by identity)
            if id(value) in self.known or isinstance(value, self._not_reached):
                self._pin_leaf(leaf, name)
            else:
                self._in_place[id(value)] = (leaf, ())
        self.reach(value, name)

    def _members(self, obj):
        """Where obj's __dict__ is read: in place for an argument's object."""
        where = self._in_place.get(id(obj))
        return instance_dict(obj) if where is None else self._in_place_holder(obj, where, False)

    def _attrs(self, obj):
        """Where obj's computed attributes are read (getattr)."""
        where = self._in_place.get(id(obj))
        return Attr(obj) if where is None else self._in_place_holder(obj, where, True)

    def _in_place_holder(self, obj, where: tuple, computed: bool) -> InPlace:
        return self.arguments.holder(*where, computed, self.known[id(obj)][1])

    def _pin(self, obj) -> None:
        """Guard by identity the argument an object read in place comes from:
        something the trace keeps depends on the object itself."""
        leaf = self._in_place[id(obj)][0]
        self._pin_leaf(leaf, self.known[id(self.arguments.leaves[leaf])][1])

    def _pin_leaf(self, leaf: int, name: str) -> None:
        if leaf not in self._pinned:
            self._pinned[leaf] = Guard(f"{name} (the same object)", ArgumentLeaves(self.arguments),
                                       leaf, Check.IDENTITY, self.arguments.leaves[leaf])

    def root_module(self, module: torch.nn.Module, name: str) -> None:
        for prefix, sub in module.named_modules():
            self.reach(sub, f"{name}.{prefix}" if prefix else name)

    def _function(self, fn, name: str) -> None:
        """Record the globals and closure cells of a function's code."""
        while True:
            if isinstance(fn, types.MethodType):
                self.reach(fn.__self__, f"{name}.__self__")
                fn = fn.__func__
            elif isinstance(fn, functools.partial):
                self._read_place(_Whole(fn.args), None, fn.args, f"{name} (partial's arguments)")
                self._read_place(_Whole(fn.keywords), None, fn.keywords,
                                 f"{name} (partial's keywords)")
                fn = fn.func
            else:
                break
        if not isinstance(fn, types.FunctionType) or id(fn) in self._scanned \
                or is_library(fn.__code__.co_filename):
            return
        self._scanned.add(id(fn))
        self.known.setdefault(id(fn), (fn, name))   # kept alive: its id is recorded
        module = fn.__globals__.get("__name__", "?")
        for gname in sorted(_global_names(fn.__code__)):
            if gname in fn.__globals__:
                value = fn.__globals__[gname]
                if isinstance(value, types.ModuleType) and is_library(
                        getattr(value, "__file__", None) or "") \
                        or isinstance(value, NumberFunction) or value is traced_isinstance:
                    continue   # (installed for the trace alone: host_arithmetic.py)
                self._read_place(fn.__globals__, gname, value, f"global {gname!r} of {module}",
                                 label=gname)
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            holder = self._cells.setdefault(id(cell), Cell(cell))
            self._read_place(holder, var, holder.get(var, MISSING),
                             f"closure variable {var!r} of {fn.__qualname__}", label=var)
        code = fn.__code__
        names = code.co_varnames[code.co_argcount - len(fn.__defaults__ or ()):code.co_argcount]
        for i, pname in enumerate(names):   # a default the call did not override
            self._read_place(Defaults(fn), i, fn.__defaults__[i],
                             f"default {pname!r} of {fn.__qualname__}", label=pname)
        for pname, value in (fn.__kwdefaults__ or {}).items():
            self._read_place(fn.__kwdefaults__, pname, value,
                             f"default {pname!r} of {fn.__qualname__}", label=pname)

    def _class_values(self, cls: type, name: str) -> None:
        """The values of a user's class (`Config.lr`, a class given as an
        argument, nested config classes): reads through a class are not
        observable, so each of its attributes that is not a method or another
        descriptor is recorded where its MRO finds it, absent from the user's
        classes before that one."""
        users = [k for k in cls.__mro__ if not _library_class(k)]
        found: set[str] = set()
        for i, klass in enumerate(users):
            for attr, value in list(vars(klass).items()):
                if attr in found or (attr[:2] == "__" and attr[-2:] == "__") \
                        or hasattr(type(value), "__get__"):
                    continue
                found.add(attr)
                for before in users[:i]:
                    self._guard(f"{name}.{attr}", self._class_holder(before), attr,
                                Check.ABSENT, MISSING)
                self._read_place(self._class_holder(klass), attr, value, f"{name}.{attr}")

    def _class_holder(self, klass: type) -> ClassAttrs:
        holder = self._class_holders.get(klass)
        if holder is None:
            holder = self._class_holders[klass] = ClassAttrs(klass)
        return holder

    # -- reads

    def attribute(self, obj, name: str, value):
        """An attribute read through __getattribute__: the value the reader gets."""
        known = self.known.get(id(obj))
        if name in _WHOLE_READS and id(obj) in self._in_place:   # vars(batch), a copy: all of it
            self._guard(f"{known[1]} (its attributes)", self._members(obj), EVERY_ATTRIBUTE,
                        Check.CONTENTS, dict(instance_dict(obj)))
        if known is None or (name[:2] == "__" and name[-2:] == "__") \
                or getattr(value, TRACE_ONLY, False):
            return value
        seen = (id(obj), name)
        if seen in self._read:
            return value
        self._read.add(seen)
        self.live = False
        try:
            if isinstance(obj, torch.nn.Module) and name in MODULE_BOOKKEEPING:
                if name in _MODULE_HOOKS:
                    self._module_hooks(obj, name, value, known[1])
                return value
            place = self._place(obj, name)
            if place is None:   # a method or a property: its code is recorded
                self._code_of(obj, name, value, known[1])
                return value
            return self._read_place(*place, value, f"{known[1]}.{name}")
        finally:
            self.live = True

    def computed(self, obj, name: str, value):
        """An attribute an object's __getattr__ computed: a module's parameter,
        buffer or submodule, or any other class's computed attribute."""
        known = self.known.get(id(obj))
        if known is None or (id(obj), name) in self._read:
            return value
        self._read.add((id(obj), name))
        self.live = False
        try:
            if isinstance(obj, torch.nn.Module):
                if id(obj) in self.argument_modules:
                    return value   # traced parameters, buffers and submodules
                members = instance_dict(obj)
                holder = next((members[m] for m in _MODULE_MEMBERS
                               if name in members.get(m, {})), None)
                if holder is None:
                    return value
                return self._read_place(holder, name, value, f"{known[1]}.{name}")
            return self._read_place(self._attrs(obj), name, value, f"{known[1]}.{name}")
        finally:
            self.live = True

    def missing(self, obj, name: str) -> None:
        """A read that found no such attribute (hasattr, getattr with a default)."""
        known = self.known.get(id(obj))
        if known is None or (name[:2] == "__" and name[-2:] == "__") \
                or (id(obj), name) in self._read:
            return
        self._read.add((id(obj), name))
        holder = self._members(obj) if instance_dict(obj) is not None else self._attrs(obj)
        self._guard(f"{known[1]}.{name}", holder, name, Check.ABSENT, MISSING)

    def _place(self, obj, name: str):
        """(holder, key) of where obj.name was read from; None for a method or
        a property (recorded by their code's own reads)."""
        cls = type(obj)
        found = self._classes.get((cls, name), MISSING)
        if found is MISSING:
            found = next(((k, k.__dict__[name]) for k in cls.__mro__ if name in k.__dict__),
                         None)
            self._classes[(cls, name)] = found
        members = instance_dict(obj)
        if found is not None and hasattr(type(found[1]), "__set__"):   # a data descriptor
            return None if isinstance(found[1], property) else (self._attrs(obj), name)
        if members is not None and name in members:
            return self._members(obj), name
        if found is None:
            return self._attrs(obj), name   # computed by a custom __getattribute__
        klass, attr = found
        if members is not None and isinstance(attr, types.FunctionType):
            # a method, until the instance has its own (a forward patched on it)
            self._guard(f"{self.known[id(obj)][1]}.{name}", self._members(obj), name,
                        Check.ABSENT, MISSING)
        if hasattr(type(attr), "__get__"):
            return None
        if members is not None:   # a class attribute, until the instance has its own
            self._guard(f"{self.known[id(obj)][1]}.{name}", self._members(obj), name,
                        Check.ABSENT, MISSING)
        return self._class_holder(klass), name

    def _code_of(self, obj, name: str, value, owner: str) -> None:
        """Record the code behind a method or a property read from obj, and that
        of the methods of the same name in its classes (super() calls them)."""
        for klass in type(obj).__mro__:
            attr = klass.__dict__.get(name)
            if attr is None:
                continue
            fn = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
            self._function(fn, f"{owner}.{name}")
        if isinstance(value, types.MethodType) and value.__self__ is not obj:
            self._function(value, f"{owner}.{name}")

    def _module_hooks(self, module, name: str, hooks, owner: str) -> None:
        members = instance_dict(module)
        self.hooks.add(f"{owner}.{name}", functools.partial(members.get, name), hooks)
        for key, hook in (hooks or {}).items():
            self.reach(hook, f"{owner}.{name}[{key}]")

    def _read_place(self, holder, key, value, name: str, label: str | None = None):
        """A value read from holder[key]: guard it (named `name`), reach into it
        (what it holds named after `label`, by default `name`), put stand-ins in
        place of the tensors on its path. Returns what the reader gets."""
        label = label or name
        gkey = (id(holder), key)
        if gkey in self.writes or gkey in self.guards:
            return value
        if isinstance(value, torch.Tensor) or _is_ndarray(value):
            return self._tensor(holder, key, (), value, name, label)
        if self.append_places and isinstance(value, (list, collections.deque)) \
                and place_key(holder, key) in self.append_places:
            return self._appended_to(name, holder, key, value)
        plain = snapshot(value)
        if plain is not MISSING:
            where = place_key(holder, key) if self.lift and is_number(value) else None
            if where in self.lift:
                return self._lifted(holder, key, where, value, name)
            self._guard(name, holder, key, Check.VALUE, value)
            return value
        if isinstance(value, CONTAINERS):
            self._guard(name, holder, key, Check.CONTENTS, value)
            replaced = self._items(holder, key, (), value, label)
            if replaced is not value and not isinstance(holder, _Whole):
                self._swap(name, holder, key, value, replaced)
            return replaced
        if isinstance(holder, InPlace) and not holder.computed and id(value) not in self.known \
                and read_in_place(value):   # an object an argument holds: followed in place
            self._in_place[id(value)] = (holder.leaf, holder.path + (key,))
            self._guard(name, holder, key, Check.TYPE, type(value))
            self.reach(value, label)
            return value
        if id(value) in self._in_place and not isinstance(holder, InPlace):
            self._pin(value)   # reached another way too: that way reads this object
        self._guard(name, holder, key, Check.IDENTITY, value)
        stand = self.stand_in_for(value, label)
        if stand is not None:
            self._swap(name, holder, key, value, stand)
            return stand
        if isinstance(value, torch.jit.ScriptFunction):   # refused if the step calls it
            refusing = _refused_when_called(label)
            self._swap(name, holder, key, value, refusing)
            return refusing
        self.reach(value, label)
        return value

    def _appended_to(self, name: str, holder, key, container):
        """A container the step appends values it computes to (appended.py):
        guarded by identity, and a stand-in that takes appends in its place."""
        self._guard(name, holder, key, Check.IDENTITY, container)
        stand = self.append_only(container, name, place_key(holder, key))
        self._swap(name, holder, key, container, stand)
        self.appending.append(stand)
        return stand

    def environment(self, environ, key, value) -> None:
        """The step read environment variable `key` (its value, or MISSING)."""
        if threading.get_ident() == self.thread and isinstance(key, str):
            self._guard(f"environment variable {key!r}", environ, key,
                        Check.ABSENT if value is MISSING else Check.VALUE, value)

    def _lifted(self, holder, key, where: tuple, value, name: str):
        """A number read from a program input filled through its place on every
        call: its type guarded, its symbolic stand-in put there for the trace."""
        self._guard(name, holder, key, Check.TYPE, type(value))
        number = self.number_stand_in(value, name, Place(holder, key), where)
        self._swap(name, holder, key, value, number)
        return number

    def _items(self, holder, key, path: tuple, value, name: str):
        """Stand-ins for the tensors in a container (in place in a list or a dict;
        a tuple is rebuilt), and the objects in it reached."""
        if isinstance(value, (list, dict)):
            pairs = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
            for k, v in pairs[:1024]:
                new = self._items(holder, key, path + (k,), v, f"{name}[{k!r}]")
                if new is not v:
                    self._swap(f"{name}[{k!r}]", value if isinstance(value, dict)
                               else Items(value), k, v, new)
            return value
        if isinstance(value, tuple):
            items = [self._items(holder, key, path + (i,), v, f"{name}[{i}]")
                     for i, v in enumerate(value)]
            if all(a is b for a, b in zip(items, value)):
                return value
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        if isinstance(value, torch.Tensor) or _is_ndarray(value):
            return self._tensor(holder, key, path, value, name)
        if snapshot(value) is MISSING and not isinstance(value, (set, frozenset)):
            stand = self.stand_in_for(value, name)
            if stand is not None:
                return stand
            self.reach(value, name)
        return value

    def stand_in_for(self, value, name: str):
        """The stand-in the step sees for `value` read at `name`, or None."""
        return next((s for s in (stand_in(value, name) for stand_in in self.stand_ins)
                     if s is not None), None)

    def _tensor(self, holder, key, path: tuple, value, name: str, label: str | None = None):
        if isinstance(value, torch.Tensor) and is_traced(value):
            return value
        stand = self.stand_in(value, label or name, Place(holder, key, path))
        if not path and stand is not value:
            self._guard(name, holder, key, Check.LAYOUT, value)
            self._swap(name, holder, key, value, stand)
        return stand

    def _guard(self, name: str, holder, key, check: Check, value) -> None:
        self.guards.setdefault((id(holder), key), Guard(name, holder, key, check, value))

    def _swap(self, name: str, holder, key, real, stand) -> None:
        shadow = isinstance(holder, (Attr, InPlace)) and holder.shadows(key)
        put(holder, key, stand)
        self.swaps.append(_Swap(name, holder, key, real, stand, shadow))

    # -- writes

    def before_write(self, obj, name: str):
        holder = self._members(obj) if instance_dict(obj) is not None else self._attrs(obj)
        return holder, holder.get(name, MISSING)

    def wrote(self, obj, holder, name: str, before) -> None:
        if holder.get(name, MISSING) is before:
            return   # it went elsewhere: a module's parameter, buffer or submodule
        key = (id(holder), name)
        if key not in self.writes:
            swapped = next((s for s in self.swaps if s.holder is holder and s.key == name), None)
            self.writes[key] = Write(f"{self.known[id(obj)][1]}.{name}", holder, name,
                                     swapped.real if swapped and before is swapped.stand
                                     else before, MISSING)

    def finish(self) -> tuple[Guards, list[Write]]:
        """Stop recording, put the real tensors back in place of their stand-ins
        and remove the recording methods. Returns the guards and every host
        write the step made, each still in place (the caller undoes or keeps it)."""
        self.live = False
        self._patches.restore()
        writes = {}
        for key, w in self.writes.items():
            w.after = w.holder.get(w.key, MISSING)
            if w.after is not w.before:
                writes[key] = w
        for swap in reversed(self.swaps):   # the real tensors back where the step left them
            now = swap.holder.get(swap.key, MISSING)
            key = (id(swap.holder), swap.key)
            if now is swap.stand:
                put(swap.holder, swap.key, swap.restored)
            elif key not in writes:
                writes[key] = Write(swap.name, swap.holder, swap.key, swap.restored, now)
        self._dict_writes(writes)
        for key, g in self.guards.items():
            if key in writes or g.check is Check.LAYOUT or g.holds():
                continue
            if isinstance(g.holder, InPlace):   # what it changed is the traced call's object's
                self._pin(g.holder.obj())
            if g.check is Check.TYPE:   # rebound where no write was observed: not undone
                continue
            now = g.current()
            if now is g.original and g.kept is not None:   # changed in place
                items = _tensors_set(now, g.kept[0][1])
                if items is not None:   # a tensor it computed stored under a key
                    writes.update({(id(now), k): Write(f"{g.name}[{k!r}]", now, k, before, v)
                                   for k, before, v in items})
                else:
                    writes[key] = Write(g.name, g.holder, g.key, g.kept, saved(now), in_place=True)
            elif now is not g.original:
                writes[key] = Write(g.name, g.holder, g.key, g.original, now,
                                    derived=_computed(g.holder, g.key))
        for w in writes.values():   # an argument's object kept on the host: that object
            for obj in _objects_in(w.values()[1]):
                if id(obj) in self._in_place:
                    self._pin(obj)
        self.hooks.seal()
        return (Guards([*self.guards.values(), *self._pinned.values()], self.hooks),
                list(writes.values()))

    def _dict_writes(self, writes: dict) -> None:
        """The writes made straight into a reached object's __dict__ (not
        through __setattr__, nor in place of a guarded read), added to writes."""
        for oid, before in self._dicts.items():
            obj, name = self.known[oid]
            members = instance_dict(obj)
            if oid in self._in_place or members is None:   # an argument's: guarded in place
                continue
            for key in members.keys() | before.keys():
                now, was = members.get(key, MISSING), before.get(key, MISSING)
                place = (id(members), key)
                if now is not was and not getattr(now, TRACE_ONLY, False) \
                        and place not in writes and place not in self.guards:
                    writes[place] = Write(f"{name}.{key}", members, key, was, now)
        for klass, before in self._class_dicts.values():
            holder = self._class_holder(klass)
            for key in vars(klass).keys() | before.keys():
                now, was = vars(klass).get(key, MISSING), before.get(key, MISSING)
                place = (id(holder), key)
                if now is not was and place not in writes and place not in self.guards:
                    writes[place] = Write(f"{klass.__qualname__}.{key}", holder, key, was, now)


def torchscript_refused(name: str) -> TranspileError:
    return TranspileError(
        f"the step runs {name}, compiled by torch.jit.script: TorchScript picks its "
        "gradient formulas and kernels as it warms up (from its second call its backward "
        "rounds otherwise than the same ops' in eager), so no traced program equals it. "
        "Remove torch.jit.script from it (or run with PYTORCH_JIT=0, which makes it a no-op); "
        "the transpiler, or backend='inductor', fuses its ops instead")


def refuse_scripted_modules(modules) -> None:
    """A TorchScript module among the step's modules, refused by its path."""
    for i, module in enumerate(modules):
        for name, m in module.named_modules():
            if isinstance(m, torch.jit.ScriptModule):
                raise torchscript_refused(f"module {i} {name or '(the model)'}")


def _refused_when_called(name: str) -> Callable:
    """What the trace reads in place of a TorchScript function: a call of it
    is refused, a read alone is not."""
    def refused(*args, **kwargs):
        raise torchscript_refused(f"{name}{user_line(None)}")
    return refused


class _Vars:
    """An object's whole __dict__, for an object whose reads are not observable."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def get(self, key, default=None):
        members = instance_dict(self.obj)
        return dict(members) if members is not None else default


class _Whole:
    """A value guarded as it is (a partial's arguments)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def get(self, key, default=None):
        return self.value


def _objects_in(value, depth: int = 2):
    """The value and what the containers in it hold, a few levels deep."""
    yield value
    if depth and isinstance(value, (list, tuple, set, frozenset, dict)):
        for item in list(value.values() if isinstance(value, dict) else value)[:LARGE]:
            yield from _objects_in(item, depth - 1)


def _tensors_set(now, before: dict) -> list | None:
    """(key, value before, tensor) of each key of a dict the step set to a
    tensor it computed, where that is all it changed in the dict; else None."""
    if not isinstance(now, dict) or not isinstance(before, dict) or before.keys() - now.keys():
        return None
    changed = [(k, before.get(k, MISSING), v) for k, v in now.items()
               if before.get(k, MISSING) is not v]
    if not changed or not all(isinstance(v, torch.Tensor) and is_traced(v) for _, _, v in changed):
        return None
    return changed


def _is_ndarray(value) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


_ENVIRON_GETITEM = os._Environ.__getitem__


def _environ_getitem(environ, key):
    """os.environ[key] while a trace records: every read of the environment
    (os.environ[...], .get, os.getenv, `in`) goes through it, and becomes a
    guard on the variable's value or absence."""
    recorder = _ACTIVE[0]
    try:
        value = _ENVIRON_GETITEM(environ, key)
    except KeyError:
        if recorder is not None:
            recorder.environment(environ, key, MISSING)
        raise
    if recorder is not None:
        recorder.environment(environ, key, value)
    return value


class recording:
    """Context: `with recording(recorder):` the recorder observes; its
    classes are restored on exit whatever happens."""

    def __init__(self, recorder: Recorder):
        self.recorder = recorder

    def __enter__(self) -> Recorder:
        if _ACTIVE[0] is not None:
            raise RuntimeError("a trace is already being recorded")
        _ACTIVE[0] = self.recorder
        os._Environ.__getitem__ = _environ_getitem
        return self.recorder

    def __exit__(self, *exc) -> None:
        os._Environ.__getitem__ = _ENVIRON_GETITEM
        _ACTIVE[0] = None
        self.recorder.live = False
        self.recorder._patches.restore()
