"""The new user's path with a saved model folder: a hybrid loaded with ``padfree_varlen`` trains packed,
``check-packing --model DIR`` checks the folder as ``from_pretrained`` loads it, and a family that cannot
train packed is refused in the same one line by every entry point."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from transformers import TrainingArguments

import padfree.torch.documents.attention  # noqa: F401  (registers padfree_varlen with transformers)
from padfree import PlanConfig
from padfree.checks.families import WHY
from padfree.cli import main as cli
from padfree.errors import ConfigError
from padfree.hf import PadfreeTrainer
from padfree.models import load_model
from padfree.torch.documents.leak_probe import probe_leak

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 256}  # fmt: skip
CONFIGS = {
    "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(
        **SMALL,
        num_hidden_layers=2,
        head_dim=8,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    ),  # fmt: skip
    "llama": lambda: transformers.LlamaConfig(**SMALL, num_hidden_layers=1),
    "gpt_neo": lambda: transformers.GPTNeoConfig(
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        max_position_embeddings=256,
        window_size=8,
        bos_token_id=0,
        eos_token_id=1,
    ),  # fmt: skip
    "mpt": lambda: transformers.MptConfig(vocab_size=128, d_model=32, n_heads=4, n_layers=2, max_seq_len=256),
}


def saved(tmp_path: Path, family: str, seed: int = 0) -> Path:
    """A tiny random ``family`` model written by ``save_pretrained`` (default attention)."""
    folder = tmp_path / family
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(CONFIGS[family]()).save_pretrained(folder)
    return folder


def _args(tmp_path: Path, **kw) -> TrainingArguments:
    return TrainingArguments(str(tmp_path / "out"), gradient_accumulation_steps=1, max_steps=1, report_to=[],
                             use_cpu=True, remove_unused_columns=False, save_strategy="no", disable_tqdm=True,
                             **kw)  # fmt: skip


DATA = [{"input_ids": list(range(1 + i, n + i))} for i, n in enumerate((20, 30, 12, 25))]
LENGTHS = [len(d["input_ids"]) for d in DATA]


# ----- a hybrid loaded with padfree_varlen ------------------------------------------------------------------
def test_a_hybrid_loaded_from_its_folder_with_padfree_varlen_trains_packed(tmp_path):
    folder = saved(tmp_path, "qwen3_5_text")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="padfree_varlen")
    for mode in (True, False, True):  # the Trainer switches modes; `kernels` resets forwards on each switch
        model.train(mode)
        assert probe_leak(model).diff == 0.0
    plan = PlanConfig(strategy="packed", budget=sum(LENGTHS), grad_accum=1, seed=0)
    trainer = PadfreeTrainer(model=model, args=_args(tmp_path, logging_steps=1), train_dataset=DATA,
                             lengths=LENGTHS, plan_config=plan)  # fmt: skip
    trainer.train()
    loss = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    assert 0 < loss < 100


def test_a_hybrid_target_folder_loads_for_packed_drafter_training(tmp_path, hf_json):
    """What ``examples/train_drafter.py --target DIR`` loads (frozen, eval mode) keeps its mixers apart."""
    from padfree.drafter.target import load_target

    folder = saved(tmp_path, "qwen3_5_text")
    shutil.copy(hf_json, folder / "tokenizer.json")
    target = load_target(folder)  # its leak probe ran on the loaded target: nothing raised
    assert not target.training and probe_leak(target).diff == 0.0


def test_check_packing_checks_the_folder_as_from_pretrained_loads_it(tmp_path, capsys):
    folder = saved(tmp_path, "qwen3_5_text")
    capsys.readouterr()
    assert cli(["check-packing", "--model", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "weights:        saved, loaded with from_pretrained" in out and "OK: every document" in out
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(folder / "config.json", config_only / "config.json")
    assert cli(["check-packing", "--model", str(config_only)]) == 0
    assert "weights:        random, built from the config" in capsys.readouterr().out
    # the saved weights are what the check ran: the same as the folder loaded by hand
    loaded = load_model(str(folder), "padfree_varlen")
    mine = transformers.AutoModelForCausalLM.from_pretrained(folder)
    for k, v in mine.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v)


# ----- one refusal sentence from every entry point ----------------------------------------------------------
def _one_line_refusal(text: str, family: str) -> None:
    assert "\n" not in text.strip(), text
    assert f"{family} cannot train on packed rows: {WHY[family]}" in text, text
    assert "--strategy bucketed" in text, text


@pytest.mark.parametrize("family", ["gpt_neo"])
def test_a_family_that_cannot_pack_is_refused_in_one_line_everywhere(tmp_path, family, capsys, hf_json):
    folder = saved(tmp_path, family)
    capsys.readouterr()
    # padfree check-packing --model DIR
    assert cli(["check-packing", "--model", str(folder)]) == 2
    err = capsys.readouterr().err
    _one_line_refusal(err, family)
    # examples/train.py --model DIR --strategy packed
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_example", ROOT / "examples" / "train.py")
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    argv = ["--model", str(folder), "--strategy", "packed", "--budget", "256", "--overlong", "truncate",
            "--vocab-size", "128", "--max-steps", "1", "--limit-samples", "4"]  # fmt: skip
    with pytest.raises(ConfigError) as exc:
        train.main(argv)
    _one_line_refusal(str(exc.value), family)
    # PadfreeTrainer, the model loaded with padfree.models.load_model (the documented loader) or by hand
    plan = PlanConfig(strategy="packed", budget=64, grad_accum=1)
    with pytest.raises(ConfigError) as exc:
        model = load_model(str(folder), "padfree_varlen", where="PadfreeTrainer")
        PadfreeTrainer(model=model, args=_args(tmp_path), train_dataset=DATA, lengths=LENGTHS,
                       plan_config=plan)  # fmt: skip
    _one_line_refusal(str(exc.value), family)
    # examples/train_drafter.py --target DIR: the target as it loads it
    from padfree.drafter.target import load_target

    shutil.copy(hf_json, folder / "tokenizer.json")
    with pytest.raises(ConfigError) as exc:
        load_target(folder)
    _one_line_refusal(str(exc.value), family)


def test_mpt_loaded_by_hand_trains_packed_as_check_packing_says(tmp_path, capsys):
    """MPT was refused (its forward reads the causal mask padfree_varlen used to leave out); padfree now hands
    such a model its own mask restricted to the row's documents: check-packing on its folder says OK against
    the model's own attention, and PadfreeTrainer trains it packed from ``from_pretrained`` by hand."""
    folder = saved(tmp_path, "mpt")
    assert cli(["check-packing", "--model", str(folder)]) == 0, capsys.readouterr().err
    assert "OK" in capsys.readouterr().out
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="padfree_varlen")
    plan = PlanConfig(strategy="packed", budget=64, grad_accum=1)
    trainer = PadfreeTrainer(model=model, args=_args(tmp_path), train_dataset=DATA, lengths=LENGTHS,
                             plan_config=plan)  # fmt: skip
    out = trainer.train()
    assert out.global_step == 1 and math.isfinite(out.training_loss)
