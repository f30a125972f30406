"""The family sweep: does packing keep documents apart on every decoder family the installed transformers has?

Each family of transformers' causal-LM mapping is built as a tiny random model that keeps every layer type of
its pattern (attention, sliding, linear attention, convolution, SSM, MoE...), with ``padfree_varlen``, and
checked three ways: the leak probe (:mod:`padfree.torch.documents.leak_probe`: a later document's logits must
not move
when the first document changes), the causality probe (no earlier logit moves when every document's last
token changes), both on the packed path in the sweep's dtype, and packed vs each document alone through the
model's OWN attention (eager, else sdpa; logits, and in float32 the parameter gradients). The verdict:

- ``exact``: both probes within the noise measured on the spot (0 on CPU), in the sweep's dtype, and packed ==
  the model's own attention alone in float32 (logits 1e-4, gradients relative 1e-4; a bfloat16 sweep also
  reports the bfloat16 difference, ``alone_dtype``, which rounding alone makes differ: eager and sdpa of one
  family differ by up to 0.2 there); the ``path`` says whether padfree's per-document mixers were needed;
- ``refused``: packed training of the family stops with one line (the reason: a leak the guard sees,
  attention to future tokens, or what padfree's attention cannot keep of the model's own: window, chunk,
  softcap, bias...);
- ``not buildable``: no tiny model of the family could be built or run here (why);
- ``out of scope``: encoders and encoder-decoders (packing of causal decoders only).

A family the generic shrinker cannot build tiny gets a hand-written config in :data:`HAND`.

>>> r = check_family("qwen3")
>>> r.status, r.probe, r.causal, r.own
('exact', 0.0, 0.0, 'eager')
"""

from __future__ import annotations

import contextlib
import io
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

STATUSES = ("exact", "refused", "not buildable", "out of scope")

# generic shrink: every field a config has among these is set to the small value (or kept when smaller)
SMALL: dict[str, int] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "state_size": 16,
    "ssm_state_size": 16,
    "n_groups": 1,
    "mamba_n_groups": 1,
    "n_embd": 64,
    "n_head": 4,
    "d_model": 64,
    "n_positions": 512,
    "num_heads": 4,
    "time_step_rank": 8,
    "vocab_size_per_layer_input": 128,
    "hidden_size_per_layer_input": 16,
    "laurel_rank": 8,
    "rotary_dim": 8,
    "first_k_dense_replace": 1,
    "topk_group": 1,
    "n_group": 1,
    "sliding_window": 8,
    "attention_window_size": 8,
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
}

# sizes a default config may leave ``None`` for a checkpoint to fill, which the model cannot do without
UNSET = ("head_dim", "num_key_value_heads")

