# Flywheel: two commands. `make run` sets everything up and runs the local training loop;
# `make test` sets everything up and runs the tests. Heavy venvs and the converted model live in
# $(FLYWHEEL_CACHE), keyed by what they are built from, so reruns and fresh clones reuse them.

SHELL := /bin/bash
.DEFAULT_GOAL := help

BOOTSTRAP_PYTHON ?= python3
export FLYWHEEL_CACHE ?= $(HOME)/.cache/flywheel
export LITELLM_LOCAL_MODEL_COST_MAP := True
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# mypy's incremental cache beside the venvs: a fresh clone's `make lint` checks only what changed
# (mypy checks each cached module's source hash, so a cache shared between checkouts stays exact).
export MYPY_CACHE_DIR ?= $(FLYWHEEL_CACHE)/mypy
export OPENHANDS_SUPPRESS_BANNER := 1
export PYTHONPATH := $(CURDIR)

ENGINE_PY := $(CURDIR)/.venv/bin/python
AGENTS_PY := $(CURDIR)/.venv-agents/bin/python
RUN_CONFIG ?= configs/run-local.yaml
PYTEST_ARGS ?=

.PHONY: help setup engine agents model harnesses harnesses-check lock test check docs test-engine test-agents coverage lint run serve bench clean

help:
	@echo "make run    set up, then run the local loop (vLLM + proxy + trainer + math workflow)"
	@echo "make test   set up, then run lint and the test suite (real vLLM, SQLite, PostgreSQL)"
	@echo "make check  the inner loop: lint, types and the tests that need no engine (a few minutes)"
	@echo "make serve  set up, then run vLLM and the proxy only (point your agent at it)"
	@echo "make bench  run the benchmarks in bench/"
	@echo "make docs   generate the reference pages and build the docs site (strict)"
	@echo "make coverage  the engine suite with a line-coverage table"
	@echo "make harnesses-check  the newest agent harnesses against the scripted engine: a compatibility matrix"

engine:
	@$(BOOTSTRAP_PYTHON) deploy/bootstrap.py engine >/dev/null

agents:
	@$(BOOTSTRAP_PYTHON) deploy/bootstrap.py agents >/dev/null

# SmolLM2 converted from its GGUF, and the tests' plumbing model built from it (deploy/model.py).
model: engine
	@$(ENGINE_PY) -m deploy.model fetch tiny >/dev/null

# Claude Code, Codex CLI and Gemini CLI at the versions deploy/harnesses/package-lock.json pins (npm ci into the cache).
harnesses:
	@$(BOOTSTRAP_PYTHON) deploy/bootstrap.py harnesses >/dev/null

setup: engine agents model harnesses

# The harness sentinel (bench/harnesses_check.py): the newest releases of Claude Code, Codex CLI,
# Gemini CLI, opencode and mini-swe-agent beside the pinned ones, each on a three-command task through
# the proxy (splicing on) and the scripted engine; prints the matrix and the request fields that
# changed. Needs the npm registry and PyPI; HARNESSES_ARGS="--pinned-only" runs offline.
HARNESSES_ARGS ?=
harnesses-check: setup
	FLYWHEEL_TINY_MODEL_DIR=$$($(ENGINE_PY) -m deploy.model path tiny) $(ENGINE_PY) -m bench.harnesses_check $(HARNESSES_ARGS)

# Recompile deploy/locks/{engine,agents}.txt from pyproject.toml (uv pip compile; CONTRIBUTING.md).
# Keeps the locked versions; UPGRADE=all takes the newest releases, UPGRADE=name,... those named.
lock:
	$(BOOTSTRAP_PYTHON) -m deploy.lock $(if $(UPGRADE),--upgrade $(UPGRADE))

# The docs site (mkdocs.yml): the reference pages generated from the code (deploy/docs.py), then a
# strict build (a broken link, a missing or unlisted page fails); the site goes to a temporary folder.
docs: engine
	$(ENGINE_PY) -m deploy.docs
	NO_MKDOCS_2_WARNING=1 $(ENGINE_PY) -m mkdocs build --strict --quiet --site-dir $$(mktemp -d)

lint: engine
	$(ENGINE_PY) -m ruff check .
	$(ENGINE_PY) -m ruff format --check .
	$(ENGINE_PY) -m mypy proxy trainer deploy workflows bench contract

# Coverage over the packages named in pyproject's [tool.coverage.run]; spelled out because a bare
# `--cov` takes the next argument (a test path in PYTEST_ARGS) as its source. Off unless COVERAGE=1
# (`make coverage`): Python 3.11's line tracer made the in-process proxy tests 1.6-1.7x slower (300 of
# them on a 2-core Xeon: 51 s -> 82 s, and 61 s -> 104 s in the other order), which `make test` cannot
# afford on a slow machine.
COVERAGE ?= 0
COV = $(if $(filter 1,$(COVERAGE)),--cov=contract --cov=proxy --cov=trainer --cov=deploy --cov=workflows)

TEST_ENV = FLYWHEEL_ENGINE_PYTHON=$(ENGINE_PY) FLYWHEEL_AGENTS_PYTHON=$(AGENTS_PY) \
	FLYWHEEL_MODEL_DIR=$$($(ENGINE_PY) -m deploy.model path) \
	FLYWHEEL_TINY_MODEL_DIR=$$($(ENGINE_PY) -m deploy.model path tiny)

# Both suites on one vLLM (tests/run_suites.py), lint and the docs build while the engines start; the
# engine suite on TEST_WORKERS pytest-xdist workers, a file per worker at a time, longest files first
# (tests/support/budget.py). `make test-engine` / `make test-agents` start their own engines.
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
test: setup
	$(TEST_ENV) $(ENGINE_PY) -m tests.run_suites --beside "$(MAKE) --no-print-directory lint docs" \
	  $(ENGINE_PY) -m pytest -m "not agents" $(XDIST) $(COV) $(PYTEST_ARGS) :: \
	  $(AGENTS_PY) -m pytest -m agents tests/workflows $(PYTEST_ARGS)

# The inner loop while developing: everything that runs without vLLM or the agents venv.
check: engine lint
	$(TEST_ENV) $(ENGINE_PY) -m pytest -m "not agents and not vllm" $(PYTEST_ARGS)

test-engine:
	$(TEST_ENV) $(ENGINE_PY) -m pytest -m "not agents" $(COV) $(PYTEST_ARGS)

# The engine suite with its line-coverage table (pytest-cov); `.coverage` is left for `coverage html`.
coverage:
	$(MAKE) test-engine COVERAGE=1

test-agents:
	$(TEST_ENV) $(AGENTS_PY) -m pytest -m agents tests/workflows $(PYTEST_ARGS)

serve: setup
	FLYWHEEL_AGENTS_PYTHON=$(AGENTS_PY) $(ENGINE_PY) -m deploy.local serve --config $(RUN_CONFIG)

run: setup
	FLYWHEEL_AGENTS_PYTHON=$(AGENTS_PY) $(ENGINE_PY) -m deploy.local run --config $(RUN_CONFIG) $(if $(SEED),--seed $(SEED)) $(if $(STEPS),--budget-steps $(STEPS))

bench: setup
	$(ENGINE_PY) -m bench.proxy_overhead
	$(ENGINE_PY) -m bench.proxy_streams
	$(ENGINE_PY) -m bench.trainer_step

clean:
	rm -rf data runs .pytest_cache .ruff_cache .coverage
