"""Parameters reduced over a process group of their own (transpile's
reduce_groups): the expert parameters of a mixture-of-experts layer, averaged
over the ranks that hold the same experts; a module shared by some ranks only.

The user gives (group, parameters) pairs, a group being a process group or a
dimension of the mesh (Dim.NODE: the ranks of this rank's node; Dim.ACROSS:
this rank's peers on the other nodes, by torchrun's LOCAL_WORLD_SIZE); each
parameter's gradient is then averaged over its group (by local SGD: its value), it starts from the
first rank of its group, and every other parameter is reduced over the world.
Groups are numbered by their position in the list, which is what the programs
and the rank agreement see: each rank passes the group it belongs to, so the
ranks' groups differ while their positions, sizes and parameter counts agree.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from ..errors import TranspileError
from ..program.mesh import Dim, Over, UserGroup
from ..program.program import InputKind, InputSpec, OutputKind, OutputSpec, Program
from ..program.roles import REDUCED


@dataclasses.dataclass(frozen=True)
class ReduceGroup:
    group: dist.ProcessGroup | Dim
    params: tuple[torch.Tensor, ...]


def check(groups: Iterable) -> tuple[ReduceGroup, ...]:
    """transpile's reduce_groups, checked: pairs of a process group this rank
    belongs to (or Dim.NODE, Dim.ACROSS) and parameters, each parameter in one
    group at most."""
    checked, seen = [], set()
    for i, entry in enumerate(groups):
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
            raise TranspileError(f"reduce_groups[{i}] must be a pair (process group, parameters), "
                                 f"got {entry!r}")
        group, params = entry[0], tuple(entry[1])
        if not (isinstance(group, dist.ProcessGroup) or group in (Dim.NODE, Dim.ACROSS)):
            raise TranspileError(
                f"reduce_groups[{i}]: {group!r} is not a process group this rank belongs to "
                "nor Dim.NODE or Dim.ACROSS; give each rank the group it is a member of "
                "(dist.new_group, dist.new_subgroups)")
        for p in params:
            if not isinstance(p, torch.nn.Parameter):
                raise TranspileError(f"reduce_groups[{i}]: give parameters (module.parameters()), "
                                     f"got a {type(p).__name__}")
            if id(p) in seen:
                raise TranspileError(f"reduce_groups[{i}]: a parameter of shape {tuple(p.shape)} "
                                     "is already in an earlier group; each is reduced over one")
            seen.add(id(p))
        checked.append(ReduceGroup(group, params))
    return tuple(checked)


def describe(groups: Sequence[ReduceGroup]) -> str:
    """What every rank must agree on: each group's size (or dimension) and
    parameter count."""
    return repr([(str(g.group) if isinstance(g.group, Dim) else g.group.size(), len(g.params))
                 for g in groups])


def assign(groups: Sequence[ReduceGroup], params: dict[int, str]) -> dict[str, Over]:
    """Program name of each grouped parameter -> its group, given the step's
    parameters (id -> name). A grouped parameter the step does not see is an
    error: its gradient would silently not be reduced where the user asked."""
    assigned = {}
    for i, g in enumerate(groups):
        over = g.group if isinstance(g.group, Dim) else UserGroup(i, g.group.size())
        for p in g.params:
            if id(p) not in params:
                raise TranspileError(
                    f"reduce_groups[{i}] names a parameter of shape {tuple(p.shape)} that is "
                    "not a parameter of the models the step was called with")
            assigned[params[id(p)]] = over
    return assigned


def check_program(program: Program, groups: dict[str, Over]) -> None:
    """Raise if a value reduced over a user's group flows into state that every
    rank of the world must hold alike. The groups' sums differ by design, so
    whatever is computed from them differs between groups: a gradient norm over
    all parameters (clip_grad_norm_), GradScaler's inf check, skip_nonfinite's
    decision would update the world's parameters differently on each group, a
    silent divergence. Values reduced over the world are the same everywhere
    again; the step's returned values and the grouped parameters' own state may
    differ."""
    if not groups:
        return
    varying: dict[fx.Node, bool | frozenset[int]] = {}
    for node in program.graph.nodes:
        reduced = node.meta.get(REDUCED)
        if reduced is not None:
            varying[node] = reduced.over is not Dim.WORLD
        elif node.op == "call_function":
            varying[node] = _varies(node, varying)
    inputs = {spec.name: spec for spec in program.inputs}
    for spec, value in zip(program.outputs, program.output_node.args[0]):
        if varying.get(value) is True and spec.kind is not OutputKind.USER \
                and _owner(spec, inputs) not in groups:
            raise TranspileError(
                f"the step computes {_describe(spec)} from gradients reduced over a group of "
                "reduce_groups, whose sums differ between the groups, so the ranks would "
                "diverge. Compute it from each group's parameters separately (e.g. clip "
                "each group's gradients with its own clip_grad_norm_ call), or leave those "
                "parameters out of reduce_groups. (GradScaler and skip_nonfinite decide "
                "from every gradient: they cannot be combined with reduce_groups.)")


def _varies(node: fx.Node, varying: dict) -> bool | frozenset[int]:
    """Whether the node's value differs between groups; for a foreach op (a list
    out, lists of as many tensors in), which of its outputs: output i reads
    element i of each list, so one group's gradient in a fused optimizer
    update does not make every parameter's update vary."""
    def varies(a) -> bool:
        if not isinstance(a, fx.Node):
            return False
        if a.target is operator.getitem and isinstance(varying.get(a.args[0]), frozenset):
            return a.args[1] in varying[a.args[0]]
        return varying.get(a) is True

    if node.target is operator.getitem and isinstance(varying.get(node.args[0]), frozenset):
        return varies(node)
    args = list(node.args) + list(node.kwargs.values())
    lists = [a for a in args if isinstance(a, (list, tuple))]
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)) and lists and all(len(x) == len(val) for x in lists):
        rest = any(varies(a) for a in args if not isinstance(a, (list, tuple)))
        return frozenset(i for i in range(len(val))
                         if rest or any(varies(x[i]) for x in lists))
    return any(varies(a) for a in node.all_input_nodes)


def _owner(spec: OutputSpec, inputs: dict[str, InputSpec]) -> str | None:
    """The parameter an output belongs to, if any."""
    if spec.kind is OutputKind.GRAD:
        return spec.target
    if spec.kind is OutputKind.STATE:
        return spec.param
    source = inputs.get(spec.target)
    if source is None:
        return None
    return source.name if source.kind is InputKind.PARAM else source.param


def _describe(spec: OutputSpec) -> str:
    return f"the {spec.kind.value} of {spec.target}" if spec.target else spec.kind.value
