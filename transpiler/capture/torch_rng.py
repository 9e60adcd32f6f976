"""torch's random number generators while the step is traced.

The program's random ops draw from torch's real generators when it runs, in
the step's order; fake ops draw nothing while it is traced. What the step's
Python does to the generators (torch.manual_seed, get_rng_state and
set_rng_state, and through them torch.random.fork_rng and torch.utils.checkpoint,
which saves the state before a block and sets it back to recompute the block
in the backward pass) would act once, on the real generator, at the trace.
Instead, while the step is traced, those functions (torch's and torch.cuda's)
act on a cursor over the draws the trace has made so far, and nothing real:

- get_rng_state() returns a state tensor (the real one, as torch would) and
  records it as a token for the current position;
- set_rng_state(token) moves the cursor back to where the token was read;
- set_rng_state(a state tensor among the step's arguments) and
  manual_seed(n) start the cursor at a new origin, replayed on the host on
  every call (n a constant, or an int computed from the step's int arguments);
- seed(), initial_seed(), and a torch.Generator of the step's own (generator=)
  are refused, naming the line: the program would draw from or bake what
  they give once.

Each event is recorded with the number of random ops traced before it;
rng_lanes.py lays the draws out after functionalization (a draw from a state
already drawn from is the earlier draw's value, the recomputation of a
checkpointed block) and rng_plan.py redoes the host's part on every call. The
real generators are compared before and after the trace: a change made
another way (torch.default_generator.manual_seed) is undone and refused.
Active only inside make_fx (trace.py's ExitStack).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Callable

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import PythonKeyTracer, get_proxy_mode, get_proxy_slot

from ..errors import TranspileError
from ..program.program import draws_random
from .inputs import Inputs
from .numbers import NumberSlot, ReachedNumberSlot
from .rng_lanes import Event, Read, Reset, Restore, lay_out
from .rng_plan import CPU, Origin, OriginKind, RngPlan, Seed
from .slots import DataSlot
from .user_code import step_name, user_line

# What is intercepted, by module: torch and torch.random, torch.cuda and
# torch.cuda.random hold the same functions.
_CPU_MODULES = (torch, torch.random)
_CUDA_MODULES = (torch.cuda, torch.cuda.random)
_REFUSED = ("seed", "initial_seed")
_CUDA_REFUSED = ("seed", "seed_all", "initial_seed")
_ORIGINAL_GET = torch.random.get_rng_state
_ORIGINAL_CUDA_GET = torch.cuda.get_rng_state
_ORIGINAL_CUDA_SEED = torch.cuda.manual_seed
_ORIGINAL_CUDA_SEED_ALL = torch.cuda.manual_seed_all


def cuda_streams() -> tuple[str, ...]:
    """The CUDA generators a program can draw from: those of an initialized CUDA."""
    if not torch.cuda.is_initialized():
        return ()
    return tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))


def _cuda_stream(device) -> str:
    """The stream of torch.cuda's `device` argument ("cuda", an index, a device)."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return f"cuda:{torch.cuda.current_device() if device.index is None else device.index}"


def _is_default(generator: torch.Generator) -> bool:
    return generator is torch.default_generator or (
        torch.cuda.is_initialized() and any(generator is g for g in torch.cuda.default_generators))


def real_states() -> list[torch.Tensor]:
    """The state of every real generator a program can draw from."""
    return [torch.default_generator.get_state()] + [
        _ORIGINAL_CUDA_GET(torch.device(s).index) for s in cuda_streams()]


def restore_real_states(before: list[torch.Tensor]) -> bool:
    """Whether a real generator changed since `before` (real_states()); if so,
    set them all back. (A CUDA initialized since starts its generators fresh.)"""
    if all(torch.equal(a, b) for a, b in zip(real_states(), before)):
        return False
    torch.default_generator.set_state(before[0])
    for stream, state in zip(cuda_streams(), before[1:]):
        torch.cuda.set_rng_state(state, torch.device(stream).index)
    return True


