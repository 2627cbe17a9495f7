# Two commands do everything on a fresh clone: `make run` (the whole pipeline on the CPU demo) and `make test`.
SHELL := /bin/bash
# The venv's interpreter: the system's own Python where it is 3.11 or newer and can make a venv (Debian's
# /usr/bin/python3.11 is linked statically and built with profile-guided and link-time optimisation: its changelog's
# "Enable LTO/PGO builds", the flags kept out of sysconfig), else python3 from PATH. pyenv's default build, first on
# PATH on this project's machines, loads libpython3.11.so and has neither: `make test` from fresh clones, the same
# hour on this 2-core host, took 12.2 minutes and 1,331 busy CPU s on it against 11.1 and 1,195 on Debian's (0.90x).
# `make venv PYTHON=...` picks another; an existing .venv keeps the interpreter it was made with.
PYTHON ?= $(shell /usr/bin/python3 -c 'import ensurepip, sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
  && echo /usr/bin/python3 || echo python3)
VENV := .venv
STAMP := $(VENV)/.installed
ENV := umask 022 && source scripts/airflow-env.sh &&
# Bytecode is written as modules are first imported (what Python does by default): a shell that sets
# PYTHONDONTWRITEBYTECODE (this CI host does) would otherwise have every rank, stage and Airflow process compile the
# same modules again in memory. Only what runs is compiled: ~6,000 of the venv's 28,000 files for the pipeline's
# imports (25 CPU s, once) where compiling all at install took 81 (measured on this 2-core host).
unexport PYTHONDONTWRITEBYTECODE
CONF ?= {}
# CONF reaches the pipeline only through the environment, as literal text: never spliced into a shell command line,
# never expanded by make ($(value …)), and not exported under its own name (exporting would expand it).
export LLM_PIPELINE_CONF := $(value CONF)
unexport CONF

.PHONY: help venv pyc run test test-fast lint bench db clean ui stop browser services npu-api device-check

# Make makes its goals in order: `make bench data` made `bench` (every bench, tens of minutes, their figures replaced)
# and only then stopped at "No rule to make target 'data'". A goal that is no target here is refused before anything
# runs; bench names go in BENCH (`make bench BENCH="data train_step"`), as literal text like CONF.
GOALS := help venv pyc run test test-fast lint bench db clean ui stop browser services npu-api device-check \
  $(STAMP) .venv-titan/.installed
NOT_GOALS := $(filter-out $(GOALS),$(MAKECMDGOALS))
ifneq ($(NOT_GOALS),)
ifneq ($(filter bench,$(MAKECMDGOALS)),)
$(error make bench: '$(firstword $(NOT_GOALS))' is not a make target; name benches in BENCH: make bench BENCH="$(NOT_GOALS)")
endif
$(error '$(firstword $(NOT_GOALS))' is not a make target (make help lists them); nothing was run)
endif
export LLM_BENCH_NAMES := $(value BENCH)
unexport BENCH

help:
	@echo "make run    - set up .venv, migrate Airflow's DB, run the llm_pipeline DAG end to end on CPU (airflow dags test)"
	@echo "make test   - set up .venv and run the whole test suite (what CI runs)"
	@echo "make test-fast - the tests not marked slow (about 3 minutes)"
	@echo "make lint   - ruff check + ruff format --check (also the first step of make test)"
	@echo "make ui     - Airflow (standalone) + MLflow servers on 127.0.0.1 with a login; make stop stops them"
	@echo "make clean  - remove var/ or \$$LLM_PIPELINE_VAR_DIR (runs, shard sets, the Airflow DB and MLflow store of make run)"
	@echo "make bench  - run the benchmarks (BENCH=\"data moe\": only those); writes bench/results.json, bench/results.md, the figures in docs/benchmarks.md"
	@echo "make npu-api - refresh tests/fixtures/npu_api from the pinned torch-npu wheels (downloaded, never installed)"
	@echo "make device-check - on a CUDA host: the device paths (train, MoE, smoke, profile, INT8, evaluate, vs torchtitan)"

venv: $(STAMP)

# uv (pinned, into the venv by pip) installs the pinned set: 1.3 min where pip took 5 from a warm cache (measured on
# this 2-core host); bytecode is left to first import (above). uv reads no pip configuration: $PIP_FIND_LINKS (where a
# local torch CPU wheel may lie) is passed on.
UV_VERSION := 0.13.8
$(STAMP): requirements.txt constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet uv==$(UV_VERSION)
	UV_FIND_LINKS="$${UV_FIND_LINKS:-$${PIP_FIND_LINKS:-}}" $(VENV)/bin/uv pip install --quiet \
	  --python $(VENV)/bin/python -r requirements.txt -c constraints.txt
	touch $(STAMP)

