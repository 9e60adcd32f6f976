"""Laying the step's random draws out over the functionalized graph, from
what the step did to torch's generators while it was traced (torch_rng.py).

A generator's state at any point of the step is an origin (the state the
call finds, a seed, a state tensor among the arguments) and the draws made
from it since. Walking the graph's random ops in order, with the recorded
events between them, per generator (a stream: "cpu", "cuda:0"):

- a draw at a position the step has already drawn from (a state read with
  get_rng_state and set back: torch.utils.checkpoint recomputing a block,
  a fork_rng around a repeat) is the same draw when it is the same op on
  equal arguments (equal: the same nodes, or the same ops on equal
  arguments, such as a recomputation's): its uses take the earlier draw's
  value and it is removed. Eager draws the same numbers again there, and the
  program holds them already;
- a draw of other numbers at an origin the step has drawn from already (a
  seed inside fork_rng, a state set back to the call's start) starts a side
  lane: a generator of the plan's own, set to that origin before each run
  (rng_plan.py), which the lane's ops take as `generator=`;
- a draw of other numbers from a state after earlier draws, or a step that
  leaves the generator at such a state, cannot be reproduced: refused,
  naming the line that set the state back.

One lane per stream is drawn from the real generator: the one holding draws
that only torch's generator makes (dropout's bernoulli: inductor compiles it
with no other; two such lanes are refused), else the one at whose end the
step leaves the generator. After the run the host sets the real generator
where eager leaves it: an origin, or a side lane's end. Runs once per trace, after
functionalization (values are then pure: equal nodes are equal values) and
before the program is built (whose dead-code elimination drops what the
removed draws read).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.fx as fx

from ..errors import TranspileError
from ..program.program import draws_random
from .micro import NotRollable
from .rng_plan import CPU, Lane, Origin, OriginKind, RngPlan, Seed, StreamPlan


@dataclasses.dataclass(frozen=True)
class Read:
    """get_rng_state(): `token` (id of the tensor returned) is the position of
    `streams` after `at` random ops."""

    token: int
    streams: tuple[str, ...]
    at: int


@dataclasses.dataclass(frozen=True)
class Restore:
    """set_rng_state(token) on `stream` after `at` random ops."""

    token: int
    stream: str
    at: int
    line: str


@dataclasses.dataclass(frozen=True)
class Reset:
    """manual_seed or set_rng_state(an argument): `streams` start at `origin`
    after `at` random ops."""

    origin: Origin
    streams: tuple[str, ...]
    at: int
    line: str


Event = Read | Restore | Reset

_SAME_VALUE = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}


@dataclasses.dataclass(eq=False)
class _Lane:
    """Draws made one after the other from `origin`."""

    origin: Origin
    draws: list[fx.Node]


@dataclasses.dataclass(frozen=True)
class _At:
    """A position: `k` draws into `lane` from `origin` (k == 0: the origin
    itself, shared by every lane that starts there)."""

    origin: Origin
    lane: _Lane | None = None
    k: int = 0


@dataclasses.dataclass
class _Stream:
    name: str
    at: _At
    lanes: list[_Lane] = dataclasses.field(default_factory=list)
    line: str = ""   # where the step last set it


def lay_out(gm: fx.GraphModule, events: list[Event], expected: int,
            lazy: list[tuple[Callable[[int], None], Seed]], step: str, rolled: bool) -> RngPlan:
    """Remove the repeated draws, give side lanes their generators, and return
    the host's part; `expected`: the random ops the trace counted."""
    if not events and not lazy:
        return RngPlan()
    draws = [n for n in gm.graph.nodes if draws_random(n)]
    if len(draws) != expected:
        raise TranspileError(f"internal: the trace drew {expected} times but its functionalized "
                             f"graph has {len(draws)} random ops")
    call = Origin(OriginKind.CALL)
    streams: dict[str, _Stream] = {}
    tokens: dict[int, dict[str, _At]] = {}

    def stream(name: str) -> _Stream:
        return streams.setdefault(name, _Stream(name, _At(call)))

    pending = iter(events)
    event = next(pending, None)
    for i in range(len(draws) + 1):
        while event is not None and event.at == i:
            if isinstance(event, Read):
                tokens[event.token] = {s: stream(s).at for s in event.streams}
            elif isinstance(event, Restore):
                at = tokens[event.token].get(event.stream)
                if at is None:
                    raise TranspileError(
                        f"{step} sets the state of torch's {event.stream} generator{event.line} "
                        "to one read from another device's: give each device its own state")
                stream(event.stream).at, stream(event.stream).line = at, event.line
            else:
                for name in event.streams:
                    stream(name).at, stream(name).line = _At(event.origin), event.line
            event = next(pending, None)
        if i < len(draws):
            _draw(stream(_stream_of(draws[i], gm, step)), draws[i], gm, step)
    plans = [p for p in (_plan(s, call, gm, step) for s in streams.values()) if p is not None]
    plan = RngPlan(tuple(plans), tuple(lazy))
    if rolled and (plan.streams or plan.lazy):
        raise NotRollable("the step seeds or sets torch's random number generator: that is "
                          "done on the host, once per call, not once per micro-batch")
    return plan


