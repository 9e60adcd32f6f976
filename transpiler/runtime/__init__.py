"""The runtime: the transpiled step called on every rank.

- step.py: TranspiledStep (trace on the first call, passes, startup, run,
  checkpoints); executor.py: a program run and its writes committed, all or
  nothing; runnable.py: what the executor runs; program_cache.py: which
  program a call runs (guards, signatures); schedule.py: which program each
  step runs (local SGD, DiLoCo, phases); micro_loop.py: a program cut into a
  loop over micro-batches; held.py: tensors kept between steps; startup.py:
  the first call's broadcast.
- The ranks kept in agreement, without hangs: control_plane.py (the gloo
  group the ranks exchange settings and digests over), agreement.py (the
  same programs on every rank before their first collective), divergence.py
  (which parameters differ between the ranks: check_consistency),
  rebuild.py (a program rebuilt on every rank at once), compile_once.py
  (compiled once per node), node_first.py (the first rank of each machine,
  which compiles for it).
- Modes' state: sharded_params.py (fsdp's released parameters), join.py and
  joined_update.py (DDP's Join), verify.py (the eager step run beside as a
  check), replica_average.py (the average of what the ranks hold apart by
  design, decentralized mode's parameters, and the distance from it).

May import: every layer below it (program, capture, lowering, the passes
through transpiler.pipeline, backends). Only the front (api.py, mode_specs.py,
the package's __init__) and the bench import it."""
