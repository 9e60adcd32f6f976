"""Node roles: what part of the training step a graph node belongs to.

The counterpart of Paddle's OpRole. Roles are set where the graph is captured
(transpiler/capture.py), from markers placed during tracing, and carried by
every pass that creates nodes; they are never guessed from node names.
"""

from __future__ import annotations

import enum


class Role(enum.IntFlag):
    FORWARD = 1
    BACKWARD = 2
    LOSS = 4
    OPTIMIZE = 8
    COMM = 16
    # Gradient processing: what the step computes from the gradients between
    # its last backward() and optimizer.step() (clipping, unscaling, edits of
    # .grad). It reads the reduced gradients, as under DDP.
    GRADIENT = 32

    def __str__(self) -> str:
        return "|".join(r.name for r in Role if r in self)


# Keys used on node.meta. One place, so that passes and printers agree.
ROLE = "role"          # Role of every call_function node
PARAM = "param"        # qualified parameter name on the node holding its gradient
# On the same node: its position in the order the autograd engine accumulated
# the gradients of the step's last backward() (DDP's order of ready gradients)
READY = "ready"
# averaging.GradAt on the node holding a parameter's .grad where a backward()
# before the last one ends (capture); averaging.py decides which are averaged
GRAD_AT = "grad_at"
COMM = "comm"          # CommInfo on collective nodes and their waits
BUCKET = "bucket"      # bucket index on the nodes that pack and unpack a fused buffer
INPUT = "input"        # InputSpec on placeholders
REDUCE = "reduce"      # Reduction (collectives.py): a value a reduction pass must reduce over the ranks
REDUCED = "reduced"    # Reduction: on the node holding a value's reduced result (lowering.complete)
# lowering.issue: on the node that divides a value by the ranks that sum it (a
# mean), the Over those ranks are (join.py divides by the ranks still stepping)
AVERAGED = "averaged"
# shard_optimizer: the parameter name on the node holding this rank's shard of
# it, and on the node holding its full value gathered from the updated shards
PARAM_SHARD = "param_shard"
GATHERED = "gathered"
# capture/micro.py: the micro-batch (0 or 1) of the cut list a node was traced
# for, and on the nodes of per-micro-batch state where one ends, a Carry
MICRO = "micro"
CARRY = "carry"
# capture (transpile(find_unused_parameters=True)): on the zero gradient the
# trace gives a parameter that got none from this rank's backward pass
UNUSED = "unused"
# capture/decisions.py: the Decision a check node (aten._assert_scalar) holds the program to
DECISION = "decision"
# program.keep_old_unless(skippable=True): on a where(ok, new, old) that keeps an
# update's old value unless ok, where the update may be skipped by a host read
# instead (skipped_update.py)
SKIPPABLE = "skippable"
# capture/buffer_sync.py: (point, buffer name) on a copy of a buffer onto
# itself where a DDP wrapper would broadcast rank 0's buffers inside the step
# (broadcast_buffers makes each point's copies a broadcast)
BUFFER_SYNC = "buffer_sync"
