"""Backends: a finished program made executable.

compile.py: compile_program (eager, inductor, CUDA graphs, HPU) and the
process group a device needs; reinplace.py: the eager executable, updating in
place; skipped_update.py: an update skipped on a host read (GradScaler);
compiler_graph.py: the copy of the graph a compiler is given; cuda_graphs.py
and hpu.py: the whole-step CUDA graph and Intel Gaudi; failure_points.py: the
ops that may raise, which state writes must follow.

May import: transpiler.program, transpiler.capture, transpiler.errors,
transpiler.world. The runtime runs what this layer builds."""
