# Two entry points on a fresh machine: `make demo` and `make test`.
# `test-gpu` and `bench` run on the GPU machine with its own python3 and jax (no venv).
VENV ?= .venv
PY := $(VENV)/bin/python
GPU_PY ?= python3
GPU_WORKERS ?= 12

.PHONY: demo test test-gpu bench lint clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,interop]"
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

test: $(VENV)/.installed
	$(VENV)/bin/ruff check jaxattn pallas_kernels tests bench examples notebooks
	$(PY) -m pytest -q -n 2 tests

# The same suite with the kernels compiled for the GPU (bf16 tolerances, bigger shapes).
# Triton compiles are CPU-bound: 8 workers share the GPU, none preallocating its memory.
test-gpu:
	XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. $(GPU_PY) -m pytest -q -rf --tb=line \
		-p no:cacheprovider -n $(GPU_WORKERS) tests

bench:
	PYTHONPATH=. $(GPU_PY) -m bench.run

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check jaxattn pallas_kernels tests bench examples notebooks
	$(VENV)/bin/ruff format --check jaxattn pallas_kernels tests bench examples notebooks

clean:
	rm -rf $(VENV) .pytest_cache
