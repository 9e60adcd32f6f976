"""The bench's command line: the default run (bench.py) or, with
--varying-shapes, the varying-shapes workload (shapes.py)."""

from __future__ import annotations

import logging
import sys

from . import bench, shapes


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = bench.parse_args(argv)
    return (shapes.main if args.varying_shapes else bench.main)(args, argv)
