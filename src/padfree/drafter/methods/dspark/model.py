"""A reference DSpark drafter (DeepSpec's DSpark, as vllm speculators' ``DSparkDraftModel`` trains it) with
random weights: written here, nothing imported from them.

DSpark is DFlash's block drafter (:mod:`padfree.drafter.methods.dflash.model`: a block of ``B`` queries opened
at anchor
``a``, the anchor's token then mask tokens, attending to the fused target context before ``a`` in its
document and to its own block) that *samples from the anchor*: slot ``k`` (``0 <= k < B``) predicts the token
after position ``a + k`` and is scored against the target's distribution at ``a + k`` under
``loss_mask[a + k]``, weighing ``exp(-k / gamma)``. Two heads sit on the draft layers' output ``h``:

* a Markov head: a low-rank logit bias ``W2 W1[x[a + k]]`` from the previous token of the block (``W1``:
  an embedding of rank ``r``, ``W2``: ``r -> vocabulary``), added to the LM head's logits;
* a confidence head: ``Linear([h ; W1[x[a + k]]]) -> 1``, trained by binary cross-entropy toward the
  acceptance rate ``1 - TV(target, drafter)`` (no gradient through the rate).

The loss is the recipe's ``ce_tv`` objective (:mod:`padfree.drafter.objective`).

The per-document contract on packed rows: anchors are chosen in each document from its own loss mask
(the recipe's margin keeps ``a + B`` inside the document, as speculators keeps the row's last block free),
every slot's label position ``a + k``, its target distribution, its loss mask and the Markov head's previous
token lie in the anchor's document, and documents under ``min_loss_tokens`` loss tokens train nothing
(DeepSpec drops such micro-batches). A row-wide choice (``leaky``) labels slots from the next document.

>>> import torch
>>> cfg = DSparkConfig(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, block_size=4,
...                    markov_rank=8)
>>> net = DSparkDrafter(cfg, torch.randn(50, 32), torch.randn(50, 32))
>>> sorted(n for n, p in net.named_parameters() if n.startswith(("lm_head", "markov")))
['lm_head.confidence_proj.bias', 'lm_head.confidence_proj.weight', 'lm_head.markov_w2.weight', \
'lm_head.weight', 'markov_w1.weight']
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from padfree.drafter.collate import DrafterBatch, FieldOptions
from padfree.drafter.contract import Contract
from padfree.drafter.export import layer_config, needs_verifier, speculators_config, speculators_head, take
from padfree.drafter.methods.base import BuildArgs
from padfree.drafter.methods.dflash import model as dflash
from padfree.drafter.recipes import Recipe
from padfree.drafter.sizes import Sizes
from padfree.drafter.target import TargetOutput
from padfree.errors import ConfigError

Fields = dflash.Fields
"""DSpark's draft queries have DFlash's block layout; slot ``k`` of anchor ``a`` labels ``a + k + 1`` with
the target's distribution at ``a + k``."""


def slot_weights(slot: torch.Tensor, gamma: float) -> torch.Tensor:
    """``exp(-k / gamma)``: slot 0 predicts too (speculators' ``dflash_loss_decay`` with
    ``sample_from_anchor``).

    >>> [round(w, 4) for w in slot_weights(torch.arange(3), 4.0).tolist()]
    [1.0, 0.7788, 0.6065]
    """
    return torch.exp(-slot.to(torch.float32) / gamma)


def fields(contract: Contract, options: FieldOptions, *, epoch: int, leaky: bool = False) -> Fields:
    """The micro-batch's blocks: DFlash's anchors (per document; ``leaky``: the row-level choice), each slot
    sampled from the anchor under the recipe (:func:`from_anchor`)."""
    make = dflash.leaky_dflash_fields if leaky else dflash.dflash_fields
    f = make(contract, options.policy, seed=options.seed, epoch=epoch, mask_token_id=options.mask_token_id)
    return from_anchor(f, contract, options.recipe, per_document=not leaky)


