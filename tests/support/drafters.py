"""Tiny drafters of the trainers padfree plugs into (vllm ``speculators``, SpecForge), built around a padfree
tiny target for tests and benchmarks: random weights, CPU float32, the target's embedding, final norm and LM
head copied in where their trainers load them from the verifier.

The peers are imported through :func:`support.peers.import_peer`; callers skip when
:func:`~support.peers.peer_missing` says they are absent. Layer ids passed here are padfree's
(decoder layer outputs from 0); speculators' configs get theirs
(:func:`padfree.integrations.feed.their_layer_ids`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from padfree.integrations.feed import their_layer_ids
from support.peers import import_peer

DRAFT_SIZES: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
}
"""The drafters' sizes (the tiny target's hidden size, one draft layer)."""


def _speculators_config(kind: str, target: Any, tokens: int) -> Any:
    config = import_peer("speculators", "config")
    greedy = import_peer("speculators", "proposals.greedy")
    return config.SpeculatorsConfig(
        algorithm=kind,
        proposal_methods=[greedy.GreedyTokenProposalConfig(speculative_tokens=tokens)],
        default_proposal_method="greedy",
        verifier=config.VerifierConfig.from_config(target.config, name_or_path=None),
    )


def _share(model: Any, target: Any) -> Any:
    """Copy the verifier's embedding, final norm and LM head into a speculators model (their trainer loads
    them from the verifier checkpoint)."""
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        model.verifier_lm_head.weight.copy_(target.get_output_embeddings().weight)
        model.verifier_norm.weight.copy_(target.model.norm.weight)
        if getattr(model, "lm_head", None) is not None:
            model.lm_head.weight.copy_(target.get_output_embeddings().weight)
    return model


def _speculators_model(
    kind: str, target: Any, layer_config: Any, speculative: int, seed: int, **extra
) -> Any:
    """speculators' draft model ``kind`` (SDPA attention) with ``layer_config``'s class for its layers."""
    package = import_peer("speculators", f"models.{kind}")
    core = import_peer("speculators", f"models.{kind}.core")
    vocab = int(target.config.vocab_size)
    tl = layer_config(**DRAFT_SIZES, vocab_size=vocab)
    tl._attn_implementation = "sdpa"
    name = {
        "dflash": "DFlash",
        "dflash2": "DFlash2",
        "eagle3": "Eagle3",
        "peagle": "PEagle",
        "dspark": "DSpark",
    }[kind]
    config, model = f"{name}SpeculatorConfig", f"{name}DraftModel"
    cfg = getattr(package, config)(
        transformer_layer_config=tl,
        speculators_config=_speculators_config(kind, target, speculative),
        draft_vocab_size=vocab,
        **extra,
    )
    torch.manual_seed(seed)
    return _share(getattr(core, model)(cfg), target)


def speculators_dflash(
    target: Any, layers: tuple[int, ...], *, block_size: int, mask_token_id: int, seed: int = 0
) -> Any:
    """speculators' ``DFlashDraftModel`` (SDPA attention) fusing padfree ``layers`` of ``target``."""
    from transformers import Qwen3Config

    return _speculators_model(
        "dflash", target, Qwen3Config, block_size - 1, seed, block_size=block_size,
        aux_hidden_state_layer_ids=their_layer_ids(layers), mask_token_id=mask_token_id,
    )  # fmt: skip


def speculators_dspark(
    target: Any,
    layers: tuple[int, ...],
    *,
    block_size: int,
    mask_token_id: int,
    markov_rank: int,
    num_layers: int = 1,
    seed: int = 0,
) -> Any:
    """speculators' ``DSparkDraftModel`` (SDPA attention, sampling from the anchor, a vanilla Markov head and
    a confidence head reading it) fusing padfree ``layers`` of ``target``."""
    from transformers import Qwen3Config

    def layer_config(**sizes: Any) -> Any:
        return Qwen3Config(**{**sizes, "num_hidden_layers": num_layers})

    return _speculators_model(
        "dspark", target, layer_config, block_size, seed, block_size=block_size,
        aux_hidden_state_layer_ids=their_layer_ids(layers), mask_token_id=mask_token_id,
        markov_rank=markov_rank,
    )  # fmt: skip


