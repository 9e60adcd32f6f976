# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; with it installed, `torch>=2.9` installs nothing more.
# The whole suite runs on 2.13.0; `pytest -m "not slow"` also passes on 2.9.1 (2.6.0 fails).
TORCH ?= torch==2.13.0

.PHONY: install demo test bench zoo clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/torchrun --nproc-per-node 2 examples/train.py

# The tests on ranks and the others as two pytest processes side by side
# (tests/parallel.py); `$(PY) -m pytest -q` runs them one after the other.
test: install
	$(PY) -m tests.parallel

# The default models and configs (transpiler/bench/bench.py: DEFAULT_MODELS, DEFAULT_CONFIGS);
# the report is generated from this run, never edited by hand. The plot needs
# the optional extra (pip install -e .[bench]); without it the report says so.
bench: install
	$(PY) -m transpiler.bench --repeat 3 --report docs/performance.md --json docs/performance.json --plot docs/performance.png

# Every architecture of tests/zoo.py on 2 ranks against DDP; writes the pass table.
zoo: install
	$(PY) -m tests.test_zoo --report docs/zoo.md

clean:
	rm -rf $(VENV) *.egg-info
