"""A reference DFlash drafter (block diffusion) with random weights, following the published architecture
(z-lab ``dflash``; vllm ``speculators``' ``DFlashDraftModel``): written here, nothing imported from them.

A block opened at anchor ``a`` is ``B`` query tokens: the anchor's token, then mask tokens, at positions
``pos[a] .. pos[a] + B - 1``. Every draft layer attends from the block's tokens to keys and values made of
(1) the fused target hidden states (``fc`` over the concatenated target layers, then a norm) of the context
and (2) the block's own tokens, under :class:`padfree.drafter.masks.DFlashMask` (same document, strictly
before the anchor, own block only). Embeddings and the LM head are the target's, frozen. The loss is the
distillation ``KL(target || drafter)`` at every supervised block slot, summed per document.

>>> import torch
>>> cfg = DFlashConfig(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, block_size=4)
>>> net = DFlashDrafter(cfg, torch.randn(50, 32), torch.randn(50, 32))
>>> sum(p.numel() for p in net.parameters() if p.requires_grad) > 0
True
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from padfree.core.anchors import AnchorPolicy, anchor_quota, choose_anchors
from padfree.drafter._blocks import MLP, DrafterConfig, QKNormAttention, RMSNorm, attend, rope
from padfree.drafter.collate import DrafterBatch, FieldOptions, QueryFields, scale_of
from padfree.drafter.contract import Contract
from padfree.drafter.export import layer_config, max_positions, take
from padfree.drafter.masks import DFlashMask, count_cross_pairs, dflash_context_mask
from padfree.drafter.methods.base import BuildArgs
from padfree.drafter.objective import VocabMap, slot_weights_of
from padfree.drafter.recipes import Recipe
from padfree.drafter.sizes import Sizes
from padfree.drafter.target import TargetOutput
from padfree.errors import ConfigError


@dataclass(frozen=True)
class Fields(QueryFields):
    """DFlash draft queries of a micro-batch: ``n`` blocks of ``B`` queries (every :class:`QueryFields` entry
    is ``(n * B,)``: slot ``k`` of anchor ``a`` predicts ``a + k``, its target's prediction is at ``a + k -
    1``).

    Attributes:
        block_size: ``B``.
        anchors: ``(n,)`` anchor positions, grouped by document, sorted.
        anchors_by_doc: each document's anchors relative to its start (what must not depend on packing).
        block_input_ids: ``(n * B,)`` the anchor's token at slot 0, ``mask_token_id`` elsewhere.
        block_position_ids: ``(n * B,)`` ``position_ids[a] + k`` (position inside the document).
    """

    block_size: int
    anchors: torch.Tensor
    anchors_by_doc: tuple[tuple[int, ...], ...]
    block_input_ids: torch.Tensor
    block_position_ids: torch.Tensor


def fields(contract: Contract, options: FieldOptions, *, epoch: int, leaky: bool = False) -> Fields:
    """The micro-batch's blocks: anchors chosen per document (``leaky``: the field's row-level choice), slot
    weights as the recipe says."""
    make = leaky_dflash_fields if leaky else dflash_fields
    f = make(contract, options.policy, seed=options.seed, epoch=epoch, mask_token_id=options.mask_token_id)
    r = options.recipe
    return dataclasses.replace(f, weight=slot_weights_of(f.slot, r.slot_weights, gamma=r.gamma))


def dflash_fields(
    contract: Contract, policy: AnchorPolicy, *, seed: int, epoch: int, mask_token_id: int
) -> Fields:
    """DFlash fields with anchors chosen per document (the correct way)."""
    mask = contract.flat("loss_mask")[0].numpy()
    per_doc = []
    for d in range(contract.n_docs):
        s = contract.doc_slice(d)
        sid = contract.sample_ids[d]
        if sid < 0:
            raise ConfigError(
                f"document {d} has no sample id: DFlash anchors are keyed by it (pass sample_ids, items "
                "from a padfree PlannedDataset, or a 'sample_id' key per item)"
            )
        a = choose_anchors(mask[s], policy, seed=seed, epoch=epoch, sample_id=sid, start=contract.starts[d])
        per_doc.append(a)
    flat = np.concatenate([a + contract.doc_starts[d] for d, a in enumerate(per_doc)] or [np.zeros(0)])
    return _block_fields(contract, flat.astype(np.int64), policy.block_size, mask_token_id, per_doc, True)


def leaky_dflash_fields(
    contract: Contract, policy: AnchorPolicy, *, seed: int, epoch: int, mask_token_id: int
) -> Fields:
    """What a row-level packer does (speculators' ``select_anchors``): valid anchors over the whole row
    (the policy's eligibility, ``mask[a]`` for speculators' own rule; only the row's last block excluded),
    one quota for the row, and block labels running into the next document. Deliberately WRONG; for
    ``check-drafter --leaky``, tests and the benchmarks' ``speculators_rows`` arm."""
    mask = contract.flat("loss_mask")[0].numpy().astype(bool)
    n = mask.shape[0]
    ok = mask.copy()
    if policy.eligibility == "pair":
        ok[:-1] &= mask[1:]
        ok[-1:] = False
    ok[max(0, n - policy.block_size) :] = False
    valid = np.flatnonzero(ok)
    q = int(anchor_quota(np.array([valid.shape[0]]), policy)[0])
    rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, epoch, *contract.sample_ids])))
    flat = np.sort(valid[np.argsort(rng.random(valid.shape[0]), kind="stable")[:q]])
    doc = contract.flat("document_ids")[0].numpy()
    per_doc = [flat[doc[flat] == d] - contract.doc_starts[d] for d in range(contract.n_docs)]
    return _block_fields(contract, flat, policy.block_size, mask_token_id, per_doc, False)


