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

A file the step writes is written the same way after every run: one it
reaches on the host (`self.log_file.write(...)`, `print(..., file=f)` with `f`
an attribute, a global or an argument) is given to the trace as a stand-in
that keeps what is written, and one the user's code opens to write inside
the step (`with open("loss.txt", "a") as f`) is opened again after every run
and written. The trace writes nothing into the file itself, so a trace that
stops, or is done again on this call's values, leaves it as it was. Reading or
moving in such a file (read, seek, tell) is refused: the program could not
give the step what it would read.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import dataclasses
import io
import logging
import sys
import time
from typing import Any
from unittest import mock

from ..errors import TranspileError
from .text_values import Renders
from .user_code import called_by_user, is_user_file, step_name, user_line


@dataclasses.dataclass(frozen=True)
class Output:
    """What one trace printed to stdout, and the records the user's code
    logged (each with its message already formatted, and its logger)."""

    text: str
    records: tuple[tuple[logging.Logger, logging.LogRecord], ...]
    # how the tensor values it holds are filled in from a run's outputs; None:
    # it holds none, and the trace showed it
    renders: Renders | None = None
    files: tuple[_File, ...] = ()   # what it wrote to files, in the order first written

    def show_again(self, values: list) -> None:
        """Show it after a run; `values`: what the run output for its renders."""
        fill = (lambda text: text) if self.renders is None \
            else (lambda text: self.renders.fill(text, values))
        sys.stdout.write(fill(self.text))
        for file in self.files:
            file.write(fill)
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

    def __init__(self, step_fn):
        self._step_fn = step_fn
        self._out, self._err = io.StringIO(), io.StringIO()
        self._records: list = []
        self._files: list[_File] = []
        self._redirects = contextlib.ExitStack()

    def __enter__(self):
        self._redirects.enter_context(contextlib.redirect_stdout(self._out))
        self._redirects.enter_context(contextlib.redirect_stderr(self._err))
        self._redirects.enter_context(mock.patch.object(builtins, "open", self._open))
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

    def show(self, files: bool = True) -> None:
        """Show what the trace printed and logged, and write its files (not
        where the trace failed)."""
        sys.stdout.write(self._out.getvalue())
        sys.stderr.write(self._err.getvalue())
        for logger, record in self._records:
            _CALL_HANDLERS(logger, record)
        for file in self._files if files else ():
            file.write(lambda text: text)

    def texts(self) -> list[str]:
        """What the user's code printed to stdout, logged and wrote to files."""
        return [self._out.getvalue(), *(record.msg for _, record in self._records),
                *(f.text for f in self._files if isinstance(f.text, str))]

    def output(self, renders: Renders | None) -> Output | None:
        """What to show again after each later run, if anything."""
        text, files = self._out.getvalue(), tuple(f for f in self._files if f.text)
        return Output(text, tuple(self._records), renders, files) \
            if text or self._records or files else None

    def stream_stand_in(self, value, name: str) -> Any:
        """The stand-in for a file the step reaches at `name` (None for any
        other value): what the step writes to it is kept."""
        if not isinstance(value, io.IOBase):
            return None
        file = _File(self._step_fn, name, stream=value)
        self._files.append(file)
        return _Writing(file)

    def _open(self, path, mode="r", *args, **kwargs):
        """builtins.open while traced: a file the user's code opens to write
        is written after the trace (and every later run), not now."""
        if not isinstance(mode, str) or "r" in mode or not called_by_user(_this_file):
            return _OPEN(path, mode, *args, **kwargs)
        file = _File(self._step_fn, f"open({path!r}, {mode!r})",
                     opened=(path, mode.replace("w", "a") if self._opened(path) else mode,
                             args, kwargs))
        self._files.append(file)
        return _Writing(file)

    def _opened(self, path) -> bool:
        """Whether the trace opened `path` before (a second open appends to
        what the first wrote in this call, as eager's second open would find
        it)."""
        return any(f.opened is not None and f.opened[0] == path for f in self._files)


_OPEN = builtins.open


def _this_file(filename: str) -> bool:
    return filename == __file__


@dataclasses.dataclass(eq=False)
class _File:
    """A file the step writes to: a stream it reached, or one its code opens
    (`opened`: open()'s arguments); what the trace wrote to it."""

    step_fn: Any
    name: str
    stream: Any = None
    opened: tuple | None = None
    text: Any = None   # str or bytes, as written

    def add(self, data) -> None:
        self.text = data if self.text is None else self.text + data

    def write(self, fill) -> None:
        """Write what the trace wrote (`fill`: how a run's values fill its text)."""
        if self.text is None and self.opened is None:
            return
        data = fill(self.text) if isinstance(self.text, str) else self.text
        if self.opened is None:
            self.stream.write(data)
            self.stream.flush()
            return
        path, mode, args, kwargs = self.opened
        with _OPEN(path, mode, *args, **kwargs) as f:
            if data is not None:
                f.write(data)

    def refused(self, what: str) -> TranspileError:
        return TranspileError(
            f"{step_name(self.step_fn)} calls {what} on {self.name}"
            f"{user_line(self.step_fn)}: the program runs without the step's Python, so it "
            "can write what the step writes to a file after every run, but not give the "
            "step what it would read from it or where it stands; do that outside the step")


def _refusing(name: str):
    """A method of _Writing that refuses what the program could not do."""
    def refused(self, *args, **kwargs):
        raise self._file.refused(f"{name}()")
    return refused


class _Writing:
    """A file for one trace: what is written to it is kept (_File); reading
    or moving in it is refused."""

    _PASSED = frozenset({"name", "mode", "encoding", "errors", "newlines", "buffer",
                         "isatty", "fileno", "readable", "writable", "seekable"})

    def __init__(self, file: _File):
        self._file = file

    def write(self, data):
        self._file.add(data)
        return len(data)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self._file.opened is None:
            raise self._file.refused("close()")

    closed = False

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    read, readline, readlines, readinto = (_refusing(n) for n in (
        "read", "readline", "readlines", "readinto"))
    seek, tell, truncate, __iter__ = (_refusing(n) for n in ("seek", "tell", "truncate", "iter"))

    def __getattr__(self, name: str):
        stream = self._file.stream
        if stream is None or not hasattr(stream, name):
            raise AttributeError(name)
        if name in self._PASSED:
            return getattr(stream, name)
        raise self._file.refused(f".{name}")   # getvalue(), a buffer's own methods
