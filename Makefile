# Everything runs from a project virtualenv that `make install` builds (every target
# depends on it). TORCH picks the torch build: the default is the CPU wheel that CI and
# the dev machines have on local disk; on a GPU host use e.g. `make install TORCH=torch`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
# NIXL for the peers' tests (weightcache/peers/): one 69 MB wheel, ~250 MB installed, ~9 s
# from PyPI on the CI VM. A GPU host takes the meta package (`make install NIXL=nixl`);
# `make install NIXL=` leaves it out, and tests/test_peers.py skips, saying why.
NIXL ?= nixl-cu12>=1.5.1,<2

.PHONY: install demo test lint bench stress clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	$(if $(NIXL),$(BIN)/pip install -q "$(NIXL)")
	# An editable install compiles no bytecode (a wheel install does): without it every fresh
	# engine compiled the client, ~20 ms on the 2-core VM where PYTHONDONTWRITEBYTECODE is set.
	$(BIN)/python -m compileall -q weightcache
	touch $@

demo: install
	$(BIN)/weightcache demo

lint: install
	$(BIN)/ruff check weightcache tests examples scripts benchmarks
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -q

bench: install
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/weightcache bench --size-gib 1 --big-gib 2 --out results/bench-cpu.json

# Longer reliability runs (docs/reliability.md): churn with SIGKILLs, tenants abusing the
# daemon, and a longer fuzz. Results go to results/.
stress: install
	$(BIN)/python -m benchmarks churn --clients 200 --seconds 30 --out results/churn.json
	$(BIN)/python -m benchmarks abuse --seconds 20 --out results/abuse.json
	WC_FUZZ_EXAMPLES=5000 $(BIN)/pytest -q -s tests/test_fuzz.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
