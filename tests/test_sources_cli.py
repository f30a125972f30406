"""``padfree analyze/plan/report`` take weighted sources (``--source NAME=FILE:WEIGHT``, ``--unit``); bad
input is one line naming the source and the rule, exit code 2 (issue 43)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from padfree.cli import main


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    rng = np.random.default_rng(0)
    out = {}
    for name, n, mu in (("chat", 400, 5.0), ("code", 120, 6.0), ("math", 30, 4.0)):
        p = tmp_path / f"{name}.npy"
        lens = np.minimum(rng.lognormal(mu, 0.7, n).astype(np.int64) + 2, 1024)
        np.save(p, lens)
        np.save(tmp_path / f"{name}.assistant.npy", lens // 2)
        out[name] = p
    np.save(tmp_path / "empty.npy", np.zeros(0, np.int64))
    out["empty"] = tmp_path / "empty.npy"
    return out


def _sources(files: dict[str, Path]) -> list[str]:
    return [f"--source=chat={files['chat']}:0.6", f"--source=code={files['code']}:0.25",
            f"--source=math={files['math']}:0.15"]  # fmt: skip


def _shape() -> list[str]:
    return ["--budget", "1024", "--world-size", "2", "--grad-accum", "2", "--epoch-steps", "12"]


@pytest.mark.parametrize("unit", ["documents", "tokens", "loss"])
def test_plan_writes_each_samples_source(files, tmp_path, unit, capsys) -> None:
    out = tmp_path / "plan.jsonl"
    args = ["plan", *_sources(files), *_shape(), "--strategy", "packed", "--unit", unit, "--out", str(out)]
    assert main(args) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 12 * 4 and recs[-1]["step"] == 11
    sizes = np.cumsum([0, 400, 120, 30])
    for r in recs:
        assert r["sources"] == (np.searchsorted(sizes, r["indices"], side="right") - 1).tolist()
    err = capsys.readouterr().err
    assert f"sources ({unit}): 12 steps; worst step share error" in err and "math: weight 0.150" in err
    worst = float(err.split("worst step share error ")[1].split()[0])
    assert worst < 1.0 if unit == "documents" else worst <= 1.0


def test_analyze_measures_the_sources(files, capsys) -> None:
    assert main(["analyze", *_sources(files), *_shape(), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["strategies"]
    assert set(got) == {"packed", "bucketed"}
    for m in got.values():
        assert m["steps"] == 12 and m["share_error_max"] <= 1.0
        assert m["sources"]["math"]["passes"] > 1 > m["sources"]["chat"]["passes"]


def test_report_has_the_sources_section(files, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "rep"
    assert main(["report", *_sources(files), *_shape(), "--out", str(out)]) == 0
    numbers = json.loads((out / "report.json").read_text())
    src = numbers["sources"]
    assert len(src["step_shares"]) == src["steps"] == 12 and len(src["step_shares"][0]) == 3
    page = (out / "index.html").read_text()
    assert "id='sources'" in page and "passes" in page


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--source=a={chat}:0"], "source 'a': weight must be a finite number > 0"),
        (["--source=a={chat}:-1"], "source 'a': weight must be a finite number > 0"),
        (["--source=a={chat}:x"], "source 'a': weight must be a finite number > 0"),
        (["--source=a={chat}:1", "--source=a={code}:1"], "source 'a': named twice"),
        (["--source=a={empty}:1"], "source 'a': "),
        (["--source=a={chat}:1", "--unit", "bytes"], "unknown unit 'bytes'"),
        (["--source=a={chat}"], "write it NAME=FILE:WEIGHT"),
        (["--source=a=missing.npy:1"], "source 'a': file not found"),
        (["{chat}", "--source=a={chat}:1"], "not both"),
    ],
)
@pytest.mark.parametrize("command", ["plan", "analyze"])
def test_bad_sources_are_one_line(files, capsys, command, extra, message) -> None:
    args = [a.format(**{k: str(v) for k, v in files.items()}) for a in extra]
    assert main([command, *args, "--strategy" if command == "plan" else "--strategies", "packed"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_plan_needs_lengths_or_sources(capsys) -> None:
    assert main(["plan", "--strategy", "packed"]) == 2
    assert "give a lengths file (or weighted sources: --source" in capsys.readouterr().err
