"""Where the gradients are averaged: at which backward() calls of a step.

DDP's reducer averages the gradients at the end of every backward() run
outside no_sync(); a training loop that accumulates micro-batches wraps all but
the last in no_sync(), so that only the sum is averaged. A transpiled step
needs no no_sync(): it reads from the program what each backward()'s gradients
are used for.

- Pure accumulation: the gradients a backward() leaves are read only by the
  next backward(), which adds its own to them. They are averaged once, where
  the last backward() before optimizer.step() ends (as under no_sync).
- Anything else reads them (SAM's ascent on the first gradient, a lookahead, a
  norm logged between micro-batches): that backward() is averaged where it
  ends, every parameter's gradient, as DDP does; later reads, and the next
  backward()'s accumulation, read the averages.

Capture marks the node holding each parameter's .grad where each backward()
before the last one ends (mark_backward_ends: meta["grad_at"], a GradAt); the
plan (early_averages) decides from the program alone which of those backward()
calls are averaged; average_grads marks their gradients to reduce, each
backward()'s as a reduction point of its own (Reduction.point), so that no
collective mixes two points.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from .program import Program
from ..errors import PassError
from .roles import GRAD_AT, PARAM, ROLE, Role


@dataclasses.dataclass(frozen=True)
class GradAt:
    """The .grad of parameter `param` where backward() number `backward` (from
    1) of the step ended."""

    param: str
    backward: int


def mark_backward_ends(ends: list[dict[str, fx.Node]]) -> None:
    """Mark the gradients each backward() of `ends` leaves (per backward(),
    from the first, parameter -> node of its .grad; the last one before
    optimizer.step() is not among them: its gradients are the step's). A node
    that several backward() calls leave (a parameter the later ones give no
    gradient) keeps the first mark."""
    for backward, grads in enumerate(ends, 1):
        for param, node in grads.items():
            node.meta.setdefault(GRAD_AT, GradAt(param, backward))


def early_averages(program: Program) -> dict[int, list[fx.Node]]:
    """backward() number -> the gradient nodes it leaves, for each backward()
    before the last one whose gradients something reads other than a later
    backward()'s accumulation (any node that is not BACKWARD: SAM's
    perturbation, a norm, a returned value). In program order. A node that is
    also the gradient the step reduces at its end (meta["param"]) is left to
    that reduction."""
    ends: dict[int, list[fx.Node]] = {}
    for node in program.graph.nodes:
        if GRAD_AT in node.meta and PARAM not in node.meta:
            ends.setdefault(node.meta[GRAD_AT].backward, []).append(node)
    return {b: nodes for b, nodes in ends.items() if any(_read(n) for n in nodes)}


def _read(node: fx.Node) -> bool:
    return any(not (u.meta.get(ROLE, Role.FORWARD) & Role.BACKWARD) for u in node.users)


class GradientReads:
    """Which nodes reading a gradient read its average over the ranks, and
    which the rank's own gradient. DDP writes the averages into .grad where the
    backward() that produced them ends: the nodes of that backward() that read
    a gradient (autograd's copy of a gradient two parameters share, as an LSTM
    layer's two biases have) read the rank's own; every later node reads the
    average (a later backward()'s accumulation included). Built before a pass
    edits the graph: positions are the program's as traced."""

    def __init__(self, program: Program):
        self.position = {n: i for i, n in enumerate(program.graph.nodes)}
        self.ends: dict[int, int] = {}   # backward() number -> where its gradients are left
        for node in program.graph.nodes:
            if GRAD_AT in node.meta:
                backward = node.meta[GRAD_AT].backward
                self.ends[backward] = max(self.ends.get(backward, -1), self.position[node])

    def average(self, user: fx.Node, point: int) -> bool:
        """Whether `user` reads the average of a gradient of reduction point
        `point` (Reduction.point: 0, the last backward(), after which no
        backward() runs; else that backward())."""
        if not user.meta.get(ROLE, Role.FORWARD) & Role.BACKWARD:
            return True
        return point > 0 and self.position.get(user, -1) > self.ends.get(point, -1)


def refuse_backward_after_update(program: Program, what: str) -> None:
    """Refuse, for a pass that assumes one update per step (`what` it does), a
    step that calls backward() after an optimizer's step (a GAN's generator
    loss through the discriminator just updated, a critic stepped several
    times): in the program as captured, a BACKWARD node after an OPTIMIZE one."""
    updated = False
    for node in program.graph.nodes:
        role = node.meta.get(ROLE, Role.FORWARD)
        updated = updated or bool(role & Role.OPTIMIZE)
        if updated and role & Role.BACKWARD:
            raise PassError(
                f"the step calls backward() after an optimizer's step (GAN training, a critic "
                f"stepped several times); {what} once per step: use mode 'fuse_all_reduce', "
                "'grad_allreduce' or 'local_sgd' for this step")
