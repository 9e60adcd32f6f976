"""torch.amp.GradScaler as part of a static program.

GradScaler keeps its scale and growth tracker in tensors and computes with
tensor ops, except for one decision: step() reads found_inf with .item() and
calls optimizer.step() only if it is zero. While a step is traced, a scaler
among the step's arguments has its two tensors swapped for program inputs (the
scaler's update writes their new values back, as state), and that decision
becomes data: optimizer.step() is always traced, and afterwards every value the
optimizer writes (parameters, optimizer state) is selected with where(found_inf
== 0, new, old). found_inf is computed by unscale_ from the gradients it reads,
which are the averaged ones (it runs between backward() and the step), so every
rank skips alike with no extra collective and no host synchronization.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from .slots import misfit_in
from ..errors import TranspileError
from ..program.program import Program, keep_old_unless, new_node, selected_update
from ..program.roles import SKIPPABLE, Role

GradScaler = torch.amp.GradScaler
# Held on the node of found_inf in the traced graph: the index of the optimizer
# whose step it decides.
SKIPS = "skips_step_of"
_ATTRS = ("_scale", "_growth_tracker")


@dataclasses.dataclass(frozen=True)
class ScalerSlot:
    """One of a GradScaler's state tensors (InputKind.SCALER)."""

    scaler: GradScaler
    attr: str

    def read(self, leaves):
        return getattr(self.scaler, self.attr)

    def misfit(self, value) -> str | None:
        return misfit_in(getattr(self.scaler, self.attr), value)

    def write(self, value):
        getattr(self.scaler, self.attr).copy_(value)

    def mirror(self, memo: dict):
        return getattr(memo[id(self.scaler)], self.attr)


def scaler_slots(scalers: list[GradScaler], device: torch.device) -> list[tuple[str, ScalerSlot]]:
    """(name, slot) of each enabled scaler's state tensors, created where the
    scaler has not made them yet (its first scale() would, on the model's device)."""
    slots = []
    for si, scaler in enumerate(scalers):
        if not scaler.is_enabled():
            continue
        if scaler._scale is None:
            scaler._lazy_init_scale_growth_tracker(device)
        prefix = f"scaler{si}" if len(scalers) > 1 else "scaler"
        slots += [(f"{prefix}.{attr.lstrip('_')}", ScalerSlot(scaler, attr)) for attr in _ATTRS]
    return slots


def signature_of(scaler: GradScaler) -> tuple:
    """What a program bakes in of a scaler (its factors are Python numbers)."""
    if not scaler.is_enabled():
        return (id(scaler), False)
    return (id(scaler), True, scaler.get_growth_factor(), scaler.get_backoff_factor(),
            scaler.get_growth_interval())


