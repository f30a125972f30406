"""The frozen target a drafter learns from: a transformers causal LM (the user's local folder,
:func:`load_target`, or a tiny random one, :func:`build_target`) run on a contract's rows (packed rows through
padfree's per-document attention), returning the hidden states of chosen layers per position.

For every document the result equals the target run on that document alone (``tests/drafter``;
``padfree check-drafter`` prints the difference). Layer ids count decoder layers from 0 (the output of
layer ``i``); each method's published choice is its ``target_layers`` rule in :mod:`padfree.drafter.methods`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from padfree.drafter.contract import Contract
from padfree.errors import ConfigError
from padfree.models import quiet_transformers

TINY_TARGET = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
}
"""The tiny target of tests, ``check-drafter`` and the examples (random weights)."""


def build_target(name: str = "tiny-llama", *, seed: int = 0, attn: str = "padfree_varlen", **overrides):
    """A frozen (eval, no gradients) causal LM with random weights: ``name`` a built-in tiny family or a
    config directory; defaults to :data:`TINY_TARGET` sizes for the built-in families."""
    from padfree.models import FAMILIES, build_model

    sizes = {**TINY_TARGET, **overrides} if name in FAMILIES else overrides
    model = build_model(name, attn_implementation=attn, seed=seed, **sizes)
    _refuse_leaks(model, attn, name)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes a target folder can be loaded in (``--dtype``)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
"""A target folder's tokenizer: one of these (``save_pretrained`` of a fast or SentencePiece tokenizer)."""


def check_target_folder(path: str | Path) -> Path:
    """``path`` if it is a local transformers causal-LM folder with a config, safetensors weights and a
    tokenizer; else a one-line :class:`ConfigError` naming what is missing (nothing is downloaded)."""
    from padfree.models import read_config_json

    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{p}: target not found (give a local folder written by save_pretrained)")
    read_config_json(p)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        import json

        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ConfigError(f"{index}: not a safetensors index (a JSON object with a weight_map)") from None
        missing = sorted(s for s in shards if not (p / str(s)).is_file())
        if missing:
            raise ConfigError(f"{p}: weight shard {missing[0]} named by {index.name} is missing")
    elif not (p / "model.safetensors").is_file():
        raise ConfigError(
            f"{p}: no model.safetensors (nor model.safetensors.index.json): the target's weights, as "
            "save_pretrained writes them"
        )
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(
            f"{p}: no tokenizer ({' or '.join(TOKENIZER_FILES)}): save the target's tokenizer into the "
            "folder (tokenizer.save_pretrained)"
        )
    return p


