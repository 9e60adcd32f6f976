"""The signature of a call: everything the traced program depends on besides
tensor values. Calls with equal signatures run the same program; a new one
traces again, and describe_change says what changed in one line."""

from __future__ import annotations

import weakref

import torch
from torch._C._dynamo.guards import TensorGuards
from torch.nn.parameter import UninitializedTensorMixin
from torch.optim import optimizer as torch_optimizer

from ..errors import TranspileError
from .optimizers import formulation_of
from .scaler import GradScaler
from .scaler import signature_of as scaler_signature
from . import ambient
from .arguments import StepArgs, is_leaf
from .optimizer_state import opt_params
from .observed_arrays import is_ndarray
from .argument_objects import read_in_place
from .guards import MISSING, snapshot

# Registering a parameter, buffer or submodule anywhere bumps this epoch, which
# invalidates the cached list of a module's tensors (walking a deep module tree
# on every call would cost a good part of a small step).
_epoch = [0]
# Per module, weakly (a dropped model's tensors must not stay alive here): the
# epoch of the entry, its state and its submodules but itself (an entry that
# refers to its own module would keep it alive).
_module_state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _bump_epoch(*_):
    _epoch[0] += 1


for _register in (torch.nn.modules.module.register_module_parameter_registration_hook,
                  torch.nn.modules.module.register_module_buffer_registration_hook,
                  torch.nn.modules.module.register_module_module_registration_hook):
    _register(_bump_epoch)


def registrations() -> int:
    """How many parameters, buffers and submodules have been registered (on
    any module) so far."""
    return _epoch[0]


def _walk(module) -> tuple[list, list, _Objects, tuple[str, ...]]:
    """(name, tensor) of every parameter (tied ones once) and buffer, (name,
    submodule) of the module and every submodule, those tensors and
    submodules by identity, and the tensors' names; cached."""
    cached = _module_state.get(module)
    if cached is None or cached[0] != _epoch[0]:
        state, submodules = ([*module.named_parameters(), *module.named_buffers()],
                             list(module.named_modules())[1:])
        cached = (_epoch[0], state, submodules, _Objects(state + submodules),
                  tuple(name for name, _ in state))
        _module_state[module] = cached
    return cached[1], [("", module), *cached[2]], cached[3], cached[4]


_NO_STATE: dict = {}   # a parameter's state before the optimizer's first step


class _Group:
    """Named entries of a signature held as one (a module's tensors, an
    optimizer's state): a call hashes and compares one tuple of them rather
    than an entry per tensor, each with a key of its own (a few hundred per
    call for a small model). describe_change looks at them one by one, each
    under the key `under` + its name."""

    __slots__ = ("under", "names", "values", "_hash")

    def __init__(self, under: tuple, names: tuple, values: tuple):
        self.under, self.names, self.values = under, names, values
        self._hash = hash(values)

    def __eq__(self, other) -> bool:
        return (isinstance(other, _Group) and self._hash == other._hash
                and self.values == other.values and self.names == other.names)

    def __hash__(self) -> int:
        return self._hash

    def entries(self) -> list:
        return [(self.under + (name if isinstance(name, tuple) else (name,)), value)
                for name, value in zip(self.names, self.values)]


# Per module or optimizer, weakly: the group of its tensors' signatures the
# last call computed, and torch's C++ check that tensors have the sizes,
# strides, dtype, device, requires_grad and dispatch keys those had (dynamo's
# TensorGuards: 0.1 us a tensor, against 1 us for _tensor_sig in Python; a
# signature has one per parameter and optimizer state tensor). A call whose
# tensors pass it has the same group; one that fails it (or whose thread
# state, such as autocast, makes the dispatch keys differ) computes it anew.
_last_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _tensor_group(owner, under: tuple, names: tuple, tensors: list) -> _Group:
    """_Group(under, names, the tensors' _tensor_sig), the last call's when
    the tensors pass its check."""
    last = _last_groups.get(owner)
    if last is not None and last[0].names == names and last[1](*tensors):
        return last[0]
    group = _Group(under, names, tuple([_tensor_sig(t) for t in tensors]))
    if all(type(t) in _PLAIN and t.layout is torch.strided for t in tensors):
        guards = TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                              dynamic_dims_strides=[list(t.stride()) for t in tensors])
        _last_groups[owner] = (group, guards.check)
    else:   # a subclass (DTensor) or a sparse tensor: computed every call
        _last_groups.pop(owner, None)
    return group