def speculators_dflash2(
    target: Any,
    layers: tuple[int, ...],
    *,
    block_size: int,
    mask_token_id: int,
    rank: int = 32,
    seed: int = 0,
) -> Any:
    """speculators' ``DFlash2DraftModel`` (SDPA attention, the convolution's groups of 16 channels, a selector
    of ``rank``) fusing padfree ``layers`` of ``target``."""
    from transformers import Qwen3Config

    return _speculators_model(
        "dflash2", target, Qwen3Config, block_size - 1, seed, block_size=block_size,
        aux_hidden_state_layer_ids=their_layer_ids(layers), mask_token_id=mask_token_id,
        sliding_window_non_causal=True, conv_kernel_size=2, conv_group_size=16, selector_rank=rank,
        selector_top_k=16,
    )  # fmt: skip


def speculators_eagle3(target: Any, layers: tuple[int, ...], *, ttt: int, seed: int = 0) -> Any:
    """speculators' ``Eagle3DraftModel`` (SDPA attention; norm before ``fc`` and post-norm state fed back, as
    their CLI defaults for EAGLE-3) fusing padfree ``layers`` of ``target``."""
    from transformers import LlamaConfig

    return _speculators_model(
        "eagle3", target, LlamaConfig, ttt, seed, norm_before_residual=False, norm_before_fc=True,
        norm_output=True, eagle_aux_hidden_state_layer_ids=their_layer_ids(layers),
    )  # fmt: skip


def speculators_mtp(target: Any, *, steps: int, seed: int = 0) -> Any:
    """speculators' ``MTPDraftModel`` (SDPA attention, a Qwen3 layer of :data:`DRAFT_SIZES`) reading the last
    layer of ``target``, with the target's embedding and LM head (their ``load_verifier_weights``)."""
    from transformers import Qwen3Config

    pkg = import_peer("speculators", "models.mtp")
    tl = Qwen3Config(
        **{**DRAFT_SIZES, "num_hidden_layers": int(target.config.num_hidden_layers)},
        vocab_size=int(target.config.vocab_size),
    )
    tl._attn_implementation = "sdpa"
    cfg = pkg.MTPSpeculatorConfig(
        transformer_layer_config=tl, speculators_config=_speculators_config("mtp", target, steps)
    )
    torch.manual_seed(seed)
    model = pkg.MTPDraftModel(cfg)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        model.lm_head.weight.copy_(target.get_output_embeddings().weight)
    return model


def speculators_peagle(
    target: Any, layers: tuple[int, ...], *, depths: int, mask_token_id: int, seed: int = 0
) -> Any:
    """speculators' ``PEagleDraftModel`` (SDPA attention; one Llama layer, no norm before ``fc``, the residual
    un-normed: what padfree's P-EAGLE export writes) fusing padfree ``layers`` of ``target``."""
    from transformers import LlamaConfig

    return _speculators_model(
        "peagle", target, LlamaConfig, depths, seed, norm_before_residual=False, norm_before_fc=False,
        norm_output=False, eagle_aux_hidden_state_layer_ids=their_layer_ids(layers),
        mask_token_id=mask_token_id,
    )  # fmt: skip


def specforge_dflash(
    target: Any,
    layers: tuple[int, ...],
    *,
    block_size: int,
    mask_token_id: int,
    num_anchors: int = 512,
    gamma: float | None = 7.0,
    seed: int = 0,
) -> Any:
    """SpecForge's ``OnlineDFlashModel`` (SDPA masks) around its ``DFlashDraftModel`` fusing padfree
    ``layers`` (SpecForge numbers target layers as padfree does), with the target's embedding and LM head."""
    from transformers import Qwen3Config

    draft = import_peer("specforge", "modeling.draft.dflash")
    family = import_peer("specforge", "algorithms.common.dflash_family_model")
    vocab = int(target.config.vocab_size)
    cfg = Qwen3Config(**DRAFT_SIZES, vocab_size=vocab)
    cfg._attn_implementation = "sdpa"
    cfg.block_size = block_size
    cfg.num_target_layers = int(target.config.num_hidden_layers)
    cfg.dflash_config = {"target_layer_ids": list(layers), "mask_token_id": mask_token_id}
    torch.manual_seed(seed)
    model = family.OnlineDFlashModel(
        draft_model=draft.DFlashDraftModel(cfg),
        target_lm_head=target.get_output_embeddings(),
        target_embed_tokens=target.get_input_embeddings(),
        mask_token_id=mask_token_id,
        block_size=block_size,
        attention_backend="sdpa",
        num_anchors=num_anchors,
        loss_decay_gamma=gamma,
    )
    return model


def fold_tokens(samples: list[dict], vocab: int) -> list[dict]:
    """``samples`` with token ids folded into ``2 .. vocab - 2`` (``vocab - 1`` stays free for DFlash's mask
    token), so a tiny target's LM head stays small."""
    return [{**s, "input_ids": (np.asarray(s["input_ids"]) % (vocab - 3)) + 2} for s in samples]


