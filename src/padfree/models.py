"""Small causal LMs built from configs with random weights (nothing is downloaded): what ``calibrate``,
``check-packing``, ``bench`` and the examples train; a saved folder loaded as the user loads it
(:func:`load_model`); and the one sentence every entry point refuses packed training of a model with
(:func:`packing_refusal`, :func:`require_packable`).

Needs the ``hf`` extra (transformers) and torch.

>>> from padfree.models import build_config
>>> cfg = build_config("tiny-llama")
>>> (cfg.hidden_size, cfg.num_hidden_layers, cfg.use_cache)
(256, 4, False)
"""

from __future__ import annotations

import contextlib
import json
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from padfree.errors import ConfigError, one_line

PADDED = "use a padded strategy instead (--strategy bucketed, PlanConfig(strategy='bucketed'))"
"""The way out of every packing refusal: padded rows never mix documents."""

# name -> (transformers config class name, extra fields)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": ("LlamaConfig", {}),
    "tiny-mistral": ("MistralConfig", {"sliding_window": None}),
    "tiny-qwen2": ("Qwen2Config", {"use_sliding_window": False}),
    "tiny-gemma": ("GemmaConfig", {"head_dim": 64}),
    "tiny-qwen3": ("Qwen3Config", {"use_sliding_window": False, "head_dim": 64}),
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


SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
MAX_SIZE = 2**31 - 1


def _check_sizes(values: dict, where: str) -> None:
    """Every size field present must be an integer from 1 to 2^31-1 (transformers takes almost anything)."""
    for k in SIZES:
        v = values.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SIZE):
            raise ConfigError(f"{where}: {k} must be an integer from 1 to {MAX_SIZE} (got {str(v)[:40]!r})")


