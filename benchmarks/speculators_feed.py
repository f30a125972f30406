"""vllm speculators' own DFlash and EAGLE-3 models fed from padfree batches: does each document of a packed
row train exactly as alone? And with the row-level inputs their trainer builds?

speculators is not a padfree dependency: its release pins transformers<=5.19 and pulls torchaudio,
torchvision, openai and hs-connectors. Unpack its wheel (``pip download --no-deps speculators==0.9.0``,
``unzip``) and pass the folder; its data-generation imports (``openai``, ``hs_connectors``), which the models
never call, are stubbed. Tiny models, random weights, CPU float32, eager loss functions.

- DFlash: padfree anchors (``AnchorPolicy(partial=False)``) through ``feed.dflash_inputs``'s ``anchor_fn`` vs
  their ``select_anchors`` over the row: labels crossing a document end, anchor sets, block logits packed
  vs alone.
- EAGLE-3: ``feed.eagle3_inputs`` vs the plain packed row (documents shifted, back to back): each document's
  loss in the packed row (loss mask kept to that document) vs the document alone.

    .venv/bin/python benchmarks/speculators_feed.py --speculators /tmp/spec --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import torch

SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4}
SIZES.update(num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6)
STUBBED = ("openai", "openai.types", "openai.types.chat", "openai.types.completion", "hs_connectors")


def import_speculators(folder: str):
    sys.path.insert(0, folder)
    for name in STUBBED:
        sys.modules.setdefault(name, mock.MagicMock())
    import speculators.models.dflash.core as dcore
    import speculators.models.eagle3.core as ecore

    return dcore, ecore


def spec_config(kind, target, tl, extra):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    vc = VerifierConfig.from_config(target.config, name_or_path=None)
    sc = SpeculatorsConfig(
        algorithm=kind,
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=extra.pop("_tokens"))],
        default_proposal_method="greedy",
        verifier=vc,
    )
    if kind == "dflash":
        from speculators.models.dflash import DFlashSpeculatorConfig

        return DFlashSpeculatorConfig(transformer_layer_config=tl, speculators_config=sc, **extra)
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    return Eagle3SpeculatorConfig(transformer_layer_config=tl, speculators_config=sc, **extra)


def share_weights(model, target):
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        model.verifier_lm_head.weight.copy_(target.get_output_embeddings().weight)
        model.verifier_norm.weight.copy_(target.model.norm.weight)
        if getattr(model, "lm_head", None) is not None:  # left uninitialised by their post_init here
            model.lm_head.weight.copy_(target.get_output_embeddings().weight)
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all(), n
    return model.eval()


def dflash(dcore, target, items, vocab, block):
    from transformers import Qwen3Config

    from padfree.core.anchors import AnchorPolicy
    from padfree.drafter.collate import DrafterCollator
    from padfree.drafter.target import run_target
    from padfree.integrations.feed import dflash_inputs

    tl = Qwen3Config(**SIZES, vocab_size=vocab)
    tl._attn_implementation = "sdpa"
    extra = {"draft_vocab_size": vocab, "block_size": block, "aux_hidden_state_layer_ids": [1, 3]}
    extra.update(mask_token_id=vocab - 1, _tokens=block - 1)
    torch.manual_seed(0)
    model = share_weights(dcore.DFlashDraftModel(spec_config("dflash", target, tl, extra)), target)
    col = DrafterCollator("dflash", AnchorPolicy(block_size=block, partial=False), mask_token_id=vocab - 1)
    theirs = dcore.select_anchors

    def run(batch, padfree_anchors):
        kw, fn = dflash_inputs(batch, run_target(target, batch.contract, (1, 3)))
        dcore.select_anchors = fn if padfree_anchors else theirs
        n = max(1, len(batch.fields.anchors)) if padfree_anchors else 512
        torch.manual_seed(1)
        with torch.no_grad():
            _, logits, _, amask, idx = model._backbone_forward(**kw, max_anchors=n)
        dcore.select_anchors = theirs
        return logits[0], amask[0], idx

    def anchors(batch, pf):
        if pf:
            return batch.fields.anchors
        torch.manual_seed(1)  # as run() seeds their torch.randperm
        a, v = theirs(batch.contract.flat("loss_mask").long(), 512, block)
        return a[v]

    out = {}
    packed = col(items)
    doc = packed.contract.flat("document_ids")[0]
    for how in ("padfree anchors", "their row-level anchors"):
        pf = how == "padfree anchors"
        lp, mp, ip = run(packed, pf)
        anchor_of = ip.view(-1, block)[:, 0].repeat_interleave(block)
        lab = ip.clamp(max=doc.shape[0] - 1)
        cross = int(((mp > 0) & ((ip >= doc.shape[0]) | (doc[lab] != doc[anchor_of]))).sum())
        a_p = anchors(packed, pf)
        same, diff = True, 0.0
        for d in range(len(items)):
            one = col([items[d]])
            mine = sorted((a_p[doc[a_p] == d] - packed.contract.doc_starts[d]).tolist())
            same &= mine == sorted(anchors(one, pf).tolist())
            if pf:
                l1, _, _ = run(one, True)
                blocks = doc[ip.view(-1, block)[:, 0]] == d
                if blocks.any():
                    v = lp.shape[-1]
                    gap = lp.view(-1, block, v)[blocks] - l1.view(-1, block, v)
                    diff = max(diff, float(gap.abs().max()))
        out[how] = {"labels_crossing_documents": cross, "anchor_sets_as_alone": bool(same)}
        if pf:
            out[how]["max_block_logit_diff_packed_vs_alone"] = diff
    return out


def eagle3(ecore, target, items, vocab, ttt):
    from speculators.losses import resolve_loss_config
    from transformers import LlamaConfig

    from padfree.drafter.collate import DrafterCollator
    from padfree.drafter.methods.eagle3.spec import low_mid_high
    from padfree.drafter.target import run_target
    from padfree.integrations.feed import eagle3_inputs

    tl = LlamaConfig(**SIZES, vocab_size=vocab)
    tl._attn_implementation = "sdpa"
    layers = list(low_mid_high(target.config.num_hidden_layers))
    extra = {"draft_vocab_size": vocab, "norm_before_residual": False, "_tokens": ttt}
    extra["eagle_aux_hidden_state_layer_ids"] = layers
    torch.manual_seed(0)
    model = share_weights(ecore.Eagle3DraftModel(spec_config("eagle3", target, tl, extra)), target)
    loss_cfg = resolve_loss_config("kl_div", "eager")
    col = DrafterCollator("eagle3", ttt=ttt)

    def loss(kw, d):
        kw = {**kw, "ttt_steps": ttt, "loss_mask": kw["loss_mask"] * (kw["document_ids"] == d)}
        with torch.no_grad():
            return float(model(**kw, loss_config=loss_cfg)[1])

    packed = col(items)
    out_p = run_target(target, packed.contract, tuple(layers))
    res = {}
    for how, rule in (("padfree eagle3_inputs", ttt), ("plain packed row", 1)):
        kw = eagle3_inputs(packed, out_p, rule)  # rule 1: documents shifted, back to back, nothing removed
        diffs, alone_losses = [], []
        for d in range(len(items)):
            one = col([items[d]])
            alone = loss(eagle3_inputs(one, run_target(target, one.contract, tuple(layers)), rule), 0)
            diffs.append(abs(loss(kw, d) - alone))
            alone_losses.append(alone)
        res[how] = {"max_loss_diff_packed_vs_alone": max(diffs), "per_document": diffs, "alone": alone_losses}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--speculators", required=True, help="folder holding the unpacked speculators package")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--docs", type=int, default=4)
    args = ap.parse_args()
    dcore, ecore = import_speculators(args.speculators)
    from importlib.metadata import version

    from padfree.drafter.check import fixture_documents
    from padfree.drafter.target import build_target

    samples = fixture_documents(args.docs, 120)
    items = [{**s, "sample_id": i} for i, s in enumerate(samples)]
    vocab = int(max(int(np.max(s["input_ids"])) for s in samples)) + 2
    target = build_target(vocab_size=vocab)
    result = {
        "speculators": version("speculators"),
        "documents": [len(s["input_ids"]) for s in samples],
        "dflash": dflash(dcore, target, items, vocab, block=8),
        "eagle3": eagle3(ecore, target, items, vocab, ttt=3),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculators_feed.json").write_text(json.dumps(result, indent=2) + "\n")
    d, e = result["dflash"], result["eagle3"]
    lines = [
        f"# speculators {result['speculators']} models fed from padfree batches (CPU, float32, tiny, random)",
        "",
        f"Packed row of {len(items)} fixture documents ({result['documents']} tokens) vs each alone.",
        "",
        "| model | inputs | labels crossing documents | anchor sets as alone | max diff packed vs alone |",
        "|---|---|---:|---|---:|",
    ]
    for how, r in d.items():
        diff = r.get("max_block_logit_diff_packed_vs_alone")
        shown = "-" if diff is None else f"{diff:.3g} (block logits)"
        lines.append(
            f"| DFlash | {how} | {r['labels_crossing_documents']} | {r['anchor_sets_as_alone']} | {shown} |"
        )
    for how, r in e.items():
        size = min(r["alone"])
        lines.append(
            f"| EAGLE-3 | {how} | - | - | {r['max_loss_diff_packed_vs_alone']:.3g} "
            f"(loss; smallest loss alone {size:.3g}) |"
        )
    (out / "speculators_feed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
