"""The README's drafter walk-through as a user runs it: a short run says its training loss (fewer steps than
``--log-every``), and its commands write nothing into the repository (every path under one work folder)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--limit-samples", "6", "--budget", "256", "--block-size", "4", "--max-anchors", "4"]


def test_a_run_shorter_than_log_every_says_its_last_loss(example, capsys):
    assert example.main([*TINY, "--max-steps", "2"]) == 0
    out = capsys.readouterr().out
    said = re.findall(r"step (\d+) \(\d+/\d+\) loss (\d+\.\d+)", out)
    assert [s for s, _ in said] == ["2"], out
