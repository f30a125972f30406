"""A reference P-EAGLE drafter (parallel EAGLE, as vllm speculators' ``PEagleDraftModel`` trains it) with
random weights: written here, nothing imported from them.

P-EAGLE drafts ``K`` positions in parallel, in one pass. Every position ``t`` is a depth-0 element: EAGLE-3's
step 0 (the fused target state at ``t``, token ``t + 1``, rotary position ``pos[t]``). A *chain* anchored at
``t`` adds depth-``d`` elements (``1 <= d < K``) fed the mask token and a learnt ``mask_hidden`` in place of
the target's three layers, at rotary position ``pos[t] + d``. Element ``(t, d)`` predicts ``x[t + d + 2]``
against the target's prediction at ``t + d + 1`` (``KL(target || drafter)``), supervised where
``loss_mask[t + d + 1]``. Its attention sees the depth-0 elements at anchors ``<= t`` of its own document and
its own chain's elements of depth ``<= d``. Which chains exist is COD sampling (conditional-on-distribution):
depth ``d`` keeps ``int((n - d) * max(r^d, r_min))`` of the chains of depth ``d - 1`` whose next label carries
loss (``n``: the document's supervised depth-0 positions). One mean over every supervised element.

The per-document contract on packed rows: a chain's labels stop at its document's end (``d + 2 <
doc_remaining[t]``), its attention stays in the document, and its chains are drawn from the document's own
generator (:func:`padfree.core.document_rng.document_rng`: seed, epoch, sample id, piece start), so a document
draws the same chains packed or alone. A document's first position carries no depth-0 loss: on speculators'
packed row a chain of the previous document would run into it (their sampler extends chains along the row's
loss mask), so :func:`padfree.integrations.feed.peagle_inputs` keeps it loss-free there and padfree does the
same here, packed or alone.

>>> import torch
>>> cfg = PEagleConfig(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, ttt=3)
>>> net = PEagleDrafter(cfg, torch.randn(50, 32), torch.randn(50, 32))
>>> tuple(net.mask_hidden.shape), net.embed_tokens.weight.requires_grad
((1, 1, 96), True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from padfree.core.document_rng import document_rng
from padfree.drafter._blocks import attend, rope
from padfree.drafter.collate import DrafterBatch, FieldOptions, no_field_padding
from padfree.drafter.contract import Contract
from padfree.drafter.masks import count_cross_pairs, eagle3_block_mask, eagle3_dense_mask, eagle3_predicate
from padfree.drafter.methods.base import BuildArgs
from padfree.drafter.methods.eagle3 import model as eagle3
from padfree.drafter.recipes import Recipe
from padfree.drafter.sizes import Sizes


@dataclass(frozen=True)
class Fields(eagle3.Fields):
    """P-EAGLE elements in EAGLE-3's ``(K, T)`` layout (depth ``d`` at anchor ``t``); ``present``: the chains
    COD sampling keeps (depth 0: every position). An absent element is computed and ignored: no loss, and no
    present element attends to it (a chain of depth ``d`` holds every depth below ``d``)."""

    present: torch.Tensor


def draw_chains(
    extend: np.ndarray,
    spans: list[tuple[int, int, int, int]],
    *,
    ratio: float,
    ratio_min: float,
    seed: int,
    epoch: int,
) -> np.ndarray:
    """``(K, W)`` the chains kept, document by document (speculators' ``generate_cod_sample_indices`` on each
    document alone). ``extend[d, p]``: a chain anchored at ``p`` may reach depth ``d`` (its label there
    carries loss; row 0: the document's supervised depth-0 positions, its seeds); ``spans``: each document's
    ``(start, stop, sample id, piece start)``. Depth ``d`` keeps ``int((n - d) * max(ratio^d, ratio_min))``
    (``n``: the document's seeds) of the chains of depth ``d - 1`` that extend to ``d``, chosen by the
    document's own generator; all of them when fewer."""
    k_max, width = extend.shape
    present = np.zeros((k_max, width), dtype=bool)
    present[0] = True
    for start, stop, sample_id, piece in spans:
        n = int(extend[0, start:stop].sum())
        rng = document_rng(seed, epoch, max(0, sample_id), piece)
        alive = np.ones(stop - start, dtype=bool)
        for d in range(1, k_max):
            size = int(max(0, n - d) * max(ratio**d, ratio_min))
            if size <= 0:
                break
            cand = np.flatnonzero(alive & extend[d, start:stop])
            order = rng.random(cand.shape[0]).argsort(kind="stable")
            kept = np.zeros_like(alive)
            kept[cand[order[:size]] if cand.shape[0] >= size else cand] = True
            present[d, start:stop] = kept
            alive = kept
    return present


def row_chains(
    loss_mask: np.ndarray,
    starts: np.ndarray,
    lens: list[int],
    sample_ids: list[int],
    recipe,
    *,
    seed: int,
    epoch: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``(gated loss mask, chains)`` of one of speculators' P-EAGLE rows (documents shifted as their
    ``shift_batch`` does, back to back at ``starts``): no loss on each document's first position (where the
    previous document's chains would end) nor on its last (its label lies past the document), and each
    document's chains (:func:`draw_chains`, the same draws as padfree's own fields give it) as ``(2, N)``
    row anchors and depths, depth ``>= 1`` only."""
    mask = np.asarray(loss_mask, dtype=bool).copy()
    width, k_max = mask.shape[0], int(recipe.ttt)
    doc = np.full(width, -1, dtype=np.int64)
    for d, (s, n) in enumerate(zip(starts, lens, strict=True)):
        if n > 0:
            mask[s] = mask[s + n - 1] = False
            doc[s : s + n] = d
    extend = np.zeros((k_max, width), dtype=bool)
    for d in range(k_max):
        inside = np.zeros(width, dtype=bool)
        inside[: width - d] = doc[d:] == doc[: width - d]
        extend[d, : width - d] = inside[: width - d] & mask[d:] & (doc[: width - d] >= 0)
    spans = [(int(s), int(s) + int(n), int(i), 0) for s, n, i in zip(starts, lens, sample_ids, strict=True)]
    present = draw_chains(
        extend, spans, ratio=recipe.cod_ratio, ratio_min=recipe.cod_ratio_min, seed=seed, epoch=epoch
    )
    depth, anchor = np.nonzero(present[1:])
    order = np.lexsort((anchor, depth))
    return mask, np.stack([anchor[order], depth[order] + 1]).astype(np.int64)


def fields(contract: Contract, options: FieldOptions, *, epoch: int, leaky: bool = False) -> Fields:
    """The micro-batch's P-EAGLE elements: EAGLE-3's layout and gate (``leaky``: labels and chains run across
    the row, as speculators' packed row without padfree's gate does; for ``check-drafter --leaky``), depth
    ``>= 1`` fed the mask token, chains sampled per document, one mean per document."""
    r = options.recipe
    base = eagle3.eagle3_fields(
        contract, r.ttt, pad_token_id=options.pad_token_id, leaky=leaky, gate=r.loss_gate
    )
    doc = contract.flat("document_ids")[0]
    first = torch.ones_like(doc, dtype=torch.bool)
    first[1:] = doc[1:] != doc[:-1]
    gated = base.supervised.clone()
    gated[0] &= ~first  # where the previous document's chains would end on speculators' packed row
    spans = [
        (s.start, s.stop, contract.sample_ids[d], contract.starts[d])
        for d, s in enumerate(map(contract.doc_slice, range(contract.n_docs)))
    ]
    present = torch.from_numpy(
        draw_chains(
            gated.numpy(), spans, ratio=r.cod_ratio, ratio_min=r.cod_ratio_min, seed=options.seed, epoch=epoch
        )
    )
    depth = torch.arange(r.ttt)[:, None]
    return Fields(
        ttt=r.ttt,
        step_input_ids=torch.where(depth == 0, base.step_input_ids, options.mask_token_id),
        input_index=torch.where(depth == 0, base.input_index, -1),
        label_index=base.label_index,
        target_index=base.target_index,
        labelled=base.labelled & present,
        supervised=gated & present,
        query_doc=base.query_doc,
        slot=base.slot,
        weight=torch.ones_like(base.weight),
        group=torch.zeros_like(base.group),
        present=present,
    )


def crossings(batch: DrafterBatch) -> tuple[int, torch.Tensor, torch.Tensor]:
    """For ``check-drafter``: ``(attended (query, key) pairs joining two documents over all depths, depth-0
    tokens fed from another document, which elements an input reaches)``: a token fed at depth 0 reaches the
    losses of its own element and (through attention) of every later anchor's in its document."""
    f, c = batch.fields, batch.contract
    assert c is not None
    doc = c.flat("document_ids")[0]
    pairs = count_cross_pairs(eagle3_predicate(doc), doc, doc.repeat(f.ttt))
    cross_in = f.input_index >= 0
    cross_in = cross_in & (doc[f.input_index.clamp(min=0)] != doc[None, :])
    reaches = f.supervised.clone()
    reaches[0] = f.supervised.any(0)
    return pairs, cross_in, reaches


@dataclass(frozen=True)
class PEagleConfig(eagle3.Eagle3Config):
    """Sizes of a P-EAGLE drafter: EAGLE-3's (``ttt``: the parallel depths ``K``, speculators'
    ``num_depths``)."""


class PEagleDrafter(eagle3.Eagle3Drafter):
    """EAGLE-3's layer (``fc``, one decoder layer over ``[embedding ; hidden]``, a norm, the LM head) plus a
    learnt ``mask_hidden`` (the three target layers' stand-in at depth ``>= 1``); the embedding trains
    (speculators' P-EAGLE default, ``embed_requires_grad``)."""

    def __init__(self, cfg: PEagleConfig, *args: Any, **kwargs: Any) -> None:
        """EAGLE-3's drafter of ``cfg`` (the other arguments as :class:`~padfree.drafter.methods.eagle3.model.
        Eagle3Drafter`'s), its embedding trainable, plus ``mask_hidden``."""
        super().__init__(cfg, *args, **kwargs)
        self.embed_tokens.weight.requires_grad_(True)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, 3 * cfg.hidden_size))

    def forward(self, target_hidden: torch.Tensor, batch: DrafterBatch, attention: str = "dense") -> list:
        """Normed hidden states ``(T, H)`` of every depth, all from one pass. ``attention``: ``"dense"``
        (segment by segment, EAGLE-3's scores: depth 0's causal block and one score per lower depth of the
        element's own chain; CPU), ``"mask"`` (SDPA, dense boolean mask) or ``"flex"`` (a BlockMask, GPU)."""
        f = batch.fields
        assert isinstance(f, Fields) and batch.contract is not None, "a P-EAGLE batch"
        c, hd = self.cfg, self.cfg.head_dim
        dev = target_hidden.device
        doc, pos = eagle3.row_ids(batch, dev)
        width = doc.shape[0]
        fused = torch.cat(
            [target_hidden[0], self.mask_hidden[0].to(target_hidden.dtype).expand(width, -1)]
        )  # depth 0's target states, then the stand-in every deeper element shares
        if self.fc_norm is not None:
            fused = self.fc_norm(fused)
        proj = self.fc(fused)
        base = [proj[:width]] + [proj[width:]] * (f.ttt - 1)
        keys, values, queries = [], [], []
        for k in range(f.ttt):
            emb = self.input_layernorm(self.embed_tokens(f.step_input_ids[k].to(dev)))
            x = torch.cat([emb, self.hidden_norm(base[k])], -1)
            queries.append(
                rope(self.q_proj(x).view(-1, c.num_heads, hd).transpose(0, 1), pos + k, c.rope_theta)
            )
            keys.append(
                rope(self.k_proj(x).view(-1, c.num_kv_heads, hd).transpose(0, 1), pos + k, c.rope_theta)
            )
            values.append(self.v_proj(x).view(-1, c.num_kv_heads, hd).transpose(0, 1))
        segs = [(s, eagle3_dense_mask(doc[s], 0)) for s in batch.contract.segments()]
        outs = []
        for k in range(f.ttt):
            q = queries[k]
            if attention == "dense":
                a = torch.cat(
                    [
                        eagle3.ttt_attention(
                            q[:, s], [x[:, s] for x in keys[: k + 1]], [x[:, s] for x in values[: k + 1]], m
                        )
                        for s, m in segs
                    ]
                )
            else:
                mask = eagle3_block_mask(doc, k) if attention == "flex" else eagle3_dense_mask(doc, k)
                a = attend(q, torch.cat(keys[: k + 1], 1), torch.cat(values[: k + 1], 1), mask)
            h = base[k] + self.o_proj(a)
            h = h + self.mlp(self.post_attention_layernorm(h))
            outs.append(self.norm(h))
        return outs


