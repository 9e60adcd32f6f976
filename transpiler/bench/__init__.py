"""The bench: the transpiler's step timed against torch DDP, FSDP2,
ZeroRedundancyOptimizer, torch.compile and the no-communication limit
(`python -m transpiler.bench`, `make bench`).

bench.py: the models, configurations and tables; launch.py: the rank
processes and the cause of a failure; report.py: the Markdown report;
shapes.py: the varying-shapes workload; timeline.py: when one step's
all-reduces are issued, run and waited for. The bench sits
above every other layer: it may import anything; nothing imports it."""
