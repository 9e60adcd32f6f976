"""Capture: trace a user's unmodified training step into one functional Program.

The step is traced with make_fx on fake tensors (nothing real is computed or
touched), with the modules' parameters and buffers, the optimizers' state and
their lifted hyperparameters swapped for graph inputs. Markers placed during the
trace (a wrapper around backward(), hooks around optimizer.step()) give every
node its role. The graph, which mutates its inputs like the eager step does, is
then made a pure function whose new state values are outputs: by rewriting its
in-place ops out of place (functionalize.py) where that is exact, else by
tracing it once more through torch.func.functionalize, which carries roles and
gradient annotations across node by node. The optimizers' state is made before
the trace as their first step would make it, so that one trace serves every
call with the same signature.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import keyword
import logging
import os
import re
import traceback
import weakref
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot, make_fx
from torch.nn.utils.stateless import _reparametrize_module

from . import functionalize
from .averaging import mark_backward_ends
from .errors import TranspileError
from .optimizers import formulation_of, hyper_value, updates_with_lifted_hyperparameters
from .program import Hyper, InputKind, InputSpec, OutputKind, OutputSpec, Program, graph_module
from .roles import GRAD_AT, INPUT, PARAM, ROLE, Role
from .scaler import SKIPS, GradScaler, guard_skipped_steps, scaler_slots, traced_scalers
from .scaler import signature_of as scaler_signature

log = logging.getLogger("transpiler")

# More backward() calls than this in one step get a warning: each is unrolled.
MANY_BACKWARDS = 8

# Group options forced while tracing: the foreach path, and capturable=True
# where it exists, keep every step-dependent quantity a tensor (no .item()).
_TRACE_GROUP_OPTIONS = {"foreach": True, "fused": None, "capturable": True}

_PROFILER_OPS = {
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
}
_DETACH = torch.ops.aten.detach.default
_COPY_ = torch.ops.aten.copy_.default
_T = torch.ops.aten.t.default


def _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """native_batch_norm updates the running statistics in place but its schema
    does not say so: functionalization would leave that mutation inside the
    program. _native_batch_norm_legit is the same kernel with a schema that does."""
    if running_mean is None:
        return torch.ops.aten._native_batch_norm_legit.no_stats(input, weight, bias, training,
                                                                momentum, eps)
    return torch.ops.aten._native_batch_norm_legit.default(input, weight, bias, running_mean,
                                                           running_var, training, momentum, eps)


_DECOMPOSITIONS = {torch.ops.aten.native_batch_norm.default: _batch_norm}


# ------------------------------------------------------------ slots

@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """A parameter or buffer of a module: fed as is (programs run under
    no_grad), written back in place."""

    tensor: torch.Tensor

    def read(self, leaves):
        return self.tensor

    def write(self, value):
        self.tensor.copy_(value)

    def mirror(self, memo: dict):
        """The same tensor in a deep copy of the step's arguments (verify)."""
        return memo[id(self.tensor)]


@dataclasses.dataclass(frozen=True)
class StateSlot:
    """One entry of optimizer.state[param]."""

    optimizer: torch.optim.Optimizer
    param: torch.Tensor
    key: str

    def read(self, leaves):
        return self.optimizer.state[self.param][self.key]

    def write(self, value):
        _store(self.optimizer.state[self.param], self.key, value)

    def mirror(self, memo: dict):
        return memo[id(self.optimizer)].state[memo[id(self.param)]].get(self.key)


@dataclasses.dataclass(frozen=True)
class HeldSlot:
    """A tensor the transpiled step keeps between calls (InputKind.HELD)."""

    store: dict
    name: str

    def read(self, leaves):
        return self.store[self.name]

    def write(self, value):
        _store(self.store, self.name, value)

    def mirror(self, memo: dict):
        return None   # the eager step has no such tensor


@dataclasses.dataclass(frozen=True)
class GradSlot:
    """A parameter's .grad: read when the step starts with one (InputKind.GRAD),
    set to the program's value when the step leaves one (OutputKind.GRAD). The
    value is the program's own tensor (for a reduced gradient, a view of its
    bucket, as DDP's gradient_as_bucket_view), not a copy."""

    param: torch.Tensor

    def read(self, leaves):
        return self.param.grad

    def write(self, value):
        self.param.grad = value

    def mirror(self, memo: dict):
        return memo[id(self.param)].grad


def _store(mapping: dict, key, value: torch.Tensor) -> None:
    """Copy into the tensor already there when it has the same shape and dtype
    (so references to it stay valid), else put the new tensor in its place."""
    old = mapping.get(key)
    if isinstance(old, torch.Tensor) and old.shape == value.shape and old.dtype == value.dtype:
        old.copy_(value)
    else:
        mapping[key] = value


@dataclasses.dataclass(frozen=True)
class HyperSlot:
    """A lifted hyperparameter: a value of param_groups[group], or one derived
    from it on the host such as 1 - beta1 (optimizers.hyper_value), fed as a 0-d
    tensor of float64 if the group has a float64 parameter, else float32.
    Kernels compute a float32 (or bf16/fp16) tensor op in float32 whatever the
    scalar's width, so this rounds exactly as eager's Python-float alpha, and
    saves a conversion per tensor."""

    optimizer: torch.optim.Optimizer
    group: int
    key: str
    dtype: torch.dtype
    device: torch.device   # the group's: a compiled device graph reads no host tensor

    def read(self, leaves):
        return torch.tensor(hyper_value(self.optimizer.param_groups[self.group], self.key),
                            dtype=self.dtype, device=self.device)


