"""Tensor values the step's own code prints, filled in after every run.

`print(f"loss {loss.item():.4f}")` or `print(loss)` in the step turns a value
of the program into text. The program runs without the step's Python, so the
text the trace printed is shown again after each later run (printed.py); were
the value a decision, each call with another loss would trace again. Instead,
while the step is traced, the user's code turning such a value into text
(str, repr, a format spec, a conversion of its logging call's message; a
symbolic number holding a tensor's value, or a traced tensor) gets a marker,
and the value becomes an output of the program (as a returned one,
returned.py): each run's text is the trace's, with every marker replaced by
that run's value turned into text as eager turns it.

A marker is only good in what goes to stdout or to the user's logging: text
used in any other way (a dict key, a comparison, a file name, stderr) would
hold it. A trace whose markers do not all reach stdout or a log record, or
that fails once it made one, is traced again without them: each such value a
decision, as before (value_text.py).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import torch

_MARKER = "\x00transpiler-value-{}\x00"
_MARKED = re.compile("\x00transpiler-value-(\\d+)\x00")


class WithoutTextValues(Exception):
    """The trace made markers and then failed, or let one reach something other
    than the printed text: trace again, with such values decisions."""


@dataclasses.dataclass
class TextValues:
    """The values one trace turned into text, each with its rendering."""

    values: list[Any] = dataclasses.field(default_factory=list)   # SymNumbers, tensors
    renders: list[Callable[[Any], str]] = dataclasses.field(default_factory=list)
    # symbols whose values are not filled in: the clocks' (read before the run,
    # a time measured in the step would not be the step's; host_random.py)
    unmarked: set = dataclasses.field(default_factory=set)

    def markable(self, number) -> bool:
        """Whether a symbolic number's text can be filled in after the run."""
        return not number.node.expr.free_symbols & self.unmarked

    def mark(self, value, render: Callable[[Any], str]) -> str:
        """The marker standing for render(value's value at a run)."""
        self.values.append(value)
        self.renders.append(render)
        return _MARKER.format(len(self.values) - 1)

    def mark_tensor(self, t: torch.Tensor, render: Callable[[torch.Tensor], str]) -> str:
        """A traced tensor's text: its value now (a copy: it may be written in
        place later), rendered from the run's real tensor."""
        return self.mark(t.detach().clone(), render)

    def check_shown(self, texts: list[str]) -> None:
        """Every marker reached one of the texts printed or logged."""
        seen = {int(k) for text in texts for k in _MARKED.findall(text)}
        if seen != set(range(len(self.values))):
            raise WithoutTextValues("a value turned into text is used otherwise than printed")


@dataclasses.dataclass(frozen=True)
class Renders:
    """How a program's printed text is filled in: each marker's rendering,
    from the values the run outputs for them (in order)."""

    renders: tuple[Callable[[Any], str], ...]

    def fill(self, text: str, values: list) -> str:
        return _MARKED.sub(lambda m: self.renders[int(m.group(1))](values[int(m.group(1))]), text)
