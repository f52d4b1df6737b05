# The two commands a newcomer needs: `make run` (the service on the embedded defaults) and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml package.json 2>/dev/null | sha1sum | cut -c1-12)

.PHONY: run test lint typecheck install clean-venv

$(STAMP): pyproject.toml $(wildcard package.json package-lock.json)
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@# torch==2.13.0 resolves to the CPU wheel on machines without a GPU (a local file here);
	@# installing it first keeps pip from fetching a multi-GB CUDA build for the range.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	@# Front-end libraries of the console (pinned in package.json) come from the npm registry.
	@if [ -f scripts/install_console_assets.sh ]; then bash scripts/install_console_assets.sh; fi
	@rm -f $(VENV)/.installed-*
	@touch $@

install: $(STAMP)

run: $(STAMP)
	$(BIN)/greenflow demo

test: $(STAMP)
	bash scripts/test.sh

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check scheduler_service energy_model worker_agent tests bench migrations
	$(BIN)/mypy scheduler_service energy_model worker_agent tests bench migrations examples