def from_anchor(f: Fields, contract: Contract, recipe: Recipe, *, per_document: bool = True) -> Fields:
    """DFlash blocks ``f`` relabelled as DSpark samples them: slot ``k`` of anchor ``a`` labels ``a + k + 1``
    (inside the anchor's document; ``per_document=False``: anywhere in the anchor's row), its target's
    prediction at ``a + k``, supervised where ``loss_mask[a + k]`` and its document has ``min_loss_tokens``
    loss tokens, weighing ``exp(-k / gamma)``."""
    lmask = contract.flat("loss_mask")[0]
    rem = contract.flat("doc_remaining")[0]
    width = int(lmask.shape[0])
    a = f.anchors.repeat_interleave(f.block_size)
    k = f.slot
    nxt = a + k + 1
    inside = nxt < width
    at = (a + k).clamp(max=max(width - 1, 0))
    if per_document:
        labelled = k + 1 < rem[a]
    else:
        row = int(contract.input_ids.shape[1])
        labelled = inside & (nxt // row == a // row)
    doc = contract.flat("document_ids")[0]
    real = doc >= 0
    loss_tokens = torch.zeros(contract.n_docs).index_add(0, doc[real], lmask[real].float())
    kept = (loss_tokens >= recipe.min_loss_tokens)[f.query_doc.clamp(min=0)]
    return dataclasses.replace(
        f,
        label_index=torch.where(inside, nxt, -1),
        target_index=at,
        labelled=labelled,
        supervised=labelled & lmask[at] & kept,
        weight=slot_weights(k, recipe.gamma),
    )


def crossings(batch: DrafterBatch) -> tuple[int, torch.Tensor, torch.Tensor]:
    """For ``check-drafter``: DFlash's attended pairs that join two documents, the Markov head's previous
    token ``x[a + k]`` taken from another document, and the losses such an input reaches (its own slot's)."""
    f, c = batch.fields, batch.contract
    assert c is not None
    pairs, _, _ = dflash.crossings(batch)
    doc = c.flat("document_ids")[0]
    cross_in = doc[f.target_index] != f.query_doc
    return pairs, cross_in, f.supervised


@dataclass(frozen=True)
class DSparkConfig(dflash.DFlashConfig):
    """Sizes of a DSpark drafter: DFlash's and the Markov head's rank."""

    markov_rank: int = 256


class DSparkHead(nn.Module):
    """The target's LM head (frozen) plus the Markov bias ``W2 e`` and the confidence head, read from a query
    state ``[h ; e]`` (``e = W1[previous token]``)."""

    def __init__(self, head_weight: torch.Tensor, hidden: int, rank: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.weight = nn.Parameter(head_weight.detach().clone(), requires_grad=False)
        self.markov_w2 = nn.Linear(rank, head_weight.shape[0], bias=False)
        self.confidence_proj = nn.Linear(hidden + rank, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits: the LM head on ``h`` plus the Markov bias of ``e``."""
        h, e = x[..., : self.hidden], x[..., self.hidden :]
        return nn.functional.linear(h, self.weight) + self.markov_w2(e)

    def confidence(self, x: torch.Tensor) -> torch.Tensor:
        """The acceptance-probability logit of each query state."""
        return self.confidence_proj(x).squeeze(-1)


class DSparkDrafter(dflash.DFlashDrafter):
    """DFlash's drafter with DSpark's heads: ``markov_w1`` (the previous token's rank-``r`` embedding) and
    :class:`DSparkHead` as ``lm_head``; the embedding and the LM head's weight are the target's, frozen."""

    def __init__(
        self, cfg: DSparkConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor, vocab: None = None
    ) -> None:
        super().__init__(cfg, embed_weight, head_weight)
        self.markov_w1 = nn.Embedding(embed_weight.shape[0], cfg.markov_rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        self.lm_head = DSparkHead(head_weight, cfg.hidden_size, cfg.markov_rank)  # type: ignore[assignment]

    def queries(
        self, target: TargetOutput, batch: DrafterBatch, attention: str = "dense"
    ) -> tuple[torch.Tensor, None]:
        """Every block query's state ``[h ; W1[x[a + k]]]`` in the fields' order (flat)."""
        h = self(target.hidden, batch, attention)
        assert batch.contract is not None
        prev = batch.contract.flat("input_ids")[0][batch.fields.target_index].to(h.device)
        return torch.cat([h, self.markov_w1(prev).to(h.dtype)], -1), None


Config = DSparkConfig
Drafter = DSparkDrafter
field_padding = dflash.pad_anchor_slots


def build(recipe: Recipe, sizes: Sizes, args: BuildArgs) -> DSparkDrafter:
    """A DSpark drafter of the target's ``sizes``: ``args.draft_layers`` layers over ``args.n_fused`` fused
    target layers, the recipe's block and Markov rank, non-causal in its block, the full vocabulary."""
    if args.vocab is not None:
        raise ConfigError("padfree's DSpark drafts over the target's full vocabulary: use --draft-vocab none")
    config = DSparkConfig(**dflash.block_config(recipe, sizes, args), markov_rank=recipe.markov_rank)
    return DSparkDrafter(config, args.weights[0], args.weights[1])


SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose DSpark format :func:`export_files` writes (and the tests load)."""

HEAD_TENSORS = {
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "lm_head.markov_w2.weight",
    "confidence_head.proj.weight": "lm_head.confidence_proj.weight",
    "confidence_head.proj.bias": "lm_head.confidence_proj.bias",
}
"""speculators' names of DSpark's head tensors -> padfree's."""


def export_files(state: dict, meta: dict) -> tuple[dict, dict]:
    """The ``speculators-dspark`` export format: speculators' ``DSparkSpeculatorConfig`` (a Qwen3 layer config
    of the drafter's sizes and layers, the block, the fused layers as their ``hidden_states`` indices, the
    mask token, sampling from the anchor, a vanilla Markov head, a confidence head reading it) and their
    parameter names (DFlash's, :func:`padfree.drafter.methods.dflash.model.export_files`, plus the heads');
    the embedding
    and LM head are the verifier's at load time and are not written."""
    import transformers

    _, tensors = dflash.export_files(state, meta)
    d, tgt = meta["drafter"], meta["target"]
    t = tgt["config"]
    n = int(d["num_layers"])
    layer = transformers.Qwen3Config(
        vocab_size=int(t["vocab_size"]),
        num_hidden_layers=n,
        **layer_config(d, t),
        layer_types=["full_attention"] * n,
    )
    block = int(meta["recipe"]["block_size"])
    config = {
        **speculators_head("DSparkSpeculator", "dspark", SPECULATORS_VERSION, layer),
        "draft_vocab_size": int(t["vocab_size"]),
        "block_size": block,
        "aux_hidden_state_layer_ids": [int(i) + 1 for i in meta["target_layers"]],
        "mask_token_id": int(meta["mask_token_id"]),
        "sliding_window_non_causal": False,
        "sample_from_anchor": True,
        "markov_rank": int(d["markov_rank"]),
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "speculators_config": speculators_config("dspark", block, meta),
    }
    tensors.update({theirs: take(state, ours) for theirs, ours in HEAD_TENSORS.items()})
    return config, tensors


def check_export(meta: dict, *, verifier_option: str | None = "--verifier") -> None:
    """Refuse in one line what speculators' DSpark format cannot hold: a draft vocabulary, a drafter causal
    inside its block or with a context window (their full attention is neither), no verifier folder (their
    class loads the embedding and LM head from it)."""
    d = meta["drafter"]
    if meta.get("d2t") is not None:
        raise ConfigError("speculators' DSpark format: train with --draft-vocab none (the full vocabulary)")
    if d.get("causal_in_block") or dflash.binding_window(meta) is not None:
        raise ConfigError(
            "speculators' DSpark format attends over the whole block and context: train with "
            "--causal-in-block no --sliding-window none"
        )
    needs_verifier(meta, "speculators' DSpark format", "embedding and LM head", verifier_option)