def _draw(stream: _Stream, node: fx.Node, gm: fx.GraphModule, step: str) -> None:
    """Place one random op at the stream's position and move it on."""
    at = stream.at
    if at.lane is None:   # at an origin: the same draw as a lane starting there, or a new lane
        lane = next((lane for lane in stream.lanes
                     if lane.origin is at.origin and _same_draw(gm, node, lane.draws[0])), None)
        if lane is None:
            lane = _Lane(at.origin, [node])
            stream.lanes.append(lane)
        else:
            _reuse(gm.graph, node, lane.draws[0])
    elif at.k < len(at.lane.draws):
        lane, earlier = at.lane, at.lane.draws[at.k]
        if not _same_draw(gm, node, earlier):
            what = (f"{_op(node)} on other values than the step's {_op(earlier)} from that state"
                    if node.target == earlier.target
                    else f"{_op(node)}, where the step drew {_op(earlier)} from that state")
            raise TranspileError(
                f"{step} sets torch's random number generator back{stream.line} to its state "
                f"after {at.k} of the step's random draws, then draws other numbers from it "
                f"({what}): the program draws each number once, so after a state is set back "
                "it can repeat the draws made from it (as torch.utils.checkpoint's "
                "recomputation does when it recomputes the same ops on the same values), or "
                "draw new ones from the state the call found or from a seed. Seed these "
                "numbers (torch.manual_seed(n) inside torch.random.fork_rng()), or draw them "
                "before the step's other random ops")
        _reuse(gm.graph, node, earlier)
    else:
        lane = at.lane
        lane.draws.append(node)
    stream.at = _At(at.origin, lane, at.k + 1)


def _plan(stream: _Stream, call: Origin, gm: fx.GraphModule, step: str) -> StreamPlan | None:
    """The stream's main lane (drawn from the real generator), side lanes and
    end; None when the host has nothing to do for it."""
    at = stream.at
    if at.lane is not None and 0 < at.k < len(at.lane.draws):
        raise TranspileError(
            f"{step} leaves torch's random number generator ({stream.name}) at its state after "
            f"{at.k} of the step's {len(at.lane.draws)} random draws from there (set back"
            f"{stream.line}): the program draws them all from one generator and cannot put it "
            "back. Seed the numbers drawn after that point (torch.manual_seed(n) inside "
            "torch.random.fork_rng()), or draw them first in the step")
    last = at.lane   # the lane at whose end the step leaves the generator, if any
    pinned = [lane for lane in stream.lanes if any(_generator_form(n) is None for n in lane.draws)]
    if len(pinned) > 1:
        first, second = (next(n for n in lane.draws if _generator_form(n) is None)
                         for lane in pinned[:2])
        raise TranspileError(
            f"{step} draws {_op(first)} and {_op(second)} from two states of torch's "
            f"{stream.name} generator (a seed or a state set back{stream.line}): the program "
            "gives the draws of one of them a generator of its own, and these ops (dropout's "
            "among them) draw from torch's generator only. Draw the seeded or forked numbers "
            "with torch.rand, torch.randn or torch.randint, or outside the step")
    main = pinned[0] if pinned else last if last is not None else next(
        (lane for lane in stream.lanes if lane.origin is call),
        stream.lanes[0] if stream.lanes else None)
    start = main.origin if main is not None and main.origin is not call else None
    sides = {lane: _side_lane(lane, stream.name, gm, step) for lane in stream.lanes
             if lane is not main}
    if last is not None:   # at a lane's end: the main lane's, or copied from a side lane's
        end = sides.get(last)
    else:                  # at an origin: set there after the run
        end = None if main is None and at.origin is call else at.origin
    if start is None and not sides and end is None:
        return None
    return StreamPlan(stream.name, start, tuple(sides.values()), end)


