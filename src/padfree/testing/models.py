"""Small decoder models built from configs with random weights (nothing is downloaded).

Needs the ``hf`` extra (transformers) and torch.

>>> from padfree.testing.models import build_config
>>> cfg = build_config("tiny-llama")
>>> (cfg.hidden_size, cfg.num_hidden_layers, cfg.use_cache)
(256, 4, False)
"""

from __future__ import annotations

from pathlib import Path

from padfree.errors import ConfigError

# name -> (transformers config class name, extra fields)
FAMILIES = {
    "tiny-llama": ("LlamaConfig", {}),
    "tiny-mistral": ("MistralConfig", {"sliding_window": None}),
    "tiny-qwen2": ("Qwen2Config", {"use_sliding_window": False}),
    "tiny-gemma": ("GemmaConfig", {"head_dim": 64}),
}

TINY = {
    "vocab_size": 32000,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 16384,
    "tie_word_embeddings": False,
}


def build_config(name_or_dir: str = "tiny-llama", vocab_size: int | None = None, **overrides):
    """A transformers config: a built-in tiny family (``tiny-llama``, ``tiny-mistral``, ``tiny-qwen2``,
    ``tiny-gemma``) or a local directory holding ``config.json``. ``use_cache`` is always off: with it on,
    transformers skips packed-sequence detection and packed documents attend to each other."""
    import transformers

    if name_or_dir in FAMILIES:
        cls_name, extra = FAMILIES[name_or_dir]
        fields = {**TINY, **extra, **overrides}
        if vocab_size is not None:
            fields["vocab_size"] = vocab_size
        cfg = getattr(transformers, cls_name)(**fields)
    else:
        path = Path(name_or_dir)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"{name_or_dir}: not a built-in model ({', '.join(FAMILIES)}) "
                "nor a directory with config.json"
            )
        cfg = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True, **overrides)
        if vocab_size is not None:
            cfg.vocab_size = vocab_size
    cfg.use_cache = False
    return cfg


def build_model(
    name_or_dir: str = "tiny-llama", attn_implementation: str = "sdpa", seed: int = 0, **overrides
):
    """A causal LM with random weights from :func:`build_config` (deterministic for a seed)."""
    import torch
    import transformers

    if attn_implementation.startswith("padfree_"):
        import padfree.torch.attention  # noqa: F401  (registers padfree_varlen / padfree_leaky with transformers)

    cfg = build_config(name_or_dir, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    model.config.use_cache = False
    return model
