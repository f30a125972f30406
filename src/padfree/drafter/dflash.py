"""A reference DFlash drafter (block diffusion) with random weights, following the published architecture
(z-lab ``dflash``; vllm ``speculators``' ``DFlashDraftModel``): written here, nothing imported from them.

A block opened at anchor ``a`` is ``B`` query tokens: the anchor's token, then mask tokens, at positions
``pos[a] .. pos[a] + B - 1``. Every draft layer attends from the block's tokens to keys and values made of
(1) the fused target hidden states (``fc`` over the concatenated target layers, then a norm) of the context
and (2) the block's own tokens, under :func:`padfree.drafter.masks.dflash_dense_mask` (same document, strictly
before the anchor, own block only). Embeddings and the LM head are the target's, frozen. The loss is the
distillation ``KL(target || drafter)`` at every supervised block slot, summed per document.

>>> import torch
>>> cfg = DFlashConfig(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, block_size=4)
>>> net = DFlashDrafter(cfg, torch.randn(50, 32), torch.randn(50, 32))
>>> sum(p.numel() for p in net.parameters() if p.requires_grad) > 0
True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from padfree.drafter._blocks import MLP, DrafterSizes, RMSNorm, attend, kl_per_document, rope
from padfree.drafter.collate import DrafterBatch
from padfree.drafter.masks import dflash_block_mask, dflash_dense_mask
from padfree.drafter.target import TargetOutput


@dataclass(frozen=True)
class DFlashConfig(DrafterSizes):
    """Sizes of a DFlash drafter: the shared ones, its layers, block size and target layers fused."""

    num_layers: int = 1
    block_size: int = 16
    n_target_layers: int = 2


class DFlashLayer(nn.Module):
    """One draft layer: block queries over [fused context ; block] keys, then a SwiGLU MLP."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.eps)
        self.k_norm = RMSNorm(d, cfg.eps)
        self.input_layernorm = RMSNorm(h, cfg.eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.eps)
        self.mlp = MLP(h, cfg.intermediate_size)

    def forward(self, x, ctx, q_pos, ctx_pos, masks) -> torch.Tensor:
        """``masks``: one mask over all keys ``[context ; blocks]``, or ``(context slice, query slice,
        dense mask)`` per segment (attention runs segment by segment, as padfree's varlen attention does)."""
        c, d = self.cfg, self.cfg.head_dim
        y = self.input_layernorm(x)
        q = rope(self.q_norm(self.q_proj(y).view(-1, c.num_heads, d)).transpose(0, 1), q_pos, c.rope_theta)

        def kv(z, p):
            k = self.k_norm(self.k_proj(z).view(-1, c.num_kv_heads, d)).transpose(0, 1)
            return rope(k, p, c.rope_theta), self.v_proj(z).view(-1, c.num_kv_heads, d).transpose(0, 1)

        k_ctx, v_ctx = kv(ctx, ctx_pos)
        k_blk, v_blk = kv(y, q_pos)
        if isinstance(masks, list):
            parts = [
                attend(
                    q[:, qs],
                    torch.cat([k_ctx[:, cs], k_blk[:, qs]], 1),
                    torch.cat([v_ctx[:, cs], v_blk[:, qs]], 1),
                    m,
                )
                for cs, qs, m in masks
            ]
            a = torch.cat(parts, 0) if parts else q.new_zeros(0, c.num_heads * d)
        else:
            a = attend(q, torch.cat([k_ctx, k_blk], 1), torch.cat([v_ctx, v_blk], 1), masks)
        x = x + self.o_proj(a)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The drafter; the embedding and LM head weights are copied from the target and frozen."""

    def __init__(self, cfg: DFlashConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight.detach().clone(), freeze=True)
        self.lm_head = nn.Linear(cfg.hidden_size, head_weight.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(head_weight.detach().clone(), requires_grad=False)
        self.fc = nn.Linear(cfg.n_target_layers * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.eps)

    def forward(
        self, target_hidden: torch.Tensor, batch: DrafterBatch, attention: str = "dense"
    ) -> torch.Tensor:
        """Hidden states ``(n * B, H)`` of every block query. ``attention``: ``"dense"`` (boolean masks
        through SDPA, segment by segment: each document of a packed row, each padded row; CPU training),
        ``"mask"`` (one dense mask over the whole flat row) or ``"flex"`` (a flex-attention BlockMask,
        GPU)."""
        f = batch.dflash
        assert f is not None, "a DFlash batch (DrafterCollator('dflash'))"
        doc = batch.contract.flat("document_ids")[0].to(target_hidden.device)
        pos = batch.contract.flat("position_ids")[0].to(target_hidden.device)
        anchors = f.anchors.to(doc.device)
        b = f.block_size
        masks: object
        segmented: list[tuple[slice, slice, torch.Tensor]] = []
        if attention == "flex":
            masks = dflash_block_mask(doc, anchors, b)
        elif attention == "mask":
            masks = dflash_dense_mask(doc, anchors, b)
        else:
            masks = segmented
            segs = batch.contract.segments()
            starts = torch.tensor([s.start for s in segs] + [doc.shape[0]], device=doc.device)
            cuts = torch.searchsorted(anchors, starts).tolist()
            for seg, i0, i1 in zip(segs, cuts[:-1], cuts[1:], strict=True):
                if i1 > i0:
                    m = dflash_dense_mask(doc[seg], anchors[i0:i1] - seg.start, b)
                    segmented.append((seg, slice(i0 * b, i1 * b), m))
        ctx = self.hidden_norm(self.fc(target_hidden[0]))
        x = self.embed_tokens(f.block_input_ids.to(doc.device))
        q_pos = f.block_position_ids.to(doc.device)
        for layer in self.layers:
            x = layer(x, ctx, q_pos, pos, masks)
        return self.norm(x)

    def loss(
        self, target: TargetOutput, target_head: nn.Module, batch: DrafterBatch, attention: str = "dense"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-document ``(numerator, denominator)`` of the distillation loss over supervised block slots."""
        f = batch.dflash
        assert f is not None
        h = self(target.hidden, batch, attention)
        sup = f.supervised.to(h.device)
        logits = self.lm_head(h[sup])
        with torch.no_grad():
            tgt = target_head(target.last[0, f.target_index.to(h.device)[sup]])
        return kl_per_document(logits, tgt, f.query_doc.to(h.device)[sup], batch.contract.n_docs)