class RngRecorder:
    """Records what the step does to torch's generators while it is traced
    (see the module docstring). `symbols`: the symbol of each lifted number
    -> its name (numbers.py), filled as the trace reads them."""

    def __init__(self, step_fn, inputs: Inputs, symbols: dict):
        self.step_fn = step_fn
        self.inputs = inputs
        self.symbols = symbols
        self.events: list[Event] = []
        self.draws = 0   # random ops traced so far
        self.lazy: list[tuple[Callable[[int], None], Seed]] = []
        self._tokens: dict[int, torch.Tensor] = {}   # kept alive: their ids are the tokens
        self._graph: fx.Graph | None = None
        self._counted: fx.Node | None = None

    # -- while tracing

    @contextlib.contextmanager
    def recording(self, on_values: bool = False) -> Iterator[None]:
        """Intercept the generators' functions; refuse a change made another way
        (but the draws of a trace on real values: decisions.py)."""
        self._graph = get_proxy_mode().tracer.graph
        self._counted = self._graph._root   # count from the graph's first node
        before = real_states()
        patches = [(m, "get_rng_state", self._get_cpu) for m in _CPU_MODULES]
        patches += [(m, "set_rng_state", self._set_cpu) for m in _CPU_MODULES]
        patches += [(m, "manual_seed", self._manual_seed) for m in _CPU_MODULES]
        patches += [(m, name, self._refusal(f"torch.{name}")) for m in _CPU_MODULES
                    for name in _REFUSED]
        patches += [(m, name, fn) for m in _CUDA_MODULES for name, fn in (
            ("get_rng_state", self._get_cuda), ("get_rng_state_all", self._get_cuda_all),
            ("set_rng_state", self._set_cuda), ("set_rng_state_all", self._set_cuda_all),
            ("manual_seed", self._seed_cuda), ("manual_seed_all", self._seed_cuda_all))]
        patches += [(m, name, self._refusal(f"torch.cuda.{name}")) for m in _CUDA_MODULES
                    for name in _CUDA_REFUSED]
        patches.append((PythonKeyTracer, "create_arg", self._checking(PythonKeyTracer.create_arg)))
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
        for owner, name, fn in patches:
            setattr(owner, name, fn)
        try:
            yield
            self._count()
        finally:
            for owner, name, fn in reversed(saved):
                setattr(owner, name, fn)
            changed = restore_real_states(before)
        if changed and not on_values:
            raise TranspileError(
                f"{step_name(self.step_fn)} changes torch's random number generator other than "
                "through torch.manual_seed, torch.get_rng_state/set_rng_state or "
                "torch.random.fork_rng (e.g. torch.default_generator.manual_seed(...)): those "
                "are what a transpiled step redoes on every call; use them")

    def _count(self) -> int:
        """The random ops traced so far (counting those added since the last call)."""
        node = self._counted.next
        while node is not self._graph._root:
            self.draws += draws_random(node)
            self._counted, node = node, node.next
        return self.draws

    def _line(self) -> str:
        return user_line(self.step_fn)

    def _read(self, state: torch.Tensor, stream: str) -> torch.Tensor:
        self._tokens[id(state)] = state
        self.events.append(Read(id(state), (stream,), self._count()))
        return state

    def _set(self, state, stream: str) -> None:
        line, at = self._line(), self._count()
        if self._tokens.get(id(state)) is state:
            self.events.append(Restore(id(state), stream, at, line))
        else:
            self.events.append(Reset(Origin(OriginKind.STATE, state=self._argument(state, line)),
                                     (stream,), at, line))

    def _argument(self, state, line: str) -> DataSlot:
        """The slot of a state tensor among the step's arguments, else refused."""
        mode = get_proxy_mode()
        slot = None if mode is None or not isinstance(state, torch.Tensor) else \
            get_proxy_slot(state, mode.tracer, None)
        node = slot.proxy.node if slot is not None else None
        if node is not None and node.op == "placeholder":
            index = [n for n in self._graph.nodes if n.op == "placeholder"].index(node)
            if isinstance(self.inputs.slots[index], DataSlot):
                return self.inputs.slots[index]
        raise TranspileError(
            f"{step_name(self.step_fn)} sets torch's random number generator state to a tensor "
            f"that is neither one get_rng_state() returned inside the step nor an argument of "
            f"the step{line}: the program runs without the step's Python and could not set "
            "it on the next call. Pass the state as an argument of the step, or seed with "
            "torch.manual_seed(n), n a Python int argument")

    def _seed(self, seed, streams: tuple[str, ...]) -> Seed:
        value = self._seed_value(seed)
        line, at = self._line(), self._count()
        self.events.append(Reset(Origin(OriginKind.SEED, seed=value), streams, at, line))
        return value

    def _seed_value(self, seed) -> Seed:
        """A constant, or an int computed from lifted int numbers (anything
        else symbolic is made a constant by int(), which makes the trace
        specialize or refuse as for any number the step decides on)."""
        if isinstance(seed, torch.SymInt):
            expr = seed.node.expr
            names = {s: self.symbols.get(s) for s in expr.free_symbols}
            if all(names.values()):
                slots = {spec.name: slot for spec, slot in zip(self.inputs.specs, self.inputs.slots)
                         if isinstance(slot, (NumberSlot, ReachedNumberSlot))}
                return Seed(expr=expr, numbers=tuple(
                    (s, slots[name]) for s, name in sorted(names.items(), key=str)))
        value = int(seed)
        torch.Generator().manual_seed(value)   # out of range: torch's error, here
        return Seed(constant=value)

    def _get_cpu(self) -> torch.Tensor:
        return self._read(_ORIGINAL_GET(), CPU)

    def _set_cpu(self, new_state) -> None:
        self._set(new_state, CPU)

    def _manual_seed(self, seed) -> torch.Generator:
        """torch.manual_seed: every device's generator."""
        value = self._seed(seed, (CPU,) + cuda_streams())
        if torch.cuda.is_available() and not torch.cuda.is_initialized():
            self.lazy.append((_ORIGINAL_CUDA_SEED_ALL, value))   # torch queues it for CUDA's start
        return torch.default_generator

    def _get_cuda(self, device="cuda") -> torch.Tensor:
        return self._read(_ORIGINAL_CUDA_GET(device), _cuda_stream(device))

    def _get_cuda_all(self) -> list[torch.Tensor]:
        return [self._get_cuda(i) for i in range(torch.cuda.device_count())]

    def _set_cuda(self, new_state, device="cuda") -> None:
        self._set(new_state, _cuda_stream(device))

    def _set_cuda_all(self, new_states) -> None:
        for i, state in enumerate(new_states):
            self._set_cuda(state, i)

    def _seed_cuda(self, seed) -> None:
        if torch.cuda.is_initialized():
            self._seed(seed, (_cuda_stream("cuda"),))
        else:
            self.lazy.append((_ORIGINAL_CUDA_SEED, self._seed_value(seed)))

    def _seed_cuda_all(self, seed) -> None:
        if torch.cuda.is_initialized():
            self._seed(seed, cuda_streams())
        else:
            self.lazy.append((_ORIGINAL_CUDA_SEED_ALL, self._seed_value(seed)))

    def _refusal(self, name: str) -> Callable:
        def refuse(*args, **kwargs):
            raise TranspileError(
                f"{step_name(self.step_fn)} calls {name}(){self._line()}: it reads or sets a "
                "nondeterministic seed on the host, which the program (run without the step's "
                "Python) would bake in once. Call it outside the step, or seed inside it with "
                "torch.manual_seed(n), n a constant or a Python int argument of the step")
        return refuse

    def _checking(self, create_arg: Callable) -> Callable:
        """make_fx's create_arg, refusing a generator of the step's own."""
        def checked(tracer, a):
            if isinstance(a, torch.Generator) and not _is_default(a):
                raise TranspileError(
                    f"{step_name(self.step_fn)} draws from a torch.Generator of its own "
                    f"(generator=...){self._line()}: the program would draw from that object on "
                    "every call without the step's Python, so what the step does to it (a seed, "
                    "a state set back) would happen once; and the step's arguments do not say "
                    "which generator the next call passes. Draw from torch's default generator "
                    "(seed it inside the step with torch.manual_seed(n), inside "
                    "torch.random.fork_rng() to keep the main sequence), or pass the random "
                    "tensor as an argument")
            return create_arg(tracer, a)
        return checked

    # -- after the trace

    def plan(self, gm: fx.GraphModule, rolled: bool) -> RngPlan:
        """Lay the functionalized graph's draws out (rng_lanes.py) and return
        the host's part of them. `rolled`: traced over a cut micro-batch list."""
        return lay_out(gm, self.events, self.draws, self.lazy, step_name(self.step_fn), rolled)