field_padding = no_field_padding  # padded rows add nothing: every position drafts


Config = PEagleConfig
Drafter = PEagleDrafter


def build(recipe: Recipe, sizes: Sizes, args: BuildArgs) -> PEagleDrafter:
    """A P-EAGLE drafter of the target's ``sizes`` under ``recipe``: one decoder layer over three fused target
    layers (the method's own), ``recipe.ttt`` parallel depths, the target's embedding (trained) and head."""
    config = PEagleConfig(**sizes.drafter_config(), ttt=recipe.ttt, norm_before_fc=recipe.norm_before_fc)
    return PEagleDrafter.of(config, recipe, args)


SPECULATORS_VERSION = eagle3.SPECULATORS_VERSION
"""The speculators release whose P-EAGLE format :func:`export_files` writes (and the tests load)."""


def export_files(state: dict, meta: dict) -> tuple[dict, dict]:
    """The ``speculators-peagle`` export format: speculators' EAGLE-3 config and names
    (:func:`padfree.drafter.methods.eagle3.model.export_files`) as their ``PEagleSpeculatorConfig``
    (``peagle``, its depths as speculative tokens, the mask token, a trained embedding)
    plus ``mask_hidden``."""
    config, tensors = eagle3.export_files(state, meta)
    config = {
        **config,
        "architectures": ["PEagleSpeculator"],
        "speculators_model_type": "peagle",
        "mask_token_id": int(meta["mask_token_id"]),
        "embed_requires_grad": True,
        "norm_output": False,
    }
    config["speculators_config"] = {**config["speculators_config"], "algorithm": "peagle"}
    tensors["mask_hidden"] = eagle3.take(state, "mask_hidden")
    return config, tensors


def check_export(meta: dict, *, verifier_option: str | None = "--verifier") -> None:
    """Refuse in one line what speculators' P-EAGLE format cannot hold (as EAGLE-3's: no verifier folder)."""
    eagle3.check_export(meta, verifier_option=verifier_option)
