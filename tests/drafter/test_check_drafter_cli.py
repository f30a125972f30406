"""``padfree check-drafter``: passes for both methods on the bundled fixtures, reports LEAK (exit 1) for the
row-level construction, and turns bad input into one line with exit 2."""

from __future__ import annotations

import json

import pytest

from padfree.cli import main


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_passes_on_fixtures_and_catches_the_row_level_leak(method, capsys):
    assert main(["check-drafter", "--method", method, "--docs", "3", "--max-tokens", "96"]) == 0
    out = capsys.readouterr().out
    assert "target hidden states, max |packed - alone|: 0" in out
    assert "cross-document (query, key) pairs: 0" in out
    assert "labels crossing a document end:    0" in out
    assert "OK: every document trains as if it were alone" in out
    assert main(["check-drafter", "--method", method, "--docs", "3", "--max-tokens", "96", "--leaky"]) == 1
    out = capsys.readouterr().out
    assert "LEAK" in out
    assert "labels crossing a document end:    0" not in out
    if method == "dflash":
        assert "anchor sets identical:            NO" in out


def test_padded_rows_pass_and_leaky_needs_packed_rows(capsys):
    assert main(["check-drafter", "--method", "eagle3", "--layout", "padded", "--docs", "3"]) == 0
    out = capsys.readouterr().out
    assert "padded rows" in out and "OK: every document" in out
    assert main(["check-drafter", "--layout", "padded", "--leaky"]) == 2
    assert "--layout packed" in capsys.readouterr().err


def test_json_lists_each_documents_loss(capsys):
    assert main(["check-drafter", "--docs", "3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ok"] and r["anchors_identical"] and len(r["docs"]) == 3
    for d in r["docs"]:
        assert d["anchors_packed"] == d["anchors_alone"] and d["den_packed"] == d["den_alone"] > 0


def test_custom_data_and_tokenizer(sp_model, fixtures_dir, capsys):
    data = str(fixtures_dir / "samples" / "humaneval.jsonl.gz")
    args = [
        "check-drafter",
        "--data",
        data,
        "--tokenizer",
        str(sp_model),
        "--docs",
        "3",
        "--max-tokens",
        "90",
    ]
    assert main(args) == 2  # the prompts fill the first 90 tokens: no loss token, nothing to compare
    assert "no document has a supervised draft position" in capsys.readouterr().err
    data = str(fixtures_dir / "samples" / "gsm8k.jsonl.gz")
    args = [
        "check-drafter",
        "--data",
        data,
        "--tokenizer",
        str(sp_model),
        "--docs",
        "3",
        "--max-tokens",
        "90",
    ]
    assert main(args) == 0
    assert "gsm8k.jsonl.gz" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--docs", "1"], "--docs: must be an integer from 2 to 4096"),
        (["--block-size", "1"], "--block-size: must be an integer from 2 to 1024"),
        (["--docs", "300", "--max-tokens", "200"], "at most 32768"),
        (["--data", "x.jsonl"], "--data and --tokenizer go together"),
        (["--method", "medusa"], "invalid choice"),
    ],
)
def test_bad_options_are_one_line_exit_2(args, message, capsys):
    assert main(["check-drafter", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_missing_data_file_is_one_line_exit_2(tmp_path, sp_model, capsys):
    missing = str(tmp_path / "nope.jsonl")
    assert main(["check-drafter", "--data", missing, "--tokenizer", str(sp_model)]) == 2
    err = capsys.readouterr().err
    assert "nope.jsonl" in err and len(err.strip().splitlines()) == 1


def test_bad_record_names_the_file_and_line(tmp_path, sp_model, capsys):
    bad = tmp_path / "chats.jsonl"
    good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'
    bad.write_text(good + "\n" + '{"messages": [{"role": "user"' + "\n")
    assert main(["check-drafter", "--data", str(bad), "--tokenizer", str(sp_model)]) == 2
    err = capsys.readouterr().err.strip()
    assert "chats.jsonl" in err and "line 2" in err and len(err.splitlines()) == 1