@dataclasses.dataclass(frozen=True)
class DataSlot:
    """A tensor among the step's arguments (the batch)."""

    leaf: int

    def read(self, leaves):
        return leaves[self.leaf]


@dataclasses.dataclass(frozen=True)
class Returned:
    """The structure of what the step returns: a pytree whose leaves are tensors
    (outputs of the program, in order) or None."""

    spec: pytree.TreeSpec
    nones: tuple[bool, ...]   # per leaf: None

    @property
    def num_tensors(self) -> int:
        return self.nones.count(False)

    def rebuild(self, outputs) -> Any:
        tensors = iter(outputs)
        return pytree.tree_unflatten([None if none else next(tensors) for none in self.nones],
                                     self.spec)


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
    averaged_after: int    # backward() calls before the first optimizer.step() (0: none)

    def param_names(self) -> dict[int, str]:
        """id of each parameter the program reads -> its input's name."""
        return {id(slot.tensor): spec.name for spec, slot in zip(self.program.inputs, self.slots)
                if spec.kind is InputKind.PARAM}


# ------------------------------------------------------------ arguments

@dataclasses.dataclass
class StepArgs:
    """The step's arguments, flattened: modules and optimizers are leaves."""

    names: list[str]       # a readable name per leaf
    leaves: list[Any]
    spec: pytree.TreeSpec
    bound: inspect.BoundArguments | None

    @property
    def modules(self) -> list[torch.nn.Module]:
        return _unique(x for x in self.leaves if isinstance(x, torch.nn.Module))

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return _unique(x for x in self.leaves if isinstance(x, torch.optim.Optimizer))

    @property
    def scalers(self) -> list[GradScaler]:
        return _unique(x for x in self.leaves if isinstance(x, GradScaler))

    def call(self, step_fn, leaves):
        values = pytree.tree_unflatten(leaves, self.spec)
        if self.bound is None:
            args, kwargs = values
            return step_fn(*args, **kwargs)
        for name, value in zip(self.bound.arguments, values):
            self.bound.arguments[name] = value
        return step_fn(*self.bound.args, **self.bound.kwargs)


def _is_leaf(x) -> bool:
    return isinstance(x, (torch.nn.Module, torch.optim.Optimizer, GradScaler))


