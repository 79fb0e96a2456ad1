# Everything runs from the project's own virtualenv; the first target that needs it builds it.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# checkov, the manifest scanner of `make lint`, in a virtualenv of its own: it pins versions
# of packages the project's environment needs at others (tools/checkov/requirements.txt)
CHECKOV_VENV  := $(VENV)/tools/checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed-stamp

.PHONY: install run dev test test-fast test-faults lint fmt bench soak clean help control-plane run-cluster checkov

help:
	@echo "make run    - start the manager on embedded defaults (Postgres + NATS from wheels)"
	@echo "make dev    - the same, restarting on code changes"
	@echo "make test   - the whole test suite (starts every server it needs)"
	@echo "make test-faults - only the fault suite (tests/faults)"
	@echo "make lint   - ruff, mypy --strict, import contracts, hadolint, checkov on the rendered k8s/"
	@echo "make checkov - build the scanner's own virtualenv ($(CHECKOV_VENV))"
	@echo "make bench  - benchmarks; prints a table and writes bench/results/latest.json"
	@echo "make soak   - 10 minutes under steady load; writes bench/results/soak.json (not in CI)"
	@echo "make control-plane - build kube-apiserver, controllers, etcd and kwok for the tests (cached)"
	@echo "make run-cluster - make run plus a real control plane, syncing examples/desired-state"

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

$(CHECKOV_STAMP): tools/checkov/requirements.txt
	@test -x $(CHECKOV_VENV)/bin/python || $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(CHECKOV_VENV)/bin/python -m pip install --quiet -r tools/checkov/requirements.txt
	@touch $(CHECKOV_STAMP)

checkov: $(CHECKOV_STAMP)

run: $(STAMP)
	$(BIN)/workload-manager serve

dev: $(STAMP)
	$(BIN)/workload-manager serve --reload

test: $(STAMP) control-plane
	$(BIN)/python -m pytest

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not e2e"

test-faults: $(STAMP)
	$(BIN)/python -m pytest tests/faults

lint: $(STAMP) $(CHECKOV_STAMP)
	$(BIN)/ruff check app tests bench
	$(BIN)/ruff format --check app tests bench
	$(BIN)/mypy app tests bench
	$(BIN)/lint-imports
	$(BIN)/hadolint Dockerfile
	CHECKOV=$(CHECKOV_VENV)/bin/checkov bash tools/checkov/scan.sh

fmt: $(STAMP)
	$(BIN)/ruff check --fix app tests bench
	$(BIN)/ruff format app tests bench

bench: $(STAMP) control-plane
	$(BIN)/python -m bench

# SOAK_SECONDS (600), SOAK_WARMUP_SECONDS (60), SOAK_WORKLOADS (100), SOAK_JOB_RATE (10/s)
soak: $(STAMP) control-plane
	$(BIN)/python -m bench.soak

# Real Kubernetes control plane for the tests, built from the pinned Go modules in
# tools/control-plane into ~/.cache/workload-manager/control-plane/<versions>/ (reused).
control-plane:
	tools/control-plane/build.sh
	tools/control-plane/crds.sh

# `make run` plus the control plane above and the example desired state (not a container
# runtime: kwok only fakes the pods' status)
run-cluster: $(STAMP) control-plane
	$(BIN)/python -m tests.support.run_cluster

clean:
	rm -rf .data .mypy_cache .ruff_cache build dist *.egg-info
