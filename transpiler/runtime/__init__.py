"""The runtime: the transpiled step called on every rank.

step.py: TranspiledStep (trace on the first call, passes, startup, run,
checkpoints); executor.py: a program run and its writes committed, all or
nothing; program_cache.py: which program a call runs (guards, signatures);
schedule.py: which program each step runs (local SGD, DiLoCo, phases);
micro_loop.py: a loop over micro-batches run as one program per part;
held.py: tensors kept between steps; startup.py: the first call's broadcast.
Agreement between ranks, without hangs: control.py (the control group),
agreement.py (the same programs on every rank), consensus.py (one rank's
value for all), consistency.py (checks that ranks agree), rebuild.py (a
program rebuilt on every rank at once), compile_once.py (compiled once per
node), nodes.py (the ranks of each machine). Modes' state: sharded_params.py
(fsdp's released parameters), join.py and joined_update.py (DDP's Join),
verify.py (the eager step run beside as a check).

May import: every layer below it (program, capture, lowering, passes through
transpiler.pipeline, backends). Only the front (api.py, modes, mode_specs) and
the bench import it."""
