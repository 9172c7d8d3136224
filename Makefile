# Two commands: `make run` (set up, then serve HTTPS on 127.0.0.1:8443) and `make test` (set up, then every check).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
CERTS   = certs/dev
HOST   ?= 127.0.0.1
PORT   ?= 8443

.PHONY: run images test test-fast test-newest lint typecheck imports pytest bench bench-micro bench-nodes bench-profile clean go-tools

# What serving needs (`make run`), then the development tools on top of it (every other target).
$(BIN)/copilot-webhook: pyproject.toml requirements/images.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e . -c requirements/images.lock
	@touch $@

DEV = $(VENV)/.dev-installed
$(DEV): $(BIN)/copilot-webhook
	$(BIN)/python -m pip install --quiet -e '.[dev]' -c requirements/images.lock
	@touch $@

$(CERTS)/tls.crt: | $(BIN)/copilot-webhook
	$(BIN)/copilot-webhook certs generate --out $(CERTS) --service copilot-webhook --namespace copilot-webhook \
		--dns localhost --ip 127.0.0.1 > /dev/null

# A local run never touches a cluster, even where a kubeconfig is present.
run: $(BIN)/copilot-webhook $(CERTS)/tls.crt
	@echo "Preview a Flyte 1.15 pod (in another terminal):"
	@echo "  curl --cacert $(CERTS)/ca.crt -H 'Content-Type: application/yaml' --data-binary @examples/flyte-1.15-pod.yaml 'https://$(HOST):$(PORT)/preview?output=diff'"
	COPILOT_WEBHOOK_CLUSTER__ENABLED=false \
	$(BIN)/copilot-webhook serve --host $(HOST) --port $(PORT) --tls-cert $(CERTS)/tls.crt --tls-key $(CERTS)/tls.key

# Both images of the Dockerfile, tagged as the chart names them by default (REGISTRY/copilot-webhook and
# REGISTRY/image-puller at the chart's appVersion): make images [REGISTRY=registry.example.com/platform]
# [DOCKER_BUILD_FLAGS='--platform linux/arm64 ...'] [CONTEXT=.]. docs/operations.md: push, then install.
REGISTRY ?= ghcr.io/copilot-webhook
CONTEXT  ?= .
DOCKER_BUILD_FLAGS ?=
APP_VERSION := $(shell sed -n 's/^appVersion: *"*\([^"]*\)"*$$/\1/p' deploy/helm/copilot-webhook/Chart.yaml)
images:
	docker build $(DOCKER_BUILD_FLAGS) --target puller --tag $(REGISTRY)/image-puller:$(APP_VERSION) $(CONTEXT)
	docker build $(DOCKER_BUILD_FLAGS) --target webhook --tag $(REGISTRY)/copilot-webhook:$(APP_VERSION) $(CONTEXT)

test: lint typecheck imports pytest test-newest

# The in-process tests alone (the `pure` tier, tests/tiers.py): no subprocess, server, daemon or cluster.
# Run it first; `make test` before a pull request.
test-fast: $(DEV)
	$(BIN)/python -m pytest -m pure

