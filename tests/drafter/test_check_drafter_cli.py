"""``padfree check-drafter``: passes for both methods on the bundled fixtures, reports LEAK (exit 1) for the
row-level construction, and turns bad input into one line with exit 2."""

from __future__ import annotations

import json

import numpy as np
import pytest

from padfree.cli import main
from padfree.errors import ConfigError


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


@pytest.mark.parametrize("name", ["humaneval", "gsm8k"])
def test_custom_data_and_tokenizer(sp_model, fixtures_dir, capsys, name):
    data = str(fixtures_dir / "samples" / f"{name}.jsonl.gz")
    args = ["check-drafter", "--data", data, "--tokenizer", str(sp_model)]
    args += ["--docs", "3", "--max-tokens", "90"]
    # humaneval's prompts fill the first 90 tokens: the checked window starts just before the first loss token
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "OK: every document trains as if it were alone" in out and f"{name}.jsonl.gz" in out


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


def _chat_args(method, sp_model, fixtures_dir, *extra):
    data = str(fixtures_dir / "samples" / "gpteacher_codegen.jsonl.gz")
    return ["check-drafter", "--method", method, "--data", data, "--tokenizer", str(sp_model), *extra]


def test_eagle3_row_wide_shift_on_chats_is_a_latent_leak(sp_model, fixtures_dir, capsys):
    """Chat-only documents start with a user turn: the row-wide shift feeds and labels the next document's
    first tokens, which carry no loss, so where the loss is gated by the predicted token (``--loss-gate 2``)
    every loss matches; the construction still crosses document ends and the check says LEAK, with how many
    crossings and that none is supervised here."""
    opts = ("--docs", "3", "--max-tokens", "96", "--ttt", "4", "--loss-gate", "2")
    assert main(_chat_args("eagle3", sp_model, fixtures_dir, *opts)) == 0
    out = capsys.readouterr().out
    assert "OK: every document trains as if it were alone" in out
    assert "shifted inputs from another document: 0" in out and "supervised on this data: 0" in out
    assert main(_chat_args("eagle3", sp_model, fixtures_dir, *opts, "--leaky")) == 1
    out = capsys.readouterr().out
    assert "losses identical per document:    yes" in out  # the losses cannot show it ...
    # ... the structure does: at each of the 2 document ends, step k feeds k + 1 and labels k + 2 tokens of
    # the next document (k = 0 .. 3)
    inputs, labels = 2 * sum(k + 1 for k in range(4)), 2 * sum(k + 2 for k in range(4))
    assert f"shifted inputs from another document: {inputs}" in out
    assert f"labels crossing a document end:    {labels}" in out
    lines = [line for line in out.splitlines() if line.startswith("LEAK")]
    assert lines == [
        f"LEAK: {inputs + labels} shifted inputs/labels cross a document end "
        "(0 supervised on this data: the leak is latent here)"
    ]


def test_eagle3_row_wide_shift_under_specforge_gating_is_supervised(sp_model, fixtures_dir, capsys):
    """SpecForge gates the prediction of ``x[t + 2 + k]`` by ``loss_mask[t + k]``: at the end of an assistant
    turn the gate holds while the label is the next document's first token, so the row-wide shift's crossings
    reach the loss on the same chats where the predicted-token gate hid them; padfree's per-document fields do
    not cross at all."""
    opts = ("--docs", "3", "--max-tokens", "96", "--ttt", "4", "--recipe", "specforge")
    assert main(_chat_args("eagle3", sp_model, fixtures_dir, *opts)) == 0
    assert "OK: every document trains as if it were alone" in capsys.readouterr().out
    assert main(_chat_args("eagle3", sp_model, fixtures_dir, *opts, "--leaky")) == 1
    out = capsys.readouterr().out
    assert "losses identical per document:    NO" in out
    leak = [line for line in out.splitlines() if line.startswith("LEAK")][0]
    assert "latent" not in leak and "supervised on this data)" in leak


def test_leaks_that_reach_the_loss_are_counted_as_supervised(capsys):
    """The bundled mix has plain documents (loss from their first token): the shift's crossings there are
    supervised, and the losses differ too."""
    args = ["check-drafter", "--method", "eagle3", "--docs", "3", "--max-tokens", "96", "--leaky", "--json"]
    assert main(args) == 1
    r = json.loads(capsys.readouterr().out)
    assert not r["ok"] and r["cross_inputs"] > 0 and r["cross_labels"] > 0
    assert 0 < r["cross_supervised"] <= r["cross_inputs"] + r["cross_labels"]
    assert r["docs_differ"] >= 1 and "latent" not in r["reason"]
    assert f"({r['cross_supervised']} supervised on this data)" in r["reason"]