def read_config_json(path: Path) -> dict:
    """``path/config.json`` as a dict with a string ``model_type`` and sane sizes, or one-line
    :class:`ConfigError` naming the file."""
    f = path / "config.json"
    try:
        st = f.stat()
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{f}: not a regular file")
        if st.st_size > 2**20:
            raise ConfigError(f"{f}: {st.st_size} bytes is too large for a model config (limit 1 MiB)")
        data = json.loads(f.read_bytes())
    except OSError as exc:
        raise ConfigError(f"{f}: cannot read the model config ({exc.strerror or exc})") from None
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{f}: not a model config (malformed JSON: {str(exc)[:120]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ConfigError(f"{f}: not a model config (a JSON object with a string model_type)")
    _check_sizes(data, str(f))
    return data


def param_count(cfg) -> int:
    """About how many parameters a decoder of this config has (embeddings, attention, MLP, LM head)."""
    h, layers = int(cfg.hidden_size), int(cfg.num_hidden_layers)
    inter = int(getattr(cfg, "intermediate_size", None) or 4 * h)
    head = 1 if getattr(cfg, "tie_word_embeddings", False) else 2
    return int(cfg.vocab_size) * h * head + layers * (4 * h * h + 3 * h * inter)


def build_config(name_or_dir: str = "tiny-llama", vocab_size: int | None = None, **overrides):
    """A transformers config: a built-in tiny family (``tiny-llama``, ``tiny-mistral``, ``tiny-qwen2``,
    ``tiny-gemma``, ``tiny-qwen3``) or a local directory holding ``config.json``. ``use_cache`` is always
    off: with it on, transformers skips packed-sequence detection and packed documents attend to each other.

    A config that is not JSON, names no ``model_type``, holds a size that is not an integer from 1 to
    2^31-1, or that transformers refuses, is a one-line :class:`ConfigError` naming the file."""
    import transformers

    _check_sizes({**overrides, "vocab_size": vocab_size}, "model override")
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
        read_config_json(path)
        try:
            cfg = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True, **overrides)
        except Exception as exc:  # transformers raises many types for a config it cannot build
            text = " ".join(str(exc).split())[:200] or type(exc).__name__  # one line
            raise ConfigError(
                f"{path / 'config.json'}: transformers cannot build a config from it ({text})"
            ) from None
        if vocab_size is not None:
            cfg.vocab_size = vocab_size
    cfg.use_cache = False
    return cfg


def build_model(
    name_or_dir: str = "tiny-llama",
    attn_implementation: str = "sdpa",
    seed: int = 0,
    max_params: int | None = None,
    **overrides,
):
    """A causal LM with random weights from :func:`build_config` (deterministic for a seed); with
    ``max_params``, a config of more (estimated) parameters is refused before any weight is allocated."""
    import torch
    import transformers

    if attn_implementation.startswith("padfree_"):
        import padfree.torch.documents.attention  # noqa: F401  (registers padfree_varlen / padfree_leaky with transformers)

    cfg = build_config(name_or_dir, **overrides)
    if max_params is not None and param_count(cfg) > max_params:
        raise ConfigError(
            f"{name_or_dir}: about {param_count(cfg) / 1e9:.2f}B parameters, over this command's limit of "
            f"{max_params / 1e9:.2f}B ({max_params * 4 / 2**30:.0f} GiB of float32 weights); the attention "
            "path does not depend on the size: lower num_hidden_layers or hidden_size in a copy of the config"
        )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    model.config.use_cache = False
    return model


# ----- loading a saved folder, and refusing packed training in one sentence ------------------------------
WEIGHTS = ("*.safetensors", "pytorch_model*.bin")


def has_weights(path: Path) -> bool:
    """Whether a model folder holds saved weights (what ``save_pretrained`` writes), not only a config."""
    return any(any(path.glob(pattern)) for pattern in WEIGHTS)


def loads_saved(name_or_dir: str, overrides: dict) -> bool:
    """Whether :func:`load_model` takes ``name_or_dir``'s saved weights (a folder with weights, no overrides)
    rather than building it from its config with random weights."""
    path = Path(name_or_dir)
    return name_or_dir not in FAMILIES and not overrides and path.is_dir() and has_weights(path)


def packing_refusal(
    where: str, family: str, exc: BaseException | None = None, attn: str = "padfree_varlen"
) -> ConfigError:
    """The one-line :class:`ConfigError` that refuses packed training of ``family`` (a ``model_type``) at
    ``where``: the family's reason as the family sweep words it (:data:`padfree.checks.families.WHY`), else
    what failed (``exc``) under ``attn``; always naming the way out. Every entry point (``check-packing
    --model``, :class:`~padfree.hf.PadfreeTrainer`, ``examples/train.py``, ``examples/train_drafter.py
    --target``) refuses with it."""
    from padfree.checks.families import WHY

    failed = "" if exc is None else f" ({type(exc).__name__}: {one_line(' '.join(str(exc).split()))[:160]})"
    why = WHY.get(family)
    if why is None:
        why = f"it does not run packed rows with attention {attn!r}{failed}"
    elif failed:
        why += failed
    return ConfigError(f"{where}: {family} cannot train on packed rows: {why}; {PADDED}")


def family_of(name_or_dir: str) -> str:
    """The ``model_type`` of a built-in tiny family or a folder's ``config.json`` (the name itself when it
    has none)."""
    if name_or_dir in FAMILIES:
        return build_config(name_or_dir).model_type
    path = Path(name_or_dir)
    try:
        return str(read_config_json(path)["model_type"])
    except ConfigError:
        return name_or_dir


def attention_refusal(name_or_dir: str, attn: str, where: str) -> ConfigError | None:
    """:func:`packing_refusal` when the model cannot even be built with ``attn`` while it builds with its
    default attention (both from its config, on the meta device: no weights); ``None`` when the attention
    is not what fails (a bad folder, bad weights)."""
    import torch
    import transformers

    try:
        cfg = build_config(name_or_dir)
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_config(cfg)  # its default attention
    except Exception:
        return None
    try:
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    except Exception as exc:
        return packing_refusal(where, str(cfg.model_type), exc, attn)
    return None


def load_model(
    name_or_dir: str = "tiny-llama",
    attn_implementation: str = "sdpa",
    seed: int = 0,
    max_params: int | None = None,
    where: str | None = None,
    **overrides,
):
    """The model as the user gets it: a folder with saved weights through ``from_pretrained`` (offline, its
    weights, ``attn_implementation``; ``use_cache`` off), anything else through :func:`build_model` (random
    weights). Under padfree's packed attention a model that cannot be built is :func:`packing_refusal`
    (``where``: who asks; default the model's name)."""
    import torch
    import transformers

    packed = attn_implementation.startswith("padfree_")
    if packed:
        import padfree.torch.documents.attention  # noqa: F401  (registers padfree_varlen / padfree_leaky with transformers)
    path = Path(name_or_dir)
    where = where or name_or_dir
    try:
        if not loads_saved(name_or_dir, overrides):
            return build_model(name_or_dir, attn_implementation, seed, max_params, **overrides)
        cfg = build_config(name_or_dir)
        if max_params is not None and param_count(cfg) > max_params:
            return build_model(name_or_dir, attn_implementation, seed, max_params)  # its one-line refusal
        torch.manual_seed(seed)
        with quiet_transformers():  # its load report and progress bar: many lines
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(path), local_files_only=True, attn_implementation=attn_implementation, dtype=torch.float32
            )
    except ConfigError:
        raise
    except Exception as exc:  # transformers raises many types for a model it cannot build
        refusal = attention_refusal(name_or_dir, attn_implementation, where) if packed else None
        if refusal is not None:
            raise refusal from None
        text = one_line(" ".join(str(exc).split()))[:200] or type(exc).__name__
        raise ConfigError(f"{where}: transformers cannot load a causal LM from it ({text})") from None
    model.config.use_cache = False
    return model


def require_packable(model: Any, where: str) -> None:
    """Refuse packed training of ``model`` at ``where`` in one line: a model whose packed forward fails is
    :func:`packing_refusal`, one whose documents see each other is the leak guard's line
    (:func:`padfree.torch.documents.leak_probe.require_exact_packing`)."""
    from padfree.torch.documents.leak_probe import require_exact_packing

    try:
        require_exact_packing(model, where)
    except ConfigError:
        raise
    except Exception as exc:  # the family's own code fails on a packed row
        cfg = getattr(model, "config", None)
        family = str(getattr(cfg, "model_type", type(model).__name__))
        attn = str(getattr(cfg, "_attn_implementation", None) or "its attention")
        raise packing_refusal(where, family, exc, attn) from None


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings (its load report) and progress bars off for the block, restored after."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
