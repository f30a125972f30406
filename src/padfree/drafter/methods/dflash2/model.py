"""A reference DFlash2 drafter (DFlash with a block-local dynamic convolution and a candidate selector, as
vllm speculators' ``DFlash2DraftModel`` and z-lab's ``dflash`` package define it) with random weights:
written here, nothing imported from them.

DFlash2 is DFlash (:mod:`padfree.drafter.methods.dflash.model`: blocks of ``B`` queries opened at anchors,
attention to the fused target context before the anchor and to the block) plus two things:

* **A grouped causal convolution** around each draft layer's attention and MLP (input side and output side,
  :class:`BlockConv`): query ``i`` mixes itself and the ``K - 1`` queries before it, channel group by channel
  group, with a kernel that depends on the query's own hidden state. It must never cross a block: block
  queries of every document sit back to back in one flat dimension, so a tap that reaches back past slot 0
  reads another anchor's block, which in a packed row may be another document's. Tap ``t`` applies only
  where the query's slot is ``>= t`` (speculators: ``arange(n * B) % B``; z-lab convolves one block at a
  time).
* **A candidate selector** (:meth:`DFlash2Drafter.selector_loss`): the unary logits' top ``k`` candidates are
  reranked by a bilinear score of the hidden state, the **teacher-forced previous token** (slot ``k``'s
  predecessor is the data token at ``a + k - 1``, inside the anchor's document for every supervised slot) and
  the candidate; its cross-entropy toward the target's argmax (injected as the last candidate when outside
  the top ``k``) is added to the unary loss times ``selector_loss_alpha``. The selector's codebooks span the
  target's vocabulary, so a pruned draft vocabulary is refused (speculators' class refuses it too).

The per-document contract on packed rows is DFlash's (anchors drawn per document, labels ``a + k`` inside the
anchor's document, context of the same document only) plus the convolution's reset at every block.
``check-drafter --leaky`` builds the row-level control: anchors over the row and a convolution that runs over
the flat query dimension (z-lab's inference convolution applied to flattened training blocks).

>>> import torch
>>> cfg = DFlash2Config(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, block_size=4,
...                     conv_group_size=8, selector_rank=4, selector_top_k=3)
>>> net = DFlash2Drafter(cfg, torch.randn(50, 32), torch.randn(50, 32))
>>> sorted(n for n, _ in net.named_parameters() if "conv" in n)[:2]
['layers.0.attention_conv.base_kernel', 'layers.0.attention_conv.kernel_projection.weight']
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


@dataclass(frozen=True)
class Fields(dflash.Fields):
    """DFlash2's draft queries: DFlash's blocks (:class:`padfree.drafter.methods.dflash.model.Fields`) and
    how its convolution reads them (``conv_across_blocks``: over the flat query dimension, the document-blind
    control; else reset at every block)."""

    conv_across_blocks: bool = False


def fields(contract: Contract, options: FieldOptions, *, epoch: int, leaky: bool = False) -> Fields:
    """The micro-batch's blocks as DFlash draws them (``leaky``: the row-level anchors, and the convolution
    across blocks)."""
    f = dflash.fields(contract, options, epoch=epoch, leaky=leaky)
    return Fields(**{x.name: getattr(f, x.name) for x in dataclasses.fields(f)}, conv_across_blocks=leaky)


def conv_index(f: Fields) -> torch.Tensor:
    """Each query's position for the convolution: tap ``t`` reads the query ``t`` before it where this is
    ``>= t`` (its slot; the flat index under the control)."""
    return torch.arange(f.slot.shape[0]) if f.conv_across_blocks else f.slot


def conv_crossings(f: Fields, kernel: int) -> torch.Tensor:
    """Which queries' convolution reads a query of another document (any tap ``1 .. kernel - 1``)."""
    n = f.slot.shape[0]
    idx, i = conv_index(f), torch.arange(n)
    out = torch.zeros(n, dtype=torch.bool)
    for t in range(1, kernel):
        src = (i - t).clamp(min=0)
        out |= (idx >= t) & (i >= t) & (f.query_doc[src] != f.query_doc)
    return out


