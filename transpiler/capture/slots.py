"""What each program input is read from and each output written to: the live
tensors of the model, the optimizers, the step's held tensors and its arguments.
A slot written to says why a value does not fit it (`misfit`, None where it
does) before anything is written: the executor asks every target of a program
first, so its write-back is all or nothing."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .optimizers import hyper_value
from .observed_arrays import is_ndarray
from .reads import Place, put


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """A parameter or buffer of a module: fed as is (programs run under
    no_grad), written back in place."""

    tensor: torch.Tensor

    def read(self, leaves):
        return self.tensor

    def misfit(self, value) -> str | None:
        return misfit_in(self.tensor, value)

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

    def misfit(self, value) -> str | None:
        return not_a_tensor(value)

    def write(self, value):
        _store(self.optimizer.state[self.param], self.key, value)

    def mirror(self, memo: dict):
        return memo[id(self.optimizer)].state[memo[id(self.param)]].get(self.key)


@dataclasses.dataclass(frozen=True)
class HeldSlot:
    """A tensor the transpiled step keeps between calls (InputKind.HELD).
    `rebind`: the program's own tensor is kept, not copied (a collective's
    result not yet waited on: its work is that tensor's)."""

    store: dict
    name: str
    rebind: bool = False

    def read(self, leaves):
        return self.store[self.name]

    def misfit(self, value) -> str | None:
        return not_a_tensor(value)

    def write(self, value):
        if self.rebind:
            self.store[self.name] = value
        else:
            _store(self.store, self.name, value)

    def mirror(self, memo: dict):
        return None   # the eager step has no such tensor


@dataclasses.dataclass(frozen=True)
class GradSlot:
    """A parameter's .grad: read when the step starts with one (InputKind.GRAD),
    set to the program's value when the step leaves one (OutputKind.GRAD). The
    value is the program's own tensor (for a reduced gradient, a view of its
    bucket, as DDP's gradient_as_bucket_view), not a copy; where the program
    read the .grad the call started with (`in_place`: the step zeroes it in
    place or accumulates into it), the value is copied into that tensor, as
    eager's backward() accumulates into it: a reference to it held elsewhere (a
    flat gradient buffer whose views they are) sees the new values."""

    param: torch.Tensor
    in_place: bool = False

    def read(self, leaves):
        return self.param.grad

    def misfit(self, value) -> str | None:
        """Why torch would refuse `value` as the parameter's .grad, or None."""
        p = self.param
        if not isinstance(value, torch.Tensor) or value is p:
            return not_a_tensor(value) or "the parameter itself"
        if (value.shape != p.shape or value.device != p.device
                or p.grad_dtype is not None and value.dtype != p.grad_dtype):
            return f"{describe(value)} for a gradient of {describe(p, p.grad_dtype or p.dtype)}"
        return None

    def write(self, value):
        grad = self.param.grad
        if self.in_place and grad is not None and grad is not value \
                and misfit_in(grad, value) is None:
            grad.copy_(value)
        else:
            self.param.grad = value

    def mirror(self, memo: dict):
        return memo[id(self.param)].grad


def misfit_in(tensor: torch.Tensor, value) -> str | None:
    """Why `value` cannot be copied into `tensor` as the value it holds next
    (copy_ would broadcast its shape, convert its dtype, move it), or None."""
    if not isinstance(value, torch.Tensor):
        return not_a_tensor(value)
    if value.shape != tensor.shape or value.dtype != tensor.dtype or value.device != tensor.device:
        return f"{describe(value)} for a tensor of {describe(tensor)}"
    return None


def not_a_tensor(value) -> str | None:
    return None if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"


def describe(t: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    """float32[8, 16] on cpu"""
    return f"{str(dtype or t.dtype).replace('torch.', '')}{list(t.shape)} on {t.device}"


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
    tensor (a vector with an entry per parameter of the group for a value
    derived from each one's step count, such as Adam's bias corrections) of
    float64 if the group has a float64 parameter, else float32.
    Kernels compute a float32 tensor op in float32 whatever the scalar's
    width, so this rounds exactly as eager's Python-float alpha, and saves a
    conversion per tensor. A group that reads its values as Python numbers
    (optimizers.reads_numbers: a bfloat16 or float16 parameter, or one off the
    CPU, with backend eager) reads float64, so that each is eager's double."""

    optimizer: torch.optim.Optimizer
    group: int
    key: str
    dtype: torch.dtype
    # the group's (a compiled device graph reads no host tensor); the host for a
    # group read as numbers (optimizers.reads_numbers)
    device: torch.device
    ahead: int = 0         # Hyper.ahead

    def read(self, leaves):
        return torch.tensor(hyper_value(self.optimizer, self.group, self.key, self.ahead),
                            dtype=self.dtype, device=self.device)


@dataclasses.dataclass(frozen=True)
class DataSlot:
    """A tensor among the step's arguments (the batch)."""

    leaf: int

    def read(self, leaves):
        return leaves[self.leaf]


@dataclasses.dataclass(frozen=True)
class ArraySlot:
    """A numpy array among the step's arguments, fed as a tensor sharing its memory."""

    leaf: int

    def read(self, leaves):
        return torch.from_numpy(leaves[self.leaf])


@dataclasses.dataclass(frozen=True)
class ReachedSlot:
    """A tensor (or numpy array) the step reads outside its arguments, through
    a host path (a global, a closure cell, an object's attribute): read through
    that path again on every call, its layout guarded (capture/reads.py)."""

    place: Place

    def read(self, leaves):
        value = self.place.read()
        return torch.from_numpy(value) if is_ndarray(value) else value

    # a tensor the step changes in place (an EMA's shadow parameters in a
    # list, a meter's tensor sum): written back into the tensor at that path
    def misfit(self, value) -> str | None:
        return misfit_in(self.read(None), value)

    def write(self, value):
        self.read(None).copy_(value)

    def mirror(self, memo: dict):
        return None   # outside the arguments: the eager step's copy reaches the same


@dataclasses.dataclass(frozen=True)
class AssignSlot:
    """A host attribute the step assigns a tensor it computed to: the
    program's output is assigned to it after every call, as the step would."""

    holder: Any
    key: Any

    def misfit(self, value) -> str | None:
        return not_a_tensor(value)   # rebound, as the step rebinds it

    def write(self, value):
        put(self.holder, self.key, value)

    def mirror(self, memo: dict):
        return None   # the eager step's copy assigns its own
