"""Fixtures of the drafter tests: the training example, imported as a module."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_drafter.py"


@pytest.fixture(scope="module")
def example():
    """``examples/train_drafter.py`` as a module (``main(argv)``, ``run_example``)."""
    sys.path.insert(0, str(ROOT / "examples"))
    spec = importlib.util.spec_from_file_location("train_drafter_example", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
