"""The optimizer state of mode "zero", kept as shards in the optimizers' own
state (passes/shard_optimizer.py says the layout): an entry shaped like its
parameter (momentum, Adam's moments) holds this rank's c = ceil(n / N)
elements of the flattened, padded parameter; scalar entries (Adam's step) stay
whole. Everything else that reads the state goes through here: the trace sees
a full-shaped stand-in, a full entry (made for the first step, or loaded from
a full state_dict) is cut to its shard before the signature is taken, and a
full state_dict is gathered back for checkpoints and single-process optimizers.

Shards never pass for full state (StateGuard, every mode): hooks on each
optimizer a transpiled step sees refuse `optimizer.state_dict()` while it holds
shards, as torch's ZeroRedundancyOptimizer does, and refuse at load a state
that holds shards, of any world size. The hooks are module functions that read
the state's layout, not the step: after the step is dropped the optimizer
keeps refusing while it holds shards, and a new step in mode zero with it
takes the shards over (its full_optimizer_state_dict gathers them)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..capture.optimizer_state import forget_state, make_first_state
from ..errors import TranspileError
from ..program.mesh import Dim, Mesh
from .rings import plain_mesh
from ..world import group as step_group, world


def shard_numel(numel: int, world_size: int) -> int:
    """Elements of each rank's shard of a tensor of `numel` elements."""
    return -(-numel // world_size)


def shard_of(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's shard of a full tensor, as a new tensor (zeros past its end)."""
    chunk = shard_numel(full.numel(), world_size)
    flat = F.pad(full.detach().reshape(-1), (0, chunk * world_size - full.numel()))
    return flat[rank * chunk:(rank + 1) * chunk].clone()


@dataclasses.dataclass(frozen=True)
class Sharding:
    """Which shard of each sharded tensor this rank holds: part `index` of
    `count`, the parts spread over the ranks of `over` in `mesh`: the world, or
    in hybrid sharding this rank's node (each node holds every part; the same
    parts are replicated across the nodes)."""

    mesh: Mesh
    over: Dim

    @classmethod
    def of(cls, hierarchical: bool, mesh: Mesh | None = None) -> "Sharding":
        """The sharding of transpile(hierarchical=...) on `mesh` (the runtime's,
        once built; before it, this world as torchrun's nodes)."""
        mesh = mesh if mesh is not None else plain_mesh(hierarchical)
        return cls(mesh, mesh.shard_over(hierarchical))

    @property
    def index(self) -> int:
        return self.mesh.position(self.over)

    @property
    def count(self) -> int:
        return self.mesh.size(self.over)

    def group(self) -> dist.ProcessGroup:
        """The process group the parts are spread over (for gathers on the host)."""
        if self.over is Dim.WORLD:
            return step_group()
        return dist.distributed_c10d._resolve_process_group(self.mesh.ring(self.over))


def full_of(shard: torch.Tensor, like: torch.Tensor, sharding: Sharding) -> torch.Tensor:
    """The full tensor shaped like `like`, gathered from the shards of the
    ranks it is spread over (shard_of's inverse). A collective: every rank calls it."""
    parts = [torch.empty_like(shard) for _ in range(sharding.count)]
    dist.all_gather(parts, shard.contiguous(), group=sharding.group())
    return torch.cat(parts)[:like.numel()].view(like.shape)


def world_mesh(device: torch.device) -> DeviceMesh:
    """The 1-D mesh of the step's ranks, for the DTensors torch.distributed.checkpoint reads."""
    return DeviceMesh.from_group(step_group(), device.type)


def refuse_hybrid_dcp(sharding: Sharding, what: str, instead: str) -> None:
    """torch.distributed.checkpoint of shards spread over the world only."""
    if sharding.over is not Dim.WORLD:
        raise TranspileError(
            f"{what} is sharded over each node ({sharding.count} ranks, replicated across "
            f"{sharding.mesh.nodes} nodes: hierarchical=True), which torch.distributed.checkpoint "
            f"does not save or load here yet; nothing was saved or loaded. Save the full state "
            f"with {instead} (a collective: call it on every rank) and load it instead")


def as_dtensor(shard: torch.Tensor, like: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """This rank's shard (padded, shard_of's layout) of a tensor shaped like
    `like` as a DTensor: Shard(0) of the flattened tensor, unpadded (global
    shape (numel,)), whose local tensor is a view of the shard's part of it.
    torch.distributed.checkpoint saves each rank's part and loads into it from
    a checkpoint of any world size (torch.chunk's layout is shard_of's)."""
    n = like.numel()
    start = min(mesh.get_local_rank() * shard.numel(), n)
    local = shard[:max(0, min(shard.numel(), n - start))]
    return DTensor.from_local(local, mesh, [Shard(0)], shape=torch.Size([n]), stride=(1,))


def from_dtensor(value: DTensor, like: torch.Tensor) -> torch.Tensor:
    """as_dtensor's inverse: this rank's shard of `like`, padded, from the
    DTensor's local part."""
    local = value.to_local()
    return F.pad(local, (0, shard_numel(like.numel(), world()[0]) - local.numel()))


def _flattened(param: torch.Tensor, value, entries: dict) -> bool:
    """A state entry laid out as mode zero's shards: 1-D, not its parameter's
    shape, among entries (the parameter's state) none of which has that shape,
    as mode zero leaves them all flat. (torch's optimizers keep each entry that
    has dimensions shaped like its parameter; Adafactor's factors keep their
    parameter's rank; a custom optimizer's 1-element step counter, Sophia's,
    sits beside moments shaped like the parameter.)"""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape != param.shape \
        and not any(isinstance(v, torch.Tensor) and v.dim() and v.shape == param.shape
                    for v in entries.values())


def _describe_flat(index: int, param: torch.Tensor, key, value: torch.Tensor) -> str:
    """What a flattened entry is: one rank's shard, and of how many ranks."""
    n, c = param.numel(), value.numel()
    lo = max(2, -(-n // c)) if c else 0   # the fewest ranks whose shards have c elements
    hi = (n - 1) // (c - 1) if c > 1 else None   # the most
    if not c or shard_numel(n, lo) != c:
        what = "not a shard of it either"
    else:
        ranks = f"{lo}" if hi == lo else f"{lo} to {hi}" if hi else f"{lo} or more"
        what = f"one rank's shard of mode zero's state on {ranks} ranks"
    ranks = world()[0]
    return (f"state {key!r} of parameter {index} (shape {tuple(param.shape)}, {n} elements) is a "
            f"flat tensor of {c} elements: {what} (this run has {ranks} rank"
            f"{'s' if ranks > 1 else ''})")


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _first_flat(entries_by_param) -> str | None:
    """The description of the first flattened entry among (index, parameter,
    entries), or None."""
    for index, param, entries in entries_by_param:
        for key, value in entries.items() if isinstance(entries, dict) else ():
            if _flattened(param, value, entries):
                return _describe_flat(index, param, key, value)
    return None


def _held(optimizer: torch.optim.Optimizer):
    """optimizer.state as (index, parameter, entries), indexed as state_dict() does."""
    index_of = {id(p): i for i, p in reversed(list(enumerate(_params(optimizer))))}
    return ((index_of[id(p)], p, entries) for p, entries in optimizer.state.items()
            if id(p) in index_of)


def _loaded(optimizer: torch.optim.Optimizer, state_dict) -> list:
    """A state_dict's state as (index, parameter, entries), its indices matched
    to the parameters as load_state_dict matches them; [] where they do not
    match (load_state_dict says why)."""
    try:
        saved = [i for group in state_dict["param_groups"] for i in group["params"]]
        state = dict(state_dict["state"])
    except (KeyError, TypeError, ValueError):
        return []
    params = _params(optimizer)
    if len(saved) != len(params):
        return []
    by_index = dict(zip(saved, params))
    return [(i, by_index[i], entries) for i, entries in state.items() if i in by_index]


_WHAT_LOADS = (
    "Save full state with step.full_optimizer_state_dict(optimizer) (a collective: call it on "
    "every rank): the state torch's optimizer holds on one process, which loads into an "
    "optimizer of these parameters on any number of ranks, in any mode; or each rank's shards "
    "with torch.distributed.checkpoint: dcp.save({'optim': step.sharded_optimizer_state_dict("
    "optimizer)}, ...), resumed by dcp.load and step.load_sharded_optimizer_state_dict")

_own = threading.local()   # set while the step reads or loads shards itself


@contextlib.contextmanager
def _own_state():
    """The step's own state_dict()/load_state_dict() of shards: not refused."""
    _own.active = True
    try:
        yield
    finally:
        _own.active = False


def _refuse_shards(optimizer: torch.optim.Optimizer) -> None:
    """state_dict pre-hook: a state held as shards is no state any optimizer loads."""
    flat = None if getattr(_own, "active", False) else _first_flat(_held(optimizer))
    if flat is not None:
        raise TranspileError(
            f"{type(optimizer).__name__}.state_dict() would return this rank's shards: a "
            f"transpiled step in mode zero holds the optimizer's state as shards ({flat}), "
            f"which no optimizer loads back. {_WHAT_LOADS}. (torch's ZeroRedundancyOptimizer "
            "likewise asks for consolidate_state_dict() first.)")


def _refuse_unfit(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """load_state_dict pre-hook: a state holding shards is refused before it is loaded."""
    flat = None if getattr(_own, "active", False) else _first_flat(_loaded(optimizer, state_dict))
    if flat is not None:
        raise TranspileError(
            f"{type(optimizer).__name__}.load_state_dict() refused, the optimizer's state is "
            f"unchanged: {flat}; every mode, zero included, loads full state only. "
            f"{_WHAT_LOADS}.")


def _check_held(optimizer: torch.optim.Optimizer) -> None:
    flat = _first_flat(_held(optimizer))
    if flat is not None:
        raise TranspileError(
            f"{type(optimizer).__name__} holds state that does not fit its parameters ({flat}): "
            "loaded before a transpiled step hooked its load_state_dict, or left by a step in "
            "mode zero, whose shards only a step in mode zero continues from. Nothing was run. "
            f"{_WHAT_LOADS}.")


_hooked: weakref.WeakSet = weakref.WeakSet()   # the optimizers given the hooks


def guard(optimizer: torch.optim.Optimizer) -> None:
    """Give `optimizer` the hooks, once; first refuse shards it was loaded
    with before it had them."""
    if optimizer not in _hooked:
        _check_held(optimizer)
        # an optimizer that skipped Optimizer.__init__ (timm's Lookahead, which
        # wraps another) has no hooks of its own to take them
        if hasattr(optimizer, "_optimizer_state_dict_pre_hooks"):
            optimizer.register_state_dict_pre_hook(_refuse_shards)
            optimizer.register_load_state_dict_pre_hook(_refuse_unfit)
        _hooked.add(optimizer)


class StateGuard:
    """A transpiled step's check of each optimizer it sees, at its first sight,
    before anything reads the state (every mode)."""

    def __init__(self, sharded: bool):
        self._sharded = sharded
        self._seen: weakref.WeakSet = weakref.WeakSet()

    def admit(self, optimizers) -> None:
        """Shards in the state are refused (loaded before the optimizer had
        the hooks, or left by a step in mode zero), except the shards of a step
        in mode zero to a step in mode zero, which takes them over."""
        for opt in optimizers:
            if opt not in self._seen:
                if not self._sharded:
                    _check_held(opt)
                guard(opt)
                self._seen.add(opt)


class ShardedState:
    """Which optimizer state entries hold shards, and the moves between full
    and sharded entries. `hierarchical`: the shards are spread over each node
    (hybrid sharding, Sharding); the runtime binds its mesh once built."""

    def __init__(self, hierarchical: bool = False):
        self._shards: dict[int, weakref.ref] = {}   # the shard tensors placed, by id
        # Per optimizer: the first state dcp_state_dict gave its parameters without state.
        self._first: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._hierarchical = hierarchical
        self.mesh: Mesh | None = None

    @property
    def sharding(self) -> Sharding:
        return Sharding.of(self._hierarchical, self.mesh)

    def is_shard(self, value) -> bool:
        ref = self._shards.get(id(value))
        return ref is not None and ref() is value

    def shard(self, optimizers) -> None:
        """Replace every full entry shaped like its parameter by this rank's
        shard: state made for the first step, state a user loaded. A shard the
        program wrote (state it created, or another step in mode zero) is
        recognized by its shape. An entry that is neither is refused before
        any is cut."""
        if world()[0] == 1:
            return
        sharding = self.sharding
        full = []
        for opt in optimizers:
            for p, entries in opt.state.items():
                for key, value in entries.items():
                    if not isinstance(value, torch.Tensor) or self.is_shard(value) \
                            or value.dim() == 0:
                        continue
                    if value.shape == p.shape:
                        full.append((p, entries, key))
                    elif value.shape == (shard_numel(p.numel(), sharding.count),):
                        self._shards[id(value)] = weakref.ref(value)
                    else:
                        raise TranspileError(
                            f"optimizer state '{key}' of a parameter of shape {tuple(p.shape)} "
                            f"has shape {tuple(value.shape)}: neither the parameter's (a full "
                            f"entry) nor a shard of {sharding.count} ranks; a state saved with "
                            "another number of ranks loads through full_optimizer_state_dict or "
                            "torch.distributed.checkpoint")
        for p, entries, key in full:
            value = entries[key] = shard_of(entries[key], sharding.index, sharding.count)
            self._shards[id(value)] = weakref.ref(value)

    def _holds_shard(self, param: torch.Tensor, value, entries: dict) -> bool:
        """A shard this step placed, or one another step in mode zero left."""
        return self.is_shard(value) or _flattened(param, value, entries)

    def stand_in(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """What the trace sees of a state entry: a shard's full layout
        (uninitialized: only its layout is read)."""
        if not self.is_shard(value):
            return value
        return torch.empty_like(param, dtype=value.dtype, memory_format=torch.preserve_format)

    def full_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """optimizer.state_dict() with every shard gathered into its full entry,
        loadable by the same optimizer on one process or any number of ranks. A
        collective: every rank calls it, in the same order of optimizers."""
        guard(optimizer)
        with _own_state():
            state = optimizer.state_dict()
        params = _params(optimizer)
        full = {}
        for index, entries in state["state"].items():
            p = params[index]
            full[index] = dict(entries)
            for key in sorted(entries):
                value = optimizer.state[p][key]
                if self._holds_shard(p, value, optimizer.state[p]):
                    full[index][key] = full_of(value, p, self.sharding).clone()
        return {"state": full, "param_groups": state["param_groups"]}

    def dcp_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """optimizer.state_dict() with each shard as a DTensor over the world:
        Shard(0) of the flattened parameter, unpadded (global shape (numel,)),
        whose local tensor is this rank's part of it. What
        torch.distributed.checkpoint saves (each rank its part) and loads into
        (reading the parts of any world size).

        Each trainable parameter without state (all of them in a fresh process
        about to resume; an unused one in a trained optimizer) is given the
        state its first step would make: so the layout depends on the
        parameters alone, and a fresh process's template fits a checkpoint of
        a trained optimizer. It is kept only in a fresh optimizer (to load
        into); load_dcp_state_dict drops an entry loaded equal to it, which is
        no state (make_first_state makes only what acts as none)."""
        self._refuse_hybrid()
        guard(optimizer)
        fresh = not optimizer.state
        made = make_first_state([optimizer])
        self.shard([optimizer])
        self._first[optimizer] = {(p, key): optimizer.state[p][key].clone() for _, p, key in made}
        try:
            return self._as_dtensors(optimizer)
        finally:
            if not fresh:
                forget_state(made)

    def _as_dtensors(self, optimizer: torch.optim.Optimizer) -> dict:
        if not optimizer.state:
            raise TranspileError(
                f"{type(optimizer).__name__} has no state to save or load into, and its first "
                "state cannot be made ahead of a step: run one step before saving, or resume "
                "through full_optimizer_state_dict")
        with _own_state():
            state = optimizer.state_dict()
        params = _params(optimizer)
        mesh = world_mesh(params[0].device)
        sharded = {}
        for index, entries in state["state"].items():
            p = params[index]
            sharded[index] = dict(entries)
            for key in entries:
                value = optimizer.state[p][key]
                if self._holds_shard(p, value, optimizer.state[p]):
                    sharded[index][key] = as_dtensor(value, p, mesh)
        return {"state": sharded, "param_groups": state["param_groups"]}

    def _refuse_hybrid(self) -> None:
        refuse_hybrid_dcp(self.sharding, "the optimizer's state",
                          "step.full_optimizer_state_dict(optimizer)")

    def load_dcp_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load what dcp_state_dict gave once torch.distributed.checkpoint has
        filled it: each DTensor's local part becomes this rank's shard (padded)."""
        self._refuse_hybrid()
        guard(optimizer)
        params = _params(optimizer)
        plain = {}
        for index, entries in state["state"].items():
            plain[index] = dict(entries)
            for key, value in entries.items():
                if isinstance(value, DTensor):
                    plain[index][key] = from_dtensor(value, params[index])
        with _own_state():
            optimizer.load_state_dict({"state": plain, "param_groups": state["param_groups"]})
        self.shard([optimizer])
        first = self._first.pop(optimizer, {})
        for p in {p for p, _ in first}:
            entries = optimizer.state.get(p, {})
            if entries and all((p, key) in first and torch.equal(value, first[p, key])
                               for key, value in entries.items()):
                del optimizer.state[p]   # the first state it was saved with: none
