"""A reference EAGLE-3 drafter with random weights, following the published architecture (SafeAILab EAGLE-3;
vllm ``speculators``' ``Eagle3DraftModel``): written here, nothing imported from them.

The target's hidden states of three layers are fused (``fc``: ``3H -> H``). One decoder layer takes, at each
position ``t``, the normed embedding of the token fed there concatenated with the normed hidden state
(``2H`` into the attention projections; the hidden state is the residual). Test-time training unrolls
``ttt`` steps: step 0 is fed the fused target state at ``t`` and token ``t + 1``; step ``k`` is fed the
drafter's own output of step ``k - 1`` and token ``t + 1 + k``, at rotary position ``pos[t] + k``, and its
queries see step 0's keys causally inside their document plus their own position at every earlier step
(:func:`padfree.drafter.masks.eagle3_dense_mask`). Step ``k`` at ``t`` predicts token ``t + 2 + k``; its loss
is ``KL(target || drafter)`` against the target's prediction there, where the collator's rule says it is
supervised. Embeddings are the target's, frozen; the LM head starts as the target's and trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from padfree.drafter._blocks import MLP, DrafterConfig, RMSNorm, attend, rope
from padfree.drafter.collate import DrafterBatch, FieldOptions, QueryFields, no_field_padding
from padfree.drafter.contract import Contract
from padfree.drafter.export import layer_config, needs_verifier, speculators_config, speculators_head, take
from padfree.drafter.masks import count_cross_pairs, eagle3_block_mask, eagle3_dense_mask, eagle3_predicate
from padfree.drafter.methods.base import BuildArgs
from padfree.drafter.objective import VocabMap
from padfree.drafter.recipes import Recipe
from padfree.drafter.sizes import Sizes
from padfree.drafter.target import TargetOutput
from padfree.errors import ConfigError


@dataclass(frozen=True)
class Fields(QueryFields):
    """EAGLE-3 draft queries: one per flat position ``t`` and test-time-training step ``k`` (every
    :class:`QueryFields` entry is ``(ttt, T)``: it predicts ``t + 2 + k``, the target's prediction of it is at
    ``t + 1 + k``, clamped into the row).

    Attributes:
        ttt: steps.
        step_input_ids: ``(ttt, T)`` token fed at each step (padding past the document end).
        input_index: ``(ttt, T)`` the flat position whose token ``step_input_ids`` holds (-1: padding).
    """

    ttt: int
    step_input_ids: torch.Tensor
    input_index: torch.Tensor


def fields(contract: Contract, options: FieldOptions, *, epoch: int, leaky: bool = False) -> Fields:
    """The micro-batch's test-time-training queries (``leaky``: the field's row-wide shift), gated and
    weighted as the recipe says."""
    r = options.recipe
    return eagle3_fields(
        contract, r.ttt, pad_token_id=options.pad_token_id, leaky=leaky, gate=r.loss_gate, decay=r.step_decay
    )


def eagle3_fields(
    contract: Contract,
    ttt: int,
    *,
    pad_token_id: int = 0,
    leaky: bool = False,
    gate: int = 2,
    decay: float = 1.0,
) -> Fields:
    """EAGLE-3 fields; ``leaky=True`` shifts across the whole row, as packers that shift the packed row do
    (deliberately WRONG; for ``check-drafter --leaky``). The prediction of ``x[t + 2 + k]`` is supervised
    where ``loss_mask[t + k + gate]`` holds (SpecForge ``gate=0``, speculators 1, the predicted token itself
    2)."""
    if isinstance(ttt, bool) or not isinstance(ttt, int) or ttt < 1:
        raise ConfigError(f"ttt must be an integer >= 1 (got {ttt!r})")
    ids = contract.flat("input_ids")[0]
    rem = contract.flat("doc_remaining")[0]
    lmask = contract.flat("loss_mask")[0]
    doc = contract.flat("document_ids")[0]
    width = ids.shape[0]
    t = torch.arange(width)
    k = torch.arange(ttt)[:, None]
    fed = t + 1 + k
    label = t + 2 + k
    fed_safe = fed.clamp(max=width - 1)
    gated = (t + k + gate).clamp(max=width - 1)
    if leaky:
        row = contract.input_ids.shape[1]  # a row-wide shift stays inside its row (padded: one document)
        fed_ok = (fed < width) & (fed // row == t // row)
        labelled = (label < width) & (label // row == t // row) & (doc >= 0)
    else:
        fed_ok = (k + 1) < rem
        labelled = (k + 2) < rem
    return Fields(
        ttt=ttt,
        step_input_ids=torch.where(fed_ok, ids[fed_safe], pad_token_id),
        input_index=torch.where(fed_ok, fed, -1),
        label_index=torch.where(label < width, label, -1),
        target_index=fed_safe,
        labelled=labelled,
        supervised=labelled & lmask[gated],
        query_doc=doc.expand(ttt, width),
        slot=k.expand(ttt, width),
        weight=(decay ** k.to(torch.float32)).expand(ttt, width),
        group=k.expand(ttt, width),
    )


def crossings(batch: DrafterBatch) -> tuple[int, torch.Tensor, torch.Tensor]:
    """For ``check-drafter``: ``(attended (query, key) pairs joining two documents, shifted inputs fed from
    another document, which (step, position) losses an input reaches)``: an input fed at step ``k`` reaches
    the losses of steps ``>= k`` at that position (the drafter's own hidden state is fed forward)."""
    f, c = batch.fields, batch.contract
    assert c is not None
    doc = c.flat("document_ids")[0]
    pairs = count_cross_pairs(eagle3_predicate(doc), doc, doc.repeat(f.ttt))
    return (pairs, *fed_crossings(f, doc))


def fed_crossings(f: Fields, doc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(shifted inputs fed from another document, which (step, position) losses an input reaches)`` of a
    drafter unrolled over steps: an input fed at step ``k`` reaches the losses of steps ``>= k`` at that
    position (each step feeds the next its state)."""
    fed = f.input_index
    cross_in = (fed >= 0) & (doc[fed.clamp(min=0)] != doc[None, :])
    return cross_in, f.supervised.int().flip(0).cummax(0).values.flip(0).bool()


@dataclass(frozen=True)
class Eagle3Config(DrafterConfig):
    """Sizes of an EAGLE-3 drafter: the shared ones and its test-time-training steps; whether step ``k + 1``
    is fed step ``k``'s hidden state after the final norm (``fed_state="postnorm"``, speculators) or before it
    (SpecForge), and whether the three target layers are normed before ``fc`` (speculators)."""

    ttt: int = 7
    fed_state: str = "prenorm"
    norm_before_fc: bool = False


def ttt_attention(q: torch.Tensor, keys: list, values: list, step0: torch.Tensor) -> torch.Tensor:
    """EAGLE-3 attention at step ``k = len(keys) - 1`` without the ``(k + 1) T`` key axis: scores against
    step 0's keys under ``step0`` (``T x T``: causal, same document), plus one score per earlier step against
    the query's own position; one softmax over the ``T + k`` scores. ``q`` ``(Hq, T, D)``, keys/values
    ``(Hkv, T, D)`` per step -> ``(T, Hq * D)``. Equal to SDPA under :func:`eagle3_dense_mask`."""
    rep = q.shape[0] // keys[0].shape[0]
    scale = q.shape[-1] ** -0.5
    ks = [x.repeat_interleave(rep, 0) for x in keys]
    vs = [x.repeat_interleave(rep, 0) for x in values]
    s0 = (q @ ks[0].transpose(1, 2) * scale).masked_fill(~step0, float("-inf"))
    diag = [(q * kx).sum(-1, keepdim=True) * scale for kx in ks[1:]]
    p = torch.softmax(torch.cat([s0, *diag], -1), -1)
    n = q.shape[1]
    out = p[..., :n] @ vs[0]
    for i, vx in enumerate(vs[1:]):
        out = out + p[..., n + i : n + i + 1] * vx
    return out.transpose(0, 1).reshape(n, -1)


_D = TypeVar("_D", bound="Eagle3Drafter")


def row_ids(batch: DrafterBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's document and position ids ``(T,)`` (its one flat row) on ``device``."""
    assert batch.contract is not None
    doc, pos = (batch.contract.flat(name)[0].to(device) for name in ("document_ids", "position_ids"))
    return doc, pos


class StepDrafter(nn.Module):
    """A drafter unrolled over steps (or depths): its forward gives one ``(T, H)`` output per step, and its
    draft queries are those outputs step-major."""

    def queries(
        self, target: TargetOutput, batch: DrafterBatch, attention: str = "dense"
    ) -> tuple[torch.Tensor, None]:
        """Every (step, position) query's hidden state in the fields' order (step-major, flat)."""
        return torch.cat(self(target.hidden, batch, attention)), None


class Eagle3Drafter(StepDrafter):
    """The drafter: ``fc``, one decoder layer over ``[embedding ; hidden]``, a norm and an LM head over the
    target's vocabulary or a draft vocabulary (``vocab``); the head starts from the target's rows
    (``head_init="target"``) or random, and trains or not (``head_trainable``)."""

    def __init__(
        self,
        cfg: Eagle3Config,
        embed_weight: torch.Tensor,
        head_weight: torch.Tensor,
        vocab: VocabMap | None = None,
        head_init: str = "target",
        head_trainable: bool = True,
    ) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight.detach().clone(), freeze=True)
        self.fc_norm = RMSNorm(3 * h, cfg.eps) if cfg.norm_before_fc else None
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, cfg.eps)
        self.hidden_norm = RMSNorm(h, cfg.eps)
        self.q_proj = nn.Linear(2 * h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.eps)
        self.mlp = MLP(h, cfg.intermediate_size)
        self.norm = RMSNorm(h, cfg.eps)
        rows = head_weight if vocab is None else head_weight[vocab.d2t]
        self.lm_head = nn.Linear(h, rows.shape[0], bias=False)
        self.vocab = vocab
        if head_init == "target":
            with torch.no_grad():
                self.lm_head.weight.copy_(rows)
        self.lm_head.weight.requires_grad_(head_trainable)

    @classmethod
    def of(cls: type[_D], config: Eagle3Config, recipe: Recipe, args: BuildArgs) -> _D:
        """This drafter of ``config`` over the target's embedding and head (``args.weights``), a draft
        vocabulary or the full one, its head as the recipe starts and trains it."""
        embed, head = args.weights
        return cls(config, embed, head, args.vocab, recipe.head_init, recipe.head_trainable)

    def forward(self, target_hidden: torch.Tensor, batch: DrafterBatch, attention: str = "dense") -> list:
        """Normed hidden states ``(T, H)`` of every step. ``attention``: ``"dense"`` (eager, segment by
        segment: each document of a packed row, each padded row; step ``k`` holds ``L x (L + k)`` scores
        per segment of ``L`` positions, the step-0 block and one diagonal score per earlier step; trains on
        CPU), ``"mask"`` (SDPA over all ``(k + 1) T`` keys with the dense boolean mask) or ``"flex"`` (a
        flex-attention BlockMask, GPU)."""
        f = batch.fields
        assert isinstance(f, Fields) and batch.contract is not None, "an EAGLE-3 batch"
        c, d = self.cfg, self.cfg.head_dim
        dev = target_hidden.device
        doc, pos = row_ids(batch, dev)
        fused = target_hidden[0] if self.fc_norm is None else self.fc_norm(target_hidden[0])
        h = self.fc(fused)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs = []
        for k in range(f.ttt):
            emb = self.input_layernorm(self.embed_tokens(f.step_input_ids[k].to(dev)))
            x = torch.cat([emb, self.hidden_norm(h)], -1)
            q = rope(self.q_proj(x).view(-1, c.num_heads, d).transpose(0, 1), pos + k, c.rope_theta)
            keys.append(
                rope(self.k_proj(x).view(-1, c.num_kv_heads, d).transpose(0, 1), pos + k, c.rope_theta)
            )
            values.append(self.v_proj(x).view(-1, c.num_kv_heads, d).transpose(0, 1))
            if attention == "dense":  # segment by segment (documents of a packed row, padded rows)
                if k == 0:
                    segs = [(s, eagle3_dense_mask(doc[s], 0)) for s in batch.contract.segments()]
                a = torch.cat(
                    [
                        ttt_attention(q[:, s], [x[:, s] for x in keys], [x[:, s] for x in values], m)
                        for s, m in segs
                    ]
                )
            else:
                mask = eagle3_block_mask(doc, k) if attention == "flex" else eagle3_dense_mask(doc, k)
                a = attend(q, torch.cat(keys, 1), torch.cat(values, 1), mask)
            h = h + self.o_proj(a)
            h = h + self.mlp(self.post_attention_layernorm(h))
            out = self.norm(h)
            outs.append(out)
            if c.fed_state == "postnorm":
                h = out
        return outs


