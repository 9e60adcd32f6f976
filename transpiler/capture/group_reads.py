"""What the step's own Python reads of its optimizers' param groups.

The values of a group that leave the signature (optimizers.Formulation's
lifted keys: SGD's lr, momentum, dampening and weight decay; Adam's lr, betas,
eps and weight decay) change between calls without a new trace: an LR
scheduler sets them, the program's update reads them from inputs. A read of
one by the step's own code (`lr = optimizer.param_groups[0]["lr"]` for a
manual weight decay, a loss scale, or a value it returns) would otherwise bake
the trace's value into the program. For the trace each such value in the
group is a symbolic number read from a program input filled from the group on
every call (float64, as eager's double), except while an optimizer's own
step() runs (it reads the real values; its update takes its inputs). So is
what an LR scheduler of those optimizers returns from `get_last_lr()`, read
from its `_last_lr` on every call, and its `last_epoch` (a warm-up factor
computed from it), read on every call: the scheduler is stepped between calls.

An LR scheduler stepped inside the step runs on the host after the call
(markers.scheduler_marker). A value it sets, read after its step() in the
same call (the group's numbers, `scheduler.get_last_lr()`,
`scheduler.last_epoch`), is known only after the call: for the rest of the
trace it is an `AfterTheCall`, which the step may return (the call returns the
value read once the scheduler stepped) and not otherwise use (TranspileError,
at the user's line).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch.optim.lr_scheduler import LRScheduler

from ..errors import TranspileError
from .numbers import OptimizerValueSlot
from .optimizers import formulation_of
from .reads import Attr, Place
from .user_code import user_line

_SYMBOLIC = (torch.SymFloat, torch.SymInt)


class AfterTheCall:
    """A value an LR scheduler stepped inside the step sets, known only after
    the call: `read()` reads it then."""

    __slots__ = ("read", "what", "refusal")

    def __init__(self, read: Callable[[], Any], what: str, refusal: str):
        self.read, self.what, self.refusal = read, what, refusal

    def __repr__(self) -> str:
        return f"<{self.what}, known after the call>"

    def refuse(self, *_):
        raise TranspileError(self.refusal.format(what=self.what, where=user_line(None)))

    __hash__ = object.__hash__


_USES = ("float", "int", "index", "bool", "complex", "round", "trunc", "floor", "ceil", "format",
         "str", "neg", "pos", "abs", "lt", "le", "gt", "ge", "eq", "ne", "getitem", "iter", "len")
_ARITHMETIC = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "divmod", "matmul")
for _name in _USES + _ARITHMETIC + tuple("r" + name for name in _ARITHMETIC):
    setattr(AfterTheCall, f"__{_name}__", AfterTheCall.refuse)
del _name


class GroupReads:
    """While active (trace.py, inside the trace), the lifted values of the
    formulated optimizers' groups are symbolic numbers from program inputs
    (`number(value, name, place)`: trace._LateInputs.number) outside their
    optimizers' step(); `scheduled(scheduler)` turns the values the scheduler
    sets into AfterTheCall. `restore()` puts every value back that the step did
    not itself assign (a write the host-state check then refuses)."""

    def __init__(self, optimizers, number: Callable, step: str):
        self.step = step
        self._real: list[tuple[Any, str, Any]] = []   # (holder, key or attribute, real value)
        self._stand_in: dict[tuple[int, str], Any] = {}
        self._handles = []
        self._optimizers = optimizers
        self._ours = {id(opt) for opt in optimizers}
        self._last_lrs: dict[int, list] = {}   # id of a scheduler -> its get_last_lr()
        self._last_epochs: dict[int, Any] = {}   # id of a scheduler -> its last_epoch
        self._scheduled: set[int] = set()
        self._number = number
        self._get_last_lr = LRScheduler.get_last_lr

    def start(self) -> None:
        """Put the stand-ins in place (restore() undoes what was done, also
        after a failure here)."""
        LRScheduler.get_last_lr = lambda scheduler: self._last_lr(scheduler)
        LRScheduler.last_epoch = _LastEpoch(self)
        number, optimizers = self._number, self._optimizers
        for oi, opt in enumerate(optimizers):
            form = formulation_of(opt)
            oname = f"optimizer {oi}" if len(optimizers) > 1 else "optimizer"
            for gi, group in enumerate(opt.param_groups if form else ()):
                for key in form.keys_lifted(group):
                    name = f"{oname}.param_groups[{gi}][{key!r}]"
                    value = group[key]
                    stand_in = (tuple(number(v, f"{name}[{j}]", Place(group, key, (j,)),
                                             slot=OptimizerValueSlot)
                                      for j, v in enumerate(value))
                                if isinstance(value, tuple) else
                                number(value, name, Place(group, key), slot=OptimizerValueSlot))
                    self._put(group, key, stand_in)
            self._handles += [opt.register_step_pre_hook(self._own_step),
                              opt.register_step_post_hook(self._after_own_step)]

    def _put(self, holder, key: str, stand_in) -> None:
        """holder[key] (a param group's) or holder.key (a scheduler's) is
        stand_in until restore(), which puts back the value found first."""
        if (id(holder), key) not in self._stand_in:
            self._real.append((holder, key, holder[key] if isinstance(holder, dict)
                               else vars(holder)[key]))
        self._stand_in[(id(holder), key)] = stand_in
        if isinstance(holder, dict):
            holder[key] = stand_in
        else:
            object.__setattr__(holder, key, stand_in)

    def _swap(self, opt, real: bool) -> None:
        for group, key, value in self._real:
            if isinstance(group, dict) and any(group is g for g in opt.param_groups) \
                    and group.get(key) is (self._stand_in[(id(group), key)] if real else value):
                group[key] = value if real else self._stand_in[(id(group), key)]

    def _own_step(self, opt, *_):
        self._swap(opt, real=True)

    def _after_own_step(self, opt, *_):
        self._swap(opt, real=False)

    def _last_lr(self, scheduler) -> list:
        """get_last_lr() of a scheduler of the step's optimizers: before its
        step() in this call, numbers read from its `_last_lr` on every call
        (a scheduler's attributes are no guarded read: they change every call)."""
        if id(getattr(scheduler, "optimizer", None)) not in self._ours:
            return self._get_last_lr(scheduler)
        if id(scheduler) in self._scheduled:
            return list(scheduler._last_lr)
        if id(scheduler) not in self._last_lrs:
            name = f"{type(scheduler).__name__}.get_last_lr()"
            self._last_lrs[id(scheduler)] = [
                self._number(v, f"{name}[{i}]", Place(Attr(scheduler), "_last_lr", (i,)),
                             slot=OptimizerValueSlot)
                for i, v in enumerate(self._get_last_lr(scheduler))]
        return list(self._last_lrs[id(scheduler)])

    def _last_epoch(self, scheduler):
        """last_epoch of a scheduler of the step's optimizers, before its
        step() in this call: a number read from it on every call."""
        value = vars(scheduler).get("last_epoch")
        if id(getattr(scheduler, "optimizer", None)) not in self._ours \
                or id(scheduler) in self._scheduled or not isinstance(value, int) \
                or isinstance(value, bool):
            return value
        if id(scheduler) not in self._last_epochs:
            self._last_epochs[id(scheduler)] = self._number(
                value, f"{type(scheduler).__name__}.last_epoch",
                Place(Attr(scheduler), "last_epoch"), slot=OptimizerValueSlot)
        return self._last_epochs[id(scheduler)]

    def scheduled(self, scheduler) -> None:
        """The scheduler's step() was recorded: what it sets is known after the call."""
        self._scheduled.add(id(scheduler))
        kind = type(scheduler).__name__
        refusal = (f"{{what}} is read after {kind}.step() inside {self.step}{{where}}: the "
                   "program steps its LR schedulers on the host after each call, so the value "
                   "the scheduler sets is known only then; return it from the step as it is "
                   "(the call returns it, read after the scheduler stepped), or read it after "
                   "the call")
        for gi, group in enumerate(scheduler.optimizer.param_groups):
            for key, value in group.items():
                if key != "params" and _number_or_numbers(value):
                    what = f"param_groups[{gi}][{key!r}]"
                    self._put(group, key, tuple(
                        AfterTheCall(Place(group, key, (j,)).read, f"{what}[{j}]", refusal)
                        for j in range(len(value))) if isinstance(value, tuple) else
                        AfterTheCall(Place(group, key).read, what, refusal))
        last = getattr(scheduler, "_last_lr", None)
        if isinstance(last, list):
            self._put(scheduler, "_last_lr", [
                AfterTheCall(lambda i=i: scheduler._last_lr[i], f"{kind}.get_last_lr()[{i}]",
                             refusal) for i in range(len(last))])
        if isinstance(vars(scheduler).get("last_epoch"), int):
            self._put(scheduler, "last_epoch", AfterTheCall(
                lambda: scheduler.last_epoch, f"{kind}.last_epoch", refusal))

    def restore(self) -> None:
        LRScheduler.get_last_lr = self._get_last_lr
        if isinstance(vars(LRScheduler).get("last_epoch"), _LastEpoch):
            del LRScheduler.last_epoch
        for holder, key, value in reversed(self._real):
            stand_in = self._stand_in.get((id(holder), key))
            if isinstance(holder, dict):
                if holder.get(key) is stand_in:
                    holder[key] = value
            elif getattr(holder, key, None) is stand_in:
                object.__setattr__(holder, key, value)
        self._real.clear()
        self._stand_in.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class _LastEpoch:
    """LRScheduler.last_epoch while traced: each scheduler's own value (in its
    __dict__), as GroupReads._last_epoch gives it to a read."""

    def __init__(self, reads: GroupReads):
        self._reads = reads

    def __get__(self, scheduler, owner=None):
        return self if scheduler is None else self._reads._last_epoch(scheduler)

    def __set__(self, scheduler, value) -> None:
        vars(scheduler)["last_epoch"] = value


def _number_or_numbers(value) -> bool:
    if isinstance(value, tuple):
        return bool(value) and all(_number_or_numbers(v) for v in value)
    return isinstance(value, (int, float) + _SYMBOLIC) and not isinstance(value, bool)


@contextlib.contextmanager
def group_reads(optimizers, number: Callable, step: str):
    reads = GroupReads(optimizers, number, step)
    try:
        reads.start()
        yield reads
    finally:
        reads.restore()
