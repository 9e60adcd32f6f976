"""python -m transpiler.bench: the bench's command line (cli.py). The ranks it
spawns unpickle transpiler.bench.launch._rank_main, never this __main__."""

import sys

from transpiler.bench.cli import main

sys.exit(main())