def _side_lane(lane: _Lane, stream: str, gm: fx.GraphModule, step: str) -> Lane:
    """Give the lane's ops a generator of their own, as a constant of the graph."""
    if stream != CPU:
        raise TranspileError(
            f"{step} draws from torch's {stream} generator at a state it has drawn from before "
            f"({_op(lane.draws[0])}: a seed or a state set back, inside torch.random.fork_rng, "
            "while the step also draws from the state the call found): that needs a generator "
            "of its own, which the transpiler gives draws on the CPU only. Draw these numbers "
            "on the CPU and move them, or outside the step")
    generator = torch.Generator(device=CPU)
    index = 0
    while hasattr(gm, f"_rng_lane{index}"):
        index += 1
    name = f"_rng_lane{index}"
    setattr(gm, name, generator)
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first):
        attr = gm.graph.create_node("get_attr", name)   # not a tensor: no buffer to register
    for node in lane.draws:
        node.target = _generator_form(node)
        node.update_kwarg("generator", attr)
    return Lane(generator, lane.origin)


# Random ops that take generator= but that inductor compiles only without one
# (its bernoulli lowering has no generator): they draw from torch's generator.
_REAL_GENERATOR_ONLY = {torch.ops.aten.bernoulli.p, torch.ops.aten.bernoulli.default,
                        torch.ops.aten.bernoulli.Tensor}


def _generator_form(node: fx.Node):
    """The overload of the random op that draws from a generator= argument
    (the op itself where it has one), or None: dropout's bernoulli, and ops
    without one (native_dropout)."""
    target = node.target
    if target in _REAL_GENERATOR_ONLY:
        return None
    names = [a.name for a in target._schema.arguments]
    if "generator" in names:
        return target
    packet = target.overloadpacket
    return next((op for op in (getattr(packet, o) for o in packet.overloads())
                 if [a.name for a in op._schema.arguments if a.name != "generator"] == names
                 and len(op._schema.arguments) == len(names) + 1), None)


def _stream_of(node: fx.Node, gm: fx.GraphModule, step: str) -> str:
    """The generator a random op draws from: its generator= argument (a
    default generator: torch_rng.py refuses others), else its device's. Only
    the CPU's and CUDA's generators are followed (torch_rng.py intercepts
    their functions)."""
    given = node.kwargs.get("generator")
    if isinstance(given, fx.Node):
        device = getattr(gm, given.target).device
    else:
        val = node.meta["val"]
        device = (val[0] if isinstance(val, (tuple, list)) else val).device
    if device.type not in ("cpu", "cuda"):
        raise TranspileError(
            f"{step} reads or sets torch's random number generator state and draws on "
            f"{device.type} ({_op(node)}): the transpiler follows the CPU's and CUDA's "
            "generators only, so the program could draw other numbers than eager there. "
            "Remove the torch.manual_seed / fork_rng / torch.utils.checkpoint from the step")
    return CPU if device.type == "cpu" else f"cuda:{device.index}"


def _reuse(graph: fx.Graph, node: fx.Node, earlier: fx.Node) -> None:
    node.replace_all_uses_with(earlier)
    graph.erase_node(node)


def _op(node: fx.Node) -> str:
    return str(node.target).removeprefix("aten.")


def _same_draw(gm: fx.GraphModule, node: fx.Node, earlier: fx.Node) -> bool:
    """Whether a random op draws what `earlier` drew from the same state: the
    same op on equal arguments."""
    return node.target == earlier.target and _equal(gm, (node.args, node.kwargs),
                                                    (earlier.args, earlier.kwargs))


def _same_constant(gm: fx.GraphModule, x: fx.Node, y: fx.Node) -> bool:
    """Two constants of the graph: the same object, or tensors of equal
    values (each torch.tensor(...) a recomputed block makes is one of its own)."""
    a, b = getattr(gm, x.target), getattr(gm, y.target)
    return a is b or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                      and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b))


def _equal(gm: fx.GraphModule, a, b) -> bool:
    """Whether two arguments are equal values: equal constants, or nodes
    computing the same deterministic op on equal arguments (detach and
    alias are their argument)."""
    todo, seen = [(a, b)], set()
    while todo:
        x, y = todo.pop()
        while isinstance(x, fx.Node) and x.target in _SAME_VALUE:
            x = x.args[0]
        while isinstance(y, fx.Node) and y.target in _SAME_VALUE:
            y = y.args[0]
        if x is y:
            continue
        if isinstance(x, fx.Node) and isinstance(y, fx.Node):
            if (x, y) in seen or x.op == y.op == "get_attr" and _same_constant(gm, x, y):
                continue
            seen.add((x, y))
            if x.op != "call_function" or y.op != "call_function" or x.target != y.target \
                    or draws_random(x) or len(x.args) != len(y.args) \
                    or x.kwargs.keys() != y.kwargs.keys():
                return False
            todo += list(zip(x.args, y.args)) + [(x.kwargs[k], y.kwargs[k]) for k in x.kwargs]
        elif isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
            if type(x) is not type(y) or len(x) != len(y):
                return False
            todo += list(zip(x, y))
        elif isinstance(x, fx.Node) or isinstance(y, fx.Node) or type(x) is not type(y) \
                or x != y:
            return False
    return True