field_padding = no_field_padding  # padded rows add nothing: every position drafts


Config = Eagle3Config
Drafter = Eagle3Drafter


def build(recipe: Recipe, sizes: Sizes, args: BuildArgs) -> Eagle3Drafter:
    """An EAGLE-3 drafter of the target's ``sizes`` (:class:`~padfree.drafter.sizes.Sizes`) under
    ``recipe`` (one decoder layer over three fused target layers: ``args.n_fused`` and ``args.draft_layers``
    are the method's own), the target's embedding and head weights, a draft vocabulary or the full one."""
    config = Eagle3Config(
        **sizes.drafter_config(),
        ttt=recipe.ttt,
        fed_state=recipe.fed_state,
        norm_before_fc=recipe.norm_before_fc,
    )
    return Eagle3Drafter.of(config, recipe, args)


SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose EAGLE-3 format :func:`export_files` writes (and the tests load)."""


def export_files(state: dict, meta: dict) -> tuple[dict, dict]:
    """The ``speculators`` export format: vllm speculators' EAGLE-3 config and parameter names, the
    embedding and draft head included, and ``d2t`` (offsets ``target id - draft id``) and ``t2d`` (a boolean
    mask over the target's vocabulary) where a draft vocabulary is used."""
    import transformers

    d, tgt = meta["drafter"], meta["target"]
    t = tgt["config"]
    vocab = int(t["vocab_size"])
    layer = transformers.LlamaConfig(
        vocab_size=vocab,
        num_hidden_layers=1,
        **layer_config(d, t),
        mlp_bias=False,
    )
    d2t = meta.get("d2t")
    draft_vocab = vocab if d2t is None else len(d2t)
    config = {
        **speculators_head("Eagle3Speculator", "eagle3", SPECULATORS_VERSION, layer),
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": False,
        "norm_before_fc": bool(d.get("norm_before_fc")),
        "fc_norm": False,
        "norm_output": d.get("fed_state") == "postnorm",
        "embed_requires_grad": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [int(i) + 1 for i in meta["target_layers"]],
        "speculators_config": speculators_config("eagle3", int(d["ttt"]), meta),
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
    tensors = {theirs: take(state, ours) for ours, theirs in names.items()}
    if d2t is not None:
        ids = torch.tensor(d2t, dtype=torch.long)
        tensors["d2t"] = ids - torch.arange(ids.shape[0])
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    return config, tensors


def check_export(meta: dict, *, verifier_option: str | None = "--verifier") -> None:
    """Refuse in one line what speculators' format cannot hold: a drafter with no verifier folder (the
    format names it and loads its embedding and norm from it); ``verifier_option`` names the option that
    gives one (None: the caller has none)."""
    needs_verifier(meta, "speculators' format", "embedding and norm", verifier_option)
