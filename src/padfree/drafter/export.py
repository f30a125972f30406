"""Drafters in the formats servers load: DFlash as z-lab's ``dflash`` package reads it (SGLang and vLLM load
the same folders), EAGLE-3 as vllm speculators' ``Eagle3DraftModel`` reads it.

A padfree checkpoint (``examples/train_drafter.py``) holds the drafter's weights (``state["model"]``) and,
under ``state["drafter_export"]``, what a served drafter needs besides them (:func:`export_meta`): the
method, the recipe, the drafter's sizes, the target layers it fuses, the mask token of its blocks and the
target (its config and folder). :func:`export_drafter` writes ``config.json`` + ``model.safetensors``:

- ``dflash``: a ``Qwen3Config`` of the drafter with ``num_target_layers`` and ``dflash_config {block_size,
  mask_token_id, target_layer_ids}`` (decoder layer outputs from 0, as z-lab counts them), parameters named
  as theirs (``layers.{i}.self_attn.q_proj.weight``, ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``);
  the embedding and LM head are the target's at serving time, so they are not written.
- ``speculators``: their ``Eagle3SpeculatorConfig`` (``speculators_model_type: eagle3``, a Llama decoder
  layer config, ``eagle_aux_hidden_state_layer_ids`` as Hugging Face ``hidden_states`` indices = padfree's
  layer + 1, the verifier's folder and architecture, ``norm_before_fc``, ``norm_output`` for a post-norm fed
  state), parameters named as theirs (``layers.0.self_attn.q_proj.weight``, ``layers.0.hidden_norm.weight``,
  ``input_norm.weight``...), the embedding and the draft head included, and ``d2t`` (offsets ``target id -
  draft id``) and ``t2d`` (a boolean mask over the target's vocabulary) where a draft vocabulary is used.

>>> FORMATS
('dflash', 'speculators')
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from padfree.errors import ConfigError, InputError, OutputError, one_line

FORMATS = ("dflash", "speculators")
"""Export formats: z-lab's DFlash folders, vllm speculators' EAGLE-3 folders."""

METHOD_OF_FORMAT = {"dflash": "dflash", "speculators": "eagle3"}
"""The drafter method each format holds."""

SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose EAGLE-3 format :func:`export_drafter` writes (and the tests load)."""

META_KEY = "drafter_export"
"""Where a checkpoint keeps :func:`export_meta`."""


def export_meta(models: Any, *, mask_token_id: int, target_path: str | Path | None = None) -> dict:
    """What a checkpoint of ``models`` (:class:`padfree.drafter.train.DrafterModels`) carries for export:
    plain values only (a checkpoint is loaded with ``weights_only``)."""
    target = models.target
    cfg = target.config
    vocab = models.drafter.vocab
    return {
        "version": 1,
        "method": models.method.name,
        "recipe": dataclasses.asdict(models.recipe),
        "drafter": dataclasses.asdict(models.drafter.cfg),
        "target_layers": [int(i) for i in models.layers],
        "mask_token_id": int(mask_token_id),
        "d2t": None if vocab is None else [int(i) for i in vocab.d2t.tolist()],
        "target": {
            "path": None if target_path is None else str(Path(target_path).resolve()),
            "architecture": type(target).__name__,
            "config": json.loads(cfg.to_json_string(use_diff=False)),
        },
    }


def default_format(method: str) -> str:
    """The export format of a drafter method (``dflash`` -> ``dflash``, ``eagle3`` -> ``speculators``)."""
    for fmt, m in METHOD_OF_FORMAT.items():
        if m == method:
            return fmt
    raise ConfigError(f"no export format holds {method} drafters (formats: {', '.join(FORMATS)})")


def with_verifier(meta: dict, verifier: str | Path | None) -> dict:
    """``meta`` with the target folder a server runs set to ``verifier`` (unchanged when ``None``); checked
    to be a target folder."""
    if verifier is None:
        return meta
    from padfree.drafter.target import check_target_folder

    path = str(check_target_folder(verifier).resolve())
    return {**meta, "target": {**meta["target"], "path": path}}