def flatten_args(step_fn, args, kwargs) -> StepArgs:
    try:
        bound = inspect.signature(step_fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        bound = None
    if bound is None:
        leaves, spec = pytree.tree_flatten((args, kwargs), is_leaf=_is_leaf)
        return StepArgs([f"arg{i}" for i in range(len(leaves))], leaves, spec, None)
    values = list(bound.arguments.values())
    leaves, spec = pytree.tree_flatten(values, is_leaf=_is_leaf)
    names = []
    for name, value in bound.arguments.items():
        n = len(pytree.tree_leaves(value, is_leaf=_is_leaf))
        names += [name] if n == 1 else [f"{name}_{i}" for i in range(n)]
    return StepArgs(names, leaves, spec, bound)


def _unique(items):
    seen, out = set(), []
    for x in items:
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


# ------------------------------------------------------------ what becomes an input

@dataclasses.dataclass
class _Inputs:
    specs: list[InputSpec] = dataclasses.field(default_factory=list)
    slots: list = dataclasses.field(default_factory=list)
    # What the trace sees of each input: the tensor, or a tensor of its layout.
    # Parameters are detached: fake tensors would otherwise also copy their .grad.
    values: list[torch.Tensor] = dataclasses.field(default_factory=list)
    param_names: dict[int, str] = dataclasses.field(default_factory=dict)
    params: list[torch.Tensor] = dataclasses.field(default_factory=list)  # by param_names order

    def add(self, spec, slot, value):
        self.specs.append(spec)
        self.slots.append(slot)
        self.values.append(value)


def _collect_inputs(step_args: StepArgs, state_stand_in: Callable | None = None) -> _Inputs:
    inputs = _Inputs()
    modules, optimizers = step_args.modules, step_args.optimizers
    for mi, module in enumerate(modules):
        prefix = f"m{mi}." if len(modules) > 1 else ""
        for name, p in module.named_parameters():
            if id(p) not in inputs.param_names:
                inputs.param_names[id(p)] = prefix + name
                inputs.params.append(p)
                inputs.add(InputSpec(InputKind.PARAM, prefix + name), ParamSlot(p), p.detach())
        for name, b in module.named_buffers():
            inputs.add(InputSpec(InputKind.BUFFER, prefix + name), ParamSlot(b), b)
    for oi, opt in enumerate(optimizers):
        for p in _opt_params(opt):
            if id(p) not in inputs.param_names:
                name = f"opt{oi}.param{len(inputs.param_names)}"
                inputs.param_names[id(p)] = name
                inputs.params.append(p)
                inputs.add(InputSpec(InputKind.PARAM, name), ParamSlot(p), p.detach())
    for p in inputs.params:
        if p.grad is not None:
            # Tracing reads only its layout: a stand-in, because a .grad that is a
            # view of a reduced bucket, cast since by module.to(), is a view of a
            # tensor of another dtype, which fake tensors refuse.
            g, name = p.grad, inputs.param_names[id(p)]
            stand_in = torch.empty_strided(g.shape, g.stride(), dtype=g.dtype, device=g.device)
            inputs.add(InputSpec(InputKind.GRAD, f"{name}.grad", param=name), GradSlot(p),
                       stand_in)
    for oi, opt in enumerate(optimizers):
        oname = f"opt{oi}." if len(optimizers) > 1 else ""
        for p in _opt_params(opt):
            pname = inputs.param_names[id(p)]
            for key, value in sorted(opt.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    inputs.add(InputSpec(InputKind.STATE, f"{oname}{pname}:{key}", param=pname),
                               StateSlot(opt, p, key),
                               state_stand_in(p, value) if state_stand_in else value)
        form = formulation_of(opt)
        for gi, group in enumerate(opt.param_groups if form else ()):
            wide = any(p.dtype == torch.float64 for p in group["params"])
            device = group["params"][0].device if group["params"] else torch.device("cpu")
            for key in form.lifted(form.terms(group)):
                slot = HyperSlot(opt, gi, key, torch.float64 if wide else torch.float32, device)
                spec = InputSpec(InputKind.HYPER, f"{oname}{key}[{gi}]", hyper=Hyper(key, gi, oi))
                inputs.add(spec, slot, slot.read(None))
    device = inputs.params[0].device if inputs.params else torch.device("cpu")
    for name, slot in scaler_slots(step_args.scalers, device):
        inputs.add(InputSpec(InputKind.SCALER, name), slot, slot.read(None))
    for i, leaf in enumerate(step_args.leaves):
        if isinstance(leaf, torch.Tensor):
            inputs.add(InputSpec(InputKind.DATA, step_args.names[i]), DataSlot(i), leaf)
    return inputs


def _opt_params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


# ------------------------------------------------------------ signature

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


def _walk(module) -> tuple[list, list]:
    """(name, tensor) of every parameter (tied ones once) and buffer, and every
    submodule; cached."""
    cached = _module_state.get(module)
    if cached is None or cached[0] != _epoch[0]:
        cached = (_epoch[0], [*module.named_parameters(), *module.named_buffers()],
                  list(module.modules())[1:])
        _module_state[module] = cached
    return cached[1], [module, *cached[2]]


def _named_state(module) -> list:
    return _walk(module)[0]


def signature(step_args: StepArgs) -> tuple:
    """Everything the traced program depends on besides tensor values, as
    ((what, ...), value) pairs: calls with equal signatures can run the same
    program. Cheap enough for every call."""
    sig: list = [(("arguments",), step_args.spec)]
    for name, leaf in zip(step_args.names, step_args.leaves):
        if isinstance(leaf, torch.Tensor):
            sig.append((("input", name), _tensor_sig(leaf)))
        elif isinstance(leaf, GradScaler):
            sig.append((("input", name), scaler_signature(leaf)))
        elif _is_leaf(leaf):
            sig.append((("input", name), (type(leaf).__name__, id(leaf))))
        else:
            sig.append((("input", name), _hashable(leaf)))
    for mi, module in enumerate(step_args.modules):
        state, submodules = _walk(module)
        for name, t in state:
            sig.append((("module", mi, name), _tensor_sig(t)))
        # train() or eval(): dropout, BatchNorm's statistics
        sig.append((("module", mi, "training"), tuple(m.training for m in submodules)))
    for oi, opt in enumerate(step_args.optimizers):
        form = formulation_of(opt)
        lifted = form.group_keys if form else ()
        for gi, group in enumerate(opt.param_groups):
            sig.append((("optimizer", oi, "group", gi, "params"), tuple(map(id, group["params"]))))
            if form:
                sig.append((("optimizer", oi, "group", gi, "terms"), form.terms(group)))
            for key, value in group.items():
                if key != "params" and key not in lifted:
                    sig.append((("optimizer", oi, "group", gi, key), _hashable(value)))
        for pi, p in enumerate(_opt_params(opt)):
            for key, value in opt.state.get(p, {}).items():
                sig.append((("optimizer", oi, "state", pi, key), _tensor_sig(value)
                            if isinstance(value, torch.Tensor) else _hashable(value)))
    return tuple(sig)


def grad_signature(step_args: StepArgs) -> tuple:
    """Which parameters have a .grad, and its type: part of the signature of a
    program that reads the gradients the step starts with."""
    sig = []
    for mi, module in enumerate(step_args.modules):
        for name, t in _named_state(module):
            if t.grad is not None:
                sig.append((("grad", mi, name), _tensor_sig(t.grad)))
    for oi, opt in enumerate(step_args.optimizers):
        for pi, p in enumerate(_opt_params(opt)):
            if p.grad is not None:
                sig.append((("grad", "optimizer", oi, pi), _tensor_sig(p.grad)))
    return tuple(sig)


def _tensor_sig(t: torch.Tensor):
    return (t.shape, t.dtype, t.device, t.requires_grad)


def _hashable(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", repr(value))
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


def describe_change(old: tuple, new: tuple) -> str:
    """One line saying what differs between two signatures."""
    old_d, new_d = dict(old), dict(new)
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
    what = " ".join(map(str, first))
    return f"{what}: {_fmt(old_d.get(first, _MISSING))} -> {_fmt(new_d.get(first, _MISSING))}{more}"


_MISSING = object()


def _fmt(v) -> str:
    if v is _MISSING:
        return "absent"
    if isinstance(v, tuple) and len(v) == 4 and isinstance(v[0], torch.Size):
        shape, dtype, device, _ = v
        return f"{str(dtype).replace('torch.', '')}{list(shape)} on {device}"
    return str(v)


# ------------------------------------------------------------ tracing

@dataclasses.dataclass
class _Markers:
    """What happened during the trace, as positions in the graph being built."""

    # traced parameters whose .grad a zero_grad(set_to_none=True) dropped before
    # the first backward(): the program does not depend on what they had
    reset: set[int] = dataclasses.field(default_factory=set)
    seeds: list[fx.Node] = dataclasses.field(default_factory=list)    # one per backward()
    losses: list[fx.Node] = dataclasses.field(default_factory=list)   # one per backward()
    backwards: list[tuple[fx.Node, fx.Node]] = dataclasses.field(default_factory=list)
    # parameter name -> node of its .grad where the last backward() ended
    grads: dict[str, fx.Node] = dataclasses.field(default_factory=dict)
    ends: list[dict[str, fx.Node]] = dataclasses.field(default_factory=list)  # ... each one
    # ... as it stood when the first optimizer.step() began: the gradients to reduce
    reduced: dict[str, fx.Node] = dataclasses.field(default_factory=dict)
    steps: list[list] = dataclasses.field(default_factory=list)  # [before, last] per step()
    stepping: torch.optim.Optimizer | None = None  # inside its step() right now
    schedulers: list = dataclasses.field(default_factory=list)  # stepped after the optimizer
    averaged_after: int = 0   # backward() calls before the first step (0: no step)


def _last_node() -> fx.Node:
    return get_proxy_mode().tracer.graph._root.prev


def _node_of(t: torch.Tensor) -> fx.Node:
    return get_proxy_slot(t, get_proxy_mode().tracer).proxy.node


@contextlib.contextmanager
def _compiling_flag():
    # Optimizers keep their step counters as tensors (no .item()) when compiling.
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


@contextlib.contextmanager
def _backward_marker(markers: _Markers, step_fn, grads_now: Callable[[], dict]):
    """Mark each backward() (its seed, its loss, its nodes) and record every
    parameter's .grad where it ends: after the last one before optimizer.step(),
    those are the gradients the program reduces."""
    original = torch.autograd.backward

    def backward(tensors, grad_tensors=None, *args, **kwargs):
        if markers.steps:
            raise TranspileError(
                f"{_name(step_fn)} calls backward() after optimizer.step(){_user_line(step_fn)}; "
                "a transpiled step computes its gradients before the optimizer's step: "
                "move this backward() into the next call of the step")
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        if len(tensors) != 1:
            raise TranspileError("backward() on several tensors at once is not supported; "
                                 "sum them into one loss first")
        loss = tensors[0]
        if grad_tensors is None:
            if loss.numel() != 1:
                raise TranspileError("the loss passed to backward() must be a scalar")
            seed = torch.ones_like(loss)
        else:
            given = grad_tensors if isinstance(grad_tensors, torch.Tensor) else grad_tensors[0]
            seed = torch.clone(given)
        markers.losses.append(_node_of(loss))
        markers.seeds.append(_node_of(seed))
        before = _last_node()
        original(loss, seed, *args, **kwargs)
        markers.backwards.append((before, _last_node()))
        markers.grads = grads_now()
        markers.ends.append(markers.grads)

    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = original


def _scheduler_classes() -> list[type]:
    """torch's LR scheduler classes that define their own step()."""
    base = torch.optim.lr_scheduler.LRScheduler
    found, todo = [], [base]
    while todo:
        cls = todo.pop()
        if "step" in vars(cls):
            found.append(cls)
        todo += cls.__subclasses__()
    return found


@contextlib.contextmanager
def intercepted_schedulers(optimizers, on_step: Callable):
    """While active, step() of a torch LR scheduler of one of `optimizers`
    calls on_step(scheduler, *args, **kwargs) instead."""
    ours = {id(opt) for opt in optimizers}
    patched = []

    def intercept(original):
        def step(self, *args, **kwargs):
            if id(getattr(self, "optimizer", None)) not in ours:
                return original(self, *args, **kwargs)
            return on_step(self, *args, **kwargs)
        return step

    try:
        for cls in _scheduler_classes():
            patched.append((cls, vars(cls)["step"]))
            cls.step = intercept(vars(cls)["step"])
        yield
    finally:
        for cls, original in patched:
            cls.step = original


def _scheduler_marker(markers: _Markers, optimizers, step_fn):
    """A scheduler of one of the step's optimizers stepped inside the step is not
    run by the trace (its change would be frozen into the program): it is
    recorded, and the runtime steps it on the host after every call."""
    def record(scheduler, *args, **kwargs):
        where = _user_line(step_fn)
        if args or kwargs:
            raise TranspileError(
                f"{type(scheduler).__name__}.step() is given arguments inside "
                f"{_name(step_fn)}{where}: a metric or an epoch is a host value the "
                "program cannot compute; call this scheduler's step() outside the step")
        if not markers.steps:
            raise TranspileError(
                f"{type(scheduler).__name__}.step() is called before optimizer.step() inside "
                f"{_name(step_fn)}{where}: call it after optimizer.step() (the order torch "
                "requires) or outside the step")
        markers.schedulers.append(scheduler)
    return intercepted_schedulers(optimizers, record)


@contextlib.contextmanager
def _optimizer_markers(markers: _Markers, optimizers, modules):
    handles = []

    def pre(opt, *_):
        if not markers.steps:
            markers.reduced = dict(markers.grads)
            markers.averaged_after = len(markers.backwards)
        markers.stepping = opt
        markers.steps.append([_last_node(), None])

    def post(*_):
        markers.stepping = None
        markers.steps[-1][1] = _last_node()

    def tracked(obj):
        method = obj.zero_grad

        def zero_grad(set_to_none: bool = True):
            if set_to_none and not markers.backwards:
                params = _opt_params(obj) if isinstance(obj, torch.optim.Optimizer) \
                    else obj.parameters()
                markers.reset.update(id(p) for p in params)
            return method(set_to_none)
        return zero_grad

    for opt in optimizers:
        handles.append(opt.register_step_pre_hook(pre))
        handles.append(opt.register_step_post_hook(post))
    patched = list(optimizers) + list(modules)
    for obj in patched:
        object.__setattr__(obj, "zero_grad", tracked(obj))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for obj in patched:
            object.__delattr__(obj, "zero_grad")


_PLAIN = (bool, int, float, str, tuple, type(None))


def _host_values(modules, optimizers) -> dict[str, Any]:
    """The host-side values a step could change: each submodule's public
    attributes of plain types (a counter, the training flag) and the values of
    each optimizer's param groups."""
    values = {}
    for mi, module in enumerate(modules):
        root = f"model{mi}" if len(modules) > 1 else "model"
        for name, sub in module.named_modules():
            for key, value in vars(sub).items():
                if not key.startswith("_") and isinstance(value, _PLAIN):
                    values[f"{root}.{name + '.' if name else ''}{key}"] = (sub, key, value)
    for oi, opt in enumerate(optimizers):
        for gi, group in enumerate(opt.param_groups):
            for key, value in group.items():
                if key != "params" and key not in _TRACE_GROUP_OPTIONS:
                    values[f"optimizer {oi} param_groups[{gi}][{key!r}]"] = (None, key, value)
    return values


@contextlib.contextmanager
def _host_state_unchanged(step_fn, modules, optimizers):
    """Python state the step changes would change once, while it is traced, and
    never again when the program runs: refuse it (and undo it on the modules;
    the optimizers' groups are restored by _redirect_optimizer)."""
    before = _host_values(modules, optimizers)
    yield
    after = _host_values(modules, optimizers)
    changed = [k for k in before if k not in after or repr(after[k][2]) != repr(before[k][2])]
    if not changed:
        return
    for key in changed:
        owner, attr, value = before[key]
        if owner is not None:
            object.__setattr__(owner, attr, value)
    first = changed[0]
    new = repr(after[first][2]) if first in after else "deleted"
    if first.startswith("optimizer"):
        advice = ("set hyperparameters outside the step, or step a torch.optim.lr_scheduler "
                  "after optimizer.step() inside it (the transpiled step runs it on the host "
                  "after every call)")
    else:
        advice = ("call model.train()/eval() and change such attributes outside the step, or "
                  "keep a counter in a tensor buffer (register_buffer) that the step updates")
    raise TranspileError(
        f"{_name(step_fn)} changes host-side state: {first} {before[first][2]!r} -> {new}"
        + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else "")
        + ". The program runs without the step's Python, so this change would happen once, "
        f"while the step is traced, and never again: {advice}")


@contextlib.contextmanager
def _redirect_optimizer(opt, traced: dict[int, torch.Tensor], state: dict[int, dict]):
    """Point an optimizer at traced tensors for the duration of the trace."""
    saved_groups = [dict(g) for g in opt.param_groups]
    saved_state = opt.state
    try:
        new_state = defaultdict(dict)
        for group in opt.param_groups:
            originals = group["params"]
            group["params"] = [traced[id(p)] for p in originals]
            for p, tp in zip(originals, group["params"]):
                new_state[tp] = dict(saved_state.get(p, {}))
                new_state[tp].update(state.get(id(p), {}))
            for key, value in _TRACE_GROUP_OPTIONS.items():
                if key in group:
                    group[key] = value
        opt.state = new_state
        yield
    finally:
        opt.state = saved_state
        for group, saved in zip(opt.param_groups, saved_groups):
            group.clear()
            group.update(saved)


def _formulated_groups(optimizers, traced: dict[int, torch.Tensor],
                       hypers: dict[tuple, torch.Tensor]) -> dict[int, tuple]:
    """id of a traced parameter -> (formulation, group, terms, {name: hyper
    input}) for the groups whose update takes its hyperparameters as inputs."""
    groups = {}
    for opt in optimizers:
        form = formulation_of(opt)
        for gi, group in enumerate(opt.param_groups if form else ()):
            terms = form.terms(group)
            h = {key: hypers[(id(opt), gi, key)] for key in form.lifted(terms)}
            for p in group["params"]:
                groups[id(traced[id(p)])] = (form, group, terms, h)
    return groups


def _name(step_fn) -> str:
    return getattr(step_fn, "__qualname__", None) or getattr(step_fn, "__name__", "train_step")


_LIB_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(__file__))


def _user_line(step_fn, tb=None) -> str:
    """' at file:line (code)' for the innermost frame in the user's code."""
    frames = traceback.extract_tb(tb) if tb is not None else traceback.extract_stack()
    for frame in reversed(frames):
        if not frame.filename.startswith(_LIB_DIRS + ("<",)) and "contextlib" not in frame.filename:
            return f" at {frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    return ""


_DATA_DEPENDENT = (
    "data-dependent", "DataDependent", "_local_scalar_dense", "item()",
    "value out of a tracing tensor", "DynamicOutputShape", "Cannot call numel",
)


def _trace_error(step_fn, exc: BaseException, markers: _Markers) -> TranspileError:
    where = _user_line(step_fn, exc.__traceback__)
    text = f"{type(exc).__name__}: {exc}"
    if markers.stepping is not None:
        return TranspileError(
            f"{type(markers.stepping).__name__}.step() cannot be captured{where}: "
            f"{text.splitlines()[0]}. SGD, Adam and AdamW are supported; other optimizers "
            "work when their step traces into tensor operations")
    if any(s in text for s in _DATA_DEPENDENT):
        return TranspileError(
            f"{_name(step_fn)} depends on the value of a tensor{where}: Python control flow "
            "or .item()/.tolist() on tensor values cannot be captured in a static program. "
            "Compute it with tensor operations (torch.where, masking) or move it outside "
            f"the step. ({text.splitlines()[0]})")
    return TranspileError(f"tracing {_name(step_fn)} failed{where}: {text.splitlines()[0]}")


def trace_step(step_fn: Callable, step_args: StepArgs,
               state_stand_in: Callable | None = None) -> Captured:
    """Trace the whole step (forward, backward, optimizer update) into a Program.
    state_stand_in(param, entry): what the trace sees of an optimizer state
    entry (mode zero keeps shards; the step reads full entries).

    The optimizers' state is made first, as their first step would make it
    (make_first_state), so that the program traced on the first call is the
    one every later call runs: the state is its input, never its creation."""
    if not step_args.modules:
        raise TranspileError(
            f"{_name(step_fn)} was called with no torch.nn.Module among its arguments: "
            "pass the model as an argument, e.g. step(model, optimizer, x, y)")
    if not step_args.optimizers:
        raise TranspileError(
            f"{_name(step_fn)} was called with no torch.optim.Optimizer among its arguments: "
            "pass the optimizer as an argument, e.g. step(model, optimizer, x, y)")
    made = make_first_state(step_args.optimizers)
    try:
        captured = _trace(step_fn, step_args, state_stand_in)
    except BaseException:
        _forget_state(made)
        raise
    # State made for a parameter the step gives no gradient: its first step
    # would not have made it, and the program does not read it.
    read = {(id(slot.optimizer), id(slot.param), slot.key) for slot in captured.slots
            if isinstance(slot, StateSlot)}
    _forget_state([m for m in made if (id(m[0]), id(m[1]), m[2]) not in read])
    return captured


def make_first_state(optimizers) -> list[tuple[torch.optim.Optimizer, torch.Tensor, str]]:
    """For each trainable parameter a formulated optimizer keeps no state for,
    the state its first step would create (Formulation.initial_state), made
    now: (optimizer, parameter, key) of each entry made. Where zeros would not
    give the first step's results, nothing is made and the first call's program
    creates the state (and the second call traces again)."""
    made = []
    for opt in optimizers:
        form = formulation_of(opt)
        for group in opt.param_groups if form else ():
            for p in group["params"]:
                if not p.requires_grad or opt.state.get(p):
                    continue
                state = form.initial_state(group, p)
                for key, value in (state or {}).items():
                    opt.state[p][key] = value
                    made.append((opt, p, key))
    return made


def _forget_state(made) -> None:
    for opt, p, key in made:
        del opt.state[p][key]
        if not opt.state[p]:
            del opt.state[p]


def _trace(step_fn: Callable, step_args: StepArgs, state_stand_in: Callable | None) -> Captured:
    modules, optimizers = step_args.modules, step_args.optimizers
    inputs = _collect_inputs(step_args, state_stand_in)
    markers = _Markers()
    created: list[tuple[torch.optim.Optimizer, torch.Tensor, str]] = []
    returned: list[Returned] = []
    left: list[torch.Tensor] = []      # parameters the step leaves a .grad
    cleared: list[tuple[str, torch.Tensor]] = []   # ... and those it leaves none
    kept: list[torch.Tensor] = []      # trainable ones whose .grad it did not drop first

    def flat(*values):
        traced: dict[int, torch.Tensor] = {}
        leaves = list(step_args.leaves)
        hypers: dict[tuple, torch.Tensor] = {}
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
            elif spec.kind is InputKind.GRAD:
                traced[id(slot.param)].grad = value
            elif spec.kind is InputKind.SCALER:
                scaled[(id(slot.scaler), slot.attr)] = value
            else:
                leaves[slot.leaf] = value
        formulated = _formulated_groups(optimizers, traced, hypers)

        def grads_now():
            return {inputs.param_names[i]: _node_of(t.grad) for i, t in traced.items()
                    if t.grad is not None}
        real_state = {id(opt): opt.state for opt in optimizers}
        real_params = {id(opt): _opt_params(opt) for opt in optimizers}
        with contextlib.ExitStack() as stack:
            for module in modules:
                mapping = {n: traced[id(t)] for n, t in _named_state(module)}
                stack.enter_context(_reparametrize_module(module, mapping, tie_weights=True))
            for opt in optimizers:
                stack.enter_context(_redirect_optimizer(opt, traced, state[id(opt)]))
            stack.enter_context(updates_with_lifted_hyperparameters(formulated))
            stack.enter_context(_compiling_flag())
            stack.enter_context(_backward_marker(markers, step_fn, grads_now))
            stack.enter_context(_optimizer_markers(markers, optimizers, modules))
            stack.enter_context(_scheduler_marker(markers, optimizers, step_fn))
            stack.enter_context(_host_state_unchanged(step_fn, modules, optimizers))
            stack.enter_context(traced_scalers(step_args.scalers, scaled, optimizers, _node_of,
                                               _name(step_fn)))
            result = step_args.call(step_fn, leaves)
            _check_markers(step_fn, markers)
            out_leaves, spec = pytree.tree_flatten(result)
            returned.append(Returned(spec, tuple(o is None for o in out_leaves)))
            out_leaves = [o for o in out_leaves if o is not None]
            for o in out_leaves:
                if not isinstance(o, torch.Tensor):
                    raise TranspileError(
                        f"{_name(step_fn)} returned a {type(o).__name__}; a transpiled step "
                        "may return only tensors (any pytree of them): return the loss tensor "
                        "and convert it with .item() outside the step")
            new_state = []
            for opt in optimizers:
                for p in real_params[id(opt)]:
                    for key, value in _state_set_by_step(opt, traced[id(p)],
                                                         state[id(opt)].get(id(p), {}),
                                                         real_state[id(opt)].get(p, {})):
                        created.append((opt, p, key))
                        new_state.append(value)
            for name, node in markers.reduced.items():
                node.meta[PARAM] = name
            grads = []
            for p in inputs.params:
                tp = traced[id(p)]
                if tp.grad is not None:
                    left.append(p)
                    grads.append(tp.grad)
                else:
                    cleared.append((inputs.param_names[id(p)], p))
                if tp.requires_grad and id(tp) not in markers.reset:
                    kept.append(p)
            return tuple(out_leaves) + tuple(new_state) + tuple(grads)

    try:
        # The traced module's Python code is never run (it becomes a Program):
        # a lazy module does not generate it.
        with _use_lazy_graph_module(True):
            gm = make_fx(flat, decomposition_table=_DECOMPOSITIONS, tracing_mode="fake",
                         _allow_non_fake_inputs=True)(*inputs.values)
    except TranspileError:
        raise
    except Exception as exc:  # noqa: BLE001 - every tracing failure becomes a clear error
        raise _trace_error(step_fn, exc, markers) from exc

    _check_no_captured_parameters(step_fn, gm)
    if len(markers.backwards) > MANY_BACKWARDS:
        log.warning("transpiler: %s calls backward() %d times: the program unrolls every "
                    "micro-batch, so it grows and traces in proportion; for many micro-batches "
                    "accumulate across calls instead (README, Training loops)",
                    _name(step_fn), len(markers.backwards))
    _assign_roles(gm.graph, markers)
    mark_backward_ends(markers.ends, markers.averaged_after)
    _drop_profiler_nodes(gm.graph)
    try:
        functionalize.rewrite(gm.graph)
        fgm = gm
    except functionalize.Unsupported as why:
        log.debug("transpiler: functionalizing %s by tracing again: %s", _name(step_fn), why)
        fgm = _functionalize(gm, inputs.values)
    program, slots, targets = _to_program(fgm, inputs, returned[0].num_tensors, created, left)
    guard_skipped_steps(program, _optimizer_of(targets, optimizers))
    reads_grads = bool(kept) or any(spec.kind is InputKind.GRAD for spec in program.inputs)
    return Captured(program, slots, targets, returned[0], markers.schedulers, cleared,
                    reads_grads, markers.averaged_after)


def _optimizer_of(targets: list, optimizers) -> list[int | None]:
    """For each output's target: the index of the optimizer that writes it (a
    parameter it updates, its state), else None."""
    index = {id(opt): oi for oi, opt in enumerate(optimizers)}
    of_param = {id(p): index[id(opt)] for opt in optimizers for p in _opt_params(opt)}
    return [index[id(t.optimizer)] if isinstance(t, StateSlot)
            else of_param.get(id(t.tensor)) if isinstance(t, ParamSlot) else None
            for t in targets]


def _check_no_captured_parameters(step_fn, gm: fx.GraphModule) -> None:
    """A parameter the step reaches through a closure or a global, not through
    its arguments, would be traced as a constant: never updated, never reduced."""
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target, None)
        if isinstance(value, torch.Tensor) and (isinstance(value, torch.nn.Parameter)
                                                or value.requires_grad):
            raise TranspileError(
                f"{_name(step_fn)} uses a parameter of shape {tuple(value.shape)} that is not "
                "among its arguments (a module captured from a closure or a global?): pass "
                "every module whose parameters the step uses as an argument, e.g. "
                "step(model, optimizer, x, y)")