_CONV_ATTN = ["conv", "full_attention"] * 2  # LFM2's pattern, twice
# dots3's sliding-window MLA layer, in the small sizes
_DOTS3_SWA = {"num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "v_head_dim": 16}
_DOTS3_SWA |= {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8}

# hand-written tiny configs, over the generic shrink, for families whose defaults the shrink cannot fit
HAND: dict[str, dict[str, Any]] = {
    "lfm2": {"num_hidden_layers": 4, "full_attn_idxs": [1, 3], "layer_types": _CONV_ATTN},
    "lfm2_moe": {"num_hidden_layers": 4, "num_dense_layers": 1, "layer_types": _CONV_ATTN},
    "deepseek_v2": {"num_experts_per_tok": 2},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "zamba": {"num_hidden_layers": 4, "layers_block_type": ["linear_attention", "hybrid"] * 2},
    "gemma3n_text": {  # sliding + full, the last two layers reusing the first two's keys, one sparse MLP
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2,
        "intermediate_size": [96] * 4,
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
    },
    "dots3_note_text": {  # indexed (DSA) + sliding MLA layers, multi-head only, the first MLP dense
        "num_key_value_heads": 4,
        "index_head_dim": 16,
        "index_n_heads": 4,
        "index_topk": 8,
        "per_layer_config": {2: _DOTS3_SWA},
    },
    "dbrx": {  # the default attention sub-config lacks ``rope_theta`` and ``clip_qkv`` (DBRX: 8)
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10_000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
    },
    "dory": {  # 1 input, 2 looped recurrent, 1 output layer; sliding and full attention alternate
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "n_input_layers": 1,
        "n_recurrent_layers": 2,
        "n_output_layers": 1,
    },
    "cohere_compass_text": {  # the default has no RoPE per layer type: sliding RoPE (M-RoPE), full NoPE
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [4, 2, 2]},
            "full_attention": None,
        },
    },
    "qwen4_exp_text": {  # gated delta-net + QSA-indexed attention, n-gram PLE on the first layer
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 2,
        "hc_lowrank": 8,
        "ple_layer_ids": [1],
        "ple_embed_dim": 32,
        "heads_per_ngram": 2,
        "ngram_vocab_size_base": 64,
        "split_ngram_parts": 1,
        "eos_token_id": 1,  # PLE hashing restarts n-grams at it
    },
    "dots1": {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
    },
    "phi4_multimodal": {  # the text decoder is what packs: its audio encoder at one small block
        "audio_config": {"num_blocks": 1, "ext_pw_out_channel": 64, "depthwise_separable_out_channel": 64}
        | {"nemo_conv_channels": 64},
    },
    "blt": {  # byte vocabulary; entropy patcher, local encoder/decoder and global transformer all small
        "vocab_size": 260,
        "encoder_hash_byte_group_vocab": 128,
        "patcher_config": {"vocab_size": 260, "num_key_value_heads": 4},
        "encoder_config": {"vocab_size": 260, "hidden_size_global": 64, "num_key_value_heads": 4},
        "decoder_config": {"vocab_size": 260, "hidden_size_global": 64, "num_key_value_heads": 4},
        "global_config": {"num_key_value_heads": 4},
    },
    "longcat_flash": {"num_layers": 1, "zero_expert_num": 2},  # one layer pair; routed + zero experts
    "mamba2": {"num_heads": 8, "head_dim": 16},
    "kimi_linear": {"linear_num_heads": 4, "linear_head_dim": 16},
    "falcon_h1": {"mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16},
}

# DeepSeek sparse attention (and its relatives): MLA keeps a key/value head per query head; a small indexer
_DSA = {"num_key_value_heads": 4, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 8}
for _fam in ("deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2"):
    HAND[_fam] = {**HAND.get(_fam, {}), **_DSA}
HAND["gemma3n"] = HAND["gemma3n_text"]
HAND["dots3_note"] = HAND["dots3_note_text"]
HAND["qwen4_exp"] = HAND["qwen4_exp_text"]

# why a family stays not buildable, in plain words (the error follows in the detail)
_INDEXER = (
    "its sparse-attention indexer picks the keys each query attends to (`indices`, computed over the dense "
    "mask), which padfree_varlen does not apply"
)
_OWN_TABLE = (
    "it picks its attention class from its own eager/sdpa/flash table, with no entry for a custom "
    "attn_implementation such as padfree_varlen"
)
_DRAFTER = (
    "a drafter head: its forward needs the target model's input embeddings and shared key/value states, "
    "there is no forward from input_ids alone"
)
WHY: dict[str, str] = {
    "axk2": _INDEXER,
    "deepseek_v32": _INDEXER,
    "dots3_note": _INDEXER,
    "dots3_note_text": _INDEXER,
    "glm_moe_dsa": _INDEXER,
    "hy_v4": _INDEXER,
    "qwen4_exp": _INDEXER,
    "qwen4_exp_text": _INDEXER,
    "falcon": _OWN_TABLE,
    "git": _OWN_TABLE,
    "gpt_neo": _OWN_TABLE,
    "gemma4_assistant": _DRAFTER,
    "gemma4_unified_assistant": _DRAFTER,
    "mpt": "its forward calls .to(bool) on the causal mask, which padfree_varlen omits for unpadded rows",
}

PARAM_LIMIT = 20_000_000
DOCS = (7, 12, 5, 9)
TOLERANCE = {"float32": 1e-4}  # packed vs the model's own attention alone, logits (the verdict: float32)
GRAD_TOLERANCE = 1e-4  # relative, float32 only


