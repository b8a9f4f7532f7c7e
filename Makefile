# Two commands: `make demo` (the local stack and the traffic-spike demo) and `make test` (the test suite).
# Both create or update the virtualenv in .venv and install what they need.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv test test-all demo bench bench-overhead clean system-deps soak fuzz

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,plot]'
	touch $(STAMP)

# Debian packages the tests and benchmarks use (Prometheus + promtool, Redis, wrk, h2load).
system-deps:
	bash scripts/install-system-deps.sh

test: venv system-deps
	$(BIN)/python -m pytest -q

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

clean:
	rm -rf $(VENV) .cache results .pytest_cache