def bundled_chats(fixtures: str | Path, n: int, vocab: int, max_tokens: int = 200) -> list[dict]:
    """The first ``n`` chats of the bundled sample sets (``fixtures/samples``, the bundled 32K SentencePiece
    tokenizer, loss on assistant turns, cut to ``max_tokens``) with token ids folded for a ``vocab``-token
    tiny target (:func:`fold_tokens`)."""
    from padfree.data.samples import load_samples

    fixtures = Path(fixtures)
    raw = load_samples([str(fixtures / "samples/*.jsonl.gz")], str(fixtures / "tokenizers/llama_sp32k.model"),
                       n, "assistant", max_tokens)  # fmt: skip
    return fold_tokens(raw, vocab)


class TargetTransfer:
    """speculators' hidden-state transfer interface (``get_cached(file_idx)``), served by running a padfree
    target on the sample alone, as their vLLM capture does: ``hidden_states`` ``[L, len(layers) + 1, H]`` (the
    fused layers, then the last layer before the final norm) and ``token_ids``."""

    def __init__(self, target: Any, samples: list[dict], layers: tuple[int, ...]) -> None:
        self.target, self.samples, self.layers = target, samples, tuple(layers)
        self._done: dict[int, dict] = {}  # a file cache's worth: each sample's states computed once

    def setup(self) -> None:
        """Nothing to connect to."""

    def delete(self, handle: Any) -> None:
        """Nothing to free."""

    def get_cached(self, file_idx: int) -> dict:
        from padfree.drafter.contract import build_contract
        from padfree.drafter.target import run_target

        if file_idx in self._done:
            return {k: v.clone() for k, v in self._done[file_idx].items()}
        s = self.samples[file_idx]
        c = build_contract([(s["input_ids"], s["loss_mask"])])
        out = run_target(self.target, c, self.layers)
        n, h = c.width, int(out.prenorm.shape[-1])  # type: ignore[union-attr]
        states = torch.cat([out.hidden.reshape(n, len(self.layers), h), out.prenorm.reshape(n, 1, h)], dim=1)  # type: ignore[union-attr]
        ids = torch.as_tensor(np.asarray(s["input_ids"]), dtype=torch.long)
        self._done[file_idx] = {"hidden_states": states, "token_ids": ids}
        return {"hidden_states": states.clone(), "token_ids": ids.clone()}


def speculators_dataset(folder: Any, samples: list[dict], *, max_len: int, transfer: TargetTransfer) -> Any:
    """speculators' own ``ArrowDataset`` over ``samples`` written to ``folder`` in their on-disk layout
    (``input_ids``, ``loss_mask``, ``seq_len``, torch format; written once: an existing folder is read),
    reading hidden states from ``transfer``."""
    from pathlib import Path

    from datasets import Dataset

    if not Path(folder).exists():
        data = Dataset.from_dict(
            {
                "input_ids": [np.asarray(s["input_ids"], np.int64) for s in samples],
                "loss_mask": [np.asarray(s["loss_mask"], np.int64) for s in samples],
                "seq_len": [len(s["input_ids"]) for s in samples],
            }
        )
        data.set_format("torch")
        data.save_to_disk(str(folder))
    arrow = import_peer("speculators", "train.data")
    return arrow.ArrowDataset(
        max_len=max_len, datapath=str(folder), transfer=transfer, hidden_states_dtype=torch.float32
    )


def specforge_features(folder: Any, samples: list[dict], target: Any, layers: tuple[int, ...]) -> list[str]:
    """Write ``samples`` as SpecForge offline DFlash feature files (``input_ids``, ``loss_mask``,
    ``hidden_states`` ``[1, L, len(layers) * H]`` from ``target`` run on each sample alone), one
    ``data_{i}.ckpt`` each, named so their sorted listing keeps the samples' order. Returns the paths."""
    from pathlib import Path

    from padfree.drafter.contract import build_contract
    from padfree.drafter.target import run_target

    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, s in enumerate(samples):
        ids = torch.as_tensor(np.asarray(s["input_ids"]), dtype=torch.long)
        mask = torch.as_tensor(np.asarray(s["loss_mask"]), dtype=torch.long)
        out = run_target(target, build_contract([(ids.numpy(), mask.numpy())]), layers)
        path = root / f"data_{i:06d}.ckpt"
        torch.save({"input_ids": ids, "loss_mask": mask, "hidden_states": out.hidden}, path)
        paths.append(str(path))
    return paths