def _block_fields(contract, flat, block, mask_token_id, per_doc, per_document) -> Fields:
    ids = contract.flat("input_ids")[0]
    doc = contract.flat("document_ids")[0]
    pos = contract.flat("position_ids")[0]
    rem = contract.flat("doc_remaining")[0]
    lmask = contract.flat("loss_mask")[0]
    width = ids.shape[0]
    anchors = torch.from_numpy(np.asarray(flat, np.int64))
    a = anchors.repeat_interleave(block)
    k = torch.arange(block).repeat(anchors.shape[0])
    label = a + k
    inside_row = label < width
    safe = label.clamp(max=max(width - 1, 0))
    if per_document:
        labelled = (k >= 1) & (k < rem[a])
    else:  # row-wide: any token of the row, whichever document it belongs to
        row = contract.input_ids.shape[1]
        labelled = (k >= 1) & inside_row & (label // row == a // row)
    block_ids = torch.full_like(a, mask_token_id)
    block_ids[k == 0] = ids[anchors]
    return Fields(
        block_size=block,
        anchors=anchors,
        anchors_by_doc=tuple(tuple(int(x) for x in d) for d in per_doc),
        query_doc=doc[a],
        block_input_ids=block_ids,
        block_position_ids=pos[a] + k,
        label_index=torch.where(inside_row, label, -1),
        target_index=(label - 1).clamp(min=0, max=max(width - 1, 0)),
        labelled=labelled,
        supervised=labelled & lmask[safe],
        slot=k,
        weight=(k > 0).to(torch.float32),
        group=torch.zeros_like(k),
    )


def crossings(batch: DrafterBatch) -> tuple[int, torch.Tensor, torch.Tensor]:
    """For ``check-drafter``: ``(attended (query, key) pairs joining two documents, inputs fed from another
    document per query, which queries' losses an input reaches)``. A block feeds its anchor's token and mask
    tokens only, so no input crosses; a query's input reaches only its own loss."""
    f, c = batch.fields, batch.contract
    assert c is not None
    doc = c.flat("document_ids")[0]
    r = batch.recipe
    window, causal = (r.sliding_window, r.causal_in_block) if r is not None else (None, False)
    visible = DFlashMask(doc, f.anchors, f.block_size, window, causal).visible
    kv_doc = torch.cat([doc, f.query_doc])
    pairs = count_cross_pairs(visible, f.query_doc, kv_doc, keys=doc.shape[0], own_block=f.block_size)
    return pairs, torch.zeros_like(f.supervised), f.supervised


def pad_anchor_slots(batch: DrafterBatch, mask_token_id: int = 1, width: int | None = None) -> DrafterBatch:
    """A batch with every row's blocks padded to ``width`` (default: the row with the most), as SpecForge's
    ``[B, N_max]`` anchor tensor with ``block_keep_mask`` does for padded rows, and speculators' fixed
    ``max_anchors`` anchor tensor (``anchor_valid``) for its one packed row: the extra blocks sit at their
    row's first position, are computed by the drafter and never supervised (what the planner's cost model
    counts for padded rows: ``rows x most``). A padded batch's rows are its documents; a packed batch is one
    row, padded only when ``width`` is given. A new batch; rows already at the width are returned as they
    are."""
    f, c = batch.fields, batch.contract
    if c is None or (c.layout != "padded" and width is None):
        return batch
    if c.layout == "padded":
        per_row = [len(a) for a in f.anchors_by_doc]
    else:
        per_row = [int(f.anchors.shape[0])] + [0] * (c.n_docs - 1)  # the row's blocks, all at document 0
    most = max(max(per_row, default=0), width or 0)
    if most == 0 or all(n == most for n in per_row[: 1 if c.layout != "padded" else None]):
        return batch
    bs = f.block_size
    parts: dict[str, list] = {
        k: [] for k in ("a", "doc", "ids", "pos", "label", "target", "lab", "sup", "slot", "w", "g")
    }
    q = 0
    for d, n in enumerate(per_row):
        extra = most - n if (c.layout == "padded" or d == 0) else 0
        start = int(c.doc_starts[d])
        if extra:
            k = torch.arange(bs).repeat(extra)
            parts["a"].append(torch.full((extra,), start, dtype=torch.int64))
            parts["doc"].append(torch.full((extra * bs,), d, dtype=f.query_doc.dtype))
            ids = torch.full((extra * bs,), mask_token_id, dtype=f.block_input_ids.dtype)
            ids[k == 0] = c.flat("input_ids")[0][start]
            parts["ids"].append(ids)
            parts["pos"].append(k.to(f.block_position_ids.dtype))
            parts["label"].append(torch.full((extra * bs,), -1, dtype=torch.int64))
            parts["target"].append(torch.full((extra * bs,), start, dtype=torch.int64))
            parts["lab"].append(torch.zeros(extra * bs, dtype=torch.bool))
            parts["sup"].append(torch.zeros(extra * bs, dtype=torch.bool))
            parts["slot"].append(k)
            parts["w"].append(torch.zeros(extra * bs))
            parts["g"].append(torch.zeros(extra * bs, dtype=torch.int64))
        sl = slice(q * bs, (q + n) * bs)
        parts["a"].append(f.anchors[q : q + n])
        parts["doc"].append(f.query_doc[sl])
        parts["ids"].append(f.block_input_ids[sl])
        parts["pos"].append(f.block_position_ids[sl])
        parts["label"].append(f.label_index[sl])
        parts["target"].append(f.target_index[sl])
        parts["lab"].append(f.labelled[sl])
        parts["sup"].append(f.supervised[sl])
        parts["slot"].append(f.slot[sl])
        parts["w"].append(f.weight[sl])
        parts["g"].append(f.group[sl])
        q += n
    cat = {k: torch.cat(v) for k, v in parts.items()}
    g = dataclasses.replace(
        f,
        anchors=cat["a"],
        query_doc=cat["doc"],
        block_input_ids=cat["ids"],
        block_position_ids=cat["pos"],
        label_index=cat["label"],
        target_index=cat["target"],
        labelled=cat["lab"],
        supervised=cat["sup"],
        slot=cat["slot"],
        weight=cat["w"],
        group=cat["g"],
    )
    assert batch.recipe is not None
    return dataclasses.replace(batch, fields=g, scale=scale_of(g, c, batch.recipe)[0])


@dataclass(frozen=True)
class DFlashConfig(DrafterConfig):
    """Sizes of a DFlash drafter: the shared ones, its layers, block size and target layers fused; its
    attention over the context (``sliding_window`` positions before the anchor, None: all) and inside a block
    (``causal_in_block``: a slot sees its block's earlier slots only)."""

    num_layers: int = 1
    block_size: int = 16
    n_target_layers: int = 2
    sliding_window: int | None = None
    causal_in_block: bool = False


class DFlashLayer(QKNormAttention):
    """One draft layer: block queries over [fused context ; block] keys, then a SwiGLU MLP."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.add_attention(cfg)
        self.input_layernorm = RMSNorm(h, cfg.eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.eps)
        self.mlp = MLP(h, cfg.intermediate_size)

    def forward(self, x, ctx, q_pos, ctx_pos, masks) -> torch.Tensor:
        """``masks``: one mask over all keys ``[context ; blocks]`` (a dense boolean or a flex BlockMask), or
        ``(context slice, query slice, context visibility per anchor)`` per segment: attention then runs
        segment by segment over the segment's context and each query's own block only
        (:func:`block_attend`)."""
        x = x + self.attention(self.input_layernorm(x), ctx, q_pos, ctx_pos, masks)
        return x + self.mlp(self.post_attention_layernorm(x))

    def attention(self, y, ctx, q_pos, ctx_pos, masks) -> torch.Tensor:
        """The attention sublayer on normed block queries ``y``: its output after ``o_proj``."""
        c, d = self.cfg, self.cfg.head_dim
        q = rope(self.q_norm(self.q_proj(y).view(-1, c.num_heads, d)).transpose(0, 1), q_pos, c.rope_theta)

        def kv(z, p):
            k = self.k_norm(self.k_proj(z).view(-1, c.num_kv_heads, d)).transpose(0, 1)
            return rope(k, p, c.rope_theta), self.v_proj(z).view(-1, c.num_kv_heads, d).transpose(0, 1)

        k_ctx, v_ctx = kv(ctx, ctx_pos)
        k_blk, v_blk = kv(y, q_pos)
        if isinstance(masks, list):
            parts = [
                block_attend(
                    q[:, qs],
                    k_ctx[:, cs],
                    v_ctx[:, cs],
                    k_blk[:, qs],
                    v_blk[:, qs],
                    vis,
                    c.block_size,
                    c.causal_in_block,
                )  # fmt: skip
                for cs, qs, vis in masks
            ]
            a = torch.cat(parts, 0) if parts else q.new_zeros(0, c.num_heads * d)
        else:
            a = attend(q, torch.cat([k_ctx, k_blk], 1), torch.cat([v_ctx, v_blk], 1), masks)
        return self.o_proj(a)


def block_attend(q, k_ctx, v_ctx, k_blk, v_blk, visible, block: int, causal: bool = False) -> torch.Tensor:
    """DFlash attention without the ``n * B`` block-key axis: each query scores its segment's context under
    ``visible`` (``(n, L)``, one row per block) and its own block's ``B`` keys (``causal``: earlier slots and
    itself), one softmax over the ``L + B`` scores. ``q`` ``(Hq, n * B, D)``, context keys/values
    ``(Hkv, L, D)``, block keys/values ``(Hkv, n * B, D)`` -> ``(n * B, Hq * D)``. Equal to SDPA under
    :class:`padfree.drafter.masks.DFlashMask`, with ``L x B`` instead of ``L x (L + n B)`` scores a
    query."""
    hq, nq, d = q.shape
    if nq == 0:
        return q.new_zeros(0, hq * d)
    rep = hq // k_ctx.shape[0]
    kc, vc = k_ctx.repeat_interleave(rep, 0), v_ctx.repeat_interleave(rep, 0)
    kb, vb = k_blk.repeat_interleave(rep, 0), v_blk.repeat_interleave(rep, 0)
    n, length, scale = nq // block, kc.shape[1], d**-0.5
    s_ctx = ((q @ kc.transpose(1, 2)) * scale).view(hq, n, block, length)
    s_ctx = s_ctx.masked_fill(~visible[None, :, None, :], float("-inf"))
    qb, kbb, vbb = q.view(hq, n, block, d), kb.view(hq, n, block, d), vb.view(hq, n, block, d)
    s_blk = (qb @ kbb.transpose(-1, -2)) * scale
    if causal:
        tril = torch.ones(block, block, dtype=torch.bool, device=q.device).tril()
        s_blk = s_blk.masked_fill(~tril, float("-inf"))
    p = torch.softmax(torch.cat([s_ctx, s_blk], -1), -1)
    out = (p[..., :length].reshape(hq, nq, length) @ vc) + (p[..., length:] @ vbb).reshape(hq, nq, d)
    return out.transpose(0, 1).reshape(nq, hq * d)


class DFlashDrafter(nn.Module):
    """The drafter; the embedding and LM head weights are copied from the target and frozen (the head
    restricted to a draft vocabulary when one is given: ``vocab``)."""

    layer_class: type[DFlashLayer] = DFlashLayer

    def __init__(
        self,
        cfg: DFlashConfig,
        embed_weight: torch.Tensor,
        head_weight: torch.Tensor,
        vocab: VocabMap | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight.detach().clone(), freeze=True)
        rows = head_weight if vocab is None else head_weight[vocab.d2t]
        self.lm_head = nn.Linear(cfg.hidden_size, rows.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(rows.detach().clone(), requires_grad=False)
        self.vocab = vocab
        self.fc = nn.Linear(cfg.n_target_layers * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.eps)
        self.layers = nn.ModuleList(self.layer_class(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.eps)

    def forward(
        self, target_hidden: torch.Tensor, batch: DrafterBatch, attention: str = "dense"
    ) -> torch.Tensor:
        """Hidden states ``(n * B, H)`` of every block query. ``attention``: ``"dense"`` (segment by segment:
        each document of a packed row, each padded row, :func:`block_attend`; CPU training), ``"mask"`` (one
        dense mask over the whole flat row, SDPA) or ``"flex"`` (a flex-attention BlockMask, GPU)."""
        x, ctx, q_pos, pos, masks = self.prepare(target_hidden, batch, attention)
        for layer in self.layers:
            x = layer(x, ctx, q_pos, pos, masks)
        return self.norm(x)

    def prepare(self, target_hidden: torch.Tensor, batch: DrafterBatch, attention: str = "dense") -> tuple:
        """What every draft layer reads: ``(block query embeddings, fused context, query positions, context
        positions, masks)`` (:meth:`forward` says what ``attention`` selects)."""
        f = batch.fields
        assert isinstance(f, Fields), "a DFlash batch (DrafterCollator('dflash'))"
        assert batch.contract is not None
        cfg = self.cfg
        doc = batch.contract.flat("document_ids")[0].to(target_hidden.device)
        pos = batch.contract.flat("position_ids")[0].to(target_hidden.device)
        anchors = f.anchors.to(doc.device)
        b = f.block_size
        window, causal = cfg.sliding_window, cfg.causal_in_block
        masks: object
        if attention == "flex":
            masks = DFlashMask(doc, anchors, b, window, causal).block_mask()
        elif attention == "mask":
            masks = DFlashMask(doc, anchors, b, window, causal).dense()
        else:
            segmented: list[tuple[slice, slice, torch.Tensor]] = []
            segs = batch.contract.segments()
            starts = torch.tensor([s.start for s in segs] + [doc.shape[0]], device=doc.device)
            cuts = torch.searchsorted(anchors, starts).tolist()
            for seg, i0, i1 in zip(segs, cuts[:-1], cuts[1:], strict=True):
                if i1 > i0:
                    vis = dflash_context_mask(doc[seg], anchors[i0:i1] - seg.start, window)
                    segmented.append((seg, slice(i0 * b, i1 * b), vis))
            masks = segmented
        ctx = self.hidden_norm(self.fc(target_hidden[0]))
        x = self.embed_tokens(f.block_input_ids.to(doc.device))
        return x, ctx, f.block_position_ids.to(doc.device), pos, masks

    def queries(
        self, target: TargetOutput, batch: DrafterBatch, attention: str = "dense"
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every draft query's hidden state in the fields' order (flat), and each query's block (D-PACE)."""
        f = batch.fields
        return self(target.hidden, batch, attention), torch.div(
            torch.arange(f.supervised.shape[0]), f.block_size, rounding_mode="floor"
        )