def test_dflash_row_level_blocks_on_chats_cross_document_ends(sp_model, fixtures_dir, capsys):
    opts = ("--docs", "3", "--max-tokens", "96", "--json")
    for layout in ("packed", "padded"):
        assert main(_chat_args("dflash", sp_model, fixtures_dir, *opts, "--layout", layout)) == 0
        r = json.loads(capsys.readouterr().out)
        assert r["reason"] == "" and r["cross_labels"] == r["cross_supervised"] == r["docs_differ"] == 0
    assert main(_chat_args("dflash", sp_model, fixtures_dir, *opts, "--leaky")) == 1
    r = json.loads(capsys.readouterr().out)
    assert r["cross_labels"] > 0 and r["cross_inputs"] == 0
    assert f"{r['cross_labels']} block labels cross a document end" in r["reason"]


def test_data_without_loss_tokens_is_one_line_exit_2(tmp_path, sp_model, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "\n".join(
            json.dumps({"messages": [{"role": "user", "content": f"say {i} things"}]}) for i in range(3)
        )
    )
    assert main(["check-drafter", "--data", str(path), "--tokenizer", str(sp_model), "--docs", "3"]) == 2
    err = capsys.readouterr().err
    assert "0 of the first 3 documents have a supervised draft position" in err
    assert len(err.strip().splitlines()) == 1


def _chats(path, answers):
    with open(path, "w") as f:
        for i, answer in enumerate(answers):
            chat = [{"role": "user", "content": f"question {i}: " + "tell me more " * 12},
                    {"role": "assistant", "content": answer}]  # fmt: skip
            f.write(json.dumps({"messages": chat}) + "\n")


def test_documents_without_a_draft_position_are_passed_over(sp_model, tmp_path, capsys):
    # speculators' DFlash recipe anchors nothing within 16 tokens of a document's end: a short final answer
    # trains nothing packed or alone, so the check takes the next documents that do train
    data = tmp_path / "chats.jsonl"
    long = "a long answer that goes on " * 8
    _chats(data, ["yes", long, "no", long, long])
    args = ["check-drafter", "--data", str(data), "--tokenizer", str(sp_model), "--recipe", "speculators"]
    assert main([*args, "--docs", "3"]) == 0
    out = capsys.readouterr().out
    assert "3 documents in one packed row" in out
    assert "(2 documents without a supervised draft position passed over)" in out
    _chats(data, ["yes", "no", long])
    assert main([*args, "--docs", "2"]) == 2
    assert "1 of the first 3 documents have a supervised draft position" in capsys.readouterr().err


def test_long_blocks_on_short_documents_fit_in_memory():
    """Regression: 1024-query blocks on 40-token documents (the recipes' up-to-512 anchors per document)
    made the crossing count build a dense (queries x keys) mask: 23 GB. Under a 6 GB address space now."""
    import resource
    import subprocess
    import sys

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6_000_000_000, 6_000_000_000))

    cmd = [sys.executable, "-m", "padfree", "check-drafter", "--block-size", "1024", "--docs", "2"]
    run = subprocess.run(
        [*cmd, "--max-tokens", "40"], capture_output=True, text=True, preexec_fn=cap, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "cross-document (query, key) pairs: 0" in run.stdout and "OK: every document" in run.stdout


def test_a_check_larger_than_the_memory_available_is_refused_in_one_line(monkeypatch, capsys):
    from padfree.drafter import proc

    monkeypatch.setattr(proc, "available_bytes", lambda: 2**30)
    assert main(["check-drafter", "--block-size", "1024", "--docs", "3", "--max-tokens", "40"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "draft blocks of 1024 queries need about" in err[0], err
    assert "1.0 GiB available: lower --block-size, --docs or --max-tokens" in err[0], err
    monkeypatch.setattr(proc, "available_bytes", lambda: 2**20)
    assert main(["check-drafter", "--method", "eagle3", "--docs", "3", "--max-tokens", "40"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "with 7 test-time-training steps need about" in err[0], err
    assert "lower --ttt, --docs or --max-tokens" in err[0], err


@pytest.mark.parametrize(
    "opts",
    [["--anchor-margin", "200"], ["--recipe", "speculators", "--max-tokens", "16"]],
)
def test_a_margin_that_leaves_no_anchor_is_named_not_blamed_on_loss_tokens(opts, capsys):
    # the bundled documents have loss tokens; the recipe's margin is what leaves no document an anchor
    assert main(["check-drafter", *opts]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no loss tokens" not in err[0], err
    margin = opts[1] if opts[0] == "--anchor-margin" else "16"
    assert "no anchor fits within the anchor margin" in err[0], err
    assert f"a + {margin} (the anchor margin" in err[0], err
    assert "documents have loss tokens" in err[0] and "lower --anchor-margin" in err[0], err


def test_prompts_only_still_say_no_loss_tokens():
    from padfree.drafter import recipes
    from padfree.drafter.check import check_drafter

    doc = {"input_ids": np.arange(40), "loss_mask": np.zeros(40, np.int8)}
    with pytest.raises(ConfigError, match="nothing to compare: no loss tokens in any of the 2 documents"):
        check_drafter("dflash", [doc, doc], recipe=recipes.get("specforge", "dflash"))
