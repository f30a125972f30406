"""The README's drafter walk-through as a user runs it: a short run says its training loss (fewer steps than
``--log-every``), and its commands write nothing into the repository (every path under one work folder)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--limit-samples", "6", "--budget", "256", "--block-size", "4", "--max-anchors", "4"]


def test_a_run_shorter_than_log_every_says_its_last_loss(example, capsys):
    assert example.main([*TINY, "--max-steps", "2"]) == 0
    out = capsys.readouterr().out
    said = re.findall(r"step (\d+) \(\d+/\d+\) loss (\d+\.\d+)", out)
    assert [s for s, _ in said] == ["1", "2"], out  # the first step at once, the last always


def _walkthrough() -> str:
    section = (ROOT / "README.md").read_text().split("## Speculative-decoding drafters", 1)[1]
    return section.split("```bash\n", 1)[1].split("```", 1)[0]


def test_the_walkthrough_writes_only_under_its_work_folder(tmp_path):
    """Every output the walk-through names is under ``$W``; its first commands (the tokenizer and the target
    folder), run from the repository root, leave the root as it was."""
    block = _walkthrough()
    assert "\nW=$(mktemp -d)\n" in block, block
    for flag in ("--target", "--checkpoint-dir", "--out", "--export-dir"):
        values = re.findall(rf"{flag} (\S+)", block)
        assert values and all(v.startswith('"$W/') for v in values), (flag, values)
    setup = block.split("\nW=$(mktemp -d)\n", 1)[1].split("\n# 1.", 1)[0]
    before = sorted(p.name for p in ROOT.iterdir())
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "W": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    run = subprocess.run(["bash", "-ec", setup], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert sorted(p.name for p in ROOT.iterdir()) == before
    assert (tmp_path / "tok.json").is_file() and (tmp_path / "my-target" / "config.json").is_file()
