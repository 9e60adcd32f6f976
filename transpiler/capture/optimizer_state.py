"""The optimizers while the step is traced: their state made as their first step
would make it, their groups pointed at the traced parameters, and the state
entries the traced step created."""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

from ..errors import TranspileError
from .optimizers import formulation_of, reads_numbers
from .reads import Place
from .user_code import step_name

# Group options forced while tracing: the foreach path, and capturable=True
# where it exists, keep every step-dependent quantity a tensor (no .item()).
TRACE_GROUP_OPTIONS = {"foreach": True, "fused": None, "capturable": True}


def opt_params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


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


def refuse_uninitialized(step_fn, optimizers) -> None:
    """An optimizer whose __init__ skipped torch.optim.Optimizer's (a wrapper of
    another, as timm's Lookahead) has none of the step hooks the trace marks
    its step() with: refused."""
    for opt in optimizers:
        if not hasattr(opt, "_optimizer_step_pre_hooks"):
            raise TranspileError(
                f"{step_name(step_fn)} steps {type(opt).__name__}, whose __init__ does not run "
                "torch.optim.Optimizer.__init__ (it wraps another optimizer?): its step() "
                "cannot be traced. Step the optimizer it wraps in the step, and do the "
                "wrapper's own work outside it")


def refuse_fused_without_kernel(step_fn, optimizers) -> None:
    """A fused group read as numbers (backend eager) runs torch's fused kernel
    (Formulation.update_fused); an optimizer whose kernel a program cannot
    run (SGD's has no fake implementation to trace) is refused."""
    for opt in optimizers:
        form = formulation_of(opt)
        if form is None or form.update_fused is not None:
            continue
        if any(group.get("fused") and reads_numbers(group) for group in opt.param_groups):
            raise TranspileError(
                f"{step_name(step_fn)} steps {type(opt).__name__}(fused=True): torch's fused "
                "kernel cannot be traced into a program, and no other update rounds as it "
                "does. Use fused=False (torch's foreach update, the default), or "
                "backend='inductor', which compiles the update within its tolerance")


def refuse_sharding_optimizers(step_fn, optimizers) -> None:
    """torch's ZeroRedundancyOptimizer shards its state and broadcasts the
    updated parameters itself, with host bookkeeping each step a program
    cannot repeat: mode 'zero' is the transpiled form of it."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.optim import ZeroRedundancyOptimizer
    for opt in optimizers:
        if isinstance(opt, ZeroRedundancyOptimizer):
            raise TranspileError(
                f"{step_name(step_fn)} steps torch's ZeroRedundancyOptimizer: it shards the "
                "optimizer state and broadcasts the parameters itself, on the host, every "
                "step. Give the step the optimizer it wraps instead "
                f"({type(opt.optim).__name__}(model.parameters(), ...)) and transpile it with "
                "mode='zero', which shards that optimizer's state over the ranks")


def group_tensors_as_inputs(optimizers, stand_in) -> dict[int, torch.Tensor]:
    """A tensor among a param group's values (`lr=torch.tensor(0.01)`, as
    torch.compile's optimizer recipes set it; betas as tensors) is read by the
    traced update as any tensor the step reaches is (reads.py): a program
    input read from the group on every call, whose layout alone is in the
    signature. The group, redirected while traced (redirect_optimizer), holds
    the traced stand-in until it is restored. Returns id of each stand-in ->
    the tensor it stands for."""
    reals = {}

    def input_of(value, name, place):
        stand = stand_in(value, name, place)
        reals[id(stand)] = value
        return stand

    for oi, opt in enumerate(optimizers):
        for gi, group in enumerate(opt.param_groups):
            for key, value in list(group.items()):
                if key == "params":
                    continue
                name = f"optimizer{oi}.param_groups[{gi}][{key!r}]"
                if isinstance(value, torch.Tensor):
                    group[key] = input_of(value, name, Place(group, key))
                elif isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value):
                    group[key] = tuple(
                        input_of(v, f"{name}[{i}]", Place(group, key, (i,)))
                        if isinstance(v, torch.Tensor) else v for i, v in enumerate(value))
    return reals


def forget_state(made) -> None:
    for opt, p, key in made:
        del opt.state[p][key]
        if not opt.state[p]:
            del opt.state[p]




@contextlib.contextmanager
def redirect_optimizer(opt, traced: dict[int, torch.Tensor], state: dict[int, dict]):
    """Point an optimizer at traced tensors for the duration of the trace."""
    groups = list(opt.param_groups)
    saved_groups = [dict(g) for g in groups]
    saved_state = opt.state
    formulated = formulation_of(opt) is not None
    try:
        new_state = defaultdict(dict)
        real_of = {id(t): i for i, t in traced.items()}   # stand-in -> id of its tensor
        keys = {id(p): p for p in saved_state}
        for group in opt.param_groups:
            # a group shared with an optimizer redirected already (SAM's) holds stand-ins
            ids = [real_of.get(id(p), id(p)) for p in group["params"]]
            group["params"] = [traced[i] for i in ids]
            for i, tp in zip(ids, group["params"]):
                new_state[tp] = dict(saved_state.get(keys.get(i), {}))
                new_state[tp].update(state.get(i, {}))
            for key, value in TRACE_GROUP_OPTIONS.items() if formulated else ():
                if key in group:
                    group[key] = value
        opt.state = new_state
        yield
    finally:
        opt.state = saved_state
        added = len(opt.param_groups) - len(groups)
        opt.param_groups[:] = groups   # a group added while traced holds stand-ins
        for group, saved in zip(groups, saved_groups):
            group.clear()
            group.update(saved)
    if added:
        raise TranspileError(
            f"the step changes the param groups of {type(opt).__name__} ({len(groups)} -> "
            f"{len(groups) + added}: add_param_group inside the step): the program updates "
            "the groups it was traced with, on every call. Add the group outside the step, "
            "between calls (the next call traces again with it); nothing was changed")


def formulated_groups(optimizers, traced: dict[int, torch.Tensor],
                       hypers: dict[tuple, torch.Tensor]) -> dict[int, tuple]:
    """id of a traced parameter -> (formulation, group, terms, {name: hyper
    input}, whether it reads them as numbers) for the groups whose update takes
    its hyperparameters as inputs; each decided from the user's group options,
    before the trace forces its own (TRACE_GROUP_OPTIONS)."""
    groups = {}
    for opt in optimizers:
        form = formulation_of(opt)
        for gi, group in enumerate(opt.param_groups if form else ()):
            terms = form.terms(group)
            h = {key: hypers[(id(opt), gi, key)] for key in form.lifted(terms)}
            for p in group["params"]:
                groups[id(traced[id(p)])] = (form, group, terms, h, reads_numbers(group))
    return groups



def state_set_by_step(opt, traced_param, given: dict, before: dict):
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


