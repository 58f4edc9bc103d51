# make setup      .venv with Python >= 3.12 (tools/find_python.sh), pip install -e '.[test]'
# make test       setup, then the test suite (CPU; GPU tests skip without 2+ Hopper GPUs)
# make bench      setup, then the whole model, fused against BSP, on the devices present
# make bench-ops  setup, then the three op benchmarks on the devices present
# make readme-table  the README's model figures from benchmarks/results/*_transformer.json
# make gpu-suite  benchmarks/gpu_suite.sh (GPU tests + benchmarks on a multi-GPU host)

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# Per-test limit in seconds. The thread method also ends a test that hangs in
# native code (a collective waiting for a peer), which the signal method cannot.
TEST_TIMEOUT ?= 600
PYTEST_ARGS ?=
OUT ?= bench_out/gpu

.PHONY: setup test bench bench-ops readme-table gpu-suite clean

setup:
	@tools/setup.sh $(VENV)

# pytest exits 5 when it collected no tests: that is a failure here too.
test: setup
	@$(PY) -m pytest -q tests --timeout=$(TEST_TIMEOUT) --timeout-method=thread $(PYTEST_ARGS) </dev/null; \
	  rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests; that is a failure." >&2; fi; \
	  exit $$rc

bench: setup
	@tools/bench.sh $(PY) model

bench-ops: setup
	@tools/bench.sh $(PY) ops

readme-table: setup
	@$(PY) -m benchmarks.model_table --write README.md

# No setup: the GPU host needs jax with the CUDA plugin ('jax[cuda13]==0.11.2'),
# installed in .venv if there is one, else in the Python on PATH.
gpu-suite:
	@if [ -x $(PY) ]; then export PATH="$(CURDIR)/$(VENV)/bin:$$PATH"; fi; \
	  OUT=$(OUT) bash benchmarks/gpu_suite.sh

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