def load_target(
    path: str | Path,
    *,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    attn: str = "padfree_varlen",
):
    """The causal LM of a local folder (:func:`check_target_folder`), frozen (eval, no gradients), in
    ``dtype`` on ``device``, with ``attn`` attention (padfree's per-document attention for packed rows by
    default). Offline: a folder transformers cannot load is one line."""
    import transformers

    p = check_target_folder(path)
    if dtype not in DTYPES:
        raise ConfigError(f"target dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
    if attn.startswith("padfree_"):
        import padfree.torch.documents.attention  # noqa: F401  (registers padfree_varlen with transformers)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    loaded: Any  # (model, loading info) with output_loading_info
    try:
        with quiet_transformers():  # its load report is a multi-line table: padfree says it in one line
            loaded = transformers.AutoModelForCausalLM.from_pretrained(
                str(p),
                local_files_only=True,
                dtype=DTYPES[dtype],
                attn_implementation=attn,
                output_loading_info=True,
                ignore_mismatched_sizes=True,  # reported below, naming the tensor, instead of raised
            )
    except Exception as exc:  # transformers raises many types for a folder it cannot load
        if attn.startswith("padfree_"):  # the family's one sentence, as every entry point says it
            from padfree.models import attention_refusal

            refusal = attention_refusal(str(p), attn, f"--target {p}")
            if refusal is not None:
                raise refusal from None
        text = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ConfigError(f"{p}: transformers cannot load a causal LM from it ({text})") from None
    model, info = loaded
    _check_loaded(p, info)
    model.config.use_cache = False
    model.eval()
    for q in model.parameters():
        q.requires_grad_(False)
    model.to(torch.device(device))
    _refuse_leaks(model, attn, str(p))
    return model


def _refuse_leaks(model: Any, attn: str, where: str) -> None:
    """A target the drafter sees packed rows through must keep its documents apart (the leak probe)."""
    if attn.startswith("padfree_varlen"):
        from padfree.models import require_packable

        require_packable(model, f"{where}: packed drafter training against this target")


def _check_loaded(folder: Path, info: dict) -> None:
    """One line naming ``folder`` and the first tensor its weights lack, hold in excess or hold in another
    shape (what transformers would otherwise fill with fresh random values, or drop, and train on)."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        name = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        shard = _indexed_shard(folder, name)
        where = (
            f"shard {shard}, where model.safetensors.index.json puts it, lacks"
            if shard
            else "its weights lack"
        )
        raise ConfigError(
            f"{folder}: {where} tensor {name}{more}: transformers would fill it with random values; save the "
            "target's complete weights (save_pretrained)"
        )
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda m: str(m[0]))
    if mismatched:
        name, stored, wanted = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise ConfigError(
            f"{folder}: tensor {name} has shape {list(stored)} in the weights, {list(wanted)} in the model "
            f"its config.json describes{more}: weights of another model?"
        )
    unexpected = sorted(info.get("unexpected_keys") or ())
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ConfigError(
            f"{folder}: the weights hold tensor {unexpected[0]}{more}, which the model its config.json "
            "describes has no place for: weights of another model?"
        )


def _indexed_shard(folder: Path, name: str) -> str | None:
    """The shard ``model.safetensors.index.json`` of ``folder`` names for tensor ``name`` (None: none)."""
    import json

    try:
        shard = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].get(name)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return str(shard) if shard else None


@dataclass(frozen=True)
class TargetOutput:
    """What the target gives the drafter, on the contract's flat view.

    Attributes:
        hidden: ``(1, R * W, len(layers) * H)``: the chosen layers' outputs, concatenated.
        last: ``(1, R * W, H)``: the final (normed) hidden state; ``lm_head(last)`` are the target's logits.
        prenorm: ``(1, R * W, H)``: the last decoder layer's output before the final norm (what trainers
            that apply the target's norm themselves, such as speculators, take as the verifier's state).
    """

    hidden: torch.Tensor
    last: torch.Tensor
    prenorm: torch.Tensor | None = None


@torch.no_grad()
def run_target(model, contract: Contract, layers: tuple[int, ...]) -> TargetOutput:
    """Run ``model`` once on ``contract``'s rows and collect the outputs of decoder ``layers``."""
    blocks = _decoder_layers(model)
    for i in layers:
        if not 0 <= i < len(blocks):
            raise ConfigError(f"target layer {i} outside 0..{len(blocks) - 1}")
    seen: dict[int, torch.Tensor] = {}
    hooks = []
    for i in sorted({*layers, len(blocks) - 1}):

        def keep(_m, _inp, out, i=i):
            seen[i] = out[0] if isinstance(out, tuple) else out

        hooks.append(blocks[i].register_forward_hook(keep))
    dev = next(model.parameters()).device
    inputs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in contract.target_inputs().items()}
    try:
        out = _base(model)(**inputs, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    hidden = torch.cat([seen[i] for i in layers], dim=-1)
    width = contract.width
    return TargetOutput(
        hidden.reshape(1, width, -1),
        out.last_hidden_state.reshape(1, width, -1),
        seen[len(blocks) - 1].reshape(1, width, -1),
    )


def _base(model):
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def _decoder_layers(model):
    return _base(model).layers


class FloatHead(torch.nn.Module):
    """A target's LM head kept in its own dtype, called on float32 hidden states, giving float32 logits (a
    bfloat16 target beside a float32 drafter)."""

    def __init__(self, head: torch.nn.Module) -> None:
        super().__init__()
        self.head = head
        self.dtype: torch.dtype = next(head.parameters()).dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.to(self.dtype)).float()