def _state_set_by_step(opt, traced_param, given: dict, before: dict):
    """(key, tensor) of the optimizer state entries the traced step created or
    replaced for one parameter; raises on non-tensor state that changed."""
    for key, value in opt.state[traced_param].items():
        if isinstance(value, torch.Tensor):
            if value is not given.get(key):
                yield key, value
        elif key not in before or repr(before[key]) != repr(value):
            raise TranspileError(
                f"{type(opt).__name__} keeps non-tensor state {key!r} that changes every "
                "step; it cannot be captured in a static program. Use an optimizer whose "
                "state is tensors.")


def _check_markers(step_fn, markers: _Markers):
    if not markers.backwards:
        raise TranspileError(f"{_name(step_fn)} never calls loss.backward(): a training "
                             "step computes a loss, calls backward() and optimizer.step()")


def _drop_profiler_nodes(graph: fx.Graph):
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node.target in _PROFILER_OPS:
            for user in list(node.users):
                graph.erase_node(user)
            graph.erase_node(node)


def _assign_roles(graph: fx.Graph, markers: _Markers):
    """Roles from the markers: backward inside each backward(), optimize inside
    optimizer.step(); what reads the gradients between the last backward() and
    the first step() is gradient processing, and after it optimize; forward for
    the rest (the forward passes, and whatever reads no gradient)."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    backwards = [(position[b], position[e]) for b, e in markers.backwards]
    steps = [(position[b], position[e]) for b, e in markers.steps]
    grads_end = backwards[-1][1]
    first_step = steps[0][0] if steps else len(position)
    seeds, losses = set(markers.seeds), set(markers.losses)
    from_grads = Role.GRADIENT | Role.OPTIMIZE
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        i = position[node]
        reads_grads = any(PARAM in a.meta or a.meta.get(ROLE, Role.FORWARD) & from_grads
                          for a in node.all_input_nodes if a.op == "call_function")
        if node in seeds:
            role = Role.BACKWARD | Role.LOSS
        elif node in losses:
            role = Role.FORWARD | Role.LOSS
        elif any(b < i <= e for b, e in backwards):
            role = Role.BACKWARD
        elif any(b < i <= e for b, e in steps):
            role = Role.OPTIMIZE
        elif grads_end < i and reads_grads:
            role = Role.GRADIENT if i <= first_step else Role.OPTIMIZE
        else:
            role = Role.FORWARD
        node.meta[ROLE] = role


class _RoleCarrier(fx.Interpreter):
    """Runs the traced graph under functionalization and gives each node it
    creates in the new graph the role (and gradient mark) of the node it came
    from; the loss and the seed keep their LOSS role on the node of their value."""

    def run_node(self, n):
        before = _last_node()
        result = super().run_node(n)
        if n.op != "call_function":
            return result
        node = before.next
        while node.op != "root":
            node.meta.setdefault(ROLE, n.meta[ROLE])
            node = node.next
        if PARAM in n.meta or SKIPS in n.meta or GRAD_AT in n.meta or n.meta[ROLE] & Role.LOSS:
            # The node of the value itself: a getitem of a multi-output op is
            # created with that op and took its role above.
            inner = torch._from_functional_tensor(result) if torch._is_functional_tensor(result) else result
            node = _node_of(inner)
            for key in (PARAM, SKIPS, GRAD_AT):
                if key in n.meta:
                    node.meta[key] = n.meta[key]
            if n.meta[ROLE] & Role.LOSS:
                node.meta[ROLE] = n.meta[ROLE]
        return result


def _functionalize(gm: fx.GraphModule, values) -> fx.GraphModule:
    def run(*args):
        return _RoleCarrier(gm).run(*args)
    return make_fx(torch.func.functionalize(run, remove="mutations"), tracing_mode="fake",
                   _allow_non_fake_inputs=True)(*[v.detach() for v in values])


def _identifier(prefix: str, name: str) -> str:
    ident = re.sub(r"\W", "_", name).strip("_") or "v"
    ident = f"{prefix}{ident}"
    return ident + "_" if keyword.iskeyword(ident) else ident


_PREFIX = {InputKind.PARAM: "p_", InputKind.BUFFER: "b_", InputKind.GRAD: "g_",
           InputKind.STATE: "s_", InputKind.HYPER: "h_", InputKind.SCALER: "sc_",
           InputKind.DATA: ""}


def _bypass(graph: fx.Graph, node: fx.Node, value: fx.Node) -> None:
    """Replace `node` by `value`, which computes the same thing, keeping its marks."""
    node.replace_all_uses_with(value, propagate_meta=False)
    for key in (PARAM, GRAD_AT):
        if key in node.meta:
            value.meta.setdefault(key, node.meta[key])
    graph.erase_node(node)


def _to_program(gm: fx.GraphModule, inputs: _Inputs, n_user: int, created,
                left: list[torch.Tensor]) -> tuple[Program, list, list]:
    """Turn the functionalized graph into a Program: name and annotate the
    placeholders, drop detaches, make the trailing write-backs outputs and drop
    the gradients and optimizer state the step starts with where it does not
    read them. Returns the program, the slot of each input and the target of
    each output."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, inputs.specs):
        node._rename(_identifier(_PREFIX[spec.kind], spec.name))
        node.meta[INPUT] = spec
    for node in list(graph.nodes):
        # detach(x) is x in a graph without autograd, and so is t(t(x)), which
        # the backward pass of every Linear layer produces.
        if node.op != "call_function":
            continue
        if node.target is _DETACH:
            _bypass(graph, node, node.args[0])
        elif node.target is _T and getattr(node.args[0], "target", None) is _T:
            inner = node.args[0]
            _bypass(graph, node, inner.args[0])
            if not inner.users:
                graph.erase_node(inner)
    index = {n: i for i, n in enumerate(placeholders)}
    updates: dict[int, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is _COPY_ and node.args[0] in index:
            if node.users:
                raise TranspileError("internal: a write-back copy_ is used inside the program")
            updates[index[node.args[0]]] = node.args[1]
            graph.erase_node(node)
    out = graph.output_node()
    results = list(out.args[0])
    specs = [OutputSpec(OutputKind.USER)] * n_user
    targets: list = [None] * n_user
    for (opt, p, key), value in zip(created, results[n_user:]):
        name = inputs.param_names[id(p)]
        specs.append(OutputSpec(OutputKind.STATE, f"{name}:{key}", param=name))
        targets.append(StateSlot(opt, p, key))
    for p in left:   # the .grad the step leaves (its output covers any write-back)
        specs.append(OutputSpec(OutputKind.GRAD, inputs.param_names[id(p)]))
        targets.append(GradSlot(p))
    for i in sorted(updates):
        if inputs.specs[i].kind is not InputKind.GRAD:
            results.append(updates[i])
            specs.append(OutputSpec(OutputKind.UPDATE, inputs.specs[i].name))
            targets.append(inputs.slots[i])
    out.args = (tuple(results),)
    graph.eliminate_dead_code()
    kept = []
    for node, spec, slot in zip(placeholders, inputs.specs, inputs.slots):
        if spec.kind in (InputKind.GRAD, InputKind.STATE) and not node.users:
            graph.erase_node(node)
        else:
            kept.append((spec, slot))
    graph.lint()
    return (Program("main", graph_module(gm, graph), [s for s, _ in kept], specs),
            [s for _, s in kept], targets)