@dataclass(frozen=True)
class FamilyResult:
    """One row of the sweep (see the module docstring for the statuses)."""

    family: str
    status: str
    detail: str = ""
    model_class: str = ""
    path: str = ""
    mixers: tuple[str, ...] = field(default_factory=tuple)
    probe: float | None = None
    alone: float | None = None
    params: int | None = None
    seconds: float = 0.0
    causal: float | None = None
    grads: float | None = None
    own: str = ""
    dtype: str = "float32"
    alone_dtype: float | None = None

    def line(self) -> str:
        bits = [f"{self.family:26s} {self.status:13s}"]
        if self.probe is not None:
            bits.append(f"probe {self.probe:.3g} causal {self.causal:.3g} vs {self.own} {self.alone:.3g}")
            if self.grads is not None:
                bits.append(f"grads {self.grads:.2g}")
            if self.alone_dtype is not None:
                bits.append(f"in {self.dtype} {self.alone_dtype:.2g}")
        bits.append(self.path or self.detail)
        return "  ".join(b for b in bits if b)


def causal_families() -> dict[str, str]:
    """model_type -> causal-LM class name, for every family of the installed transformers' mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def out_of_scope(family: str, cfg: Any) -> str | None:
    """Why ``family`` is not a causal decoder padfree packs (an encoder, an encoder-decoder), or ``None``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if getattr(cfg, "is_encoder_decoder", False):
        return "encoder-decoder"
    if family in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "encoder (masked LM) used as a decoder"
    if getattr(cfg, "attn_type", None) == "bi":
        return "bidirectional attention (XLNet's permutation LM): not a causal decoder"
    if getattr(cfg, "add_cross_attention", False) or family in ("trocr", "bert-generation"):
        return "the decoder of an encoder-decoder model"
    return None