# The suite runs on the lock; the HTTP layer's tests run again on the newest releases pyproject.toml allows
# (uvicorn, httptools, uvloop among them), in a venv of their own.
NEWEST = .venv-newest
test-newest:
	$(PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install --quiet --upgrade pip
	$(NEWEST)/bin/python -m pip install --quiet --upgrade -e '.[dev]'
	$(NEWEST)/bin/python -m pip list 2>/dev/null | grep -iE '^(uvicorn|httptools|uvloop|h11) '
	$(NEWEST)/bin/python -m pytest -p no:cacheprovider -q tests/test_admission.py tests/test_relay.py \
		tests/test_private_names.py tests/test_direct_answers.py tests/test_connections.py tests/test_e2e.py

lint: $(DEV)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/radon cc -j webhook certs scripts bench | $(BIN)/python -c 'import json, sys; over = ["%s:%s %s: complexity %s, over 12" % (p, b["lineno"], b["name"], b["complexity"]) for p, bs in json.load(sys.stdin).items() for b in bs if b["complexity"] > 12]; print(*over, sep="\n"); sys.exit(bool(over))'

typecheck: $(DEV)
	$(BIN)/mypy webhook certs tests bench scripts harness

imports: $(DEV)
	$(BIN)/lint-imports

# Every test under coverage, the servers, CLIs, preview workers and puller they start included; the
# floor is what the suite reaches (94.5% of lines), rounded down.
COVERAGE_FLOOR ?= 94
pytest: $(DEV)
	rm -rf .coverage-data && mkdir -p .coverage-data
	COVERAGE_FILE=$(CURDIR)/.coverage-data/coverage $(BIN)/python -m coverage run -m pytest
	COVERAGE_FILE=$(CURDIR)/.coverage-data/coverage $(BIN)/python -m coverage combine -q
	COVERAGE_FILE=$(CURDIR)/.coverage-data/coverage $(BIN)/python -m coverage report --fail-under=$(COVERAGE_FLOOR)

bench-micro: $(DEV)
	$(BIN)/python bench/plan_bench.py
	$(BIN)/python bench/stalls_bench.py

# Where one request's CPU goes: the server under wrk load, profiled by py-spy and sorted into parts.
bench-profile: $(DEV)
	$(BIN)/python bench/profile.py

# The node cache at scale: make bench-nodes NODES=65000
NODES ?= 5000
bench-nodes: $(DEV)
	$(BIN)/python bench/nodes_bench.py --nodes $(NODES)

# Load benchmark against the reference webhooks: make bench ANCHORS=<dir with go-floor/, py-naive/, post.lua>
bench: $(DEV)
	@test -n "$(ANCHORS)" || { echo "make bench ANCHORS=<dir with go-floor/, py-naive/, post.lua>"; exit 2; }
	$(BIN)/python bench/load.py --anchors $(ANCHORS)

# The Go programs the tests run (etcd, the Kubernetes binaries, Flyte's programs), built from tests/*/go.mod into
# a cache outside the work tree keyed by their pins: a warm run builds nothing. Tests that need one skip
# without it (under CI=true a skip fails).
go-tools: $(DEV)
	$(BIN)/python -m harness.gotools build

# Flyte's pods as Flyte's own Go code prints them (tests/flyte/v<release>/, built like go-tools and cached),
# rewritten into tests/flyte/pods/ with the golden contexts that feed them to the webhook, and the
# hand-derived pods of the releases whose Flyte modules do not resolve. Review the diff; then
# REFRESH_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py rewrites the webhook's answers.
.PHONY: flyte-pods
flyte-pods: $(DEV)
	$(BIN)/python -m scripts.flyte_source

clean:
	rm -rf $(VENV) $(NEWEST) $(CERTS) .mypy_cache .ruff_cache .pytest_cache .hypothesis mutants

# Pod creation through the real kube-apiserver at 50 and 100 pods/s with no webhook, ours (installed by the
# chart), go-floor and the control go-same (go-floor's code giving our answer; both registered the same way), side
# by side: make bench-pods ANCHORS=<dir with go-floor/>. Needs root and `make go-tools`; 8 to 14 minutes on a
# quiet machine, up to twice that where the hypervisor takes the CPUs often (its turns are run again).
# SAVE=<file> keeps the run's slices; make bench-pods-pool RUNS="<file> ..." reports saved runs as one, each
# ratio with its spread over all their turns.
.PHONY: bench-pods bench-pods-pool
bench-pods: $(DEV)
	@test -n "$(ANCHORS)" || { echo "make bench-pods ANCHORS=<dir with go-floor/>"; exit 2; }
	$(BIN)/python bench/pods_bench.py --anchors $(ANCHORS) --same-answer $(if $(SAVE),--save $(SAVE))

bench-pods-pool: $(DEV)
	@test -n "$(RUNS)" || { echo 'make bench-pods-pool RUNS="<file saved by make bench-pods SAVE=...> ..."'; exit 2; }
	$(BIN)/python bench/pods_bench.py --pool $(RUNS)

# What the image puller adds to a pod's start on the tests' real node, in each mode (none, socket, agent), for
# cached and fresh images: make bench-puller [ROUNDS=7]. Needs root, the node's packages and `make go-tools`.
ROUNDS ?= 7
.PHONY: bench-puller
bench-puller: $(DEV)
	$(BIN)/python bench/puller_bench.py --rounds $(ROUNDS)

# The real server under sustained mixed load (reviews, previews, scrapes, refused requests, SIGHUPs), loopback
# only and bounded in time; fails on a failed check, an error in the log or memory growth (bench/soak.py).
SOAK_SECONDS ?= 180
.PHONY: soak
soak: $(DEV)
	$(BIN)/python bench/soak.py --seconds $(SOAK_SECONDS)

# Mutation testing of the decision core, webhook/mutation/ (docs/testing.md): each mutant against the fast
# in-process tests that reach the function it changes ([tool.mutmut] in pyproject.toml). Slow, so not part of
# `make test`; it prints the score and every mutant not killed. Verdicts are kept in mutants/: a second run
# tests only the mutants of functions changed since; after a test changes, name the mutants it should kill
# (.venv/bin/mutmut run <name>...) or start afresh (rm -rf mutants). The tests it runs skip nothing, and CI's
# rule for skips (tests/skips.py) judges the whole suite, so CI is unset.
# The floor is the measured score (docs/testing.md), rounded down.
MUTATION_CHILDREN ?= 2
MUTATION_FLOOR ?= 95
.PHONY: mutation
mutation: $(DEV)
	env -u CI nice -n 10 $(BIN)/mutmut run --max-children $(MUTATION_CHILDREN)
	$(BIN)/python -m scripts.mutation_score --fail-under $(MUTATION_FLOOR)
