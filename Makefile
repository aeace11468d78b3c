# Quick start: `make demo` then `make test`. Both create .venv on first use.
# `make test` runs the tests of the code; `make docs` builds the documentation and runs every block and docstring
# example in it (tests/docs); `make test-fast` leaves out the tests marked slow (model sweeps, subprocesses, big
# images, reference oracles with a trunk of their own, CLI option sweeps): the edit loop. CI runs lint, docs and test.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pytest-xdist workers: one per core, at most 4 (a worker's memory peaks at about 9.5 GB, as the whole suite's in
# one process does); WORKERS=0 runs in one process
WORKERS ?= auto
# bytecode caches written even where PYTHONDONTWRITEBYTECODE is set: every worker otherwise compiles the package
# and rewrites the asserts of every test file again (about 8 s of CPU each, each run)
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n $(WORKERS) --maxprocesses 4 --dist worksteal

.PHONY: demo test test-fast lint docs bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py
	$(PY) examples/style_transfer.py --demo --side-by-side --out demo-output/style_transfer.png

test: $(STAMP)
	$(PYTEST) --ignore=tests/docs

test-fast: $(STAMP)
	$(PYTEST) --ignore=tests/docs -m "not slow"

# ruff (lint and format) everywhere; mypy on the library, strict on the engine (pyproject.toml, [tool.mypy])
lint: $(STAMP)
	$(VENV)/bin/ruff check featurehooks tests benchmarks examples
	$(VENV)/bin/ruff format --check featurehooks tests benchmarks examples
	$(PY) -m mypy

# the user guide (docs/*.md) and the API reference generated from the docstrings (docs/api/), into site/;
# --strict: a warning (a broken link, a docstring griffe cannot read) fails the build (not --quiet: it hides
# the warnings, and --strict then passes); then every code block of README.md and docs/, and every docstring
# example, runs (tests/docs)
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site
	$(PYTEST) tests/docs

# the CPU benchmarks, one after another (about an hour on 2 quiet cores); results land in benchmarks/results/
BENCHMARKS := extraction losses memory_formats metrics generative probes dump_throughput dump_command dump_memory compile attention live_exit max_pool
bench: $(STAMP)
	for name in $(BENCHMARKS); do $(PY) benchmarks/$$name.py || exit 1; done

clean:
	rm -rf $(VENV) demo-output .pytest_cache site