def tiny_config(family: str) -> Any:
    """A tiny config of ``family`` keeping one layer of each distinct per-layer pattern entry (multimodal
    families: their text config), with :data:`HAND` over the generic shrink.

    The shrink sets the :data:`SMALL` sizes (through ``attribute_map`` aliases too, :data:`UNSET` ones the
    default leaves ``None``), lets the config recompute what its ``__post_init__`` derives (:func:`_derived`),
    keeps MLA's ``head_dim`` equal to ``qk_rope_head_dim``, shrinks nested sub-configs and the
    ``per_layer_config`` overrides with their layers, and drops read-only properties."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[family]()
    text = getattr(cfg, "text_config", None)
    if text is not None and hasattr(text, "hidden_size"):
        cfg = text
    d = cfg.to_dict()
    orig = dict(d)
    mapped = getattr(cfg, "attribute_map", {}) or {}
    for k, v in SMALL.items():
        key = mapped.get(k, k)  # an alias (``num_experts_per_tok`` -> ``num_experts_per_token``): its target
        cur = d[key] if key in d else _attr(cfg, k)
        if cur is None and key in UNSET and key in d:
            d[key] = v  # left unset by the default config and needed by the model
        elif isinstance(cur, int) and not isinstance(cur, bool):
            d[key] = v if k == "hidden_size" else min(v, cur)
    if orig.get("head_dim") is not None and orig.get("head_dim") == orig.get("qk_rope_head_dim"):
        d["head_dim"] = d["qk_rope_head_dim"]  # MLA: the rotary tables are sized by head_dim
    for k in _derived(cfg, d, mapped):
        d.pop(k)  # computed from the other fields by the config itself: recomputed from the small ones
    for k, sub in d.items():  # sub-configs (a vision tower, BLT's patcher and local models...): small too
        if _is_sub(sub):
            d[k] = _small_sub(sub)
    n0 = int(_attr(cfg, "num_hidden_layers") or 0)
    layers = mapped.get("num_hidden_layers", "num_hidden_layers")  # GPT-Neo's ``num_layers``...
    per_layer = [k for k, v in d.items() if isinstance(v, list) and n0 and len(v) == n0 and k not in mapped]
    plc = d.get("per_layer_config")  # per-layer overrides {"05": {"head_dim": 512}, ...} (Gemma 4, dots3)
    overrides = {int(i): o for i, o in plc.items()} if isinstance(plc, dict) else {}
    keep: list[int] = [0, 1]
    if per_layer or overrides:  # one layer of each distinct combination of per-layer fields, in order
        seen: set[tuple[str, ...]] = set()
        keep = []
        for i in range(n0):
            key = (*(str(d[k][i]) for k in per_layer), str(overrides.get(i)))
            if key not in seen:
                seen.add(key)
                keep.append(i)
        if len(keep) == 1 and n0 > 1:
            keep.append(1)
        for k in per_layer:
            d[k] = [d[k][i] for i in keep]
        d[layers] = len(keep)
    elif layers in d:
        d[layers] = 2
    if isinstance(d.get("attn_layer_indices"), list):
        d["attn_layer_indices"] = [1]
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        tok = d.get(k)
        if (isinstance(tok, int) and tok >= SMALL["vocab_size"]) or isinstance(tok, list):
            d[k] = 0
    for k in mapped:
        d.pop(k, None)
    for k in [k for k in d if isinstance(p := getattr(type(cfg), k, None), property) and p.fset is None]:
        d.pop(k)  # computed by the config class (Falcon's ``head_dim``, xLSTM's ``v_head_dim``): not settable
    for k, v in HAND.get(family, {}).items():  # a sub-config's hand sizes go over its small ones
        d[k] = d[k] | v if isinstance(v, dict) and _is_sub(d.get(k)) else v
    if isinstance(plc, dict) and "per_layer_config" not in HAND.get(family, {}):
        width = max((len(str(i)) for i in plc), default=1)
        d["per_layer_config"] = {
            str(j).zfill(width): _scaled(overrides[i], orig, d) for j, i in enumerate(keep) if i in overrides
        }
    new = type(cfg)(**d)
    new.use_cache = False
    return new


def _is_sub(v: Any) -> bool:
    return isinstance(v, dict) and ("model_type" in v or "hidden_size" in v)


def _small_sub(sub: dict[str, Any]) -> dict[str, Any]:
    """A sub-config dict with the :data:`SMALL` sizes and at most two layers."""
    out = dict(sub)
    for k, v in SMALL.items():
        cur = out.get(k)
        if isinstance(cur, int) and not isinstance(cur, bool):
            out[k] = v if k == "hidden_size" else min(v, cur)
    if isinstance(out.get("num_hidden_layers"), int):
        out["num_hidden_layers"] = min(2, out["num_hidden_layers"])
    return out


def _attr(cfg: Any, name: str) -> Any:
    """``cfg.name``, or ``None`` where it is missing or per-layer (a config with ``per_layer_config`` refuses
    the global read of a size that varies across layers)."""
    try:
        return getattr(cfg, name, None)
    except Exception:
        return None


def _scaled(override: dict[str, Any], orig: dict[str, Any], d: dict[str, Any]) -> dict[str, Any]:
    """A per-layer override shrunk like its global value: Gemma 4's full-attention ``head_dim`` 512 over the
    global 256 stays twice the small ``head_dim``."""
    out = dict(override)
    for k, v in override.items():
        was, now = orig.get(k), d.get(k)
        if all(isinstance(x, int) and not isinstance(x, bool) for x in (v, was, now)) and was:
            out[k] = max(1, round(v * now / was))
    return out


def _derived(cfg: Any, d: dict[str, Any], mapped: dict[str, str]) -> list[str]:
    """The entries of ``d`` that ``cfg``'s ``__post_init__`` derived from its fields: integers and lists that
    are no field (``qk_head_dim``, Zamba2's ``mamba_headdim`` and ``hybrid_layer_ids``...) and integer fields
    whose default is ``None`` or ``"auto"`` (Zamba's ``attention_hidden_size``, Jamba's ``mamba_dt_rank``),
    so that a rebuild recomputes them from the small fields."""
    import dataclasses

    if not dataclasses.is_dataclass(cfg):
        return []
    fields = {f.name: f.default for f in dataclasses.fields(cfg)}
    targets = set(mapped.values())
    out = []
    for k, v in d.items():
        if isinstance(v, bool) or k in targets:
            continue
        if k not in fields and isinstance(v, int | list):
            out.append(k)  # set by __post_init__ alone
        elif k in fields and k not in SMALL and isinstance(v, int) and isinstance(fields[k], str | None):
            out.append(k)  # a field left ``None`` / ``"auto"`` that __post_init__ sized from the others
    return out


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"


def check_family(family: str, seed: int = 0, device: str = "cpu", dtype: str = "float32") -> FamilyResult:
    """Build ``family`` tiny with ``padfree_varlen`` and judge it in ``dtype`` (``bfloat16``: float32 weights
    under autocast: the probes; the comparison with the model's own attention is always float32, with
    gradients): one :class:`FamilyResult`, never raises."""
    import torch
    import transformers

    import padfree.torch.documents.attention as pa
    from padfree.errors import ConfigError
    from padfree.torch.documents.leak_probe import against_own_attention, probe_leak
    from padfree.torch.documents.mixers import mixers_of

    t0 = time.perf_counter()

    def result(status: str, **kw: Any) -> FamilyResult:
        if status in ("not buildable", "refused") and family in WHY:
            kw["detail"] = f"{WHY[family]} ({kw.get('detail', '')})"
        return FamilyResult(family, status, seconds=round(time.perf_counter() - t0, 2), dtype=dtype, **kw)

    try:
        cfg = tiny_config(family)
    except Exception as exc:  # the shrink does not fit this family: say so, the table lists it
        return result("not buildable", detail=f"tiny config: {_one_line(exc)}")
    why = out_of_scope(family, cfg)
    if why:
        return result("out of scope", detail=why)
    try:
        with torch.device("meta"):
            cls = getattr(transformers, causal_families()[family], None)
            try:
                meta = transformers.AutoModelForCausalLM.from_config(cfg)
            except ValueError:  # a text config the auto class does not map: the family's own class
                if cls is None:
                    raise
                meta = cls._from_config(cfg)
        params = sum(p.numel() for p in meta.parameters())
        if params > PARAM_LIMIT:
            return result("not buildable", detail=f"tiny config still has {params / 1e6:.0f}M parameters")
    except Exception as exc:
        return result("not buildable", detail=f"build: {_one_line(exc)}")

    def build(attn: str) -> Any:
        torch.manual_seed(seed)
        if cls is not None and type(meta) is cls:
            net = cls._from_config(cfg, attn_implementation=attn)
        else:
            net = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
        net.to(device).eval()
        with torch.no_grad():
            net(input_ids=torch.arange(5, device=device)[None] % cfg.vocab_size, use_cache=False)
        return net

    try:
        model = build(pa.NAME)
    except Exception as exc:  # padfree's attention cannot serve it: does the family run at all?
        runs = None
        for other in ("sdpa", "eager"):
            try:
                build(other)
                runs = other
                break
            except Exception as exc2:
                failed = exc2
        if runs is None:
            return result("not buildable", detail=f"build or unpacked forward: {_one_line(failed)}")
        return result(
            "refused",
            detail=f"runs under {runs}, not under padfree_varlen ({_one_line(exc)}): train it with "
            "--strategy bucketed",
            model_class=causal_families()[family],
            params=params,
        )
    kw: dict[str, Any] = {"model_class": type(model).__name__, "params": params}
    kw["mixers"] = tuple(sorted({type(model.get_submodule(q)).__name__ for q in mixers_of(model)}))
    autocast = torch.bfloat16 if dtype == "bfloat16" else None
    try:
        pa.reset_path()
        probe = probe_leak(model, DOCS, seed, autocast=autocast)
        attn = pa.last_path() or "the family's own attention (no padfree_varlen call)"
        ref = against_own_attention(model, DOCS, seed)  # the pattern's verdict: float32, with gradients
        low = against_own_attention(model, DOCS, seed, grads=False, autocast=autocast) if autocast else None
    except ConfigError as exc:
        return result("refused", detail=str(exc), **kw)
    except Exception as exc:
        if autocast is not None and not _runs(model, autocast):
            return result(
                "not buildable",
                detail=f"the family's own code fails under {dtype} autocast, unpacked too: {_one_line(exc)}",
                **kw,
            )
        return result("refused", detail=f"packed forward fails: {_one_line(exc)}", **kw)
    return _judge(model, cfg, probe, ref, low, attn, seed, device, kw, result)


def _judge(
    model: Any,
    cfg: Any,
    probe: Any,
    ref: Any,
    low: Any,
    attn: str,
    seed: int,
    device: str,
    kw: dict,
    result: Any,
) -> FamilyResult:
    """The verdict on a family that built and ran packed: refused when its probes see a leak or its own
    future, or when it differs from its own attention; else exact (``result`` makes the record)."""
    from padfree.torch.documents.leak_probe import leaking_modules
    from padfree.torch.documents.mixers import fused_kernel, mixers_of

    kw.update(probe=probe.diff, alone=ref.logits, causal=probe.causal, grads=ref.grads, own=ref.attn)
    kw["alone_dtype"] = None if low is None else low.logits
    mods = [model.get_submodule(q) for q in mixers_of(model)]
    fused = sorted({type(m).__name__ for m in mods if fused_kernel(m, device)})
    apart = [m for m in kw["mixers"] if m not in fused]
    path = attn + (f" + per-document {', '.join(apart)}" if apart else "")
    path += f" + through transformers' fused kernel: {', '.join(fused)}" if fused else ""
    if probe.leaked:
        culprits = leaking_modules(model, DOCS, seed)
        names = ", ".join(sorted({type(model.get_submodule(n)).__name__ for n in culprits})) or "?"
        return result(
            "refused",
            detail=f"leaks through {names}: the packing guard refuses it"
            if culprits
            else "leaks through the model's own row-wide code (no single module's output explains it): the "
            "packing guard refuses it",
            path=path,
            **kw,
        )
    if probe.sees_future:
        return result(
            "refused",
            detail="attends to its own future tokens under padfree_varlen (causality probe "
            f"{probe.causal:.3g}): the packing guard refuses it",
            path=path,
            **kw,
        )
    grads_off = ref.grads is not None and not ref.grads <= GRAD_TOLERANCE
    if grads_off or not ref.logits <= TOLERANCE["float32"]:
        grads = "" if ref.grads is None else f", gradients {ref.grads:.2g}"
        return result(
            "refused",
            detail=f"differs from its own {ref.attn} attention (logits {ref.logits:.2g}{grads}): "
            f"padfree_varlen does not keep its {pattern_features(cfg)}",
            path=path,
            **kw,
        )
    return result("exact", path=path, **kw)


def _runs(model: Any, dtype: Any) -> bool:
    """Whether ``model`` runs one unpacked sequence under autocast to ``dtype``."""
    import torch

    device = next(model.parameters()).device
    try:
        with torch.no_grad(), torch.autocast(device_type=device.type, dtype=dtype):
            model(input_ids=torch.arange(5, device=device)[None], use_cache=False)
    except Exception:
        return False
    return True


def pattern_features(cfg: Any) -> str:
    """What of an attention pattern a config declares beyond plain causal attention, in words (for the
    refusal line): window, chunk, softcap, sinks, ALiBi / position bias; ``attention pattern`` when none."""
    out = []
    window = getattr(cfg, "sliding_window", None)
    if isinstance(window, int) and window > 0:
        out.append(f"sliding window ({window})")
    chunk = getattr(cfg, "attention_chunk_size", None)
    if isinstance(chunk, int) and chunk > 0:
        out.append(f"chunked attention ({chunk})")
    for name in ("attn_logit_softcapping", "attention_logit_softcapping", "logit_softcapping"):
        if getattr(cfg, name, None):
            out.append(f"softcap ({name})")
            break
    if getattr(cfg, "alibi", False) or getattr(cfg, "model_type", "") in ("bloom", "mpt"):
        out.append("ALiBi bias")
    if getattr(cfg, "relative_attention_num_buckets", None):
        out.append("position bias")
    return ", ".join(out) or "attention pattern"


def sweep(
    families: list[str] | None = None,
    seed: int = 0,
    log: Any = None,
    device: str = "cpu",
    dtype: str = "float32",
) -> list[FamilyResult]:
    """:func:`check_family` for ``families`` (default: every causal family installed), transformers'
    warnings kept out of the way."""
    import transformers

    names = list(causal_families()) if families is None else families
    unknown = [f for f in names if f not in causal_families()]
    if unknown:
        from padfree.errors import ConfigError

        raise ConfigError(f"check-packing: {', '.join(unknown)}: not a causal-LM family of this transformers")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    out = []
    try:
        for f in names:
            quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
            with warnings.catch_warnings(), quiet[0], quiet[1]:
                warnings.simplefilter("ignore")
                r = check_family(f, seed, device, dtype)
            out.append(r)
            if log is not None:
                log(r)
    finally:
        transformers.logging.set_verbosity(verbosity)
    return out


def summary(results: list[FamilyResult]) -> dict[str, int]:
    return {s: sum(r.status == s for r in results) for s in STATUSES}


def as_json(results: list[FamilyResult]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]