def crossings(batch: DrafterBatch) -> tuple[int, torch.Tensor, torch.Tensor]:
    """For ``check-drafter``: DFlash's attended pairs (:func:`padfree.drafter.methods.dflash.model.
    crossings`), the queries whose convolution reads another document's query as the inputs that cross, and
    the losses such an input reaches: every supervised slot of its block (attention inside a block mixes its
    slots)."""
    pairs, _, sup = dflash.crossings(batch)
    f = batch.fields
    assert isinstance(f, Fields) and batch.recipe is not None
    cross = conv_crossings(f, batch.recipe.conv_kernel_size)
    b = f.block_size
    block_sup = sup.reshape(-1, b).any(1, keepdim=True).expand(-1, b).reshape(-1) if sup.numel() else sup
    return pairs, cross, block_sup


def block_conv(
    x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, index: torch.Tensor, group: int
) -> torch.Tensor:
    """``y[i] = sum_t (base[t] + delta[i, t, group]) * x[i - t]`` over taps ``t`` with ``index[i] >= t``:
    ``x`` ``(N, H)``, ``delta`` ``(N, K, H / group)`` (one coefficient per channel group), ``base`` ``(K,
    H)``, ``index`` ``(N,)``.

    >>> x = torch.arange(6.0).reshape(6, 1)
    >>> block_conv(x, torch.zeros(6, 2, 1), torch.ones(2, 1), torch.tensor([0, 1, 2, 0, 1, 2]), 1).flatten()
    tensor([0., 1., 3., 3., 7., 9.])
    """
    n, h = x.shape
    g = h // group
    xs = x.reshape(n, g, group)
    out = torch.zeros_like(xs)
    for t in range(base.shape[0]):
        shifted = xs if t == 0 else torch.cat([xs.new_zeros(min(t, n), g, group), xs[: max(n - t, 0)]])
        coef = base[t].to(x.dtype).reshape(1, g, group) + delta[:, t, :, None]
        out = out + shifted * coef * (index >= t).to(x.dtype).reshape(-1, 1, 1)
    return out.reshape(n, h)


