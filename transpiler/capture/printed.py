"""What the step's Python prints and logs while it is traced, shown again
after every later run of its program.

The program runs without the step's Python, so a `print` or a `logging` call
in the step would show once, at the trace, where eager shows it on every call
(`print(f"lr {lr} batch {tuple(x.shape)}")`, `log.info("step done")`). What
the trace printed to stdout, and the records the user's own code logged, are
kept with the program and shown again after each run that did not trace. A
tensor's value the step's own code prints is filled in from each run's
outputs (text_values.py; the trace's own text is then shown after its run).
Every other value in that text is one the program holds fixed: a plain value
the trace read is guarded, a tensor's value turned into text otherwise or a
symbolic size is a decision or a guard (value_text.py), so a call that would
print otherwise runs another program, traced again (which prints its own).
What goes to stderr (warnings, which eager shows once per line) and the
records of library code (torch, transformers' warn-once loggers) show at the
trace only.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import logging
import sys
import time
from unittest import mock

from .text_values import Renders
from .user_code import is_user_file


@dataclasses.dataclass(frozen=True)
class Output:
    """What one trace printed to stdout, and the records the user's code
    logged (each with its message already formatted, and its logger)."""

    text: str
    records: tuple[tuple[logging.Logger, logging.LogRecord], ...]
    # how the tensor values it holds are filled in from a run's outputs; None:
    # it holds none, and the trace showed it
    renders: Renders | None = None

    def show_again(self, values: list) -> None:
        """Show it after a run; `values`: what the run output for its renders."""
        fill = (lambda text: text) if self.renders is None \
            else (lambda text: self.renders.fill(text, values))
        sys.stdout.write(fill(self.text))
        for logger, record in self.records:
            if logger.isEnabledFor(record.levelno):
                again = copy.copy(record)
                again.msg = fill(record.msg)
                again.created = time.time()
                again.msecs = again.created % 1 * 1000
                again.relativeCreated = (again.created - logging._startTime) * 1000
                logger.handle(again)


_CALL_HANDLERS = logging.Logger.callHandlers


class Printed:
    """While a step is traced: its stdout and stderr, and the records its own
    code logs, kept; shown once the trace is over, unless the trace is done
    again on this call's values (it stopped at a decision on one), which
    shows them again."""

    def __init__(self):
        self._out, self._err = io.StringIO(), io.StringIO()
        self._records: list = []
        self._redirects = contextlib.ExitStack()

    def __enter__(self):
        self._redirects.enter_context(contextlib.redirect_stdout(self._out))
        self._redirects.enter_context(contextlib.redirect_stderr(self._err))
        records = self._records

        def call_handlers(logger, record):
            if not is_user_file(record.pathname):
                return _CALL_HANDLERS(logger, record)
            kept = copy.copy(record)
            kept.msg, kept.args = record.getMessage(), None   # the text as traced
            records.append((logger, kept))
        self._redirects.enter_context(mock.patch.object(logging.Logger, "callHandlers",
                                                        call_handlers))
        return self

    def __exit__(self, *exc_info):
        self._redirects.close()

    def show(self) -> None:
        sys.stdout.write(self._out.getvalue())
        sys.stderr.write(self._err.getvalue())
        for logger, record in self._records:
            _CALL_HANDLERS(logger, record)

    def texts(self) -> list[str]:
        """What the user's code printed to stdout and logged."""
        return [self._out.getvalue(), *(record.msg for _, record in self._records)]

    def output(self, renders: Renders | None) -> Output | None:
        """What to show again after each later run, if anything."""
        text = self._out.getvalue()
        return Output(text, tuple(self._records), renders) if text or self._records else None
