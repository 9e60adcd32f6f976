"""`python -m tests.parallel [pytest options]`: the whole suite as two pytest
processes side by side, the tests on real ranks and the others.

A test on ranks keeps its ranks' processes busy and the pytest process
waiting, and a one-process test keeps one core busy: side by side, the two
halves use a 2-core machine that running them one after the other leaves half
idle. Each half's output is printed when it ends (a line a minute says what
still runs); the exit status is a failing half's, else 0. `pytest -q` runs the
same tests one after another."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

# (marker `compiles`: slow tests in one process, which inductor keeps busy)
HALVES = (("ranks", "slow and not compiles"), ("one process", "not slow or compiles"))
NO_TESTS = 5   # pytest's exit status when it collected no test
HEARTBEAT_S = 60


def main(argv: list[str]) -> int:
    start = time.monotonic()
    running = []
    for name, marker in HALVES:
        log = tempfile.TemporaryFile(mode="w+")
        command = [sys.executable, "-m", "pytest", "-q", "-m", marker, *argv]
        running.append((name, log, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)))
    codes = {}
    heartbeat = start
    while len(codes) < len(running):
        if time.monotonic() - heartbeat >= HEARTBEAT_S:   # progress, where output waits
            heartbeat = time.monotonic()
            left = [name for name, _, _ in running if name not in codes]
            print(f"tests.parallel: {' and '.join(left)} running, "
                  f"{heartbeat - start:.0f} s from the start", flush=True)
        for name, log, process in running:
            if name in codes or process.poll() is None:
                continue
            codes[name] = process.returncode
            log.seek(0)
            print(f"===== {name} ({' '.join(process.args[3:])}): exit {process.returncode}, "
                  f"{time.monotonic() - start:.0f} s from the start =====", flush=True)
            sys.stdout.write(log.read())
            sys.stdout.flush()
        time.sleep(0.5)
    # 5: that half collected no test (options that select from the other half only)
    failed = [code for code in codes.values() if code not in (0, NO_TESTS)]
    if failed:
        return failed[0]
    return NO_TESTS if all(code == NO_TESTS for code in codes.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
