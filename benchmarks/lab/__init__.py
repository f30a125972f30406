"""padfree's benchmark-only library, kept out of the wheel: the protocols benchmarks/ runs and tests/ checks.

It is found the same way everywhere: a benchmark script's own folder (benchmarks/) is on ``sys.path``, pytest
adds benchmarks/ and tests/ (``pythonpath`` in pyproject.toml), and a child process a protocol starts gets
this checkout's src/, benchmarks/ and tests/ through :func:`child_env`. Importing ``lab`` also puts tests/ on
``sys.path``, where ``support`` lives: the fixtures the tests and the benchmarks share (tests/support/)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root."""
PATHS = (ROOT / "src", ROOT / "benchmarks", ROOT / "tests")
"""Where this checkout's ``padfree``, ``lab`` and ``support`` are imported from."""

if str(ROOT / "tests") not in sys.path:
    sys.path.append(str(ROOT / "tests"))


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with :data:`PATHS` first on ``PYTHONPATH`` (and ``extra`` set): a child process runs
    this checkout's padfree, lab and support."""
    env = dict(os.environ)
    paths = [str(p) for p in PATHS] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra)
    return env
