# padfree: `make demo` and `make test` work on a fresh machine (they create .venv and install what they need).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch==2.13.0 CPU wheel: pip takes it from the local disk where present; never an unpinned torch.
# what the README's quick start uses without torch: report (matplotlib), io (parquet), hf (the tokenizers
# `padfree lengths` reads). The torch parts of the quick start say their one command next to them.
EXTRAS_DEMO := report,io,hf
EXTRAS_DEV  := dev,torch,hf,io,report,bench,peers

.PHONY: demo test lint format setup setup-dev drafter browser bench-plan clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.demo-installed: pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS_DEMO)]"
	touch $@

$(VENV)/.dev-installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS_DEV)]"
	touch $@

# the drafter trainers' own packages, for the tests and benchmarks that run their code beside padfree's: their
# pins are not ours, so their wheels go in without dependencies (tests/support/peers.py says what imports)
PEERS := dflash==0.1.0 speculators==0.9.0 specforge==0.2.0
$(VENV)/.peers-installed: Makefile | $(VENV)/.dev-installed
	$(BIN)/python -m pip install -q --no-deps $(PEERS)
	touch $@

# the README's drafter walk-through: padfree with torch and transformers, the peers' wheels without their pins
# (speculators 0.9.0's would take transformers back to 5.19 and move huggingface_hub), and what their model
# modules import (the `peers` extra); it fails if huggingface_hub's version moved, and checks the imports
HUB_VERSION = $(BIN)/python -c "import importlib.metadata as m; print(m.version('huggingface_hub'))"
$(VENV)/.drafter-installed: pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[torch,hf,peers]"
	@hub=$$($(HUB_VERSION)) && $(BIN)/python -m pip install -q --no-deps $(PEERS) && now=$$($(HUB_VERSION)) && \
	  { [ "$$hub" = "$$now" ] || { echo "huggingface_hub moved from $$hub to $$now"; exit 1; }; } && \
	  echo "huggingface_hub $$now (unchanged)"
	$(BIN)/python -c "from dflash import DFlashDraftModel; from speculators.models.eagle3 import Eagle3DraftModel"
	touch $@

drafter: $(VENV)/.drafter-installed

setup: $(VENV)/.demo-installed
setup-dev: $(VENV)/.dev-installed $(VENV)/.peers-installed browser

# tests/test_report.py renders the HTML report in headless Chromium (Debian's `chromium` package)
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=""; [ "$$(id -u)" = "0" ] || SUDO="sudo"; \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends chromium; }

demo: setup
	$(BIN)/padfree analyze

lint: setup-dev
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/ruff format --check src tests examples benchmarks
	$(BIN)/mypy

format: setup-dev
	$(BIN)/ruff format src tests examples benchmarks
	$(BIN)/ruff check --fix src tests examples benchmarks

test: setup-dev lint
	$(BIN)/python -m pytest -n 2 --durations=15 --doctest-modules src/padfree benchmarks/lab tests

bench-plan: setup-dev
	$(BIN)/python benchmarks/plan_speed.py --out benchmarks/results

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
