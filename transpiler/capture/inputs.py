"""What becomes a program input: every parameter, buffer, .grad, optimizer state
entry, lifted hyperparameter, GradScaler value and batch tensor, with its slot."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .optimizers import formulation_of, reads_numbers
from ..program.program import Hyper, InputKind, InputSpec, same_layout
from .scaler import scaler_slots
from .arguments import StepArgs
from .optimizer_state import opt_params
from .observed_arrays import is_ndarray
from .numbers import NumberSlot
from .slots import ArraySlot, DataSlot, GradSlot, HyperSlot, ParamSlot, StateSlot


@dataclasses.dataclass
class Inputs:
    specs: list[InputSpec] = dataclasses.field(default_factory=list)
    slots: list = dataclasses.field(default_factory=list)
    # What the trace sees of each input: the tensor, or a tensor of its layout.
    # Parameters are detached: fake tensors would otherwise also copy their .grad.
    values: list[torch.Tensor] = dataclasses.field(default_factory=list)
    param_names: dict[int, str] = dataclasses.field(default_factory=dict)
    params: list[torch.Tensor] = dataclasses.field(default_factory=list)  # by param_names order
    # argument leaves that are a parameter or buffer input: leaf index -> that tensor
    state_leaves: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def add(self, spec, slot, value):
        self.specs.append(spec)
        self.slots.append(slot)
        self.values.append(value)


def collect_inputs(step_args: StepArgs, state_stand_in: Callable | None = None) -> Inputs:
    inputs = Inputs()
    modules, optimizers = step_args.modules, step_args.optimizers
    for mi, module in enumerate(modules):
        prefix = f"m{mi}." if len(modules) > 1 else ""
        for name, p in module.named_parameters():
            if id(p) not in inputs.param_names:
                inputs.param_names[id(p)] = prefix + name
                inputs.params.append(p)
                inputs.add(InputSpec(InputKind.PARAM, prefix + name, module=mi), ParamSlot(p),
                           p.detach())
        for name, b in module.named_buffers():
            inputs.add(InputSpec(InputKind.BUFFER, prefix + name, module=mi), ParamSlot(b), b)
    for oi, opt in enumerate(optimizers):
        for p in opt_params(opt):
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
            stand_in = same_layout(g)
            inputs.add(InputSpec(InputKind.GRAD, f"{name}.grad", param=name), GradSlot(p),
                       stand_in)
    for oi, opt in enumerate(optimizers):
        oname = f"opt{oi}." if len(optimizers) > 1 else ""
        for p in opt_params(opt):
            pname = inputs.param_names[id(p)]
            for key, value in sorted(opt.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    inputs.add(InputSpec(InputKind.STATE, f"{oname}{pname}:{key}", param=pname),
                               StateSlot(opt, p, key),
                               state_stand_in(p, value) if state_stand_in else value)
        form = formulation_of(opt)
        for gi, group in enumerate(opt.param_groups if form else ()):
            # read as numbers (reads_numbers): float64, so .item() gives eager's
            # double, and on the host, so reading it does not wait for a device
            numbers = reads_numbers(group)
            wide = numbers or any(p.dtype == torch.float64 for p in group["params"])
            device = group["params"][0].device if group["params"] and not numbers \
                else torch.device("cpu")
            for key in form.lifted(form.terms(group)):
                slot = HyperSlot(opt, gi, key, torch.float64 if wide else torch.float32, device)
                spec = InputSpec(InputKind.HYPER, f"{oname}{key}[{gi}]", hyper=Hyper(key, gi, oi))
                inputs.add(spec, slot, slot.read(None))
    device = inputs.params[0].device if inputs.params else torch.device("cpu")
    for name, slot in scaler_slots(step_args.scalers, device):
        inputs.add(InputSpec(InputKind.SCALER, name), slot, slot.read(None))
    held = {id(slot.tensor): slot.tensor for slot in inputs.slots if isinstance(slot, ParamSlot)}
    for i, leaf in enumerate(step_args.leaves):
        if isinstance(leaf, torch.Tensor) and id(leaf) in held:
            # a parameter or buffer passed itself (SAC's log_alpha beside the optimizer
            # that steps it): the step reads that input, as eager reads the tensor
            inputs.state_leaves[i] = leaf
        elif isinstance(leaf, torch.Tensor):
            inputs.add(InputSpec(InputKind.DATA, step_args.names[i]), DataSlot(i), leaf)
        elif is_ndarray(leaf):
            inputs.add(InputSpec(InputKind.DATA, step_args.names[i]), ArraySlot(i),
                       torch.from_numpy(leaf))
        elif i in step_args.lifted:
            inputs.add(InputSpec(InputKind.NUMBER, step_args.names[i]), NumberSlot(i),
                       NumberSlot(i).read(step_args.leaves))
    return inputs



