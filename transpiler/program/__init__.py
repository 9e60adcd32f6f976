"""The IR: what a traced step is once captured and what every pass reads
and writes.

program.py: Program (a torch.fx graph of the whole step and the specs of its
inputs and outputs), held tensors, node helpers; roles.py: the roles and
annotations on node.meta; collectives.py: the collective ops, reductions and
their placements; mesh.py: the groups of ranks a collective runs over;
averaging.py: where a gradient is averaged.

May import: torch, transpiler.errors. Every other layer imports this one."""