Config = DFlashConfig
Drafter = DFlashDrafter
field_padding = pad_anchor_slots


def build(recipe: Recipe, sizes: Sizes, args: BuildArgs) -> DFlashDrafter:
    """A DFlash drafter of the target's ``sizes`` (:class:`~padfree.drafter.sizes.Sizes`) under
    ``recipe``: ``args.draft_layers`` layers over ``args.n_fused`` fused target layers, the target's embedding
    and head weights, a draft vocabulary or the full one."""
    config = DFlashConfig(**block_config(recipe, sizes, args))
    return DFlashDrafter(config, args.weights[0], args.weights[1], vocab=args.vocab)


def block_config(recipe: Recipe, sizes: Sizes, args: BuildArgs) -> dict[str, Any]:
    """The fields of a :class:`DFlashConfig` (and of the block methods' configs that extend it) under
    ``recipe``: the drafter's sizes, layers, block, fused layers, context window and in-block causality."""
    return {
        **sizes.drafter_config(),
        "num_layers": args.draft_layers,
        "block_size": recipe.block_size,
        "n_target_layers": args.n_fused,
        "sliding_window": recipe.sliding_window,
        "causal_in_block": recipe.causal_in_block,
    }


def binding_window(meta: dict) -> int | None:
    """The DFlash drafter's context window where it can bind: None when it has none or it spans the target's
    whole context (no block ever sees fewer positions than without one)."""
    window = meta["drafter"].get("sliding_window")
    if window is None or int(window) >= max_positions(meta["target"]["config"]):
        return None
    return int(window)