class BlockConv(nn.Module):
    """A sublayer's pair of convolutions (input side, output side) with one projection giving both dynamic
    kernels from the sublayer's input; initialised as the identity (DFlash's layer)."""

    def __init__(self, hidden: int, kernel: int, group: int) -> None:
        super().__init__()
        self.kernel, self.group = kernel, group
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * (hidden // group), bias=False)
        with torch.no_grad():
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, y: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolved sublayer input and the output side's dynamic kernel."""
        k = self.kernel_projection(y).reshape(y.shape[0], 2, self.kernel, y.shape[1] // self.group)
        return block_conv(y, k[:, 0], self.base_kernel[0], index, self.group), k[:, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The sublayer output convolved with the kernel :meth:`prepare` gave."""
        return block_conv(y, delta, self.base_kernel[1], index, self.group)


@dataclass(frozen=True)
class DFlash2Config(dflash.DFlashConfig):
    """Sizes of a DFlash2 drafter: DFlash's, its convolution (taps, channels per dynamic kernel) and its
    candidate selector (rank, candidates)."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16


class DFlash2Layer(dflash.DFlashLayer):
    """A DFlash draft layer with a :class:`BlockConv` around its attention and one around its MLP."""

    def __init__(self, cfg: DFlash2Config) -> None:
        super().__init__(cfg)
        h = cfg.hidden_size
        self.attention_conv = BlockConv(h, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = BlockConv(h, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x, ctx, q_pos, ctx_pos, masks, index=None) -> torch.Tensor:
        """DFlash's layer (``masks`` as there), each sublayer between its convolutions over ``index``
        (:func:`conv_index`)."""
        assert index is not None, "a DFlash2 layer needs each query's convolution index"
        y, kernel = self.attention_conv.prepare(self.input_layernorm(x), index)
        x = x + self.attention_conv.finish(self.attention(y, ctx, q_pos, ctx_pos, masks), kernel, index)
        y, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(x), index)
        return x + self.mlp_conv.finish(self.mlp(y), kernel, index)


class DFlash2Drafter(dflash.DFlashDrafter):
    """The drafter: DFlash's with :class:`DFlash2Layer` layers and the candidate selector's parameters
    (``predecessor_codebook``, ``successor_codebook``: ``(vocab, rank)``; ``hidden_projection``)."""

    layer_class = DFlash2Layer

    def __init__(
        self, cfg: DFlash2Config, embed_weight: torch.Tensor, head_weight: torch.Tensor, vocab: None = None
    ) -> None:
        super().__init__(cfg, embed_weight, head_weight, vocab=None)
        v, r = int(head_weight.shape[0]), cfg.selector_rank
        self.predecessor_codebook = nn.Parameter(torch.randn(v, r) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(v, r) * 0.02)
        self.hidden_projection = nn.Linear(cfg.hidden_size, r, bias=False)
        nn.init.normal_(self.hidden_projection.weight, std=0.02)

    def forward(
        self, target_hidden: torch.Tensor, batch: DrafterBatch, attention: str = "dense"
    ) -> torch.Tensor:
        """Hidden states ``(n * B, H)`` of every block query (``attention`` as DFlash's)."""
        f = batch.fields
        assert isinstance(f, Fields), "a DFlash2 batch (DrafterCollator('dflash2'))"
        x, ctx, q_pos, pos, masks = self.prepare(target_hidden, batch, attention)
        index = conv_index(f).to(x.device)
        for layer in self.layers:
            x = layer(x, ctx, q_pos, pos, masks, index)
        return self.norm(x)

    def selector_loss(
        self, hidden: torch.Tensor, logits: torch.Tensor, predecessor: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        """The selector's cross-entropy per position over the unary ``logits``' top ``k`` candidates (the
        ``target`` id in the last place when outside them), each scored ``logit + <predecessor code *
        projected hidden, candidate code>``."""
        assert isinstance(self.cfg, DFlash2Config)
        k = self.cfg.selector_top_k
        cand = logits.topk(k, dim=-1).indices
        hit = cand.eq(target[:, None])
        inside = hit.any(-1)
        where = torch.where(inside, hit.long().argmax(-1), k - 1)
        cand = torch.cat([cand[:, :-1], torch.where(inside, cand[:, -1], target)[:, None]], 1)
        ctx = self.predecessor_codebook[predecessor] * self.hidden_projection(hidden)
        score = logits.gather(-1, cand) + (ctx[:, None, :] * self.successor_codebook[cand]).sum(-1)
        return torch.nn.functional.cross_entropy(score, where, reduction="none")

    def queries(
        self, target: TargetOutput, batch: DrafterBatch, attention: str = "dense"
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every draft query's hidden state in the fields' order (flat), and each query's block."""
        f = batch.fields
        blocks = torch.div(torch.arange(f.supervised.shape[0]), f.block_size, rounding_mode="floor")
        return self(target.hidden, batch, attention), blocks


Config = DFlash2Config
Drafter = DFlash2Drafter
field_padding = dflash.pad_anchor_slots  # extra blocks at a row's start, never supervised, as DFlash's


def build(recipe: Recipe, sizes: Sizes, args: BuildArgs) -> DFlash2Drafter:
    """A DFlash2 drafter of the target's ``sizes`` (:class:`~padfree.drafter.sizes.Sizes`) under ``recipe``
    (DFlash's shape plus its convolution and selector); a draft vocabulary, an objective without the
    target's distribution and D-PACE weights are refused in one line."""
    if args.vocab is not None:
        raise ConfigError(
            "DFlash2's candidate selector spans the target's vocabulary (speculators' DFlash2DraftModel "
            "refuses a pruned one): use --draft-vocab none"
        )
    if recipe.objective == "data_ce" or recipe.slot_weights == "dpace":
        raise ConfigError(
            f"recipe {recipe.name}: DFlash2's selector is trained toward the target's argmax under fixed "
            f"slot weights (speculators' DFlash2 weighs each term by its own D-PACE): use --objective kl or "
            f"argmax_ce and --slot-weights exp or uniform (got {recipe.objective}, {recipe.slot_weights})"
        )
    h, v = sizes.hidden, int(args.weights[1].shape[0])
    if h % recipe.conv_group_size or recipe.selector_top_k > v:
        raise ConfigError(
            f"recipe {recipe.name}: DFlash2 needs the hidden size ({h}) divisible by conv_group_size "
            f"({recipe.conv_group_size}) and selector_top_k ({recipe.selector_top_k}) at most the vocabulary "
            f"({v})"
        )
    config = DFlash2Config(
        **dflash.block_config(recipe, sizes, args),
        conv_kernel_size=recipe.conv_kernel_size,
        conv_group_size=recipe.conv_group_size,
        selector_rank=recipe.selector_rank,
        selector_top_k=recipe.selector_top_k,
    )
    return DFlash2Drafter(config, args.weights[0], args.weights[1])


SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose DFlash2 format :func:`export_files` writes (and the tests load)."""

CONV_PARTS = ("attention_conv", "mlp_conv")
SELECTOR_PARTS = ("predecessor_codebook", "successor_codebook", "hidden_projection.weight")


def export_files(state: dict, meta: dict) -> tuple[dict, dict]:
    """The ``speculators-dflash2`` export format: speculators' ``DFlash2SpeculatorConfig`` (a Qwen3 layer
    config of the drafter's sizes and layers, every layer ``sliding_attention`` with the recipe's window, or
    ``full_attention`` without one; ``sliding_window_non_causal`` the opposite of ``causal_in_block``) and
    their parameter names: DFlash's (:func:`padfree.drafter.methods.dflash.model.export_files`), each
    layer's two convolutions and ``candidate_selector.*``. The embedding and LM head are the verifier's at
    load time and are not written (their ``_keys_to_ignore_on_save``)."""
    import transformers

    d, tgt, r = meta["drafter"], meta["target"], meta["recipe"]
    t = tgt["config"]
    n, window, block = int(d["num_layers"]), d.get("sliding_window"), int(r["block_size"])
    layer = transformers.Qwen3Config(
        vocab_size=int(t["vocab_size"]),
        num_hidden_layers=n,
        **layer_config(d, t),
        use_sliding_window=window is not None,
        sliding_window=None if window is None else int(window),
        layer_types=["sliding_attention" if window is not None else "full_attention"] * n,
    )
    config = {
        **speculators_head("DFlash2DraftModel", "dflash2", SPECULATORS_VERSION, layer),
        "draft_vocab_size": int(t["vocab_size"]),
        "block_size": block,
        "max_anchors": int(r["max_anchors"]),
        "aux_hidden_state_layer_ids": [int(i) + 1 for i in meta["target_layers"]],
        "mask_token_id": int(meta["mask_token_id"]),
        "sliding_window_non_causal": not bool(d.get("causal_in_block")),
        "sample_from_anchor": False,
        "conv_kernel_size": int(d["conv_kernel_size"]),
        "conv_group_size": int(d["conv_group_size"]),
        "selector_rank": int(d["selector_rank"]),
        "selector_top_k": int(d["selector_top_k"]),
        "speculators_config": speculators_config("dflash2", block - 1, meta),
    }
    _, tensors = dflash.export_files(state, meta)
    for i in range(n):
        for conv in CONV_PARTS:
            for part in ("base_kernel", "kernel_projection.weight"):
                name = f"layers.{i}.{conv}.{part}"
                tensors[name] = take(state, name)
    for part in SELECTOR_PARTS:
        tensors[f"candidate_selector.{part}"] = take(state, part)
    return config, tensors


def check_export(meta: dict, *, verifier_option: str | None = "--verifier") -> None:
    """Refuse in one line what speculators' DFlash2 format cannot hold: a draft vocabulary, no verifier folder
    (their class loads the embedding and LM head from it)."""
    if meta.get("d2t") is not None:
        raise ConfigError(
            "speculators' DFlash2 format has no draft vocabulary: train with --draft-vocab none"
        )
    needs_verifier(meta, "speculators' DFlash2 format", "embedding and LM head", verifier_option)


def zlab_files(state: dict, meta: dict) -> tuple[dict, dict]:
    """z-lab's DFlash2 folder (their ``dflash`` package's ``DFlash2DraftModel.from_pretrained`` and
    ``dflash_generate`` read it): z-lab's DFlash config (:func:`padfree.drafter.methods.dflash.model.
    export_files`) naming ``DFlash2DraftModel`` with the convolution and selector sizes in ``dflash_config``,
    and the tensors of :func:`export_files` (their loader maps the selector's codebooks to its embeddings).
    Refused in one line where z-lab's format cannot hold the drafter as trained
    (:func:`padfree.drafter.methods.dflash.model.check_export`: a context window that binds, which z-lab
    slides per query)."""
    dflash.check_export(meta, verifier_option=None)
    config, _ = dflash.export_files(state, meta)
    d = meta["drafter"]
    config["architectures"] = ["DFlash2DraftModel"]
    config["dflash_config"] = {
        **config["dflash_config"],
        **{k: int(d[k]) for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")},
    }
    return config, export_files(state, meta)[1]
