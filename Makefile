# kvfleet: `make demo` and `make test` set themselves up on first use.
#
# PyPI's torch wheel is a large CUDA build (it runs on the CPU too), so the Python environment lives in a
# cache outside the checkout, is created once, and is only topped up when a requirements file changes.

SHELL := /bin/bash
PYTHON ?= python3
KVFLEET_CACHE ?= $(HOME)/.cache/kvfleet
VENV ?= $(KVFLEET_CACHE)/venv
PY := $(VENV)/bin/python
REQUIREMENTS := requirements/runtime.txt requirements/operator.txt requirements/gateway.txt \
	requirements/simulate.txt requirements/test.txt
REQ_HASH := $(shell cat requirements/*.txt pyproject.toml | sha256sum | cut -c1-16)
STAMP := $(VENV)/.kvfleet-$(REQ_HASH)
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` and `make test-unit` (0 runs the tests in pytest's own process).
TEST_WORKERS ?= 2
# A test module is one unit of work and every end-to-end test is in one unit (one local cluster); scheduled
# in the order given, so that the longest unit starts first.
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# vLLM's CPU build for `make bench-vs-vllm`, in an environment of its own (never the project's).
VLLM_VENV ?= $(KVFLEET_CACHE)/vllm-venv
VLLM_TORCH := torch==2.13.0
VLLM_STAMP := $(VLLM_VENV)/.vllm-$(shell echo $(VLLM_TORCH) | cat - bench/vllm/requirements.txt | sha256sum | cut -c1-16)

.PHONY: setup test test-unit test-e2e lint demo demo-runtime bench-vs-vllm kv-events-vs-vllm test-vllm-runtime clean-venv \
	images test-images crds push chart push-chart

# -P keeps the checkout off sys.path: its operator/ package would shadow the standard library's `operator`
# for any `python -m` run here before the editable install exists.
setup: $(STAMP)
	@# The editable install points at this checkout; re-pointing it is cheap and keeps clones independent.
	@$(PY) -I -c 'import kvfleet.contract, kvfleet.runtime as r, pathlib, sys; sys.exit(pathlib.Path(r.__file__).parent != pathlib.Path("runtime").resolve())' 2>/dev/null \
		|| $(PY) -P -m pip install -q --no-deps --no-build-isolation -e .

$(STAMP): $(wildcard requirements/*.txt) pyproject.toml
	@test -x $(PY) || $(PYTHON) -P -m venv $(VENV)
	$(PY) -P -m pip install -q --disable-pip-version-check $(addprefix -r ,$(REQUIREMENTS)) setuptools==80.9.0 wheel
	@# pyproject.toml may have new packages, which an older editable install does not map.
	$(PY) -P -m pip install -q --no-deps --no-build-isolation -e .
	@rm -f $(VENV)/.kvfleet-* && touch $@

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The InferenceService CRD is rendered from the operator's spec and status models (kvfleet.operator.crd):
# this rewrites crds/ and the chart's copy, which a test keeps equal to the rendering.
CRD_FILE := kvfleet.dev_inferenceservices.yaml
crds: setup
	$(PY) -P -m kvfleet.operator.crd > crds/$(CRD_FILE).tmp
	mv crds/$(CRD_FILE).tmp crds/$(CRD_FILE)
	cp crds/$(CRD_FILE) charts/kvfleet/crds/$(CRD_FILE)

# The end-to-end suite builds the control plane from Go modules on first use (about 10 minutes on 2 cores),
# into $(KVFLEET_CACHE)/k8s, and reuses it afterwards. One worker runs the end-to-end tests, which mostly wait
# on the cluster and its pods, while the other runs the unit tests' modules; then both share what is left.
# The suite runs many engines at once on few cores: their OpenMP workers sleep as soon as a region ends
# rather than spin through a step's gaps (runtime/__init__.py), which only pays where an engine has its cores.
test test-unit test-e2e: export OMP_WAIT_POLICY := PASSIVE
test: setup lint
	$(PY) -m pytest $(XDIST) e2e tests $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest $(XDIST) tests $(PYTEST_ARGS)

test-e2e: setup
	$(PY) -m pytest e2e $(PYTEST_ARGS)

# The runtime and operator images, built from the Dockerfile with podman (no daemon) on a base made from
# Debian's packages; exported as OCI archives with their SBOMs under $(KVFLEET_CACHE)/images (docs/images.md).
# Needs root; installs podman, runc, skopeo, mmdebstrap and docker-registry with apt-get when missing.
images:
	KVFLEET_CACHE=$(KVFLEET_CACHE) $(PYTHON) images/build.py

# A release's artifacts in a registry, as .github/workflows/release.yaml publishes them on a tag:
# `make images push REGISTRY=registry.example.com/platform` builds both images, then copies them to
# REGISTRY/kvfleet/<target>:<version> (the chart's names under imageRegistry) and the packaged chart to
# oci://REGISTRY/charts/kvfleet:<chart version>. Log in first: `skopeo login` and `helm registry login`.
REGISTRY ?=
HELM ?= helm
CHART_VERSION := $(shell sed -n 's/^version: *//p' charts/kvfleet/Chart.yaml)
CHART_PACKAGE := $(KVFLEET_CACHE)/charts/kvfleet-$(CHART_VERSION).tgz

push: push-chart
	@test -n "$(REGISTRY)" || { echo "make push needs REGISTRY=<registry host>/<path>" >&2; exit 2; }
	KVFLEET_CACHE=$(KVFLEET_CACHE) $(PYTHON) images/build.py --push-to $(REGISTRY)

chart:
	$(HELM) package charts/kvfleet --destination $(KVFLEET_CACHE)/charts

push-chart: chart
	@test -n "$(REGISTRY)" || { echo "make push-chart needs REGISTRY=<registry host>/<path>" >&2; exit 2; }
	$(HELM) push $(CHART_PACKAGE) oci://$(REGISTRY)/charts

# The built images run as the chart's and the operator's pods run them. Not part of `make test`: a cold
# `make images` downloads and installs torch's CUDA wheels (several GB) and outlasts CI's budget beside the
# suite (docs/images.md has the times).
test-images: setup
	KVFLEET_CACHE=$(KVFLEET_CACHE) $(PY) -m pytest images/tests $(PYTEST_ARGS)

# The whole product on a local Kubernetes control plane: KEEP=1 leaves the cluster running.
demo: setup
	$(PY) -m e2e.demo

# The engine alone: a tiny model, a few prompts, outputs and throughput.
demo-runtime: setup
	$(VENV)/bin/kvfleet demo

# kvfleet against vLLM's CPU build on the `small` model, one server at a time (about 15 minutes on 2 cores;
# the first run also installs vLLM, several GB): serving at 4 and 8 req/s, offline throughput, decode step
# time at batch 1 and 8. Writes its table into docs/benchmarks.md.
bench-vs-vllm: setup $(VLLM_STAMP)
	VLLM_PYTHON=$(VLLM_VENV)/bin/python KVFLEET=$(VENV)/bin/kvfleet KVFLEET_CACHE=$(KVFLEET_CACHE) bash bench/vllm/run.sh

# KV-cache events both ways with vLLM's CPU build, in its environment as above (a few minutes): vLLM's own
# decoder reads a kvfleet replica's events, and the gateway's precise-prefix policy routes two vLLM replicas
# on theirs.
kv-events-vs-vllm: setup $(VLLM_STAMP)
	$(PY) bench/vllm/kv_events.py --vllm-python $(VLLM_VENV)/bin/python \
		--model $(KVFLEET_CACHE)/bench-vs-vllm/small --workdir $(KVFLEET_CACHE)/kv-events-vs-vllm

# vLLM itself as an InferenceService's runtime (spec.engine.runtime: vllm), its CPU build in its environment as
# above, on a local control plane with the chart and its gateway (several minutes): a chat completion through
# the gateway, then a burst that fills vLLM's queue until the operator adds a replica; and kvfleet's beam search
# against vLLM's. Not part of `make test`.
test-vllm-runtime: setup $(VLLM_STAMP)
	VLLM_PYTHON=$(VLLM_VENV)/bin/python $(PY) -m pytest bench/vllm/tests $(PYTEST_ARGS)

# torch first with its own dependencies, then vLLM and what it imports, exactly as pinned (see the file).
$(VLLM_STAMP): bench/vllm/requirements.txt
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -P -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -P -m pip install -q --disable-pip-version-check $(VLLM_TORCH)
	$(VLLM_VENV)/bin/python -P -m pip install -q --disable-pip-version-check --no-deps -r bench/vllm/requirements.txt
	@rm -f $(VLLM_VENV)/.vllm-* && touch $@

clean-venv:
	rm -rf $(VENV)
