"""requires_grad flags the step sets on its parameters (a GAN's
`for p in netD.parameters(): p.requires_grad = False` before the generator's
step, a fine-tuning script freezing a backbone inside the step).

The trace runs the step on stand-ins, so the flag it sets lands on a stand-in:
each parameter whose flag the step leaves other than it found it is written
back after every call, as a host write (undone and redone as the others:
runtime/program_cache.py). The next call then starts from the new flag, which
the signature sees (signature.py), as eager's next call does."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(eq=False)
class FlagWrite:
    """Parameter `name`'s requires_grad, `before` the step and `after` it."""

    name: str
    param: torch.Tensor
    before: bool
    after: bool

    key = "requires_grad"

    @property
    def holder(self) -> torch.Tensor:
        return self.param

    def undo(self) -> None:
        self.param.requires_grad_(self.before)

    def redo(self) -> None:
        self.param.requires_grad_(self.after)

    def change(self) -> str:
        return f"{self.before} -> {self.after}"

    def describe(self) -> str:
        return f"{self.name}.requires_grad {self.change()}"


def flags_changed(params: list[torch.Tensor], traced: dict[int, torch.Tensor],
                  names: dict[int, str]) -> list[FlagWrite]:
    """The parameters whose stand-in in `traced` ends the trace with another
    requires_grad flag than the parameter has."""
    return [FlagWrite(names[id(p)], p, p.requires_grad, traced[id(p)].requires_grad)
            for p in params if traced[id(p)].requires_grad != p.requires_grad]
