# Everything runs from the project's own virtualenv; the first target that needs it builds it.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# checkov, the manifest scanner of `make lint`, in a virtualenv of its own: it pins versions
# of packages the project's environment needs at others (tools/checkov/requirements.txt)
CHECKOV_VENV  := $(VENV)/tools/checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed-stamp

.PHONY: install run dev test test-deps test-fast fuzz test-faults test-node lint fmt bench soak clean help control-plane run-cluster run-node image install-file checkov cold-path

help:
	@echo "make run    - start the manager on embedded defaults (Postgres + NATS from wheels)"
	@echo "make dev    - the same, restarting on code changes"
	@echo "make test   - the whole test suite (starts every server it needs)"
	@echo "make test-fast - every test that needs no control plane, image or manager process (by marker)"
	@echo "make fuzz   - the property and schema fuzz tests with new random examples (not in CI)"
	@echo "make test-faults - only the fault suite (tests/faults)"
	@echo "make lint   - ruff, mypy --strict, import contracts, migration kinds, shellcheck, hadolint, checkov on the rendered k8s/"
	@echo "make checkov - build the scanner's own virtualenv ($(CHECKOV_VENV))"
	@echo "make bench  - benchmarks (installs wrk, oha and nats first); prints tables, writes bench/results/latest.json"
	@echo "make soak   - 10 minutes under steady load; writes bench/results/soak.json (not in CI)"
	@echo "make control-plane - build kube-apiserver, controllers, etcd and kwok for the tests (cached)"
	@echo "make run-cluster - make run plus a real control plane, syncing examples/desired-state"
	@echo "make image  - the manager's OCI image from the Dockerfile, built here (no registry)"
	@echo "make install-file - render k8s/ into build/install/workload-manager.yaml (docs/install.md)"
	@echo "make run-node - a real node (kubelet, containerd) with the manager installed from its image"
	@echo "make test-node - only the real node's tests (tests/node)"
	@echo "make cold-path - the image and node builds from an empty cache, then again from the cache; both times"

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

# What the tests need besides the virtualenv, the control plane and the images, installed when
# missing: Debian's headless Chromium (the status page test), openssl (the test control plane's
# certificates), PgBouncer (the registry and ledger suites run through it too), kubectl
# (renders the kustomizations; Debian's kubernetes-client unless a kubectl is on PATH
# already) and the scanner's own virtualenv. In CI a test that skips for want of any
# of them fails the run (tests/support/ci_skips.py).
TEST_PACKAGES := chromium openssl pgbouncer
KUBECTL_PACKAGE = $$(command -v kubectl >/dev/null || echo kubernetes-client)

test-deps: $(STAMP) $(CHECKOV_STAMP)
	tools/debian-packages.sh $(TEST_PACKAGES) $(KUBECTL_PACKAGE)

test: test-deps control-plane image
	$(BIN)/python -m pytest

test-node: test-deps control-plane image
	$(BIN)/python -m pytest tests/node

# Every test that needs no control plane, no image and no manager process, selected by
# marker across tests/ (a test that uses the control plane is marked by its fixture): the
# pure rules, the API, the adapters and the services against the servers that come from
# wheels (PostgreSQL, nats-server, moto); no Go build, no image; four processes.
FAST_MARKERS := not e2e and not control_plane and not node and not faults
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n 4 -m "$(FAST_MARKERS)" tests

fuzz: $(STAMP) control-plane
	HYPOTHESIS_PROFILE=explore $(BIN)/python -m pytest tests/api/test_ping_properties.py \
		tests/domain/test_redaction.py tests/domain/test_job_properties.py \
		tests/adapters/test_workload_http.py tests/e2e/test_openapi_fuzz.py

test-faults: $(STAMP)
	$(BIN)/python -m pytest tests/faults

# Every shell script of the project; shellcheck reads .shellcheckrc (sourced files followed).
SHELL_SCRIPTS = $(shell git ls-files --cached --others --exclude-standard '*.sh' 2>/dev/null || find tools -name '*.sh') .ci/run

lint: $(STAMP) $(CHECKOV_STAMP)
	tools/debian-packages.sh shellcheck $(KUBECTL_PACKAGE)
	shellcheck $(SHELL_SCRIPTS)
	$(BIN)/ruff check app tests bench standins
	$(BIN)/ruff format --check app tests bench standins
	$(BIN)/mypy app tests bench standins
	$(BIN)/lint-imports
	$(BIN)/python -m app lint-migrations migrations
	$(BIN)/hadolint Dockerfile
	CHECKOV=$(CHECKOV_VENV)/bin/checkov bash tools/checkov/scan.sh

fmt: $(STAMP)
	$(BIN)/ruff check --fix app tests bench standins
	$(BIN)/ruff format app tests bench standins

# The load tools (wrk from Debian, oha built with cargo into ~/.cache/workload-manager/oha/,
# nats with go install into ~/.cache/workload-manager/natscli/, reused):
# tools/bench-tools/install.sh, whose last line is the PATH prefix to run them from.
bench: $(STAMP) control-plane
	PATH="$$(tools/bench-tools/install.sh | tail -n1):$$PATH" $(BIN)/python -m bench

# SOAK_SECONDS (600), SOAK_WARMUP_SECONDS (60), SOAK_WORKLOADS (100), SOAK_JOB_RATE (10/s);
# the pings come from wrk (Debian's package: tools/debian-packages.sh wrk)
soak: $(STAMP) control-plane
	$(BIN)/python -m bench.soak

# Real Kubernetes control plane for the tests, built from the pinned Go modules in
# tools/control-plane into ~/.cache/workload-manager/control-plane/<versions>/ (reused).
control-plane:
	tools/control-plane/build.sh
	tools/control-plane/crds.sh
	tools/control-plane/build.sh --node

# The manager's image from the Dockerfile, on a base built here from Debian's packages
# (tools/image/build.sh; cached in ~/.cache/workload-manager/image); the OCI archive's path
# is the last line. Also the real node's pause and workload (pinger) images.
# Root and these Debian packages: tools/debian-packages.sh installs the missing ones (wrk
# sends the node's memory test its ping load).
NODE_PACKAGES := containerd runc containernetworking-plugins iproute2 iptables socat buildah \
                 debootstrap busybox-static wrk

image:
	tools/debian-packages.sh $(NODE_PACKAGES)
	tools/image/build.sh --helpers
	tools/image/build.sh

install-file:
	@mkdir -p build/install
	kubectl kustomize k8s > build/install/workload-manager.yaml
	@echo build/install/workload-manager.yaml

# `make run` plus the control plane above and the example desired state (not a container
# runtime: kwok only fakes the pods' status)
run-cluster: $(STAMP) control-plane
	$(BIN)/python -m tests.support.run_cluster

# A real single-node cluster in a network namespace of its own (tests/support/node.py), the
# manager installed on it from its image, syncing examples/desired-state from the local
# backend; prints the kubectl commands to look. Ctrl-C removes everything.
run-node: $(STAMP) control-plane image
	$(BIN)/python -m tests.support.run_node

# Before resolving a change to tools/, the Makefile, the Dockerfile or the dependencies: the
# set-up of `make test` from empty build caches in a temporary home, then again from them
# (tools/cold-path.sh; prints both times; the README's set-up times come from it).
cold-path:
	tools/cold-path.sh

clean:
	rm -rf .data .mypy_cache .ruff_cache build dist *.egg-info
