"""defer_waits: a sync's all-reduces waited on in a later program (Streaming
DiLoCo's fragment_sync_delay: the inner steps in between run while the
fragment's pseudo-gradients are summed).

Requires: coalesce_tensors (the buckets of pseudo_gradients' values; its
collectives not hierarchical).
Produces, by ctx.sync_part, for each bucket i (its all-reduce and its wait, in
issue order; collectives of the model's own code are not touched):

    SEND     the all-reduce issued as before, its result output un-waited as
             the held value Held.IN_FLIGHT:<i>; the wait, and the
             pseudo-gradient outputs with whatever only they read, dropped
    RECEIVE  the all-reduce replaced by a held input Held.IN_FLIGHT:<i>, which
             its wait reads; what only the all-reduce read (the deltas and
             their pack) dropped

Built by the same passes from one trace, the two programs have the same
buckets in the same order; the schedule (transpiler/runtime/schedule.py DiLoCo) runs
SEND, then RECEIVE fragment_sync_delay steps later, and the runtime keeps the
in-flight values between them. With one rank (nothing summed) SEND outputs
the pseudo-gradients it computes and RECEIVE none. Without ctx.sync_part it
does not apply.
Order: after coalesce_tensors, ring_round_robin and schedule_comm (last).
"""

from __future__ import annotations

import torch.fx as fx

from transpiler.program.collectives import WAIT
from transpiler.lowering.context import PassContext, SyncPart, requires
from transpiler.program.program import (Held, InputKind, InputSpec, OutputKind, OutputSpec, Program,
                                        erase_unread, held_name)
from transpiler.program.roles import BUCKET, COMM


def plan_buckets(program: Program) -> list[tuple[fx.Node, fx.Node]]:
    """(all-reduce, wait) of each bucket, in issue order."""
    pairs = []
    for collective in program.collectives():
        if collective.meta.get(BUCKET) is None:
            continue
        waits = [u for u in collective.users if u.target is WAIT]
        if len(waits) != 1 or len(collective.users) != 1:
            raise ValueError(f"bucket {collective.meta[BUCKET]}'s {collective.meta[COMM].op} is "
                             "not one collective read by its wait alone (hierarchical?)")
        pairs.append((collective, waits[0]))
    return pairs


@requires("coalesce_tensors")
def defer_waits(program: Program, ctx: PassContext) -> None:
    if ctx.sync_part is None:
        return
    buckets = plan_buckets(program)
    if ctx.sync_part is SyncPart.SEND and buckets:
        for i, (collective, _) in enumerate(buckets):
            name = held_name(Held.IN_FLIGHT, str(i))
            program.add_output(OutputSpec(OutputKind.HELD, name, held=Held.IN_FLIGHT), collective)
        _drop_pseudo_gradients(program)
    elif ctx.sync_part is SyncPart.RECEIVE:
        _receive(program, buckets)


def _drop_pseudo_gradients(program: Program) -> None:
    """The pseudo-gradient outputs dropped, and whatever only they read."""
    out = program.output_node
    pairs = list(zip(program.outputs, out.args[0]))
    program.outputs = [spec for spec, _ in pairs if spec.held is not Held.PSEUDO_GRAD]
    out.args = (tuple(value for spec, value in pairs if spec.held is not Held.PSEUDO_GRAD),)
    erase_unread([value for spec, value in pairs if spec.held is Held.PSEUDO_GRAD])


def _receive(program: Program, buckets: list[tuple[fx.Node, fx.Node]]) -> None:
    if not buckets:   # one rank: the send program's pseudo-gradients are those kept
        _drop_pseudo_gradients(program)
    for i, (collective, wait) in enumerate(buckets):
        spec = InputSpec(InputKind.HELD, held_name(Held.IN_FLIGHT, str(i)), held=Held.IN_FLIGHT)
        received = program.add_input(spec, collective, f"in_flight_{i}")
        wait.replace_input_with(collective, received)
        erase_unread([collective])
