"""The ambient state: process-wide settings that change what a step computes
without being among its arguments. Grad mode, autocast (per device type),
the default dtype and torch function modes act while the step is traced, and
the program records their effect (autocast's casts, the dtype of a tensor
made from literals); deterministic algorithms, the float32 precision of
matmuls and convolutions and attention's inference fast path choose the
kernels the program runs (and the code a compiler generates). A snapshot of
all of them is part of the signature (signature.py): a call under another
state traces again and the log names the change, e.g.
`ambient autocast(cpu): off -> bfloat16`.

A program runs, and compiles, `as_traced()`: without autocast (its casts are
in the program: autocast would cast its ops again), grad mode or the caller's
torch function modes (their effect is in the program), and, by the
signature, under the deterministic and precision settings it was traced with.
A torch dispatch mode active at a call is refused (`refuse_untraceable`): the
trace would run beneath it and the program without it."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..errors import TranspileError
from .user_code import step_name

_AUTOCAST_DEVICES = tuple(torch._C._autocast_supported_devices())
# Settings that choose the kernels (or the code inductor generates), and so
# the numbers, as (name, getter, argument): the float32 precision of each
# backend's operations ("ieee", "tf32", "bf16" or "none": as the generic one),
# which torch.set_float32_matmul_precision and the older allow_tf32 flags set
# too, and the flags the new API leaves out.
_FLAGS = (
    *((f"{b}.{op}.fp32_precision" if b != "generic" else "fp32_precision",
       torch._C._get_fp32_precision_getter, (b, op))
      for b, op in (("generic", "all"), ("cuda", "matmul"), ("cuda", "conv"), ("cuda", "rnn"),
                    ("mkldnn", "matmul"), ("mkldnn", "conv"), ("mkldnn", "rnn"))),
    ("cuda.matmul.allow_fp16_reduced_precision_reduction",
     torch._C._get_cublas_allow_fp16_reduced_precision_reduction, ()),
    ("cuda.matmul.allow_bf16_reduced_precision_reduction",
     torch._C._get_cublas_allow_bf16_reduced_precision_reduction, ()),
    ("cpu.allow_fp16_reduced_precision_reduction",
     torch._C._get_cpu_allow_fp16_reduced_precision_reduction, ()),
    ("cudnn.enabled", torch._C._get_cudnn_enabled, ()),
    ("cudnn.deterministic", torch._C._get_cudnn_deterministic, ()),
    ("mkldnn.enabled", torch._C._get_mkldnn_enabled, ()),
    # MultiheadAttention's and TransformerEncoder's fused inference kernels
    ("mha.fastpath_enabled", torch.backends.mha.get_fastpath_enabled, ()),
)


class Mode(NamedTuple):
    """A torch function mode as the signature knows it: its class and its
    attributes of plain types (a mode's settings, such as DeviceContext's device)."""

    cls: str
    settings: tuple[tuple[str, Any], ...]

    def __str__(self) -> str:
        return self.cls + (f"({', '.join(f'{k}={v!r}' for k, v in self.settings)})"
                           if self.settings else "")


class Ambient(NamedTuple):
    """The ambient state of one call."""

    grad: bool
    inference: bool
    autocast: tuple[tuple[str, torch.dtype], ...]   # (device type, dtype) where it is on
    autocast_cache: bool
    default_dtype: torch.dtype
    deterministic: bool
    deterministic_warn_only: bool
    fill_uninitialized_memory: bool   # with deterministic algorithms: torch.empty is NaN
    function_modes: tuple[Mode, ...]
    dispatch_modes: tuple[str, ...]   # class names; refused
    flags: tuple   # the values of _FLAGS, in order


def snapshot() -> Ambient:
    """The ambient state now; a few microseconds (it is taken on every call)."""
    return Ambient(
        torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
        tuple((d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
              if torch.is_autocast_enabled(d)) if torch._C._is_any_autocast_enabled() else (),
        torch.is_autocast_cache_enabled(), torch.get_default_dtype(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch._C._get_deterministic_fill_uninitialized_memory(),
        tuple(_mode(m) for m in torch.overrides._get_current_function_mode_stack())
        if torch._C._len_torch_function_stack() else (),
        tuple(_qualname(m) for m in torch.utils._python_dispatch._get_current_dispatch_mode_stack())
        if torch._C._len_torch_dispatch_stack() else (),
        tuple([read(*args) for _, read, args in _FLAGS]))


def _qualname(obj) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _mode(mode) -> Mode:
    return Mode(_qualname(mode), tuple(sorted(
        (k, v) for k, v in getattr(mode, "__dict__", {}).items() if isinstance(v, _PLAIN))))


def describe_change(old: Ambient, new: Ambient) -> str:
    """What differs between two snapshots, e.g. `ambient autocast(cpu): off -> bfloat16`."""
    changes = []
    for device in dict.fromkeys([d for d, _ in old.autocast + new.autocast]):
        was, now = dict(old.autocast).get(device), dict(new.autocast).get(device)
        if was != now:
            changes.append((f"autocast({device})", _dtype(was), _dtype(now)))
    for field in _NAMES:
        was, now = getattr(old, field), getattr(new, field)
        if was != now:
            changes.append((_NAMES[field], _value(field, was), _value(field, now)))
    changes += [(name, was, now) for (name, _, _), was, now in zip(_FLAGS, old.flags, new.flags)
                if was != now]
    return "; ".join(f"ambient {what}: {was} -> {now}" for what, was, now in changes) \
        or "nothing changed"


_NAMES = {"grad": "grad mode", "inference": "inference mode", "autocast_cache": "autocast cache",
          "default_dtype": "default dtype", "deterministic": "deterministic algorithms",
          "deterministic_warn_only": "deterministic algorithms warn only",
          "fill_uninitialized_memory": "deterministic fill of uninitialized memory",
          "function_modes": "torch function modes", "dispatch_modes": "torch dispatch modes"}


def _dtype(dtype: torch.dtype | None) -> str:
    return "off" if dtype is None else str(dtype).replace("torch.", "")


def _value(field: str, value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, torch.dtype):
        return _dtype(value)
    if field.endswith("modes"):
        return f"[{', '.join(map(str, value))}]" if value else "none"
    return str(value)


def refuse_untraceable(step_fn, ambient: Ambient) -> None:
    """A call the step cannot be traced under: a torch dispatch mode is active
    (the trace would run beneath it, the program outside it)."""
    if ambient.dispatch_modes:
        raise TranspileError(
            f"{step_name(step_fn)} was called under a torch dispatch mode "
            f"({', '.join(ambient.dispatch_modes)}): a transpiled step is traced once and "
            "then runs as a program, so such a mode would neither see the step's operations "
            "nor apply to them. Call the step outside the mode (to study its operations, "
            "run the eager step under it)")


class as_traced:
    """Run (or compile) a program as the trace left it: grad mode off,
    autocast off on every device, the caller's torch function modes set
    aside; all restored on exit. A few microseconds: it wraps every run."""

    def __enter__(self):
        self.modes = []
        while torch._C._len_torch_function_stack():
            self.modes.append(torch._C._pop_torch_function_stack())
        self.grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        self.autocast = [d for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)] \
            if torch._C._is_any_autocast_enabled() else []
        for device in self.autocast:
            torch.set_autocast_enabled(device, False)
        return self

    def __exit__(self, *exc):
        for device in self.autocast:
            torch.set_autocast_enabled(device, True)
        torch._C._set_grad_enabled(self.grad)
        for mode in reversed(self.modes):
            torch._C._push_on_torch_function_stack(mode)
