"""``padfree check-packing``'s options: what the family sweep and the SP/CP check cannot honour is refused in
one line (exit 2) before any work, never ignored; a device is checked once, up front."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from padfree.cli import main
from padfree.core.config import PlanConfig
from padfree.errors import ConfigError
from padfree.models import build_model
from padfree.torch.execution.runner import StepRunner

SMALL = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 256}  # fmt: skip
CONFIGS = {
    "gemma2": {**SMALL, "model_type": "gemma2", "num_hidden_layers": 2, "head_dim": 8},  # soft-capping
    "mamba": {"model_type": "mamba", "vocab_size": 96, "hidden_size": 32, "state_size": 4,
              "num_hidden_layers": 2, "expand": 2},
    "gpt_oss": {**SMALL, "model_type": "gpt_oss", "num_hidden_layers": 2, "head_dim": 8,
                "intermediate_size": 32, "num_local_experts": 2, "num_experts_per_tok": 1,
                "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]},  # sinks
    "lfm2": {**SMALL, "model_type": "lfm2", "num_hidden_layers": 2,
             "layer_types": ["conv", "full_attention"]},
}  # fmt: skip


def _folder(tmp_path: Path, family: str) -> Path:
    d = tmp_path / family
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIGS[family]))
    return d


def _one_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("names", ["", ",,", " , "])
def test_families_naming_nothing_is_refused(names: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["check-packing", "--families", names]) == 2  # it swept nothing and exited 0
    assert "--families" in (line := _one_line(capsys)) and "names no family" in line


def test_a_family_named_several_times_is_checked_once(capsys: pytest.CaptureFixture) -> None:
    assert main(["check-packing", "--families", "llama, llama,qwen3,llama", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [r["family"] for r in got["families"]] == ["llama", "qwen3"]
    assert got["summary"]["exact"] == 2


@pytest.mark.parametrize("sweep", [["--families", "llama"], ["--all-families"]])
@pytest.mark.parametrize(
    "option",
    [["--attn", "leaky"], ["--whole-row-mixers"], ["--sp", "2"], ["--cp", "2"], ["--use-cache"],
     ["--model", "tiny-qwen2"], ["--tolerance", "0.1"]],
)  # fmt: skip
def test_the_sweep_refuses_what_it_cannot_honour(
    sweep: list, option: list, capsys: pytest.CaptureFixture
) -> None:
    assert main(["check-packing", *sweep, *option]) == 2
    line = _one_line(capsys)
    assert f"check-packing {sweep[0]}: the family sweep checks each family's own tiny config" in line
    assert f"drop {option[0]}," in line


def test_the_sweep_takes_its_own_attention_and_dtype(capsys: pytest.CaptureFixture) -> None:
    """``--attn padfree_varlen`` is what the sweep runs, and ``--dtype`` is not the command's to refuse."""
    argv = ["check-packing", "--families", "llama", "--attn", "padfree_varlen", "--dtype", "bfloat16"]
    assert main(argv) == 0
    assert "1 exact" in capsys.readouterr().out
    assert main(["check-packing", "--all-families", "--families", "llama"]) == 2
    assert "not both" in _one_line(capsys)


@pytest.mark.parametrize(
    "argv",
    [
        ["check-packing"],
        ["check-packing", "--families", "llama"],
        ["check-packing", "--all-families"],
        ["check-packing", "--sp", "2"],
        ["calibrate", "--quick"],
        ["bench"],
    ],
)
def test_a_device_is_checked_once_up_front(argv: list, capsys, monkeypatch, tmp_path) -> None:
    """A bogus device, or CUDA on a machine without it, is one line (the sweep reported every family "not
    buildable" and exited 0)."""
    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--device", "bogus"]) == 2
    assert _one_line(capsys) == "padfree: error: --device 'bogus': not a device name (cpu, cuda or cuda:N)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert main([*argv, "--device", "cuda"]) == 2
    no_cuda = "padfree: error: --device cuda: no CUDA device on this machine (use --device cpu)"
    assert _one_line(capsys) == no_cuda


@pytest.mark.parametrize(
    ("family", "flag", "cause"),
    [
        ("gemma2", "--cp", "padfree CP (cp=2): this model's attention soft-caps its scores "
         "(attn_logit_softcapping=50) in model.layers.0.self_attn, which padfree's CP attention does not "
         "compute; train it without CP"),
        ("gpt_oss", "--cp", "padfree CP (cp=2): this model's attention has sinks (a learned logit per head) "
         "in model.layers.0.self_attn, which padfree's CP attention does not compute; train it without CP"),
        ("mamba", "--sp", "padfree SP (sp=2): this model has convolutions or recurrences (Mamba selective "
         "scan: a hybrid or recurrent model), which would see only their shard; train it without SP/CP"),
        ("lfm2", "--sp", "padfree SP (sp=2): this model has convolutions or recurrences (short convolution: "
         "a hybrid or recurrent model), which would see only their shard; train it without SP/CP"),
        ("lfm2", "--cp", "padfree CP (cp=2): this model has convolutions or recurrences"),
    ],
)  # fmt: skip
def test_a_model_sp_cp_cannot_shard_is_refused_as_the_trainer_refuses_it(
    family: str, flag: str, cause: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Gemma-2 under ``--cp`` ended in an 85-line traceback, Mamba under ``--sp`` in "unexpected
    AttributeError", a hybrid under ``--sp`` in a reported leak; the Trainer refuses each with the same
    line."""
    folder = _folder(tmp_path, family)
    assert main(["check-packing", "--model", str(folder), flag, "2"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"padfree: error: {cause}"), line
    net = build_model(str(folder), attn_implementation="padfree_varlen")
    config = PlanConfig(strategy="packed", budget=256, world_size=1, grad_accum=1, **{flag[2:]: 2})
    with pytest.raises(ConfigError) as refused:
        StepRunner(config, net, rank=0, world=2)
    assert line == f"padfree: error: {refused.value}"


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_sp_runs_what_cp_refuses(family: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The refusal is CP's only: SP computes soft-capped scores and sinks (per document, after the
    all-to-all)."""
    assert main(["check-packing", "--model", str(_folder(tmp_path, family)), "--sp", "2"]) == 0
    assert "OK: the shards reproduce the unsharded row" in capsys.readouterr().out
