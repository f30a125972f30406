"""Every bad input of docs/errors.md: exit code 2, one line on stderr naming the file, the sample and the
rule, the documented exception type, and no traceback."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import HANG_S

from padfree import PlanConfig
from padfree.cli import build_parser, main
from padfree.core.fingerprint import check_state, fingerprint
from padfree.errors import ConfigError, InputError, OutputError, OverlongError, StateError

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--world-size=1", "--grad-accum=1"]


def _npy(p: Path, arr: np.ndarray) -> None:
    with p.open("wb") as f:
        np.save(f, arr, allow_pickle=True)


def _parquet(p: Path, **cols: pa.Array) -> None:
    pq.write_table(pa.table(cols), p)


@dataclass
class Row:
    """One bad input: how to make it, the command, what must come back."""

    id: str
    name: str  # file name inside tmp_path ("" when the row has no lengths file)
    make: object  # callable(path) that writes the file, or None
    args: list[str]  # command after the file argument (the file comes first when `name` is set)
    exc: type  # exception the command raises (SystemExit for argparse usage errors)
    rule: str  # regex the one line must match (after the file/sample prefix)
    sample: int | None = None
    command: str = "plan"
    extra: dict = field(default_factory=dict)


def _w(data: bytes):
    return lambda p: p.write_bytes(data)


def _t(text: str):
    return lambda p: p.write_text(text)


ROWS = [
    # --- the lengths themselves -------------------------------------------------------------------------
    Row("empty-npy", "l.npy", _w(b""), SMALL, InputError, r"empty file: no samples"),
    Row("empty-txt", "l.txt", _w(b""), SMALL, InputError, r"empty file: no samples"),
    Row("empty-array", "l.npy", lambda p: _npy(p, np.zeros(0, np.int64)), SMALL, InputError, r"no samples"),
    Row(
        "zero", "l.txt", _t("5\n0\n7\n"), SMALL, InputError, r"length must be a positive integer \(got 0\)", 1
    ),
    Row(
        "negative", "l.txt", _t("5\n9\n-3\n"), SMALL, InputError, r"must be a positive integer \(got -3\)", 2
    ),
    Row("non-integer-txt", "l.txt", _t("5\n3.5\n"), SMALL, InputError, r"not an integer: '3\.5'", 1),
    Row(
        "non-integer-npy",
        "l.npy",
        lambda p: _npy(p, np.array([4.0, 2.5])),
        SMALL,
        InputError,
        r"must be a positive integer \(got 2\.5\)",
        1,
    ),
    Row(
        "nan",
        "l.npy",
        lambda p: _npy(p, np.array([4.0, 3.0, np.nan])),
        SMALL,
        InputError,
        r"must be a positive integer \(got nan\)",
        2,
    ),
    Row(
        "absurd-npy",
        "l.npy",
        lambda p: _npy(p, np.array([4, 2**40])),
        SMALL,
        InputError,
        r"length 1099511627776 is absurdly large \(limit 2147483647 tokens\)",
        1,
    ),
    Row("absurd-txt", "l.txt", _t("4\n" + "9" * 50 + "\n"), SMALL, InputError, r"absurdly large", 1),
    Row("2d", "l.npy", lambda p: _npy(p, np.ones((2, 3), np.int64)), SMALL, InputError, r"1-D array"),
    Row("bool", "l.npy", lambda p: _npy(p, np.ones(3, bool)), SMALL, InputError, r"must be integers"),
    Row(
        "object-npy",
        "l.npy",
        lambda p: _npy(p, np.array([1, None], object)),
        SMALL,
        InputError,
        r"must be integers \(got dtype object\)",
    ),
    Row(
        "truncated-npy",
        "l.npy",
        lambda p: (_npy(p, np.arange(1, 50)), p.write_bytes(p.read_bytes()[:-7])),
        SMALL,
        InputError,
        r"truncated \.npy: the header promises 392 bytes of data, the file holds 385",
    ),
    Row("not-npy", "l.npy", _t("1\n2\n3\n"), SMALL, InputError, r"not a \.npy file"),
    Row(
        "npz-as-npy",
        "l.npy",
        lambda p: np.savez(str(p).replace(".npy", ".npz"), a=np.ones(3)) or p.with_suffix(".npz").rename(p),
        SMALL,
        InputError,
        r"an \.npz archive",
    ),
    Row("txt-empty-line", "l.txt", _t("4\n\n5\n"), SMALL, InputError, r"empty line", 1),
    Row("txt-not-utf8", "l.txt", _w(b"4\n\xff\xfe\n"), SMALL, InputError, r"not UTF-8", 1),
    Row(
        "jsonl-malformed",
        "l.jsonl",
        _t('{"length": 3}\n{"length": \n'),
        SMALL,
        InputError,
        r"malformed JSON",
        1,
    ),
    Row(
        "jsonl-not-utf8",
        "l.jsonl",
        _w(b'{"length": 3}\n{"a": "\xff"}\n'),
        SMALL,
        InputError,
        r"malformed JSON",
        1,
    ),
    Row(
        "jsonl-missing",
        "l.jsonl",
        _t('{"length": 3}\n{"len": 3}\n'),
        SMALL,
        InputError,
        r"missing field 'length'",
        1,
    ),
    Row(
        "jsonl-not-int",
        "l.jsonl",
        _t('{"length": 3}\n{"length": "3"}\n'),
        SMALL,
        InputError,
        r"field 'length' must be an integer \(got '3'\)",
        1,
    ),
    Row("jsonl-empty-line", "l.jsonl", _t('{"length": 3}\n\n'), SMALL, InputError, r"empty line", 1),
    Row(
        "jsonl-deep",
        "l.jsonl",
        _t("[" * 100_000 + "\n"),
        SMALL,
        InputError,
        r"malformed JSON \(maximum recursion depth",
        0,
    ),
    Row(
        "parquet-missing-column",
        "l.parquet",
        lambda p: _parquet(p, n=pa.array([1, 2])),
        SMALL,
        InputError,
        r"missing column 'length' \(columns: n\)",
    ),
    Row(
        "parquet-null",
        "l.parquet",
        lambda p: _parquet(p, length=pa.array([1, 2, None])),
        SMALL,
        InputError,
        r"column 'length' has a missing value",
        2,
    ),
    Row(
        "parquet-string",
        "l.parquet",
        lambda p: _parquet(p, length=pa.array(["1", "2"])),
        SMALL,
        InputError,
        r"column 'length' must hold integers \(got type string\)",
    ),
    Row(
        "parquet-damaged",
        "l.parquet",
        _w(b"PAR1" + b"\x00" * 40),
        SMALL,
        InputError,
        r"not a readable parquet",
    ),
    # --- the file as a file ------------------------------------------------------------------------------
    Row("missing-file", "nope.npy", None, SMALL, InputError, r"file not found"),
    Row("directory", "d.npy", lambda p: p.mkdir(), SMALL, InputError, r"is a directory"),
    Row("fifo", "f.txt", lambda p: os.mkfifo(p), SMALL, InputError, r"not a regular file"),
    Row(
        "unreadable",
        "l.txt",
        _t("3\n4\n"),
        SMALL,
        InputError,
        r"cannot read the file \(permission denied\)",
        extra={"deny": True},
    ),
    Row("unknown-format", "l.csv", _t("3\n"), SMALL, InputError, r"unknown lengths format '\.csv'"),
    # --- planning options -------------------------------------------------------------------------------
    Row(
        "budget-0",
        "l.txt",
        _t("3\n"),
        [*SMALL, "--budget=0"],
        SystemExit,
        r"argument --budget: must be an integer from 1 to 16777216 \(got '0'\)",
    ),
    Row(
        "budget-huge",
        "l.txt",
        _t("3\n"),
        [*SMALL, "--budget=99999999999"],
        SystemExit,
        r"argument --budget: must be an integer from 1 to 16777216 \(got '99999999999'\)",
    ),
    Row(
        "world-0",
        "l.txt",
        _t("3\n"),
        ["--world-size=0"],
        SystemExit,
        r"argument --world-size: must be an integer from 1 to 1048576 \(got '0'\)",
    ),
    Row(
        "accum-0",
        "l.txt",
        _t("3\n"),
        ["--grad-accum=-2"],
        SystemExit,
        r"argument --grad-accum: must be an integer from 1 to 1048576 \(got '-2'\)",
    ),
    Row(
        "growth-1",
        "l.txt",
        _t("3\n"),
        [*SMALL, "--growth=1"],
        SystemExit,
        r"argument --growth: must be a number > 1 and <= 1e\+09 \(got '1'\)",
    ),
    Row(
        "growth-nan",
        "l.txt",
        _t("3\n"),
        [*SMALL, "--growth=nan"],
        SystemExit,
        r"argument --growth: must be a number > 1 and <= 1e\+09 \(got 'nan'\)",
    ),
    Row(
        "growth-too-fine",
        "l.txt",
        _t("3\n"),
        [*SMALL, "--growth=1.00000001"],
        ConfigError,
        r"growth 1.00000001 would cut 1 .. 16384 tokens into ~970,406,064 buckets \(at most 1024\); use a "
        r"growth >= 1.009522 at this budget",
    ),
    Row(
        "unknown-strategy",
        "l.txt",
        _t("3\n"),
        [*SMALL, "--strategy=fast"],
        ConfigError,
        r"unknown strategy 'fast'",
    ),
    Row(
        "unknown-strategy-analyze",
        "l.txt",
        _t("3\n"),
        [*SMALL, "--strategies=sorted,fast"],
        ConfigError,
        r"unknown strategy 'fast'",
        command="analyze",
    ),
    Row(
        "unknown-overlong",
        "l.txt",
        _t("3\n"),
        [*SMALL, "--overlong=cut"],
        ConfigError,
        r"unknown overlong policy 'cut'",
    ),
    Row(
        "overlong-error",
        "l.txt",
        _t("3\n4\n900\n5\n2000\n"),
        [*SMALL, "--budget=512"],
        OverlongError,
        r"2 sample\(s\) longer than the budget of 512 tokens \(first: sample 2, longest: 2000 tokens\); "
        r"raise the budget \(budget=, --budget\) or choose an overlong policy \(overlong=, --overlong:",
    ),
    Row(
        "overlong-chunked",
        "l.txt",
        _t("3\n4\n900\n5\n2000\n"),
        ["--world-size=1", "--grad-accum=2", "--budget=512", "--strategy=chunked"],
        OverlongError,
        r"1 sample\(s\) longer than the chunked reach of 1024 tokens \(grad_accum 2 x budget 512\) \(first: "
        r"sample 4, longest: 2000 tokens\); raise the budget or grad_accum .* --overlong: truncate or drop; "
        r"chunked trains a document whole or not at all, it cannot split one\)$",
    ),
    Row(
        "too-few-samples",
        "l.txt",
        _t("3\n4\n"),
        ["--world-size=2", "--grad-accum=2"],
        ConfigError,
        r"2 samples cannot fill one step of 4 micro-batches",
    ),
    Row(
        "epoch-negative",
        "l.txt",
        _t("3\n"),
        [*SMALL, "--epoch=-1"],
        SystemExit,
        r"argument --epoch: must be an integer from 0 to 9223372036854775807 \(got '-1'\)",
    ),
    Row(
        "cost-missing", "l.txt", _t("3\n"), [*SMALL, "--cost=nope.json"], ConfigError, r"cost file not found"
    ),
    Row(
        "out-is-directory",
        "l.txt",
        _t("3\n"),
        [*SMALL, "--out=."],
        OutputError,
        r"cannot write the plan: it is a folder",
    ),
    Row(
        "budget-not-a-number",
        "l.txt",
        _t("3\n"),
        [*SMALL, "--budget=lots"],
        SystemExit,
        r"argument --budget: must be an integer from 1 to 16777216 \(got 'lots'\)",
    ),
]


def _argv(row: Row, tmp: Path) -> tuple[list[str], Path | None]:
    path = None
    if row.name:
        path = tmp / row.name
        if row.make is not None:
            row.make(path)
    args = [a if not a.startswith("--cost=") else f"--cost={tmp / a[7:]}" for a in row.args]
    args = [a if a != "--out=." else f"--out={tmp}" for a in args]
    if row.command == "plan" and not any(a.startswith("--out") for a in args):
        args.append(f"--out={tmp / 'plan.jsonl'}")
    if row.command == "analyze":
        args.append("--json")
    return [row.command, *([str(path)] if path else []), *args], path


def _deny(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """Tests run as root, so chmod cannot make a file unreadable: refuse to open this one instead."""
    real = pathlib.Path.open

    def fake(self, *a, **k):
        if Path(self) == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "open", fake)


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input(row: Row, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    argv, path = _argv(row, tmp_path)
    if row.extra.get("deny"):
        _deny(monkeypatch, path)
    # the exception type, from the command itself
    if row.exc is SystemExit:
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(argv)
        assert info.value.code == 2
    else:
        args = build_parser().parse_args(argv)
        with pytest.raises(row.exc) as info:
            args._run(args)
        assert type(info.value) is row.exc
    capsys.readouterr()
    # the CLI: exit 2, exactly one line naming the file, the sample and the rule
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    out = capsys.readouterr()
    assert code == 2
    lines = out.err.splitlines()
    assert len(lines) == 1, out.err
    line = lines[0]
    assert "Traceback" not in out.err
    assert re.search(row.rule, line), line
    if path is not None and row.exc is not SystemExit and row.exc is not ConfigError:
        assert str(path) in line or (row.id == "out-is-directory" and str(tmp_path) in line), line
    if row.sample is not None:
        assert f"sample {row.sample}:" in line, line
    assert not (tmp_path / "plan.jsonl").exists()


def test_every_rule_is_documented():
    doc = (ROOT / "docs" / "errors.md").read_text()
    missing = [r.id for r in ROWS if f"`{r.id}`" not in doc]
    assert not missing, f"rows missing from docs/errors.md: {missing}"


@pytest.mark.parametrize("row_id", ["truncated-npy", "jsonl-deep", "overlong-error"])
def test_no_traceback_in_a_real_process(row_id: str, tmp_path: Path):
    row = next(r for r in ROWS if r.id == row_id)
    argv, path = _argv(row, tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    res = subprocess.run(
        [sys.executable, "-m", "padfree.cli", *argv], capture_output=True, text=True, env=env, timeout=HANG_S
    )
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and re.search(row.rule, lines[0]) and str(path) in lines[0], res.stderr
    assert res.stdout == ""


# --- resume with a state from another dataset, config or seed (the sampler calls check_state) ---------------


def test_state_from_the_same_run_is_accepted():
    lengths = np.array([5, 9, 3, 7])
    cfg = PlanConfig(seed=3)
    check_state(fingerprint(lengths, cfg), lengths, cfg)
    # world size and grad-accum may change on an elastic resume
    check_state(fingerprint(lengths, cfg), lengths, cfg.with_(world_size=4, grad_accum=2))


@pytest.mark.parametrize(
    "change",
    [
        {"lengths": np.array([5, 9, 3, 8])},
        {"lengths": np.array([5, 9, 3])},
        {"seed": 4},
        {"strategy": "packed"},
        {"budget": 4096},
        {"overlong": "truncate"},
    ],
    ids=["other-lengths", "fewer-samples", "other-seed", "other-strategy", "other-budget", "other-overlong"],
)
def test_state_from_another_run_is_refused(change: dict):
    lengths = np.array([5, 9, 3, 7])
    cfg = PlanConfig(seed=3)
    saved = fingerprint(lengths, cfg)
    now_lengths = change.pop("lengths", lengths)
    now = cfg.with_(**change)
    with pytest.raises(StateError, match=r"belongs to other lengths, config or seed") as info:
        check_state(saved, now_lengths, now)
    msg = str(info.value)
    assert "\n" not in msg and saved[:12] in msg and f"seed {now.seed}" in msg


@pytest.mark.parametrize("bad", [None, "", 17, {"fp": "x"}])
def test_state_without_fingerprint_is_refused(bad: object):
    with pytest.raises(StateError, match=r"has no fingerprint"):
        check_state(bad, np.array([3, 4]), PlanConfig())


def test_fingerprint_is_the_same_for_int32_and_int64_and_chunked(monkeypatch: pytest.MonkeyPatch):
    import padfree.core.fingerprint

    monkeypatch.setattr(padfree.core.fingerprint, "_CHUNK", 7)  # many chunks on a small array
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 5000, 100)
    cfg = PlanConfig(seed=1)
    a = fingerprint(lengths, cfg)
    assert a == fingerprint(lengths.astype(np.int32), cfg)
    # the chunked hash equals the hash of one int64 buffer
    import hashlib

    h = hashlib.sha256(lengths.astype("<i8").tobytes())
    fields = {
        "strategy": cfg.strategy,
        "budget": cfg.budget,
        "growth": cfg.growth,
        "buckets": cfg.buckets,
        "mix": cfg.mix,
        "overlong": cfg.overlong,
        "seed": cfg.seed,
    }
    h.update(json.dumps(fields, sort_keys=True).encode())
    assert a == h.hexdigest()[:32]


def test_the_examples_and_bench_read_model_and_plan_options_alike():
    """``padfree bench`` and the examples share ``padfree.options``: ``--model-set`` without ``=`` is one
    line, a value that is not JSON stays a string; the plan options become the same PlanConfig fields."""
    import argparse

    from padfree.options import model_overrides, plan_config

    ns = argparse.Namespace
    with pytest.raises(ConfigError, match="--model-set takes KEY=VALUE"):
        model_overrides(ns(model_set=["hidden_size"], vocab_size=None))
    got = model_overrides(ns(model_set=["hidden_size=32", "act=gelu"], vocab_size=64))
    assert got == {"hidden_size": 32, "act": "gelu", "vocab_size": 64}
    args = ns(strategy="packed", budget=256, grad_accum=2, seed=3, overlong="truncate", lr=0.1)
    cfg = plan_config(args)
    got_cfg = (cfg.strategy, cfg.budget, cfg.grad_accum, cfg.seed, cfg.overlong)
    assert got_cfg == ("packed", 256, 2, 3, "truncate") and cfg.world_size == PlanConfig().world_size
    assert plan_config(args, "bucketed", world_size=4).world_size == 4
