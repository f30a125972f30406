"""Hostile training data for `padfree lengths` (and the training path, which reads it the same way): exit
code 2, one line naming the file (and the line or record), never a traceback; every row is documented in
docs/errors.md. Lone UTF-16 surrogates are not an error: they are replaced by U+FFFD, and said."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import HANG_S

from padfree.cli import main
from padfree.data.samples import load_samples
from padfree.errors import PadfreeError

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]}
GOOD = (json.dumps(CHAT) + "\n").encode()


def _gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


def _docs_gz() -> bytes:
    return _gz(b"".join(json.dumps({"text": f"line {i} " * 20}).encode() + b"\n" for i in range(3000)))


def _corrupt_gz(p: Path) -> None:
    z = bytearray(_docs_gz())
    for i in range(300, 400):
        z[i] ^= 0x5A
    p.write_bytes(bytes(z))


def _parquet(p: Path, cut: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([CHAT] * 400), p, row_group_size=100)
    b = bytearray(p.read_bytes())
    if cut == "truncated":
        b = b[: len(b) // 2]
    else:  # scramble the first data pages, keep the footer
        for i in range(100, 400):
            b[i] = (b[i] * 7 + 3) % 256
    p.write_bytes(bytes(b))


def _datasetdict(p: Path) -> None:
    import datasets

    ds = datasets.Dataset.from_list([CHAT] * 3)
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(p))


def _no_eos_tokenizer(p: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(p))


@dataclass
class Row:
    id: str
    name: str  # the data path inside tmp_path
    make: Callable[[Path], object] | None
    rule: str  # a substring of the one line
    args: tuple[str, ...] = ()
    line: int | None = None  # the line the error must name
    tokenizers: tuple[str, ...] = ("sp",)


ROWS = [
    Row(
        "data-gzip-corrupt",
        "d.jsonl.gz",
        _corrupt_gz,
        "cannot read the file near line",
        tokenizers=("sp", "json"),
    ),
    Row(
        "data-gzip-truncated",
        "d.jsonl.gz",
        lambda p: p.write_bytes(_docs_gz()[:-2000]),
        "Compressed file ended before the end-of-stream marker was reached",
        tokenizers=("sp", "json"),
    ),
    Row("data-gzip-not-gzip", "d.jsonl.gz", lambda p: p.write_bytes(GOOD), "Not a gzipped file"),
    Row(
        "data-not-utf8",
        "d.jsonl",
        lambda p: p.write_bytes(GOOD + b'{"messages": "\xff"}\n'),
        "malformed JSON ('utf-8' codec can't decode byte 0xff",
        line=2,
    ),
    Row(
        "data-parquet-truncated",
        "d.parquet",
        lambda p: _parquet(p, "truncated"),
        "not a readable parquet file",
    ),
    Row("data-parquet-corrupt", "d.parquet", lambda p: _parquet(p, "pages"), "cannot read the parquet data"),
    Row("data-fifo", "d.jsonl", os.mkfifo, "not a regular file"),
    Row("data-empty-folder", "folder", lambda p: p.mkdir(), "a folder with no .jsonl, .jsonl.gz or .parquet"),
    Row("data-glob-no-match", "none-*.jsonl", None, "no files match this pattern"),
    Row("data-datasetdict-no-split", "dd", _datasetdict, "a DatasetDict folder: choose a split with --split"),
    Row(
        "data-unknown-role",
        "d.jsonl",
        lambda p: p.write_text(
            GOOD.decode() + json.dumps({"messages": [{"role": "", "content": "x"}]}) + "\n"
        ),
        "messages[0].role '' is not a known role",
        line=2,
    ),
    Row(
        "data-no-format",
        "d.jsonl",
        lambda p: p.write_text('{"question": "q", "answer": "a"}\n'),
        "the record matches no format (keys: question, answer)",
        line=1,
    ),
    Row(
        "data-field-map",
        "d.jsonl",
        lambda p: p.write_bytes(GOOD),
        "--field-map takes KEY=NAME (got 'from')",
        args=("--field-map", "from"),
    ),
    Row(
        "data-tokenizer-no-eos",
        "d.jsonl",
        lambda p: p.write_bytes(GOOD),
        "cannot tell the tokenizer's end-of-sequence token",
        tokenizers=("no-eos",),
    ),
]
CASES = [(r, t) for r in ROWS for t in r.tokenizers]


def _tokenizer(kind: str, sp_model: Path, hf_json: Path, tmp: Path) -> Path:
    if kind == "no-eos":
        _no_eos_tokenizer(tmp / "tok.json")
        return tmp / "tok.json"
    return sp_model if kind == "sp" else hf_json


def _argv(row: Row, tok: Path, tmp: Path) -> tuple[list[str], Path]:
    path = tmp / row.name
    if row.make is not None:
        row.make(path)
    out = [
        "lengths",
        str(path),
        "--tokenizer",
        str(tok),
        "--out",
        str(tmp / "o.npy"),
        "--no-cache",
        "--quiet",
    ]
    return [*out, *row.args], path


@pytest.mark.parametrize(("row", "tok"), CASES, ids=[f"{r.id}-{t}" for r, t in CASES])
def test_bad_data_is_one_line(
    row: Row, tok: str, sp_model: Path, hf_json: Path, tmp_path: Path, capsys
) -> None:
    argv, path = _argv(row, _tokenizer(tok, sp_model, hf_json, tmp_path), tmp_path)
    capsys.readouterr()  # what making the input printed (datasets' progress bars)
    for workers in ("1", "2"):
        assert main([*argv, "--workers", workers]) == 2
        err = capsys.readouterr().err
        lines = err.splitlines()
        assert len(lines) == 1 and "Traceback" not in err, err
        assert row.rule in lines[0], lines[0]
        if row.id not in ("data-field-map", "data-tokenizer-no-eos"):
            assert str(path) in lines[0], lines[0]
        if row.line is not None:
            assert f"line {row.line}:" in lines[0], lines[0]
    assert not (tmp_path / "o.npy").exists()
    if row.args or row.id == "data-fifo":
        return
    with pytest.raises(PadfreeError) as info:  # the training path reads the same way
        load_samples(path, argv[3])
    assert row.rule in str(info.value)


def test_every_row_is_documented() -> None:
    doc = (ROOT / "docs" / "errors.md").read_text()
    missing = [r.id for r in ROWS if f"`{r.id}`" not in doc]
    assert not missing, f"rows missing from docs/errors.md: {missing}"


@pytest.mark.parametrize("tok", ["sp", "json"])
def test_lone_surrogates_are_replaced_and_said(
    tok: str, sp_model: Path, hf_json: Path, tmp_path: Path
) -> None:
    """Half an emoji (a JSON escape of one UTF-16 surrogate) becomes U+FFFD; the counts are those of the
    replaced text, in a real process (pool workers), with one warning line naming the first record."""
    tokenizer = _tokenizer(tok, sp_model, hf_json, tmp_path)
    raw = tmp_path / "s.jsonl"
    raw.write_bytes(
        GOOD
        + b'{"messages": [{"role": "user", "content": "half \\ud83d emoji"}, '
        + b'{"role": "assistant", "content": "ok \\ud83d\\ude00 \\udc00"}]}\n'
    )
    fixed = tmp_path / "f.jsonl"
    rec = {
        "messages": [
            {"role": "user", "content": "half \ufffd emoji"},
            {"role": "assistant", "content": "ok 😀 \ufffd"},
        ]
    }
    fixed.write_text(json.dumps(CHAT) + "\n" + json.dumps(rec) + "\n", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    outs = []
    for data in (raw, fixed):
        out = tmp_path / f"{data.stem}.npy"
        cmd = [
            "lengths",
            str(data),
            "--tokenizer",
            str(tokenizer),
            "--out",
            str(out),
            "--no-cache",
            "--quiet",
        ]
        res = subprocess.run(
            [sys.executable, "-m", "padfree", *cmd, "--workers", "2"],
            capture_output=True,
            text=True,
            env=env,
            timeout=HANG_S,
        )
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
        outs.append((np.load(out), res.stderr.splitlines()))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    warning = [x for x in outs[0][1] if "warning" in x]
    assert warning == [
        "padfree: warning: 1 record(s) held lone UTF-16 surrogates (half an emoji), each replaced by U+FFFD "
        f"(first: {raw} line 2)"
    ]
    assert not [x for x in outs[1][1] if "warning" in x]
    samples = load_samples(raw, tokenizer)
    assert [len(s["input_ids"]) for s in samples] == outs[0][0].tolist()


def _example(name: str):  # noqa: ANN202
    """Import examples/NAME.py."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_example", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_examples_train_on_padfree_lengths_and_stop_when_they_disagree(
    fixtures_dir: Path, sp_model: Path, hf_json: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """`padfree lengths` output trains through examples/train.py --lengths (with a tokenizer.json, which the
    examples used to refuse with a traceback); 3 tokens short stop train.py and hf_trainer.py with one line
    naming the sample and both numbers."""
    with gzip.open(fixtures_dir / "samples" / "gsm8k.jsonl.gz", "rb") as f:
        data = tmp_path / "gsm8k40.jsonl"
        data.write_bytes(b"".join(f.readlines()[:40]))
    files = {}
    for name, tok in (("json", hf_json), ("sp", sp_model)):
        files[name] = tmp_path / f"{name}.npy"
        argv = ["lengths", str(data), "--tokenizer", str(tok), "--out", str(files[name]), "--no-cache"]
        assert main([*argv, "--quiet"]) == 0
    short = np.load(files["sp"])
    short[17] -= 3
    short_file = tmp_path / "short.npy"
    np.save(short_file, short)
    tiny = ["--data", str(data), "--budget", "512", "--max-steps", "1", "--model-set", "hidden_size=32",
            "--model-set", "intermediate_size=64", "--model-set", "num_hidden_layers=1",
            "--vocab-size", "256"]  # fmt: skip
    capsys.readouterr()
    assert _example("train").main([*tiny, "--tokenizer", str(hf_json), "--lengths", str(files["json"])]) == 0
    tokens = int(np.load(files["json"]).sum())
    out = capsys.readouterr().out
    assert f"40 samples, {tokens} tokens" in out and "finished at step 1" in out
    capsys.readouterr()
    for name in ("train", "hf_trainer"):
        example = _example(name)
        argv = [f"{name}.py", *tiny, "--tokenizer", str(sp_model), "--lengths", str(short_file)]
        monkeypatch.setattr(
            sys, "argv", argv + (["--output-dir", str(tmp_path / "hf")] if name != "train" else [])
        )
        with pytest.raises(SystemExit) as info:
            example.run_example(example.main)
        assert info.value.code == 2
        assert capsys.readouterr().err.splitlines() == [
            f"{name}.py: error: {short_file}: sample 17: the lengths file says {short[17]} tokens, the "
            f"data has {short[17] + 3} ({data} line 18; 1 of 40 samples differ): count again with "
            "`padfree lengths` and the same tokenizer, --format and --chat-template"
        ]


def test_examples_follow_the_overlong_policy_and_say_what_was_cut(
    fixtures_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 19: samples over --budget stop the example with one line by default (as `padfree plan`); with
    --overlong truncate one line says how many were cut and how many tokens are not trained, and the banner
    counts the tokens trained."""
    from padfree.data.samples import load_samples

    data = fixtures_dir / "samples/gsm8k.jsonl.gz"
    sp = fixtures_dir / "tokenizers/llama_sp32k.model"
    n = 40
    full = np.array([len(s["input_ids"]) for s in load_samples(str(data), str(sp), n)])
    budget = int(np.sort(full)[-5]) - 1  # 5 samples are longer
    tiny = ["--data", str(data), "--tokenizer", str(sp), "--budget", str(budget), "--max-steps", "1",
            "--limit-samples", str(n), "--model-set", "hidden_size=32", "--model-set", "intermediate_size=64",
            "--model-set", "num_hidden_layers=1", "--vocab-size", "256"]  # fmt: skip
    example = _example("train")
    monkeypatch.setattr(sys, "argv", ["train.py", *tiny])
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        example.run_example(example.main)
    err = capsys.readouterr().err.splitlines()
    assert info.value.code == 2 and len(err) == 1
    assert f"5 sample(s) longer than the budget of {budget} tokens" in err[0] and "--overlong" in err[0]
    assert example.main([*tiny, "--overlong", "truncate"]) == 0
    out = capsys.readouterr().out
    kept = int(np.minimum(full, budget).sum())
    assert (
        f"--overlong truncate: 5 of {n} samples are longer than the budget of {budget} tokens (longest "
        f"{full.max()}): truncated to {budget} tokens, {int(full.sum()) - kept} of {int(full.sum())} tokens "
        "not trained" in out
    )
    assert f"{n} samples, {kept} tokens" in out


@pytest.mark.parametrize(
    ("name", "content", "rule"),
    [
        (
            "l.jsonl",
            '{"length": 5}\n{"length": 123456789012345678901}\n',
            "length 123456789012345678901 is absurdly",
        ),
        ("l.jsonl", '{"length": 5}\n{"length": 1e20}\n', "field 'length' must be an integer (got '1e+20')"),
        ("l.txt", "5\n123456789012345678901\n", "length 123456789012345678901 is absurdly large"),
        ("l.txt", "5\n-123456789012345678901\n", "must be a positive integer (got -123456789012345678901)"),
        ("l.npy", np.array([5.0, 1e20]), "length 100000000000000000000 is absurdly large"),
        ("l.parquet", np.array([5.0, 1e20]), "length 100000000000000000000 is absurdly large"),
    ],
)
def test_lengths_too_large_to_be_exact_are_refused(
    name: str, content, rule: str, tmp_path: Path, capsys
) -> None:
    """A length beyond int64 (or read as a float) is refused with its exact digits, never rounded."""
    path = tmp_path / name
    if isinstance(content, str):
        path.write_text(content)
    elif name.endswith(".npy"):
        np.save(path, content)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"length": pa.array(content)}), path)
    assert main(["analyze", str(path), "--json"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and f"{path}: sample 1: " in lines[0] and rule in lines[0], lines


@pytest.mark.parametrize("name", ["data.jsonl.gz", "data.jsonl", "data.parquet"])
def test_analyze_on_training_data_points_to_padfree_lengths(name: str, tmp_path: Path, capsys) -> None:
    path = tmp_path / name
    if name.endswith(".gz"):
        path.write_bytes(_gz(GOOD * 3))
    elif name.endswith(".jsonl"):
        path.write_bytes(GOOD * 3)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([CHAT] * 3), path)
    assert main(["analyze", str(path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and str(path) in lines[0], lines
    assert "count their tokens first: padfree lengths DATA --tokenizer TOK --out lengths.npy" in lines[0]
