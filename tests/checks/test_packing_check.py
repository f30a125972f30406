"""``padfree check-packing``: passes for padfree_varlen on every supported family, catches leaking setups."""

from __future__ import annotations

import json

import pytest

from padfree.checks.packing import check_packing
from padfree.cli import main


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-gemma"])
def test_varlen_passes_on_every_family(family: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["check-packing", "--model", family]) == 0
    out = capsys.readouterr().out
    assert "path used:      per-document SDPA (CPU)" in out
    assert "OK: every document sees only itself" in out


def test_leaky_attention_is_caught(capsys: pytest.CaptureFixture) -> None:
    assert main(["check-packing", "--attn", "leaky"]) == 1
    out = capsys.readouterr().out
    assert "LEAK: documents see each other" in out
    assert "deliberately leaky" in out


def test_use_cache_pitfall_is_caught_for_sdpa_and_harmless_for_varlen(capsys: pytest.CaptureFixture) -> None:
    assert main(["check-packing", "--attn", "sdpa"]) == 0  # transformers' dense block-diagonal mask
    assert main(["check-packing", "--attn", "sdpa", "--use-cache"]) == 1
    assert "LEAK" in capsys.readouterr().out
    assert main(["check-packing", "--use-cache"]) == 0


def test_result_and_local_config_directory(tmp_path) -> None:
    overrides = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}
    leaky = check_packing("tiny-qwen2", "leaky", overrides=overrides)
    assert leaky.leaked and leaky.family == "qwen2"
    assert leaky.max_logit_diff_later > 100 * leaky.tolerance
    config = {
        "model_type": "mistral",
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "sliding_window": 16,  # shorter than some documents: the window is honoured per document
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    ok = check_packing(str(tmp_path))
    assert not ok.leaked and ok.family == "mistral" and ok.max_logit_diff <= ok.tolerance
    assert max(ok.doc_lengths) > 16


def test_bad_model_is_one_line_exit_2(capsys: pytest.CaptureFixture, tmp_path) -> None:
    assert main(["check-packing", "--model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a built-in model" in err
    assert main(["check-packing", "--attn", "no_such_attention"]) == 2
    assert "no_such_attention" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--sp", "--cp"])
def test_sharded_check_on_two_cpu_ranks(flag: str, capsys: pytest.CaptureFixture) -> None:
    """``--sp 2`` / ``--cp 2``: the row sharded over 2 gloo ranks equals the unsharded row (exit 0); with
    ``--attn leaky`` the sharded attention is the leaky control and the check reports the leak (exit 1)."""
    assert main(["check-packing", flag, "2"]) == 0
    out = capsys.readouterr().out
    assert "2 CPU ranks (gloo)" in out and "OK: the shards reproduce the unsharded row" in out
    assert main(["check-packing", flag, "2", "--attn", "leaky", "--json"]) == 1
    r = json.loads(capsys.readouterr().out)
    assert r["leaked"] and r["alone_diff"] > 100 * r["tolerance"]
    assert r["impl"] == ("padfree_ulysses_leaky" if flag == "--sp" else "padfree_zigzag_cp_leaky")


@pytest.mark.parametrize(
    ("args", "rule"),
    [
        (["--sp", "2", "--cp", "2"], "give one of --sp N or --cp N"),
        (["--sp", "3"], "4 attention heads do not split over 3 ranks"),
        (["--cp", "2", "--dtype", "bfloat16"], "runs float32 on CPU ranks"),
        (["--cp", "2", "--attn", "sdpa"], "--attn must be padfree_varlen or leaky"),
    ],
)
def test_sharded_check_refusals_are_one_line(args: list, rule: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["check-packing", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and rule in err[0], err
