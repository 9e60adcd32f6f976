"""Markers placed while the step is traced (a wrapper around backward(), hooks
around optimizer.step(), LR schedulers intercepted) and the roles the graph's
nodes get from them."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import TranspileError
from ..program.roles import PARAM, ROLE, Role
from .optimizer_state import opt_params
from .optimizers import formulation_of
from .reads import TRACE_ONLY, is_traced
from .user_code import step_name, user_line


def _unread(grad: torch.Tensor | None) -> bool:
    """Whether the program has not read this .grad so far: none, or the one
    the step started with, read by no node (a GAN's generator gradients,
    dropped by its zero_grad() after the discriminator's backward())."""
    if grad is None:
        return True
    slot = get_proxy_slot(grad, get_proxy_mode().tracer, None)
    return slot is not None and slot.proxy.node.op == "placeholder" and not slot.proxy.node.users


@dataclasses.dataclass
class Markers:
    """What happened during the trace, as positions in the graph being built."""

    # traced parameters whose .grad a zero_grad(set_to_none=True) dropped before
    # anything read it: the program does not depend on what they had
    reset: set[int] = dataclasses.field(default_factory=set)
    seeds: list[fx.Node] = dataclasses.field(default_factory=list)    # one per backward()
    losses: list[fx.Node] = dataclasses.field(default_factory=list)   # one per backward()
    backwards: list[tuple[fx.Node, fx.Node]] = dataclasses.field(default_factory=list)
    # parameter name -> node of its .grad where the last backward() ended
    grads: dict[str, fx.Node] = dataclasses.field(default_factory=dict)
    ends: list[dict[str, fx.Node]] = dataclasses.field(default_factory=list)  # ... each one
    # ... as the last backward() left it, if the step takes an optimizer step (a
    # backward() after one, a GAN's generator loss, reads the updated parameters):
    # the gradients the step reduces at its end
    reduced: dict[str, fx.Node] = dataclasses.field(default_factory=dict)
    steps: list[list] = dataclasses.field(default_factory=list)  # [before, last] per step()
    stepping: torch.optim.Optimizer | None = None  # inside its step() right now
    schedulers: list = dataclasses.field(default_factory=list)  # stepped after the optimizer
    # ids of the step's modules that ran a forward (theirs or a submodule's)
    # with grad enabled since a backward() last reached their parameters (set
    # by buffer_sync_points, which sees every module call)
    forwarded: set[int] = dataclasses.field(default_factory=set)


def last_node() -> fx.Node:
    return get_proxy_mode().tracer.graph._root.prev


def node_of(t: torch.Tensor) -> fx.Node:
    return get_proxy_slot(t, get_proxy_mode().tracer).proxy.node


@contextlib.contextmanager
def compiling_flag():
    """torch.compiler.is_compiling() True: optimizers keep their step counters
    as tensors (no .item()). Only while a formulated optimizer steps
    (optimizer_markers): model code that branches on it takes eager's path."""
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


@contextlib.contextmanager
def backward_marker(markers: Markers, grads_now: Callable[[], dict],
                    at_end: Callable[[], None] = lambda: None,
                    reached: Callable[[set], None] = lambda names: None):
    """Mark each backward() (its seed, its loss, its nodes), run at_end() where
    it ends and record every parameter's .grad there: after the last one (of a
    step that takes an optimizer step), those are the gradients the program
    reduces at its end. reached(names): the parameters whose .grad the pass
    itself wrote (before at_end())."""
    original = torch.autograd.backward
    running = []   # a backward() of the step is running

    def backward(tensors, grad_tensors=None, *args, **kwargs):
        if running:
            # Called by the backward pass itself (torch.utils.checkpoint with
            # use_reentrant=True differentiates its recomputed block): part of it.
            return original(tensors, grad_tensors, *args, **kwargs)
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
        markers.losses.append(node_of(loss))
        markers.seeds.append(node_of(seed))
        before, had = last_node(), grads_now()
        running.append(loss)
        try:
            original(loss, seed, *args, **kwargs)
        finally:
            running.pop()
        reached({name for name, node in grads_now().items() if had.get(name) is not node})
        at_end()
        markers.backwards.append((before, last_node()))
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


def scheduler_marker(markers: Markers, optimizers, step_fn,
                     after: Callable | None = None):
    """A scheduler of one of the step's optimizers stepped inside the step is not
    run by the trace (its change would be frozen into the program): it is
    recorded (then after(scheduler) is called), and the runtime steps it on the
    host after every call."""
    def record(scheduler, *args, **kwargs):
        where = user_line(step_fn)
        if args or kwargs:
            raise TranspileError(
                f"{type(scheduler).__name__}.step() is given arguments inside "
                f"{step_name(step_fn)}{where}: a metric or an epoch is a host value the "
                "program cannot compute; call this scheduler's step() outside the step")
        if not markers.steps:
            raise TranspileError(
                f"{type(scheduler).__name__}.step() is called before optimizer.step() inside "
                f"{step_name(step_fn)}{where}: call it after optimizer.step() (the order torch "
                "requires) or outside the step")
        markers.schedulers.append(scheduler)
        if after is not None:
            after(scheduler)
    return intercepted_schedulers(optimizers, record)


@contextlib.contextmanager
def optimizer_markers(markers: Markers, optimizers, modules):
    handles, flags = [], []

    def pre(opt, args, kwargs):
        if kwargs.get("closure", args[1] if len(args) > 1 else None) is not None:
            raise TranspileError(
                f"{type(opt).__name__}.step() is given a closure{user_line(None)}: a closure "
                "re-evaluates the loss inside the optimizer's step, which a static program "
                "cannot capture; call backward() in the step and optimizer.step() without one "
                "(LBFGS, which needs it, is not supported)")
        if any(scheduler.optimizer is opt for scheduler in markers.schedulers):
            raise TranspileError(
                f"{type(opt).__name__}.step() runs again after its LR scheduler's step() in the "
                f"same call{user_line(None)}: the program's updates read the learning rate the "
                "call starts with; step the scheduler once, after the call's last "
                "optimizer.step(), or outside the step")
        markers.stepping = opt
        markers.steps.append([last_node(), None])
        # an optimizer traced as torch wrote it computes as in eager: its step
        # count read with .item() (is_compiling() would keep it a tensor,
        # which rounds the bias corrections in float32, not in Python's double)
        flags.append(compiling_flag() if formulation_of(opt) is not None
                     else contextlib.nullcontext())
        flags[-1].__enter__()

    def post(*_):
        markers.stepping = None
        markers.steps[-1][1] = last_node()
        flags.pop().__exit__(None, None, None)

    def tracked(obj):
        method = obj.zero_grad

        def zero_grad(set_to_none: bool = True):
            if set_to_none:
                params = opt_params(obj) if isinstance(obj, torch.optim.Optimizer) \
                    else obj.parameters()
                markers.reset.update(id(p) for p in params if _unread(p.grad))
            return method(set_to_none)
        setattr(zero_grad, TRACE_ONLY, True)   # not a read of the step's objects to guard
        return zero_grad

    for opt in optimizers:
        handles.append(opt.register_step_pre_hook(pre))
        handles.append(opt.register_step_post_hook(post))
    ours = {id(opt) for opt in optimizers}

    def unknown(opt, args, kwargs):
        if id(opt) not in ours and any(is_traced(p) for p in opt_params(opt)):
            raise TranspileError(
                f"{type(opt).__name__}.step() is called{user_line(None)} on an optimizer the "
                "step makes on the model's parameters as it runs (a new one on every call, or "
                "a lazy `if self.opt is None:`): a transpiled step's optimizers are fixed when "
                "it is traced; create it before the first call and pass it as an argument")
        if id(opt) not in ours:
            raise TranspileError(
                f"{type(opt).__name__}.step() is called{user_line(None)} on an optimizer the "
                "step does not take as an argument nor reaches through its own object, a "
                "partial, its closure or its globals: pass it as an argument, e.g. "
                "step(model, optimizer, x, y)")
    handles.append(register_optimizer_step_pre_hook(unknown))
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
        while flags:   # a step that raised
            flags.pop().__exit__(None, None, None)



def assign_roles(graph: fx.Graph, markers: Markers):
    """Roles from the markers: backward inside each backward(), optimize inside
    optimizer.step(); what reads the gradients between the last backward() and
    the first step() after it is gradient processing, and after it optimize;
    forward for the rest (the forward passes, those after an earlier step()
    included, and whatever reads no gradient)."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    backwards = [(position[b], position[e]) for b, e in markers.backwards]
    steps = [(position[b], position[e]) for b, e in markers.steps]
    # (a program that ends in the step's raise before any backward(): forward only)
    grads_end = backwards[-1][1] if backwards else len(position)
    # the first step() after the last backward(): a GAN's generator step
    first_step = next((b for b, _ in steps if b > grads_end), len(position))
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


