"""A reference MTP drafter (multi-token prediction, FastMTP / DeepSeek-V3 style, as vllm speculators'
``MTPDraftModel`` trains it) with random weights: written here, nothing imported from them.

One MTP layer is unrolled over ``K`` steps. Step 0 takes the target's last layer (before its final norm) at
position ``t``; step ``k`` takes step ``k - 1``'s output at ``t``. Each step normalises the token
embedding of ``x[t + k + 1]`` and the hidden state, projects their concatenation (``input_proj``: ``2H ->
H``), runs one Qwen3 decoder layer (causal attention over its document, rotary position ``pos[t]`` at every
step, ``q_norm``/``k_norm``) and a final norm; its LM head (the target's, frozen) predicts ``x[t + k + 2]``
with cross-entropy on the data token, step ``k`` weighing ``beta^k / sum_j beta^j``.

The per-document contract on packed rows: a step's fed token ``t + k + 1`` and label ``t + k + 2`` are
taken inside ``t``'s document only (``k + 2 < doc_remaining[t]``: the label shift stops at the document's
end), attention is causal inside the document, and each step's loss is the document's own mean. On one
packed row speculators' class shifts over the whole row (``input_ids[:, k + 2 :]``) and drops the row's
last ``K + 1`` positions as queries (``valid_len``); :func:`padfree.integrations.feed.mtp_inputs` gives
their class each document followed by ``K + 1`` loss-free positions, so a document trains there as it
does here, packed or alone.

>>> import torch
>>> cfg = MTPConfig(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, ttt=2)
>>> net = MTPDrafter(cfg, torch.randn(50, 32), torch.randn(50, 32))
>>> sorted(n for n, p in net.named_parameters() if p.requires_grad)[:3]
['final_layernorm.weight', 'hidden_layernorm.weight', 'input_layernorm.weight']
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from padfree.drafter._blocks import MLP, DrafterConfig, QKNormAttention, RMSNorm, attend, rope
from padfree.drafter.collate import DrafterBatch, FieldOptions, no_field_padding
from padfree.drafter.contract import Contract
from padfree.drafter.export import layer_config, needs_verifier, speculators_config, speculators_head, take
from padfree.drafter.masks import count_cross_pairs, eagle3_block_mask, eagle3_dense_mask, eagle3_predicate
from padfree.drafter.methods.base import BuildArgs
from padfree.drafter.methods.eagle3 import model as eagle3
from padfree.drafter.recipes import Recipe
from padfree.drafter.sizes import Sizes
from padfree.errors import ConfigError

Fields = eagle3.Fields
"""MTP's draft queries have EAGLE-3's layout: ``(K, T)``, step ``k`` at ``t`` fed ``x[t + k + 1]``,
predicting ``x[t + k + 2]``."""


def step_weights(steps: int, beta: float) -> torch.Tensor:
    """``beta^k / sum_j beta^j`` for ``k < steps`` (speculators' ``compute_step_weights``).

    >>> [round(w, 4) for w in step_weights(3, 0.6).tolist()]
    [0.5102, 0.3061, 0.1837]
    """
    raw = beta ** torch.arange(steps, dtype=torch.float64)
    return (raw / raw.sum()).to(torch.float32)


def fields(contract: Contract, options: FieldOptions, *, epoch: int, leaky: bool = False) -> Fields:
    """The micro-batch's MTP queries: step ``k`` at ``t`` supervised where ``x[t + k + 2]`` lies in ``t``'s
    document and carries loss (``leaky``: the shift runs across the row, as speculators' packed row does;
    for ``check-drafter --leaky``), weighted by the recipe's normalised step weights."""
    r = options.recipe
    f = eagle3.eagle3_fields(contract, r.ttt, pad_token_id=options.pad_token_id, leaky=leaky, gate=2)
    w = step_weights(r.ttt, r.step_decay)[:, None].expand_as(f.weight)
    return dataclasses.replace(f, weight=w)


def crossings(batch: DrafterBatch) -> tuple[int, torch.Tensor, torch.Tensor]:
    """For ``check-drafter``: ``(attended (query, key) pairs joining two documents over all steps, fed tokens
    from another document, which (step, position) losses an input reaches)``: a token fed at step ``k``
    reaches the losses of steps ``>= k`` at that position (each step feeds the next its output)."""
    f, c = batch.fields, batch.contract
    assert c is not None
    doc = c.flat("document_ids")[0]
    pairs = f.ttt * count_cross_pairs(eagle3_predicate(doc), doc, doc)
    return (pairs, *eagle3.fed_crossings(f, doc))


@dataclass(frozen=True)
class MTPConfig(DrafterConfig):
    """Sizes of an MTP drafter: the shared ones and its steps (``ttt``, speculators'
    ``num_speculative_steps``)."""

    ttt: int = 3


class MTPDrafter(eagle3.StepDrafter, QKNormAttention):
    """The MTP layer: ``hidden_layernorm``/``token_layernorm``, ``input_proj``, a Qwen3 decoder layer and
    ``final_layernorm``; the embedding and LM head are the target's, frozen (speculators loads both from the
    verifier and trains neither)."""

    def __init__(
        self, cfg: MTPConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor, vocab: None = None
    ) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.vocab = vocab
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight.detach().clone(), freeze=True)
        self.lm_head = nn.Linear(h, head_weight.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(head_weight.detach().clone(), requires_grad=False)
        self.hidden_layernorm = RMSNorm(h, cfg.eps)
        self.token_layernorm = RMSNorm(h, cfg.eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, cfg.eps)
        self.add_attention(cfg)
        self.post_attention_layernorm = RMSNorm(h, cfg.eps)
        self.mlp = MLP(h, cfg.intermediate_size)
        self.final_layernorm = RMSNorm(h, cfg.eps)

    def step(
        self, hidden: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor, segments: list, mask
    ) -> torch.Tensor:
        """One MTP step: ``hidden`` ``(T, H)`` and the fed ``tokens`` ``(T,)`` -> the step's output. Attention
        causal inside each of ``segments`` (``(slice, None)`` a document, ``(slice, document ids)`` a padded
        row; ``mask`` None), or under ``mask`` (dense boolean or BlockMask)."""
        c, d = self.cfg, self.cfg.head_dim
        e = self.token_layernorm(self.embed_tokens(tokens))
        x = self.input_proj(torch.cat([e, self.hidden_layernorm(hidden)], -1))
        y = self.input_layernorm(x)
        q = rope(self.q_norm(self.q_proj(y).view(-1, c.num_heads, d)).transpose(0, 1), pos, c.rope_theta)
        k = rope(self.k_norm(self.k_proj(y).view(-1, c.num_kv_heads, d)).transpose(0, 1), pos, c.rope_theta)
        v = self.v_proj(y).view(-1, c.num_kv_heads, d).transpose(0, 1)
        if mask is None:
            parts = [self._causal(q[:, s], k[:, s], v[:, s], doc) for s, doc in segments]
            a = torch.cat(parts) if parts else q.new_zeros(0, c.num_heads * d)
        else:
            a = attend(q, k, v, mask)
        x = x + self.o_proj(a)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.final_layernorm(x)

    def _causal(self, q, k, v, doc: torch.Tensor | None) -> torch.Tensor:
        """Causal attention over one segment: a document (``doc`` None) or a padded row (its padding sees
        itself only, as under the one mask)."""
        if doc is not None:
            return attend(q, k, v, eagle3_dense_mask(doc, 0))
        gqa = self.cfg.num_heads != self.cfg.num_kv_heads
        out = nn.functional.scaled_dot_product_attention(
            q[None], k[None], v[None], is_causal=True, enable_gqa=gqa
        )
        return out[0].transpose(0, 1).reshape(q.shape[1], -1)

    def forward(self, target_hidden: torch.Tensor, batch: DrafterBatch, attention: str = "dense") -> list:
        """Every step's output ``(T, H)``. ``target_hidden``: the target's last layer ``(1, T, H)``.
        ``attention``: ``"dense"`` (causal SDPA document by document, padded rows as rows; CPU), ``"mask"``
        (one dense causal same-document mask) or ``"flex"`` (a flex-attention BlockMask, GPU)."""
        f = batch.fields
        assert isinstance(f, Fields) and batch.contract is not None, "an MTP batch"
        dev = target_hidden.device
        doc, pos = eagle3.row_ids(batch, dev)
        mask = None
        if attention == "mask":
            mask = eagle3_dense_mask(doc, 0)
        elif attention == "flex":
            mask = eagle3_block_mask(doc, 0)
        segments = [(s, doc[s] if bool((doc[s] < 0).any()) else None) for s in batch.contract.segments()]
        h = target_hidden[0]
        outs = []
        for k in range(f.ttt):
            h = self.step(h, f.step_input_ids[k].to(dev), pos, segments, mask)
            outs.append(h)
        return outs


field_padding = no_field_padding  # padded rows add nothing: every position drafts


Config = MTPConfig
Drafter = MTPDrafter


def build(recipe: Recipe, sizes: Sizes, args: BuildArgs) -> MTPDrafter:
    """An MTP drafter of the target's ``sizes`` reading its last layer (``args.n_fused`` 1), one layer
    unrolled ``recipe.ttt`` steps; the target's embedding and head (speculators' MTP has no draft
    vocabulary)."""
    if args.vocab is not None or args.n_fused != 1:
        raise ConfigError(
            "MTP reads the target's last layer and drafts over its full vocabulary (speculators' class "
            "refuses a reduced one): use --draft-vocab none and --fused-layers 1"
        )
    return MTPDrafter(MTPConfig(**sizes.drafter_config(), ttt=recipe.ttt), args.weights[0], args.weights[1])


SPECULATORS_VERSION = eagle3.SPECULATORS_VERSION
"""The speculators release whose MTP format :func:`export_files` writes (and the tests load)."""

LAYER_PARTS = (
    "hidden_layernorm",
    "token_layernorm",
    "input_proj",
    "final_layernorm",
    "input_layernorm",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def export_files(state: dict, meta: dict) -> tuple[dict, dict]:
    """The ``speculators-mtp`` export format: vllm speculators' MTP config (a Qwen3 layer config of the
    drafter's sizes with the target's layer count, which their class reads as the verifier's last layer) and
    their parameter names (``mtp_layers.0.*``); the embedding and LM head are the verifier's at load time and
    are not written (their ``_keys_to_ignore_on_save``)."""
    import transformers

    d, tgt = meta["drafter"], meta["target"]
    t = tgt["config"]
    layer = transformers.Qwen3Config(
        vocab_size=int(t["vocab_size"]),
        num_hidden_layers=int(t["num_hidden_layers"]),
        **layer_config(d, t),
    )
    config = {
        **speculators_head("MTPDraftModel", "mtp", SPECULATORS_VERSION, layer),
        "num_nextn_predict_layers": 1,
        "speculators_config": speculators_config("mtp", int(d["ttt"]), meta),
    }
    tensors = {f"mtp_layers.0.{p}.weight": take(state, f"{p}.weight") for p in LAYER_PARTS}
    for p in ATTENTION_PARTS:
        tensors[f"mtp_layers.0.self_attn.{p}.weight"] = take(state, f"{p}.weight")
    return config, tensors


def check_export(meta: dict, *, verifier_option: str | None = "--verifier") -> None:
    """Refuse in one line what speculators' MTP format cannot hold: no verifier folder (their class loads the
    embedding and LM head from it), a draft vocabulary."""
    if meta.get("d2t") is not None:
        raise ConfigError("speculators' MTP format has no draft vocabulary: train with --draft-vocab none")
    needs_verifier(meta, "speculators' MTP format", "embedding and LM head", verifier_option)
