"""Lowering: reductions made into collectives over the ranks, and what
decides them.

reductions.py: a value to reduce issued and completed as collectives (flat,
hierarchical, over a group); rings.py: the communicators and the mesh of the
ranks; topology.py: gossip topologies (decentralized mode); reduce_groups.py:
parameters reduced over a group of their own; shards.py: how a tensor is
sharded over ranks (zero, fsdp); comm_hooks.py and powersgd.py: DDP's
communication hooks traced into a program.

May import: transpiler.program, transpiler.capture (the collectives a hook
traces), transpiler.errors, transpiler.world. The passes (passes/) build on
this layer."""
