# Two entry points on a fresh machine: `make demo` and `make test`.
# `test-gpu` and `bench` run on the GPU machine with its own python3 and jax (no venv).
VENV ?= .venv
PY := $(VENV)/bin/python
GPU_PY ?= python3
GPU_WORKERS ?= 12

.PHONY: demo test test-full test-gpu test-gpu-dense test-gpu-grad test-gpu-kernels test-gpu-rest \
	test-gpu-mosaic bench lint clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,interop]"
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

# Whole files to a worker (--dist loadfile): cases of one file share compiled kernels. On
# 2 cores the main suite ran 9:03 and 10:16 (two runs, 2026-11-25) against 9:32-9:46
# with cases spread one by one: no clear gain beyond the machine's noise yet.
# XLA:CPU compiles without LLVM's optimizations (as `tests/util.py`'s FAST_COMPILE does
# per call): `make test` ran 9:37 against 10:52 (main suite 7:57 against 8:37, the
# parallel one 1:35 against 2:10; 2026-11-27), every test passing: the suite is bound by
# compiling interpret-mode kernels, not by running them.
# `make test` runs a quarter of each parametrized test's cases (`--sample 4`,
# tests/conftest.py: the first, then every fourth with an offset that varies by test, every
# implementation value kept). On 2026-11-27 the whole matrix took 25-32 min on 2 cores here
# (CI: 1405 s), where it had taken 9:39 the day before with nearly the same tests (a bare
# Python loop of 10^7 additions ran 1.5-2.7 s here that day, varying from run to run).
# There `--sample 3` took 20:13 (main suite 14:55, parallel 5:06) and `--sample 4` 15:58
# (12:32, 3:16). Cheap cases (marked `every_case`) all run. `make test-full` runs every
# case; so does the GPU suite.
CPU_XLA_FLAGS = --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true
SAMPLE ?= 4
CPU_PYTEST = $(PY) -m pytest -q -n 2 --dist loadfile --sample $(SAMPLE)
test: $(VENV)/.installed lint
	XLA_FLAGS="$(CPU_XLA_FLAGS)" $(CPU_PYTEST) tests --ignore=tests/parallel
	XLA_FLAGS="--xla_force_host_platform_device_count=8 $(CPU_XLA_FLAGS)" $(CPU_PYTEST) tests/parallel

test-full:
	$(MAKE) test SAMPLE=1

# The same suite with the kernels compiled for the GPU (bf16 tolerances, bigger shapes).
# Triton compiles are CPU-bound: GPU_WORKERS workers share the GPU, none preallocating memory.
# Four parts, so each fits a GPU machine's 10-minute limit on one command (the whole
# suite takes about 25 min on an H100): the dense ops' suites (attention, reference; 6.5
# min), the gradient suites (5-7 min), the decode and Hopper kernels' files (6 min; with the
# last part, 12 min, it had outgrown one command), then every other file (a new test file
# lands in the last part; 6.5 min).
GPU_PYTEST = XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. $(GPU_PY) -m pytest -q -rf \
	--tb=line -p no:cacheprovider -n $(GPU_WORKERS)
GPU_DENSE_TESTS = tests/test_attention.py tests/test_reference.py
GPU_GRAD_TESTS = tests/test_grad.py tests/test_grad_kernels.py tests/test_train_example.py \
	tests/test_nn.py
GPU_KERNEL_TESTS = tests/test_decode.py tests/test_ppl.py tests/test_mosaic.py \
	tests/test_mosaic_backward.py tests/test_beam.py tests/test_cache.py tests/test_generation.py \
	tests/test_llama_hf.py tests/test_notebooks.py tests/test_stacked.py tests/test_bench_report.py

test-gpu: test-gpu-dense test-gpu-grad test-gpu-kernels test-gpu-rest

test-gpu-dense:
	$(GPU_PYTEST) $(GPU_DENSE_TESTS)

test-gpu-grad:
	$(GPU_PYTEST) $(GPU_GRAD_TESTS)

test-gpu-kernels:
	$(GPU_PYTEST) $(GPU_KERNEL_TESTS)

test-gpu-rest:
	$(GPU_PYTEST) $(addprefix --ignore=,$(GPU_DENSE_TESTS) $(GPU_GRAD_TESTS) $(GPU_KERNEL_TESTS) \
		tests/parallel) tests

# The Hopper (Mosaic GPU) kernels' own files alone (also in test-gpu-kernels and -rest): a quick
# check on another sm90 kind (H200).
test-gpu-mosaic:
	$(GPU_PYTEST) tests/test_mosaic.py tests/test_mosaic_backward.py tests/test_mosaic_lengths.py \
		tests/test_mosaic_packed.py tests/test_mosaic_sinks.py

bench:
	PYTHONPATH=. $(GPU_PY) -m bench.run

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check jaxattn pallas_kernels tests bench examples notebooks
	$(VENV)/bin/ruff format --check jaxattn pallas_kernels tests bench examples notebooks

clean:
	rm -rf $(VENV) .pytest_cache