class _Objects:
    """A module's tensors and submodules by identity, in a signature: the
    program reads those objects, and the trace does not guard what the step's
    modules hold, so another one assigned in a place (a new nn.Parameter, a
    buffer set anew, `model.drop = nn.Identity()`) needs a program of its own.
    They are held, so that no other object takes their ids meanwhile."""

    __slots__ = ("named", "_ids")

    def __init__(self, named: list):
        self.named = named
        self._ids = tuple(id(obj) for _, obj in named)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Objects) and self._ids == other._ids

    def __hash__(self) -> int:
        return hash(self._ids)

    def first_change(self, before: _Objects) -> str:
        """What another object is in, or what appeared or went, since `before`."""
        was = dict(before.named)
        for name, obj in self.named:
            old = was.pop(name, None)
            if old is not obj:
                kind = "tensor" if isinstance(obj, torch.Tensor) else "module"
                return (f"{name} is another {kind} than the program was traced with "
                        f"(assigned anew)" if old is not None else f"{name} was added")
        return f"{next(iter(was))} was removed" if was else "nothing changed"


def named_state(module) -> list:
    return _walk(module)[0]


def signature(step_args: StepArgs) -> tuple:
    """Everything the traced program depends on besides tensor values, as
    ((what, ...), value) pairs: calls with equal signatures can run the same
    program. Cheap enough for every call."""
    sig: list = [(("arguments",), step_args.spec), (("ambient",), ambient.snapshot())]
    for i, (name, leaf) in enumerate(zip(step_args.names, step_args.leaves)):
        if isinstance(leaf, torch.Tensor):
            sig.append((("input", name), _tensor_sig(leaf, step_args.dynamic.get(i))))
        elif i in step_args.lifted:
            sig.append((("input", name), ("number", type(leaf).__name__)))
        elif is_ndarray(leaf):
            sig.append((("input", name), ("ndarray", _shape(leaf.shape, step_args.dynamic.get(i)),
                                           leaf.dtype.str)))
        elif isinstance(leaf, GradScaler):
            sig.append((("input", name), scaler_signature(leaf)))
        elif is_leaf(leaf):
            sig.append((("input", name), (type(leaf).__name__, id(leaf))))
        elif read_in_place(leaf):   # its reads are the guards' (argument_objects.py)
            sig.append((("input", name), ("object", type(leaf))))
        else:
            sig.append((("input", name), _hashable(leaf)))
    for name, value in step_args.found:
        sig.append((("found", name), (type(value).__name__, id(value))))
    for mi, module in enumerate(step_args.modules):
        state, submodules, objects, names = _walk(module)
        for name, t in state:
            if isinstance(t, UninitializedTensorMixin):
                raise TranspileError(
                    f"{name} of {type(module).__name__} is not initialized yet (a lazy module "
                    "such as nn.LazyLinear): run one forward pass of the model on a batch "
                    "before the first call of the step, e.g. `with torch.no_grad(): model(x)`")
        sig.append((("module", mi, "state"),
                    _tensor_group(module, ("module", mi), names, [t for _, t in state])))
        sig.append((("module", mi, "objects"), objects))
        # train() or eval(): dropout, BatchNorm's statistics
        sig.append((("module", mi, "training"), tuple(m.training for _, m in submodules)))
    for oi, opt in enumerate(step_args.optimizers):
        form = formulation_of(opt)
        for gi, group in enumerate(opt.param_groups):
            lifted = form.keys_lifted(group) if form else ()
            sig.append((("optimizer", oi, "group", gi, "params"), tuple(map(id, group["params"]))))
            if form:
                sig.append((("optimizer", oi, "group", gi, "terms"), form.terms(group)))
            for key, value in group.items():
                if key != "params" and key not in lifted:
                    sig.append((("optimizer", oi, "group", gi, key), _group_value(value)))
        names, values, state = [], [], opt.state
        for pi, p in enumerate(opt_params(opt)):
            for key, value in state.get(p, _NO_STATE).items():
                names.append((pi, key))
                values.append(value)
        under = ("optimizer", oi, "state")
        if all(isinstance(value, torch.Tensor) for value in values):
            group = _tensor_group(opt, under, tuple(names), values)
        else:
            group = _Group(under, tuple(names), tuple(
                _tensor_sig(v) if isinstance(v, torch.Tensor) else _hashable(v) for v in values))
        sig.append((under, group))
        sig.append((("optimizer", oi, "step hooks"), _step_hooks(
            getattr(opt, "_optimizer_step_pre_hooks", {}),
            getattr(opt, "_optimizer_step_post_hooks", {}))))
    if step_args.optimizers:
        sig.append((("optimizer", "global", "step hooks"), _step_hooks(
            torch_optimizer._global_optimizer_pre_hooks,
            torch_optimizer._global_optimizer_post_hooks)))
    return tuple(sig)


