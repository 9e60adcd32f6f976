"""What a rank that has joined runs in modes zero and fsdp: the update of the shards it holds.

Under DDP's Join a joined rank contributes zeros to each all-reduce and its
optimizer rests, while the ranks still stepping update every parameter from
the averaged gradients. In modes zero and fsdp each rank holds, and alone
updates, its shard of the optimizer state (and of the parameters): the shard of
a joined rank must still take each of the others' updates, or the model would
leave DDP's. So a joined rank runs its last program with zero gradients:
`joined_update(program)` is that program with every parameter's gradient
(meta["param"]) replaced by zeros and what its forward and backward compute
left out. What stays: the same collectives in the same order (checked), the
update of this rank's shards from the reduced gradients (clipping, the
GradScaler's check and skip included), the all-gather of the updated
parameters. Its outputs are the parameters, the optimizer state, the held
shards and values, the GradScaler's state; not the buffers (a joined rank's
forward does not run, as under DDP), the .grad, or what the step returns.

The hyperparameters and numbers it reads are given by the ranks still stepping
(join.py exchanges them): a joined rank's learning-rate scheduler rests, as
under DDP, and the update of its shard is still theirs. A program whose update
reads the batch, a value drawn on the host, or a random op cannot be run so:
TranspileError, which join.py raises on every rank.
"""

from __future__ import annotations

import torch

from .agreement import collective_summary
from ..errors import TranspileError
from ..program.program import InputKind, OutputKind, Program, draws_random, new_node
from ..program.roles import COMM, INPUT, PARAM, Role

aten = torch.ops.aten

# Inputs a joined rank sets itself: those the ranks still stepping give it.
GIVEN = (InputKind.HYPER, InputKind.NUMBER)
# Inputs of the step's call a joined rank has none of for the others' steps.
_OF_THE_CALL = (InputKind.DATA, InputKind.DRAW, InputKind.REACHED, InputKind.LOOP)
# Outputs of an update: the parameters' (their full values, gathered), the
# optimizer state, the held shards and values, the GradScaler's state.
_UPDATED_INPUTS = (InputKind.PARAM, InputKind.STATE, InputKind.HELD, InputKind.SCALER)


def kept_outputs(program: Program) -> list[bool]:
    """For each output of `program`: whether the joined update computes it."""
    kinds = {spec.name: spec.kind for spec in program.inputs}
    return [spec.kind in (OutputKind.STATE, OutputKind.HELD)
            or (spec.kind is OutputKind.UPDATE and kinds[spec.target] in _UPDATED_INPUTS)
            for spec in program.outputs]


def joined_update(program: Program) -> Program:
    """`program` as a rank that has joined runs it: zero gradients, the same
    collectives, its outputs those kept_outputs() keeps (the others left out)."""
    joined = program.copy(program.name)
    graph = joined.graph
    for grad in list(joined.grads.values()):
        val = grad.meta["val"]
        with graph.inserting_before(grad):
            zeros = new_node(graph, aten.zeros.default, (list(val.shape),), Role.BACKWARD,
                             {"dtype": val.dtype, "device": val.device},
                             fake_mode=val.fake_mode, **{PARAM: grad.meta[PARAM]})
        grad.replace_all_uses_with(zeros)
        del grad.meta[PARAM]
    out = joined.output_node
    kept = kept_outputs(program)
    out.args = (tuple(v for v, keep in zip(out.args[0], kept) if keep),)
    joined.outputs = [spec for spec, keep in zip(program.outputs, kept) if keep]
    graph.eliminate_dead_code(
        is_impure_node=lambda n: COMM in n.meta or n.is_impure(impure_random=False))
    joined.gm.recompile()
    _check(program, joined)
    return joined


def _check(program: Program, joined: Program) -> None:
    reads = [n.meta[INPUT].name for n in joined.placeholders
             if n.meta[INPUT].kind in _OF_THE_CALL and n.users]
    if reads:
        raise TranspileError(
            f"program {program.name!r} reads what the step's call gives ({', '.join(reads)}) "
            "in its collectives or its update, not only through the gradients: a rank that has "
            "joined has none of it for the others' steps (the buffers the step writes, "
            "broadcast: pass broadcast_buffers=False; SyncBatchNorm's statistics; a value of "
            "the batch in the update)")
    if any(draws_random(n) for n in joined.graph.nodes):
        raise TranspileError(f"program {program.name!r} draws random numbers in its update, "
                             "which a rank that has joined cannot draw as the others")
    if collective_summary(joined) != collective_summary(program):   # what the others issue
        raise TranspileError(
            f"program {program.name!r}: without the batch its collectives change (a collective "
            "reads the forward's values, as SyncBatchNorm's statistics), so a rank that has "
            "joined cannot run them with the others")
