"""Drafter attention on packed rows, CPU: per document (the drafters' default ``attention="dense"``: one
SDPA or eager EAGLE-3 call per document) vs one call over the whole row under the block-diagonal mask
(``attention="mask"``), and where a packed and a length-sorted fixed-count padded micro-batch spend their CPU
seconds (target forward vs drafter forward + backward + update).

    PYTHONPATH=src python benchmarks/drafter_attention.py --out benchmarks/results

Same data, models, recipe (``--recipe``, default specforge) and anchor budget as ``drafter_speed.py`` (fewer
samples). The attention comparison packs rows of ``--mask-budget`` tokens from the samples that fit in one: at
the recipes' density one masked call over a row of the speed budget's 2048 tokens and its ~8K DFlash block
queries would score a ``queries x (2048 + queries)`` matrix per head. One torch thread; CPU seconds of this
process. Writes ``drafter_attention.json`` and ``.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--per-file", type=int, default=60)
    p.add_argument("--rows", type=int, default=6, help="packed micro-batches timed")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--mask-budget", type=int, default=1024, help="tokens per packed row of the comparison")
    p.add_argument("--recipe", default="specforge")
    args = p.parse_args(argv)
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import drafter_speed as ds

    from lab.drafter import as_trained, bench_models, collator, items_of, make_arms, sample_anchors
    from padfree.drafter.methods import METHODS
    from padfree.drafter.target import run_target
    from padfree.drafter.train import loss_sums, token_counts

    torch.set_num_threads(1)
    bargs = ds.parse(["--out", str(args.out), "--per-file", str(args.per_file), "--recipe", args.recipe])
    samples = ds.load(bargs)
    lengths = np.array([len(s["input_ids"]) for s in samples], np.int64)
    counts = token_counts(samples, bargs.vocab)
    result: dict = {"recipe": args.recipe, "samples": len(samples), "budget": bargs.budget,
                    "mask_budget": args.mask_budget, "method": {}}  # fmt: skip
    for method in METHODS:
        recipe = ds.recipe_of(bargs, method)
        uses = METHODS[method].uses_anchors
        anchors = sample_anchors(samples, recipe.anchor_policy()) if uses else np.zeros_like(lengths)
        cost = ds.method_cost(recipe, hidden=bargs.hidden, layers=bargs.layers, vocab=bargs.vocab)

        arms = make_arms(lengths, anchors, bargs.budget, bargs.seed, cost,
                         anchor_budget=ds.anchor_budget(bargs, recipe, bargs.budget))  # fmt: skip
        models = bench_models(method, vocab=bargs.vocab, hidden=bargs.hidden, layers=bargs.layers,
                              intermediate=4 * bargs.hidden, recipe=recipe, seed=bargs.seed,
                              counts=counts)  # fmt: skip
        row: dict = {}
        # 1. the packed row's drafter attention: per document vs one masked call over the row
        fit = np.flatnonzero(lengths <= args.mask_budget)  # the samples a row of --mask-budget holds
        ab = ds.anchor_budget(bargs, recipe, args.mask_budget)
        small = make_arms(lengths[fit], anchors[fit], args.mask_budget, bargs.seed, cost, anchor_budget=ab)
        small = small["padfree_packed"]
        b = small.batching
        col = collator(method, small, recipe, bargs.seed)
        picks = np.linspace(0, b.n_micro - 1, args.rows).round().astype(int)
        batches = [col(items_of(samples, fit[b.order[b.offsets[j] : b.offsets[j + 1]]])) for j in picks]
        with torch.no_grad():
            outs = [run_target(models.target, x.contract, models.layers) for x in batches]
        sec = {"dense": 0.0, "mask": 0.0}
        dens: dict[str, list] = {"dense": [], "mask": []}
        for r in range(args.repeats + 1):  # round 0 warms up
            for mode in sec:
                for x, o in zip(batches, outs, strict=True):
                    t = time.process_time()
                    num, den = loss_sums(models, x, attention=mode, out=o)
                    (num.sum() / den.sum()).backward()
                    dt = time.process_time() - t
                    models.drafter.zero_grad(set_to_none=True)
                    if r:
                        sec[mode] += dt
                    if r == 1:
                        dens[mode].append(num.detach())
        same = all(torch.allclose(a, c, rtol=1e-4, atol=1e-5) for a, c in zip(dens["dense"], dens["mask"]))
        row["packed_attention"] = {
            "docs_per_row": [x.contract.n_docs for x in batches],
            "per_document_cpu_s": sec["dense"],
            "one_masked_call_cpu_s": sec["mask"],
            "masked_over_per_document": sec["mask"] / sec["dense"],
            "same_losses": same,
        }
        # 2. where a micro-batch's CPU seconds go: packed vs the field's length-sorted fixed-count batches
        split = {}
        for name in ("padfree_packed", "sorted_fixed"):
            arm = arms[name]
            b = arm.batching
            c = collator(method, arm, recipe, bargs.seed)
            tgt = drf = 0.0
            pos = 0
            for j in np.linspace(0, b.n_micro - 1, args.rows).round().astype(int):
                x = as_trained(c(items_of(samples, b.order[b.offsets[j] : b.offsets[j + 1]])), arm)
                t = time.process_time()
                o = run_target(models.target, x.contract, models.layers)
                t1 = time.process_time()
                num, den = loss_sums(models, x, out=o)
                (num.sum() / den.sum().clamp(min=1.0)).backward()
                models.optimizer.step()
                models.optimizer.zero_grad(set_to_none=True)
                drf += time.process_time() - t1
                tgt += t1 - t
                pos += x.positions
            split[name] = {"target_cpu_s": tgt, "drafter_cpu_s": drf, "draft_positions": pos,
                           "target_share": tgt / (tgt + drf)}  # fmt: skip
        row["cpu_split"] = split
        result["method"][method] = row
        print(method, json.dumps(row), file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "drafter_attention.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [
        "# drafter_attention\n",
        f"recipe {args.recipe}; {len(samples)} samples; attention compared on packed rows of "
        f"{args.mask_budget} tokens, CPU split at budget {bargs.budget}; CPU seconds, one thread\n",
        "| method | docs per packed row | per-document attention (s) | one masked call (s) | masked / "
        "per-document | same losses |",
        "|---|---|---|---|---|---|",
    ]
    for m, r in result["method"].items():
        a = r["packed_attention"]
        md.append(
            f"| {m} | {a['docs_per_row']} | {a['per_document_cpu_s']:.2f} | "
            f"{a['one_masked_call_cpu_s']:.2f} | {a['masked_over_per_document']:.2f} | {a['same_losses']} |"
        )
    md += [
        "",
        "| method | arm | target forward share of CPU | draft positions per CPU s |",
        "|---|---|---|---|",
    ]
    for m, r in result["method"].items():
        for name, s in r["cpu_split"].items():
            rate = s["draft_positions"] / (s["target_cpu_s"] + s["drafter_cpu_s"])
            md.append(f"| {m} | {name} | {s['target_share']:.2f} | {rate:.0f} |")
    (args.out / "drafter_attention.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
