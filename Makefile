# pdmesh: two commands for a newcomer (README.md): `make up` and `make test`.
# Each creates .venv when missing and installs what it needs; re-runs skip the install
# unless pyproject.toml changed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
MODEL ?= smollm2
ARGS ?=

.PHONY: up test test-fast test-fuzz test-compose test-multihost test-long test-chaos verify lint bench clean venv

$(VENV)/bin/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "pdmesh needs Python >= 3.11 (3.11 is what CI tests; README: Supported Python); $(PYTHON) is " + sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.installed-run: $(VENV)/bin/python pyproject.toml
	$(PIP) install -q -e .
	touch $@

# The UCX and NIXL extras are chosen after torch is in, to match its CUDA stack
# (pyproject.toml): CUDA 13 builds for a CUDA 13 torch, else the CUDA 12 ones.
# The KV tiers' store tests start Debian's redis-server (tier 3, docs/KVTIERS.md); Debian's
# libibverbs1 is there as on an RDMA host, where NIXL's wheel loads it (transports/nixl.py:
# NIXL_UCX_MODULES; tests/transports/test_ucx_env.py).
$(VENV)/.installed-test: $(VENV)/bin/python pyproject.toml
	@{ command -v redis-server && ldconfig -p | grep -q 'libibverbs\.so\.1 '; } >/dev/null || \
	{ echo "installing redis-server and libibverbs1 (Debian packages)"; \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); export DEBIAN_FRONTEND=noninteractive; \
	  $$sudo apt-get install -y -qq redis-server libibverbs1 >/dev/null 2>&1 || \
	  { $$sudo apt-get update -qq && \
	    $$sudo apt-get install -y -qq redis-server libibverbs1 >/dev/null; }; }
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q -e ".[$$($(PY) -c 'import torch; print("ucx-cu13,nixl-cu13" if (torch.version.cuda or "").startswith("13") else "ucx,nixl")')]"
	touch $@ $(VENV)/.installed-run

venv: $(VENV)/.installed-run

## make up: embedded NATS + admission, prefill, decode, gateway on :8000 (TCP transport).
up: $(VENV)/.installed-run
	$(VENV)/bin/pdmesh up --model $(MODEL) --transport tcp --allow-dev-credentials $(ARGS)

## make lint: ruff with the rule set in pyproject.toml (part of `make test`).
lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .

## make test: lint, then the whole suite (slow-marked tests included), as CI runs it.
test: lint
	$(PY) -m pytest -q -ra --durations=15 $(ARGS)

test-fast: $(VENV)/.installed-test
	$(PY) -m pytest -q -m "not slow" $(ARGS)

## make test-multihost: the mesh across four network namespaces joined by a bridge (a NATS
## cluster, prefill and decode on separate hosts), TCP then UCX; root; a few minutes.
## Skipped, loudly, only where network namespaces cannot be created.
test-multihost: $(VENV)/.installed-test
	@if $(PY) -m tests.support.netns; then \
	  PDMESH_MULTIHOST=1 $(PY) -m pytest -q -ra -p no:cacheprovider --durations=10 \
	    tests/multihost $(ARGS); \
	else \
	  echo "!!!!!! make test-multihost: SKIPPED: network namespaces cannot be created here" \
	       "(needs root and CAP_NET_ADMIN); the multi-host scenarios did NOT run !!!!!!" >&2; \
	fi

## make test-long: long-context and long-prompt scenarios (tiny model at 32k tokens: minutes
## of prefill on two cores), the fairness benchmark's acceptance run and structured outputs on
## SmolLM2 (the openai client's parse, 50 schemas), lm-eval's local-completions on SmolLM2
## (a task written by the test, scored with echoed prompt logprobs) and SmolLM2 decoded on
## its Q4_1 blocks (PDMESH_QUANTIZED_DECODE=on, the default): served against its oracle,
## and its accuracy against fp32; SmolLM2's fp32 decode served against transformers on the
## same GGUF; kept out of `make test` for its time budget.
test-long: $(VENV)/.installed-test
	PDMESH_LONG_TESTS=1 $(PY) -m pytest -q -ra -p no:cacheprovider --durations=10 \
	  tests/gateway/test_long_context.py tests/prefill/test_long_prompts.py \
	  tests/gateway/test_liveness_mesh.py tests/loadtest/test_bench_disagg.py \
	  tests/loadtest/test_bench_fairness.py tests/gateway/test_structured_smollm2.py \
	  tests/gateway/test_lm_eval.py tests/gateway/test_quantized_mesh.py \
	  tests/gateway/test_smollm2_transformers.py tests/engine/test_quantized.py $(ARGS)

## make test-chaos: pdmesh soak for 3 minutes against a 2-prefill 2-decode mesh while a
## seeded killer SIGTERMs or SIGKILLs a worker every 15-30 s and `pdmesh up` restarts it:
## no admitted request fails, no oracle mismatch, no lease left, migrations counted; prints
## and saves one JSON. PDMESH_CHAOS_SEED=N replays a run. Also the real-mesh drain and
## supervision cases (a worker drained, killed, never coming back; Ctrl-C's stop order).
test-chaos: $(VENV)/.installed-test
	PDMESH_CHAOS_TESTS=1 $(PY) -m pytest -q -ra -s -p no:cacheprovider --durations=8 \
	  tests/chaos tests/isolation/test_drain.py tests/ops/test_supervise.py $(ARGS)

## make test-fuzz: the trust-boundary fuzzers (HTTP bodies, control messages, frame headers,
## random header bytes) at 10,000 cases each (`make test` draws 1,000).
test-fuzz: $(VENV)/.installed-test
	PDMESH_FUZZ_EXAMPLES=10000 $(PY) -m pytest -q -ra -p no:cacheprovider --durations=5 \
	  tests/isolation/test_fuzz.py tests/transports/test_framing.py $(ARGS)

## make verify: explore the Promela model of the handoff (tests/model/handoff.pml) in full
## with Spin, then each variant with one guard removed, expecting a counterexample for each
## (tests/model/verify.py; ~4 minutes on 2 cores). Installs Debian's spin when missing.
verify:
	@command -v spin >/dev/null || { echo "verify: installing spin (Debian package)"; \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); export DEBIAN_FRONTEND=noninteractive; \
	  $$sudo apt-get install -y -qq spin >/dev/null 2>&1 || \
	  { $$sudo apt-get update -qq && $$sudo apt-get install -y -qq spin >/dev/null; }; }
	$(PYTHON) tests/model/verify.py $(ARGS)

## make test-compose: build the image and run the lab stack for real under dockerd (root).
test-compose: $(VENV)/.installed-test
	bash compose/ci.sh

bench: $(VENV)/.installed-test
	$(VENV)/bin/pdmesh bench engine
	$(VENV)/bin/pdmesh bench transport
	$(VENV)/bin/pdmesh bench admission

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
