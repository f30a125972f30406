"""docs/errors.md lists every bound of a sampler state, the balance, the measured times, simulate --speeds and
the per-record counting: each row of its table of bounds is the code's value, and each of those constants
has its row."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
CONSTANTS = {
    "padfree.core.state_check": ("MAX_SEGMENTS", "MAX_EPOCH"),
    "padfree.core.config": ("MAX_COST",),
    "padfree.core.balance": ("SPEED_MEAN_TOLERANCE",),
    "padfree.core.refit": ("SPEED_RATIO", "MAX_COEF", "MIN_SECONDS", "MAX_SECONDS", "OUTLIER", "MEDIAN_MIN",
                           "MIN_SHARE"),
    "padfree.advice.simulate": ("SPEED_FACTORS",),
    "padfree.data.tokenizer": ("PIECE_CHARS", "MAX_UNCUT_CHARS"),
    "padfree.data.formats": ("MAX_MESSAGES",),
}  # fmt: skip


def _shown(value: object) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(_shown(v) for v in value) + ")"
    return f"{value:g}" if isinstance(value, float) else str(value)


def test_every_bound_in_the_docs_is_the_codes_value_and_none_is_missing():
    text = DOC.read_text()
    section = text[text.index("### The bounds in the code") :]
    rows = dict(re.findall(r"^\| `(padfree\.[\w.]+)` \| (.+?) \|$", section, flags=re.M))
    wanted = {f"{mod}.{name}" for mod, names in CONSTANTS.items() for name in names}
    assert set(rows) == wanted, set(rows) ^ wanted
    for path, shown in rows.items():
        mod, name = path.rsplit(".", 1)
        assert _shown(getattr(importlib.import_module(mod), name)) == shown, path