def export_files(state: dict, meta: dict) -> tuple[dict, dict]:
    """The ``dflash`` export format: z-lab's DFlash config and parameter names (the embedding and LM head
    are the target's at serving time, so they are not written). A drafter trained causal inside its block
    is served so (``is_causal``: each slot sees its block's earlier slots and the whole context, as
    trained); a context window that cannot bind is left out (:func:`check_export` refuses one that can:
    z-lab's class slides its window per query)."""
    import transformers

    d, t = meta["drafter"], meta["target"]["config"]
    n = int(d["num_layers"])
    window = binding_window(meta)
    qwen = transformers.Qwen3Config(
        vocab_size=int(t["vocab_size"]),
        num_hidden_layers=n,
        **layer_config(d, t),
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
    tensors = {name: take(state, name) for name in ("fc.weight", "hidden_norm.weight", "norm.weight")}
    for i in range(n):
        for part in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            tensors[f"layers.{i}.self_attn.{part}.weight"] = take(state, f"layers.{i}.{part}.weight")
        for part in (
            "input_layernorm",
            "post_attention_layernorm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ):
            tensors[f"layers.{i}.{part}.weight"] = take(state, f"layers.{i}.{part}.weight")
    return config, tensors


def check_export(meta: dict, *, verifier_option: str | None = "--verifier") -> None:
    """Refuse in one line what z-lab's DFlash format cannot hold: a draft vocabulary, a context window that
    binds (``verifier_option``: the format names no verifier)."""
    if meta.get("d2t") is not None:
        raise ConfigError(
            "z-lab's DFlash format has no draft vocabulary (the target's LM head drafts): train with the "
            "full vocabulary (--draft-vocab none)"
        )
    window = binding_window(meta)
    if window is not None:
        recipe = (meta.get("recipe") or {}).get("name", "?")
        raise ConfigError(
            f"z-lab's DFlash format slides its window per query over [context; block], so a block's later "
            f"slots see fewer positions; this drafter (recipe {recipe}) was trained with every block seeing "
            f"the {window} positions before its anchor, which no z-lab config reproduces: served logits "
            "would differ; train with --sliding-window none to export it in this format"
        )