# The project's own modules compiled to __pycache__ (~2 s; unchanged files skipped) before the processes that import
# them start together (the ranks of a launch, the test workers): each would otherwise compile them on its own.
pyc: venv
	@$(VENV)/bin/python -m compileall -q -j0 tasks data_prep dags plugins tests bench scripts >/dev/null

db: venv pyc  ## var/ checked writable (one line if not), then Airflow's DB migrated (scripts/migrate-db.sh)
	@bash scripts/migrate-db.sh

run: db
	@bash scripts/run-pipeline.sh

# Three worker processes on two cores (the tests wait on processes, servers and schedulers often: a third worker fills
# those waits), a test file each at a time (module fixtures stay in one process), the files longest first
# (tests/conftest.py). pytest's exit 5 = "none selected": PYTEST_ARGS selects nothing. --cpu-durations: the 30 tests
# that used the most CPU. The tests make their own temporary Airflow and MLflow stores (tests/conftest.py), so var/'s
# DB is not migrated first (make db: ~4 s).
TEST_WORKERS ?= 3
PYTEST_PAR = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: lint pyc browser services
	@$(ABS_VAR) $(ENV) a=0; python -m pytest -q --durations=30 --cpu-durations=30 $(PYTEST_PAR) $(PYTEST_ARGS) || a=$$?; \
	if [ $$a -eq 5 ]; then echo "make test: PYTEST_ARGS selects no test" >&2; fi; \
	exit $$a

lint: venv  ## ruff lint + format check (pyproject.toml [tool.ruff]); make test runs it first
	@$(VENV)/bin/ruff check --no-cache .
	@$(VENV)/bin/ruff format --check --no-cache . || (echo "run: .venv/bin/ruff format ." >&2; exit 1)

test-fast: venv pyc browser services
	@$(ABS_VAR) $(ENV) python -m pytest -q $(PYTEST_PAR) -m "not slow" $(PYTEST_ARGS)

ui: venv  ## Airflow (standalone) + MLflow server on 127.0.0.1, both with a login; prints where the passwords are
	@bash scripts/ui.sh

stop:  ## stop what `make ui` started (SIGINT to Airflow standalone, then MLflow)
	@bash scripts/stop.sh

browser:  ## Debian's chromium for tests/test_browser.py (apt-get; a no-op when installed)
	@bash scripts/install-browser.sh

services:  ## Debian's postgresql + redis-server for tests/test_celery_cluster.py (apt-get; a no-op when installed)
	@bash scripts/install-services.sh

# scripts/airflow-env.sh (in ENV) creates the var dir's logs/: a relative LLM_PIPELINE_VAR_DIR is refused first, in
# scripts/migrate-db.sh's words (make run / make db), so no stray var dir appears in the checkout.
ABS_VAR := v="$${LLM_PIPELINE_VAR_DIR:-}"; case "$$v" in "" | /*) ;; *) echo "error: LLM_PIPELINE_VAR_DIR=$$v is a" \
  "relative path (each process would read it from its own working directory); give an absolute one, e.g." \
  "LLM_PIPELINE_VAR_DIR=\$$PWD/$$v" >&2; exit 2 ;; esac;

bench: venv  ## BENCH="data train_step": only those (bench/run_all.py NAME …); split into words, never run by a shell
	@$(ABS_VAR) $(ENV) set -f && python bench/run_all.py $$LLM_BENCH_NAMES

clean:
	@bash scripts/clean.sh

npu-api: venv  ## snapshot torch_npu's (pinned wheels, downloaded not installed) and AMCT's API into tests/fixtures/npu_api
	@$(ABS_VAR) $(ENV) python scripts/npu_api.py  # AMCT_GIT_DIR reaches it through the environment, never the command line

# On a CUDA host (< 10 minutes after the installs): train steps of the demo and MoE models, smoke, profile with
# torch.profiler, INT8 quantize + evaluate, all in strict NCCL mode, and the throughput against torchtitan 0.3.0
# (installed once into .venv-titan: requirements-titan.txt). Report: var/device-check/device-check.json.
device-check: venv .venv-titan/.installed
	@$(ABS_VAR) $(ENV) python bench/device_check.py --out var/device-check --titan-python .venv-titan/bin/python

.venv-titan/.installed: requirements-titan.txt
	test -x .venv-titan/bin/python || $(PYTHON) -m venv .venv-titan
	.venv-titan/bin/pip install --quiet -r requirements-titan.txt
	touch $@