# Marks a step hook of this package's runtime, which no trace runs.
OWN_HOOK = "_transpiler_own_hook"


def _step_hooks(pre: dict, post: dict) -> tuple:
    """The optimizer step's pre- and post-hooks by their handles' ids (never
    reused): the program holds what those of its trace did."""
    return tuple(tuple(k for k, hook in hooks.items() if not getattr(hook, OWN_HOOK, False))
                 for hooks in (pre, post))


def grad_signature(step_args: StepArgs) -> tuple:
    """Which parameters have a .grad, and its type: part of the signature of a
    program that reads the gradients the step starts with."""
    sig = []
    for mi, module in enumerate(step_args.modules):
        for name, t in named_state(module):
            if t.grad is not None:
                sig.append((("grad", mi, name), _tensor_sig(t.grad)))
    for oi, opt in enumerate(step_args.optimizers):
        for pi, p in enumerate(opt_params(opt)):
            if p.grad is not None:
                sig.append((("grad", "optimizer", oi, pi), _tensor_sig(p.grad)))
    return tuple(sig)


def _tensor_sig(t: torch.Tensor, dynamic: frozenset[int] | None = None):
    return (_shape(t.shape, dynamic), t.dtype, t.device, t.requires_grad, memory_layout(t))


def memory_layout(t: torch.Tensor):
    """What a program assumes of a tensor's memory besides its sizes, the same
    for every size: contiguous, or the order of its strides and whether it is
    dense. The trace decides on it (a reshape of a contiguous tensor is a view,
    of a channels_last one a copy) and a compiler's kernels are generated for
    it: a batch that arrives in another layout needs a program of its own."""
    if t.layout is not torch.strided:
        return str(t.layout)
    if t.is_contiguous():
        return "contiguous"
    order = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), d)))
    return order, _dense(t, order)


def _dense(t: torch.Tensor, order: tuple[int, ...]) -> bool:
    """Whether the tensor's elements fill its memory, in this order of dims."""
    step = 1
    for d in reversed(order):
        if t.size(d) != 1:
            if t.stride(d) != step:
                return False
            step *= t.size(d)
    return True


def _shape(shape, dynamic: frozenset[int] | None) -> tuple:
    """The shape with each symbolic dimension (shapes.py) as None: its size
    is the program's guards' to check, not the signature's."""
    return tuple(None if d in dynamic else s for d, s in enumerate(shape)) if dynamic else shape


