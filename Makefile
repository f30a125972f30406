# padfree: `make demo` and `make test` work on a fresh machine (they create .venv and install what they need).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch==2.13.0 CPU wheel: pip takes it from the local disk where present; never an unpinned torch.
# what the README's quick start uses without torch: report (matplotlib), io (parquet), hf (the tokenizers
# `padfree lengths` reads). The torch parts of the quick start say their one command next to them.
EXTRAS_DEMO := report,io,hf
EXTRAS_DEV  := dev,torch,hf,trainer,io,report,bench,peers
# the lock: every version `make demo`, `make test` and CI install, so a fresh machine reproduces the last green
# run (users still install padfree with the ranges of pyproject.toml). `make lock` writes it anew from the
# newest releases the ranges allow; `make compat` tries those releases without writing it.
LOCK := constraints.txt
PIP_LOCKED = $(BIN)/python -m pip install -q -c $(LOCK)

.PHONY: demo test lint format setup setup-dev drafter browser bench-plan bench-stream-peers clean lock compat

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.demo-installed: pyproject.toml Makefile $(LOCK) | $(BIN)/python
	$(PIP_LOCKED) -e ".[$(EXTRAS_DEMO)]"
	touch $@

$(VENV)/.dev-installed: pyproject.toml $(LOCK) | $(BIN)/python
	$(PIP_LOCKED) -e ".[$(EXTRAS_DEV)]"
	touch $@

# the drafter trainers' own packages, for the tests and benchmarks that run their code beside padfree's: their
# pins are not ours, so their wheels go in without dependencies (tests/support/peers.py says what imports)
PEERS := dflash==0.1.0 speculators==0.9.0 specforge==0.2.0
$(VENV)/.peers-installed: Makefile $(LOCK) | $(VENV)/.dev-installed
	$(PIP_LOCKED) --no-deps $(PEERS)
	touch $@

# the README's drafter walk-through: padfree with torch and transformers, the peers' wheels without their pins
# (speculators 0.9.0's would take transformers back to 5.19 and move huggingface_hub), and what their model
# modules import (the `peers` extra); it fails if huggingface_hub's version moved, and checks the imports
HUB_VERSION = $(BIN)/python -c "import importlib.metadata as m; print(m.version('huggingface_hub'))"
$(VENV)/.drafter-installed: pyproject.toml Makefile $(LOCK) | $(BIN)/python
	$(PIP_LOCKED) -e ".[torch,hf,peers]"
	@hub=$$($(HUB_VERSION)) && $(PIP_LOCKED) --no-deps $(PEERS) && now=$$($(HUB_VERSION)) && \
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

# issue 43: padfree's streamed planner against the peers' own code (grain's first-fit packer, TRL's BFD, lhotse,
# torchtitan's weighted interleave) in a venv of its own: grain and torchtitan are never part of the dev install
# or make test. torchtitan goes in without its dependencies (only its InterleavedDataset is used; it needs torch).
BENCH_VENV := build/bench-venv
BENCH_PEERS := grain==0.2.18 urllib3
bench-stream-peers:
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q -c $(LOCK) -e ".[bench,io]" $(BENCH_PEERS)
	$(BENCH_VENV)/bin/python -m pip install -q -c $(LOCK) --no-deps torchtitan==0.3.0
	for s in seed_mix three_sets; do $(BENCH_VENV)/bin/python benchmarks/stream_peers.py --streams $$s \
	  --name stream_peers_$$s --lengths ../shared/data/lengths --out benchmarks/results || exit 1; done

# the lock anew: a throw-away venv gets the newest releases the ranges allow (torch stays 2.13.0, the CPU
# wheel), the peers without their pins, and its versions become $(LOCK). Run `make test` after it.
LOCK_VENV := build/lock-venv
lock:
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install -q -e ".[$(EXTRAS_DEV)]"
	$(LOCK_VENV)/bin/python -m pip install -q --no-deps $(PEERS)
	{ echo "# make lock: the versions make demo, make test and CI install (pip -c); users get the ranges of"; \
	  echo "# pyproject.toml. Made with Python $$($(LOCK_VENV)/bin/python -c 'import platform; print(platform.python_version())')."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --exclude-editable --all | grep -v '^padfree' | sed 's/+cpu$$//'; } > $(LOCK)

# the newest allowed releases, not the lock: the family sweep and the exactness tests under them, and what
# changed per family against the sweep committed under the lock (build/compat/compat.md). Not part of make test.
COMPAT_VENV := .venv-compat
COMPAT_TESTS := tests/torch/test_mixers.py tests/torch/test_attention.py tests/checks tests/torch/test_sp_cp_attention.py
compat:
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q --upgrade pip
	$(COMPAT_VENV)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[$(EXTRAS_DEV)]"
	$(COMPAT_VENV)/bin/python -m pip install -q --no-deps $(PEERS)
	mkdir -p build/compat
	$(COMPAT_VENV)/bin/python -m pip freeze --exclude-editable --all | grep -v "^padfree" > build/compat/versions.txt
	$(COMPAT_VENV)/bin/python benchmarks/families.py --out build/compat --jobs 2
	$(COMPAT_VENV)/bin/python benchmarks/compat.py --lock benchmarks/results/families.json \
	  --new build/compat/families.json --out build/compat --versions $(LOCK) build/compat/versions.txt
	$(COMPAT_VENV)/bin/python -m pytest -n 2 $(COMPAT_TESTS) | tee build/compat/tests.txt

clean:
	rm -rf $(VENV) $(COMPAT_VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
