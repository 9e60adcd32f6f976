"""State the step writes through Python rather than through tensor ops: a
buffer re-assigned in forward (`self.avg = 0.9 * self.avg + ...`) and a
parameter's data replaced (`p.data = p.data.clamp(...)`). Eager changes the
module's state; a trace would drop the write (the traced tensors are put back
when the trace ends). While the step is traced, each such write becomes an
in-place copy into the traced parameter or buffer, which the program then writes
back like every state it updates. A write that changes the shape or the dtype,
or removes the tensor, is refused, naming it. A module converted in the step
(`self.classifier = self.classifier.to(self.dtype)`, a router's) is left as
it is where the conversion changes nothing, as in eager; else refused."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ..errors import TranspileError
from .user_code import step_name, user_line

_DATA = vars(torch._C.TensorBase)["data"]
_APPLY = torch.nn.Module._apply


@contextlib.contextmanager
def state_writes_kept(step_fn, modules, traced: set[int],
                      read_elsewhere: Callable[[torch.Tensor], str | None]):
    """`traced`: ids of the traced parameters and buffers now in the modules;
    `read_elsewhere(t)`: the path through which the step also read the tensor
    that t stands in for (an alias held in a plain attribute), or None."""
    installed = [(name, sub, kind, key, t) for module in modules
                 for name, sub in module.named_modules()
                 for kind in ("_parameters", "_buffers")
                 for key, t in getattr(sub, kind).items() if t is not None]

    # `p.data = t` makes p and t share memory in eager: what later updates p in
    # place updates t (SAM's `p.data = state["old_p"]`, then the optimizer's
    # step). Each such t ends the step holding the value p has when the step
    # ends (or is pointed elsewhere); where nothing reads t, that copy is dead.
    shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def set_data(tensor, value):
        if id(tensor) not in traced:
            return _DATA.__set__(tensor, value)
        _unshare(shared.pop(id(tensor), None))
        _copy_into(step_fn, tensor, value, "its .data")
        if isinstance(value, torch.Tensor) and value is not tensor:
            shared[id(tensor)] = (tensor, value)

    def converted(module, fn, recurse=True):
        """Module._apply (module.to(...), .float(), .cpu()): a conversion
        that leaves every tensor as it is, as eager's returns the module
        untouched; one that would convert a traced tensor is refused."""
        tensors = [t for t in (*module.parameters(recurse=recurse),
                               *module.buffers(recurse=recurse))]
        if all(fn(t) is t for t in tensors):
            return module
        if any(id(t) in traced for t in tensors):
            raise TranspileError(
                f"{step_name(step_fn)} converts {type(module).__name__}'s parameters or "
                f"buffers (module.to, .float(), .half()){user_line(step_fn)}: a transpiled step "
                "writes them in place, in their dtype and device; convert the model before the "
                "first call")
        return _APPLY(module, fn, recurse)

    torch.Tensor.data = property(_DATA.__get__, set_data)
    torch.nn.Module._apply = converted
    try:
        yield
        for pair in shared.values():
            _unshare(pair)
    finally:
        del torch.Tensor.data
        torch.nn.Module._apply = _APPLY
    for name, sub, kind, key, t in installed:
        now = getattr(sub, kind).get(key)
        if now is not t:
            getattr(sub, kind)[key] = t
            what = f"{name + '.' if name else ''}{key}"
            alias = read_elsewhere(t)
            if alias is not None:
                raise TranspileError(
                    f"{step_name(step_fn)} replaces {what}{user_line(step_fn)}, whose tensor it "
                    f"also reads as {alias}: eager points {what} at the new tensor and leaves "
                    f"{alias} as it was, where a transpiled step writes the new value into the "
                    f"tensor in place, which {alias} would see. Keep a copy "
                    f"({alias} = {key}.clone()) where the module is built")
            _copy_into(step_fn, t, now, what)


def _unshare(pair) -> None:
    if pair is not None:
        target, source = pair
        with torch.no_grad():
            source.copy_(target)


def _copy_into(step_fn, target: torch.Tensor, value, what: str) -> None:
    if not isinstance(value, torch.Tensor) or value.shape != target.shape \
            or value.dtype != target.dtype or value.device != target.device:
        new = ("None" if value is None else f"a {type(value).__name__}"
               if not isinstance(value, torch.Tensor)
               else f"{str(value.dtype).replace('torch.', '')}{list(value.shape)} on {value.device}")
        raise TranspileError(
            f"{step_name(step_fn)} replaces {what} "
            f"({str(target.dtype).replace('torch.', '')}{list(target.shape)} on {target.device}) "
            f"with {new}{user_line(step_fn)}: a transpiled step writes parameters and buffers in "
            "place, so the new value must keep the shape, dtype and device; assign outside the "
            "step, or register a buffer of the new layout")
    with torch.no_grad():
        target.copy_(value)
