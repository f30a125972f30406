"""Small transformers target folders for tests: a tiny Llama or Qwen3 with random weights and a tokenizer,
written by ``save_pretrained`` as a user's model folder is (config, safetensors, tokenizer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

FAMILIES = ("llama", "qwen3")

SIZES = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
"""Default sizes: 8 layers, so that every recipe's layer rule picks distinct layers."""


def save_target_folder(
    out: str | Path,
    tokenizer_json: str | Path,
    *,
    family: str = "llama",
    seed: int = 0,
    bos: str | None = None,
    eos: str | None = None,
    **sizes: Any,
) -> Path:
    """Write a tiny ``family`` causal LM with random weights (``seed``) and the ``tokenizer.json`` at
    ``tokenizer_json`` (a fast tokenizer; ``bos``/``eos`` its begin and end tokens, default: its first two
    special tokens) into ``out``; the vocabulary is the tokenizer's."""
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES} (got {family!r})")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    added = sorted(tok.added_tokens_decoder.items())
    specials = [t.content for _, t in added if t.special]
    tok.bos_token = bos or (specials[0] if specials else None)
    tok.eos_token = eos or (specials[1] if len(specials) > 1 else None)
    cls = transformers.LlamaConfig if family == "llama" else transformers.Qwen3Config
    ids = {f"{k}_token_id": getattr(tok, f"{k}_token_id") for k in ("bos", "eos", "pad")}  # as a real model's
    cfg = cls(vocab_size=len(tok), **{**SIZES, **ids, **sizes})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    path = Path(out)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
