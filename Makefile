# Two commands: `make demo` (the local stack and the traffic-spike demo) and `make test` (the test suite).
# Both create or update the virtualenv in .venv and install what they need.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv test test-reliability test-all demo bench bench-overhead docs k8s clean system-deps soak fuzz

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,plot]'
	touch $(STAMP)

# Debian packages the tests and benchmarks use (Prometheus + promtool, Redis, wrk, h2load).
system-deps:
	bash scripts/install-system-deps.sh

# The suite you run often (~6 min here): everything but tests/reliability, on four pytest workers, then the few
# tests marked `timing` (they assert latency through real processes, and three more workers on two cores moved it
# past their bounds) one at a time. A worker takes a whole file (--dist loadfile), so a module's servers start once.
# Most of these tests wait on real servers or run the engine model: four workers on two cores finish ~3x sooner.
test: venv system-deps
	$(BIN)/python -m pytest -q -n 4 --dist loadfile --ignore=tests/reliability -m 'not slow and not timing'
	$(BIN)/python -m pytest -q --ignore=tests/reliability -m 'timing and not slow'

# The reliability suite (docs/reliability.md: edge, faults, reloads, loop stalls, load through Envoy; ~3.5 min), one
# test at a time: its load tests measure what clients see, and a CPU shared with other workers moves those timings.
# CI runs it after `make test`.
test-reliability: venv system-deps
	$(BIN)/python -m pytest -q tests/reliability

# Everything, slow suites included (soak, long benchmarks).
test-all: venv system-deps
	$(BIN)/python -m pytest -q -m ''

# Reliability (docs/reliability.md): the 10-minute soak through Envoy + the simulator, and 10,000 fuzzed
# ext_proc streams. Neither is part of `make test`.
soak: venv system-deps
	$(BIN)/python -m pytest -q -m soak tests/reliability -s

fuzz: venv
	EXTPROC_FUZZ_EXAMPLES=10000 $(BIN)/python -m pytest -q -m fuzz tests/reliability

demo: venv
	$(BIN)/python -m extproc.cli demo

bench-overhead: venv system-deps
	$(BIN)/python bench/overhead.py

# The benchmark tables of docs/benchmarks.md (the overhead run takes a few minutes).
bench: venv system-deps
	$(BIN)/python bench/decision.py
	$(BIN)/python bench/scale.py
	$(BIN)/python bench/cardinality.py
	$(BIN)/python bench/gc_pauses.py
	$(BIN)/python bench/cost_estimate.py
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/transport.py
	$(BIN)/python bench/workers.py
	$(BIN)/python bench/slot_drift.py
	$(BIN)/python bench/ttft.py
	$(BIN)/python bench/store.py

# Regenerate the configuration reference from the policy schema (a test fails when it is stale).
docs: venv
	$(BIN)/python -m extproc.tools.docsgen > docs/configuration.md
	$(BIN)/python -m extproc.tools.docsgen --troubleshooting docs/troubleshooting.md

# Regenerate deploy/k8s's PrometheusRule from compose/prometheus/rules (a test fails when it is stale).
k8s: venv
	$(BIN)/python scripts/k8s-prometheusrule.py > deploy/k8s/components/prometheus-operator/prometheusrule.yaml

clean:
	rm -rf $(VENV) .cache results .pytest_cache

# Real vLLM on the CPU: vllm-setup, vllm-model, vllm-serve, vllm-fixtures, e2e-vllm (docs/vllm.md).
include Makefile.vllm