def batch_shapes(old: tuple, new: tuple) -> list[str]:
    """The batch inputs (tensors, numpy arrays) whose shape differs between
    two signatures in its sizes alone (as many dimensions, the same dtype
    and device)."""
    old_d = dict(old)
    changed = []
    for key, value in new:
        now, before = _sized(value), _sized(old_d.get(key))
        if key[0] == "input" and now and before and now != before and now[1] == before[1] \
                and len(now[0]) == len(before[0]):
            changed.append(key[1])
    return changed


def _sized(v) -> tuple | None:
    """(shape, the rest) of a tensor's or an array's signature."""
    if _is_tensor_sig(v):
        return v[0], v[1:]
    if isinstance(v, tuple) and len(v) == 3 and v[0] == "ndarray":
        return v[1], v[2]
    return None


def _is_tensor_sig(v) -> bool:
    return isinstance(v, tuple) and len(v) == 5 and isinstance(v[1], torch.dtype)


def _group_value(value):
    """A param group's value as the signature sees it: a tensor (in a tuple,
    too) by its layout, being a program input (optimizer_state.group_tensors_as_inputs)."""
    if isinstance(value, torch.Tensor):
        return _tensor_sig(value)
    if isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value):
        return tuple(_group_value(v) for v in value)
    return _hashable(value)


def _hashable(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", repr(value))
    try:
        hash(value)
        return value
    except TypeError:   # a plain value by its repr; an object by identity
        return repr(value) if snapshot(value) is not MISSING else _Same(value)


class _Same:
    """An unhashable object in a signature: equal only to itself (its repr,
    such as PyG's `Data(x=[12, 16])`, says nothing of its tensors), kept alive
    so that no other object takes its id."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"a {type(self.obj).__name__} object"


def describe_change(old: tuple, new: tuple) -> str:
    """One line saying what differs between two signatures."""
    old_d, new_d = dict(_expanded(old)), dict(_expanded(new))
    changed = [k for k in new_d if old_d.get(k, _MISSING) != new_d[k]]
    changed += [k for k in old_d if k not in new_d]
    if not changed:
        return "nothing changed"
    # Which parameters have a .grad is the reason only when nothing else is:
    # it changes along with the rest, and most programs do not read it.
    changed = [k for k in changed if k[0] != "grad"] or changed
    if all(k[0] == "optimizer" and k[2] == "state" and k not in old_d for k in changed):
        keys = sorted({k[4] for k in changed})
        return (f"the optimizer's first step created its state ({', '.join(keys)} for "
                f"{len({k[:4] for k in changed})} parameters)")
    first = changed[0]
    more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
    if first == ("ambient",):
        return ambient.describe_change(old_d[first], new_d[first]) + more
    if first[0] == "module" and first[-1] == "objects" and first in old_d:
        return f"module {first[1]} {new_d[first].first_change(old_d[first])}{more}"
    if first[0] == "optimizer" and first[-1] == "step hooks" and first in old_d:
        (pre, post), (pre_now, post_now) = old_d[first], new_d[first]
        whose = "global" if first[1] == "global" else f"optimizer {first[1]}'s"
        return (f"{whose} step hooks: {len(pre)} -> {len(pre_now)} pre-hooks, {len(post)} -> "
                f"{len(post_now)} post-hooks{more}")
    what = " ".join(map(str, first))
    return f"{what}: {_fmt(old_d.get(first, _MISSING))} -> {_fmt(new_d.get(first, _MISSING))}{more}"


_MISSING = object()


def _expanded(sig: tuple) -> list:
    """The signature with each _Group's entries in its place."""
    return [e for key, value in sig
            for e in (value.entries() if isinstance(value, _Group) else [(key, value)])]


def _fmt(v) -> str:
    if v is _MISSING:
        return "absent"
    if _is_tensor_sig(v):
        shape, dtype, device, _, layout = v
        dims = ", ".join("*" if s is None else str(s) for s in shape)
        return f"{str(dtype).replace('torch.', '')}[{dims}] on {device}" \
            + ("" if layout == "contiguous" else
               f" (strides in the order of dims {list(layout[0])}"
               f"{'' if layout[1] else ', not dense'})")
    return str(v)

