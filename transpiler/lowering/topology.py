"""Topologies of decentralized training (mode "decentralized"): at each step,
which ranks average their parameters together, and with what weight.

A `Mixing` is one step's partition of the ranks into groups with a self-weight
w: rank i in group R sets

    x_i <- w * x_i + (1 - w) / (|R| - 1) * sum(x_j for j in R, j != i)

(w=None: the plain mean of the group, 1/|R| each). A `Topology` is a periodic
sequence of mixings: step t uses mixings[t % period]. The built-in ones are
those of Decent-DP (DecentralizedDataParallel), by name: "complete", "ring",
"one-peer-exp", "alternating-exp-ring". A topology is plain data, a
deterministic function of the step, so every rank issues the same collectives;
the process groups of its partitions are created once, before the first step
(transpiler/lowering/rings.py).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Callable, Sequence

from ..errors import TranspileError
from ..program.mesh import Peers

Group = tuple[int, ...]
Partition = tuple[Group, ...]


@dataclasses.dataclass(frozen=True)
class Mixing:
    """One step of a topology: the groups (a partition of the ranks, every
    group of two ranks or more) and the self-weight w (None: the group's mean)."""

    groups: Partition
    weight: Fraction | None = None

    def group_of(self, rank: int) -> Group:
        return next(g for g in self.groups if rank in g)

    def coefficients(self, rank: int) -> tuple[Fraction, Fraction] | None:
        """(a, b) with x_i <- a * x_i + b * sum(x_j for j in R), exactly; None for
        the plain mean."""
        if self.weight is None:
            return None
        b = (1 - self.weight) / (len(self.group_of(rank)) - 1)
        return self.weight - b, b


@dataclasses.dataclass(frozen=True)
class Topology:
    """A periodic sequence of mixings, given for one world size."""

    name: str
    mixings: tuple[Mixing, ...]

    @property
    def partitions(self) -> tuple[Partition, ...]:
        """The distinct partitions, in order of first use: one set of process
        groups each."""
        return tuple(dict.fromkeys(m.groups for m in self.mixings))

    def check(self, world_size: int) -> None:
        """Raise unless every mixing partitions the ranks of this world into
        groups of two or more, with a weight in [0, 1]."""
        if not self.mixings:
            raise TranspileError(f"topology {self.name!r} has no mixing")
        for t, m in enumerate(self.mixings):
            ranks = sorted(r for g in m.groups for r in g)
            if ranks != list(range(world_size)):
                raise TranspileError(
                    f"topology {self.name!r}, step {t}: its groups {list(map(list, m.groups))} "
                    f"must hold each of the {world_size} ranks exactly once")
            if any(len(g) < 2 for g in m.groups):
                raise TranspileError(
                    f"topology {self.name!r}, step {t}: every group needs two ranks or more "
                    "(a rank that does not mix has nothing to wait for; pair it instead)")
            if m.weight is not None and not 0 <= m.weight <= 1:
                raise TranspileError(f"topology {self.name!r}, step {t}: the self-weight "
                                     f"must be in [0, 1], got {m.weight}")

    def gossip(self, phase: int, rank: int) -> "Gossip":
        """What `rank` does at the steps of this phase (step mod period)."""
        mixing = self.mixings[phase]
        group = Peers(self.partitions.index(mixing.groups), len(mixing.group_of(rank)))
        return Gossip(group, mixing.coefficients(rank))


@dataclasses.dataclass(frozen=True)
class Gossip:
    """One rank's mixing at one phase of a topology: the group it averages with
    and the coefficients (a, b) of x <- a * x + b * (the group's sum); None: the
    group's mean. What passes/mix_params reads."""

    over: Peers
    coefficients: tuple[Fraction, Fraction] | None


def of(name: str, steps: Sequence[tuple[Sequence[Sequence[int]], float | Fraction | None]]
       ) -> Topology:
    """A topology of one's own: for each step of its period, (groups, self-weight),
    the weight None for the groups' plain mean."""
    return Topology(name, tuple(
        Mixing(tuple(tuple(int(r) for r in g) for g in groups),
               None if w is None else Fraction(w)) for groups, w in steps))


def complete(world_size: int, local_size: int) -> Topology:
    """Every rank with every other: the mean of the world, each step."""
    return of("complete", [([range(world_size)], None)])


def ring(world_size: int, local_size: int) -> Topology:
    """Pairs (0,1),(2,3),... on even steps, (1,2),(3,4),...,(N-1,0) on odd steps; w = 1/2."""
    if world_size % 2:
        raise TranspileError(f"topology 'ring' needs an even number of ranks, not {world_size}; "
                             "use 'complete' or a topology of one's own")
    half = Fraction(1, 2)
    return of("ring", [([(i, i + 1) for i in range(0, world_size, 2)], half),
                       ([sorted((i, (i + 1) % world_size)) for i in range(1, world_size, 2)],
                        half)])


def _pairs(n: int, distance: int) -> list[tuple[int, int]]:
    """0..n-1 paired with the one `distance` ahead (n a power of 2, distance < n)."""
    paired, pairs = set(), []
    for j in range(n):
        if j not in paired:
            k = (j + distance) % n
            paired |= {j, k}
            pairs.append(tuple(sorted((j, k))))
    return pairs


def _log2(n: int, what: str, name: str) -> int:
    rounds = round(math.log2(n)) if n >= 1 else 0
    if n < 2 or 2 ** rounds != n:
        raise TranspileError(f"topology {name!r} needs a power of 2 {what} (2, 4, 8, ...), "
                             f"not {n}")
    return rounds


def one_peer_exp(world_size: int, local_size: int) -> Topology:
    """On step t each rank pairs with the rank 2^(t mod log2 N) away; w = 1/2."""
    rounds = _log2(world_size, "number of ranks", "one-peer-exp")
    return of("one-peer-exp", [(_pairs(world_size, 2 ** k), Fraction(1, 2))
                               for k in range(rounds)])


def alternating_exp_ring(world_size: int, local_size: int) -> Topology:
    """Nodes of `local_size` ranks (torchrun's LOCAL_WORLD_SIZE), a power of 2
    of them. Round k pairs each node with the node 2^k away; in the round's two
    steps each node once averages inside itself and once with its pair (the
    whole two nodes), the pairs taking turns as Decent-DP staggers them. Plain
    means throughout."""
    if local_size < 2:
        raise TranspileError("topology 'alternating-exp-ring' averages inside nodes of two ranks "
                             "or more (LOCAL_WORLD_SIZE); with one rank per node use 'one-peer-exp'")
    nodes = world_size // local_size
    rounds = _log2(nodes, "number of nodes (of LOCAL_WORLD_SIZE ranks)", "alternating-exp-ring")

    def node(n: int) -> list[int]:
        return list(range(n * local_size, (n + 1) * local_size))

    steps = []
    for k in range(rounds):
        inside_first, pair_first = [], []
        for i, (a, b) in enumerate(_pairs(nodes, 2 ** k)):
            inside, pair = [node(a), node(b)], [node(a) + node(b)]
            if i % 2 == 0:
                inside_first += inside
                pair_first += pair
            else:
                inside_first += pair
                pair_first += inside
        steps += [(inside_first, None), (pair_first, None)]
    return of("alternating-exp-ring", steps)


BUILT_IN: dict[str, Callable[[int, int], Topology]] = {
    "complete": complete,
    "ring": ring,
    "one-peer-exp": one_peer_exp,
    "alternating-exp-ring": alternating_exp_ring,
}


def check_spec(topology) -> None:
    """At transpile(): a built-in name or a Topology."""
    if isinstance(topology, Topology):
        return
    if not isinstance(topology, str) or topology not in BUILT_IN:
        raise TranspileError(f"topology must be one of {', '.join(BUILT_IN)} or a "
                             f"transpiler.topology.Topology (topology.of(...)), got {topology!r}")


def resolve(topology: str | Topology, world_size: int, local_size: int) -> Topology:
    """The topology for this world, checked."""
    topo = BUILT_IN[topology](world_size, local_size) if isinstance(topology, str) else topology
    topo.check(world_size)
    return topo
