"""The bench's command line: the default run (bench.py); with
--varying-shapes, the varying-shapes workload (shapes.py); with --timeline,
one step's all-reduces in time (timeline.py)."""

from __future__ import annotations

import logging
import sys

from . import bench, shapes, timeline


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = bench.parse_args(argv)
    if args.timeline:
        configs = bench._names(args.configs or "ddp,fuse_all_reduce", bench.CONFIGS, "config")
        return timeline.main(bench._names(args.timeline, bench.MODELS, "model")[0], configs,
                             args.world_size, args.optimizer)
    return (shapes.main if args.varying_shapes else bench.main)(args, argv)