@contextlib.contextmanager
def traced_scalers(scalers: list[GradScaler], values: dict[tuple[int, str], torch.Tensor],
                   optimizers: list[torch.optim.Optimizer], node_of, step_fn_name: str):
    """While tracing: the scalers among the step's arguments compute on the
    program's inputs, and their step() traces optimizer.step() unconditionally,
    marking the node of found_inf with the optimizer it decides. A scaler the
    step reaches another way (a closure, a global) is an error."""
    ours = {id(s) for s in scalers}
    scalers = [s for s in scalers if s.is_enabled()]   # a disabled one passes through
    index = {id(opt): oi for oi, opt in enumerate(optimizers)}
    saved = [(s, {a: getattr(s, a) for a in _ATTRS}) for s in scalers]
    amp_scaling = [(opt, vars(opt).get("_step_supports_amp_scaling")) for opt in optimizers
                   if "_step_supports_amp_scaling" in vars(opt)]
    original_scale = GradScaler.scale
    stepped: set[int] = set()   # the optimizers a scaler has stepped in this trace

    def maybe_step(self, optimizer, optimizer_state, *args, **kwargs):
        # unscale_ wrote found_inf in place (an op without outputs, so its node
        # is the tensor's value before): mark a copy taken now, and hand the copy
        # to update(), which reads it, so that it stays in the program.
        if id(optimizer) in stepped:
            raise TranspileError(
                f"{step_fn_name} steps {type(optimizer).__name__} through a GradScaler twice in "
                "one call (a critic stepped several times): a program skips each optimizer's "
                "updates of a call together, where eager skips each step on its own found_inf; "
                "step it once per call through the scaler (one critic update per call)")
        stepped.add(id(optimizer))
        flags = optimizer_state["found_inf_per_device"]
        for device, found in list(flags.items()):
            flags[device] = found.clone()
            node_of(flags[device]).meta[SKIPS] = index[id(optimizer)]
        return optimizer.step(*args, **kwargs)

    def scale(self, outputs):
        if id(self) not in ours:
            raise TranspileError(
                f"{step_fn_name} uses a GradScaler that is not among its arguments nor reached "
                "from them when the call starts (one made inside the step, `if self.scaler is "
                "None:`, is new to every trace): make it before the first call and pass it as "
                "one, e.g. step(model, optimizer, scaler, x, y), or keep it where the step "
                "reaches it (an attribute of the object whose method is the step), so that "
                "its scale is state of the program")
        return original_scale(self, outputs)

    try:
        for scaler in scalers:
            for attr in _ATTRS:
                if (id(scaler), attr) in values:
                    setattr(scaler, attr, values[(id(scaler), attr)])
            scaler._maybe_opt_step = maybe_step.__get__(scaler)
        for opt, _ in amp_scaling:   # fused optimizers: unscaled by the scaler instead
            opt._step_supports_amp_scaling = False
        GradScaler.scale = scale
        yield
        for scaler in scalers:
            if any(state["found_inf_per_device"] for state in scaler._per_optimizer_states.values()):
                raise TranspileError(
                    f"{step_fn_name} calls scaler.step() but not scaler.update() after it: call "
                    "scaler.update() inside the step, where the program can update the scale")
    finally:
        GradScaler.scale = original_scale
        for opt, value in amp_scaling:
            opt._step_supports_amp_scaling = value
        for scaler, attrs in saved:
            for attr, value in attrs.items():
                setattr(scaler, attr, value)
            vars(scaler).pop("_maybe_opt_step", None)
            scaler._per_optimizer_states.clear()


def guard_skipped_steps(program: Program, optimizer_of: list[int | None]) -> None:
    """Every output optimizer i writes (optimizer_of[k] == i for output k) keeps
    its old value unless the found_inf flags marked with i are all zero (one
    flag per device its gradients are on)."""
    flags: dict[int, list] = {}
    for n in program.graph.nodes:
        if SKIPS in n.meta:
            flags.setdefault(n.meta[SKIPS], []).append(n)
    if not flags:
        return
    ok = {}
    for i, found in flags.items():
        # where its flags are known: before the optimizer's step, so that what
        # reads the step's values later in the program can read the selected ones
        with program.graph.inserting_before(found[-1].next):
            for flag in found:
                clear = new_node(program.graph, torch.ops.aten.eq.Scalar, (flag, 0), Role.OPTIMIZE)
                ok[i] = clear if i not in ok else new_node(
                    program.graph, torch.ops.aten.logical_and.default, (ok[i], clear), Role.OPTIMIZE)
    keep_old_unless(program, [ok.get(i) for i in optimizer_of], skippable=True)
    _read_as_selected(program)


def _read_as_selected(program: Program) -> None:
    """What reads a value a skippable update writes, other than that update
    itself, reads its select instead, placed where the value is computed: an
    EMA of the parameters or a validation forward after scaler.step(), a GAN's
    generator step through the discriminator just updated, each sees the old
    value where eager skipped optimizer.step(). The update's own nodes (what
    only the selects' new values read) keep reading the new values, so that a
    step with no such reader keeps its selects at the end, where a backend
    that reads the host cuts the update off (backends/skipped_update.py)."""
    graph = program.graph
    selects = [n for n in graph.nodes if n.meta.get(SKIPPABLE)]
    for ok in dict.fromkeys(n.args[0] for n in selects):
        chosen = {n for n in selects if n.args[0] is ok}
        update = selected_update(graph, chosen)
        for select in [n for n in graph.nodes if n in chosen]:
            new, old = select.args[1], select.args[2]
            readers = [u for u in new.users if u not in (select, old) and u not in update]
            if not readers:
                continue
            position = {n: i for i, n in enumerate(graph.nodes)}
            # what read the value before the step decided (an input the update
            # leaves as it is, read by the forward) is not the update's
            after = max(new, ok, key=position.__getitem__)
            readers = [u for u in readers if position[u] > position[after]]
            if not readers:
                continue
            if old.op != "placeholder":   # zeros for state the step creates
                after.append(old)
                old.append(select)
            else:
                after.append(select)
            for reader in readers:
                reader.replace_input_with(new, select)