def lm_head(model) -> torch.nn.Module:
    """The target's output projection (hidden -> vocabulary logits), float32 logits whatever its dtype."""
    head = model.get_output_embeddings()
    return head if head.weight.dtype == torch.float32 else FloatHead(head)


def shared_weights(model) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embedding weight, LM head weight)`` of the target in float32, which the reference drafters start
    from."""
    return model.get_input_embeddings().weight.float(), model.get_output_embeddings().weight.float()


def as_float(out: TargetOutput, dtype: torch.dtype = torch.float32) -> TargetOutput:
    """``out`` in ``dtype`` (a bfloat16 target's states for a float32 drafter); ``out`` itself when it is."""
    if out.hidden.dtype == dtype:
        return out
    pre = None if out.prenorm is None else out.prenorm.to(dtype)
    return TargetOutput(out.hidden.to(dtype), out.last.to(dtype), pre)


def load_tokenizer(path: str | Path) -> Any:
    """The transformers tokenizer of a target folder, offline, transformers' own warnings kept quiet; a
    folder it cannot load is one line (a ``tokenizer.model`` alone without the protobuf package says so,
    not the unrelated tiktoken fallback transformers reports)."""
    import importlib.util

    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = Path(path)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as exc:  # transformers raises many types for a folder it cannot load
        sentencepiece_only = (p / "tokenizer.model").is_file() and not (p / "tokenizer.json").is_file()
        try:
            protobuf = importlib.util.find_spec("google.protobuf") is not None
        except ModuleNotFoundError:  # no google namespace at all
            protobuf = False
        if sentencepiece_only and not protobuf:
            raise ConfigError(
                f"{p}: its tokenizer.model (SentencePiece) needs the protobuf package to load here (pip "
                "install protobuf), or save the tokenizer's tokenizer.json into the folder"
            ) from None
        text = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ConfigError(f"{p}: transformers cannot load its tokenizer ({text})") from None
    finally:
        transformers.logging.set_verbosity(verbosity)


def check_target_tokenizer(path: str | Path) -> None:
    """The tokenizer of a target folder belongs to its model: it has no more ids than the model's vocabulary
    (``config.json`` ``vocab_size``) and not far fewer (a model pads its vocabulary by a few hundred ids at
    most; a 32K tokenizer beside a 129K model is another model's), and its BOS, EOS and pad ids are the
    config's where both name one. Else one :class:`ConfigError` line naming what differs."""
    from padfree.models import read_config_json

    p = Path(path)
    tok = load_tokenizer(p)
    cfg = read_config_json(p)
    cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
    vocab, n = cfg.get("vocab_size"), len(tok)
    other = "a tokenizer of another model?"
    if isinstance(vocab, int) and (n > vocab or n < 0.9 * vocab):
        how = "more than" if n > vocab else "far fewer than"
        raise ConfigError(
            f"{p}: its tokenizer has {n} ids, {how} the model's vocabulary of {vocab} (config.json): {other}"
        )
    for name in ("bos", "eos", "pad"):
        want, got = cfg.get(f"{name}_token_id"), getattr(tok, f"{name}_token_id", None)
        allowed = want if isinstance(want, list) else [want]
        if want is not None and isinstance(got, int) and got not in allowed:
            raise ConfigError(
                f"{p}: its tokenizer's {name} token is id {got}, config.json's {name}_token_id {want}: "
                f"{other}"
            )


def default_mask_token(path: str | Path) -> int:
    """The DFlash mask token of a target folder's tokenizer: its mask token, else its pad token, else its
    unknown token, else its last id (z-lab's drafters use a dedicated token; any fixed id the target embeds
    works, as long as training and serving use the same, which the export records)."""
    tok = load_tokenizer(path)
    for name in ("mask_token_id", "pad_token_id", "unk_token_id"):
        value = getattr(tok, name, None)
        if isinstance(value, int):
            return value
    return len(tok) - 1