def check_exportable(meta: dict, fmt: str, *, option: str = "--format") -> None:
    """Raise the one line :func:`export_drafter` would for ``meta`` in ``fmt`` before any weight exists
    (what ``train_drafter.py --export-dir`` checks before it trains); ``option``: the caller's option that
    chooses the format (``padfree export-drafter --format``, ``train_drafter.py --export-format``)."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}: choose {' or '.join(FORMATS)}")
    method = meta.get("method")
    if METHOD_OF_FORMAT[fmt] != method:
        other = [f for f, m in METHOD_OF_FORMAT.items() if m == method]
        raise ConfigError(
            f"the {fmt} format holds {METHOD_OF_FORMAT[fmt]} drafters; this drafter is {method}"
            + (f" (export it with {option} {other[0]})" if other else "")
        )
    if fmt == "dflash" and meta.get("d2t") is not None:
        raise ConfigError(
            "z-lab's DFlash format has no draft vocabulary (the target's LM head drafts): train with the "
            "full vocabulary (--draft-vocab none)"
        )
    if fmt == "speculators" and not meta["target"].get("path"):
        raise ConfigError(
            "speculators' format names the verifier, the target folder a server runs, and loads its "
            "embedding and norm from it: this drafter was trained on padfree's tiny random target; pass "
            "--verifier DIR, or train with --target DIR"
        )


def read_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """``(drafter state dict, export meta)`` of a checkpoint file or of the newest intact checkpoint of a
    checkpoint folder; one line when there is none or it carries no export meta (written before padfree saved
    it: retrain, or resume and let it save)."""
    from padfree.torch.checkpoint import CheckpointDir

    p = Path(path)
    if p.is_dir():
        found, state = CheckpointDir(p, say=lambda *_a, **_k: None).newest_intact()
        if found is None or state is None:
            raise InputError("no intact checkpoint (step-NNNNNNNNN.pt) in this folder", path=str(p))
        p = found
    elif not p.is_file():
        raise InputError("checkpoint not found", path=str(p))
    else:
        try:
            state = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch.load raises many types for a garbled file
            raise InputError(
                f"not a checkpoint ({type(exc).__name__}: {one_line(str(exc))[:120]})", path=str(p)
            ) from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise InputError("not a padfree drafter checkpoint (no model state)", path=str(p))
    meta = state.get(META_KEY)
    if not isinstance(meta, dict) or meta.get("version") != 1:
        raise InputError(
            "the checkpoint carries no export information (written before export was supported): train or "
            "resume with examples/train_drafter.py to write one that does",
            path=str(p),
        )
    return state["model"], meta


def export_drafter(
    state: dict[str, torch.Tensor], meta: dict, fmt: str, out: str | Path, *, dtype: str = "float32"
) -> Path:
    """Write the drafter of ``state`` + ``meta`` in ``fmt`` (:data:`FORMATS`) into the folder ``out``
    (created; files in it are replaced); returns ``out``."""
    check_exportable(meta, fmt)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if dt is None:
        raise ConfigError(f"export dtype must be float32 or bfloat16 (got {dtype!r})")
    config, tensors = (_dflash if fmt == "dflash" else _speculators)(state, meta)
    tensors = {k: (v.to(dt) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    config["dtype"] = dtype
    target = Path(out)
    try:
        target.mkdir(parents=True, exist_ok=True)
        from safetensors.torch import save_file

        save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
        (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    except OSError as exc:
        raise OutputError(
            f"cannot write the exported drafter ({exc.strerror or exc})", path=str(target)
        ) from None
    return target


def export_models(
    models: Any,
    fmt: str,
    out: str | Path,
    *,
    mask_token_id: int,
    target_path: str | Path | None = None,
    dtype: str = "float32",
) -> Path:
    """Export the drafter of in-memory ``models`` (what a checkpoint of them would export)."""
    state = {k: v.detach().cpu() for k, v in models.drafter.state_dict().items()}
    meta = export_meta(models, mask_token_id=mask_token_id, target_path=target_path)
    return export_drafter(state, meta, fmt, out, dtype=dtype)


def _layer_sizes(d: dict, t: dict) -> dict:
    """The transformers config fields of the drafter's layers both formats write: its sizes (``d``, from the
    export meta), plain rotary embeddings with the target's base, the target's (``t``) context length; no
    biases, no tied embeddings."""
    return {
        "hidden_size": int(d["hidden_size"]),
        "intermediate_size": int(d["intermediate_size"]),
        "num_attention_heads": int(d["num_heads"]),
        "num_key_value_heads": int(d["num_kv_heads"]),
        "head_dim": int(d["head_size"] or d["hidden_size"] // d["num_heads"]),
        "rms_norm_eps": float(d["eps"]),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(d["rope_theta"])},
        "max_position_embeddings": int(t.get("max_position_embeddings") or 32768),
        "tie_word_embeddings": False,
        "attention_bias": False,
    }


def _take(state: dict, name: str) -> torch.Tensor:
    if name not in state:
        raise InputError(f"the checkpoint's drafter has no {name} (another drafter version?)")
    return state[name]


def _dflash(state: dict, meta: dict) -> tuple[dict, dict]:
    """z-lab's DFlash config and parameter names."""
    import transformers

    d, t = meta["drafter"], meta["target"]["config"]
    n = int(d["num_layers"])
    window = d.get("sliding_window")
    qwen = transformers.Qwen3Config(
        vocab_size=int(t["vocab_size"]),
        num_hidden_layers=n,
        **_layer_sizes(d, t),
        use_sliding_window=window is not None,
        sliding_window=window,
        layer_types=["sliding_attention" if window is not None else "full_attention"] * n,
    )
    config = qwen.to_dict()
    block = int(meta["recipe"]["block_size"])
    config.update(
        architectures=["DFlashDraftModel"],
        num_target_layers=int(t["num_hidden_layers"]),
        block_size=block,
        is_causal=bool(d.get("causal_in_block")),
        dflash_config={
            "block_size": block,
            "mask_token_id": int(meta["mask_token_id"]),
            "target_layer_ids": [int(i) for i in meta["target_layers"]],
        },
    )
    config.pop("transformers_version", None)
    tensors = {name: _take(state, name) for name in ("fc.weight", "hidden_norm.weight", "norm.weight")}
    for i in range(n):
        for part in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            tensors[f"layers.{i}.self_attn.{part}.weight"] = _take(state, f"layers.{i}.{part}.weight")
        for part in (
            "input_layernorm",
            "post_attention_layernorm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ):
            tensors[f"layers.{i}.{part}.weight"] = _take(state, f"layers.{i}.{part}.weight")
    return config, tensors


def _speculators(state: dict, meta: dict) -> tuple[dict, dict]:
    """vllm speculators' EAGLE-3 config and parameter names."""
    import transformers

    d, tgt = meta["drafter"], meta["target"]
    t = tgt["config"]
    vocab = int(t["vocab_size"])
    layer = transformers.LlamaConfig(
        vocab_size=vocab,
        num_hidden_layers=1,
        **_layer_sizes(d, t),
        mlp_bias=False,
    ).to_diff_dict()
    layer.pop("transformers_version", None)
    d2t = meta.get("d2t")
    draft_vocab = vocab if d2t is None else len(d2t)
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": False,
        "norm_before_fc": bool(d.get("norm_before_fc")),
        "fc_norm": False,
        "norm_output": d.get("fed_state") == "postnorm",
        "embed_requires_grad": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [int(i) + 1 for i in meta["target_layers"]],
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(d["ttt"]),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {
                "name_or_path": tgt.get("path"),
                "architectures": list(t.get("architectures") or [tgt["architecture"]]),
            },
        },
    }
    names = {
        "embed_tokens.weight": "embed_tokens.weight",
        "fc.weight": "fc.weight",
        "input_layernorm.weight": "layers.0.input_layernorm.weight",
        "hidden_norm.weight": "layers.0.hidden_norm.weight",
        "q_proj.weight": "layers.0.self_attn.q_proj.weight",
        "k_proj.weight": "layers.0.self_attn.k_proj.weight",
        "v_proj.weight": "layers.0.self_attn.v_proj.weight",
        "o_proj.weight": "layers.0.self_attn.o_proj.weight",
        "post_attention_layernorm.weight": "layers.0.post_attention_layernorm.weight",
        "mlp.gate_proj.weight": "layers.0.mlp.gate_proj.weight",
        "mlp.up_proj.weight": "layers.0.mlp.up_proj.weight",
        "mlp.down_proj.weight": "layers.0.mlp.down_proj.weight",
        "norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
    }
    if d.get("norm_before_fc"):
        names["fc_norm.weight"] = "input_norm.weight"
    tensors = {theirs: _take(state, ours) for ours, theirs in names.items()}
    if d2t is not None:
        ids = torch.tensor(d2t, dtype=torch.long)
        tensors["d2t"] = ids - torch.arange(ids.shape[0])
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    return config, tensors


__all__ = [
    "FORMATS",
    "META_KEY",
    "METHOD_OF_FORMAT",
    "check_exportable",
    "default_format",
    "export_drafter",
    "export_meta",
    "export_models",
    "read_checkpoint",
    "with_verifier",
]
