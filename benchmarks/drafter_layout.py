"""The same documents trained packed and padded: what the row layout alone costs a drafter step on this CPU
(DFlash and EAGLE-3, the tiny models of ``drafter_speed.py``, trained under its recipe: ``--recipe``, default
specforge), free of which micro-batches an arm's epoch happens to hold.

    PYTHONPATH=src python benchmarks/drafter_layout.py --out benchmarks/results

For each length band, the first ``count`` samples of the band (the shared chat, math and code sets, loss on
assistant turns) form one micro-batch, collated once as a packed row and once as padded rows (DFlash blocks
padded per row to the most, as ``drafter_speed.py``'s padded arms are); each is trained ``--repeats`` times
after one untimed step and the fastest CPU seconds kept. Writes ``drafter_layout.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from lab.drafter import Arm, as_trained, bench_models, collator, items_of
from padfree.bench.measure import Batching
from padfree.drafter import recipes
from padfree.drafter.methods import METHODS
from padfree.drafter.train import token_counts, train_micro

BANDS = ((100, 200, 13), (300, 400, 5), (900, 1100, 2))  # (shortest, longest + 1, documents): ~2K tokens


def main(argv: list[str] | None = None) -> int:
    import importlib.util

    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--recipe", choices=recipes.NAMES, default=recipes.DEFAULT)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("ds", Path(__file__).with_name("drafter_speed.py"))
    assert spec is not None and spec.loader is not None
    ds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ds)
    opts = ds.parse(["--quick", "--out", str(args.out), "--recipe", args.recipe])
    samples = ds.load(opts)
    lengths = np.array([len(s["input_ids"]) for s in samples])
    counts = token_counts(samples, opts.vocab)
    rows = []
    for method in METHODS:
        recipe = ds.recipe_of(opts, method)
        models = bench_models(method, vocab=opts.vocab, hidden=opts.hidden, layers=opts.layers,
                              intermediate=4 * opts.hidden, recipe=recipe, counts=counts)  # fmt: skip
        for lo, hi, count in BANDS:
            ids = np.flatnonzero((lengths >= lo) & (lengths < hi))[:count]
            best = {}
            for layout in ("packed", "padded"):
                arm = Arm(layout, Batching(ids, np.array([0, ids.shape[0]]), layout == "packed"), layout)
                batch = as_trained(collator(method, arm, recipe, opts.seed)(items_of(samples, ids)), arm)
                train_micro(models, batch)
                times = []
                for _ in range(args.repeats):
                    t0 = time.process_time()
                    train_micro(models, batch)
                    times.append(time.process_time() - t0)
                best[layout] = min(times)
            rows.append(
                {
                    "method": method,
                    "band": [lo, hi],
                    "documents": int(ids.shape[0]),
                    "tokens": int(lengths[ids].sum()),
                    "packed_s": best["packed"],
                    "padded_s": best["padded"],
                    "padded_over_packed": best["padded"] / best["packed"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"recipe": args.recipe, "rows": rows}
    (args.out / "drafter_layout.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [
        "# drafter_layout\n",
        f"recipe {args.recipe}; CPU seconds of one train step (best of {args.repeats}), one thread\n",
        "| method | lengths | documents | tokens | packed s | padded s | padded / packed |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['method']} | {r['band'][0]}-{r['band'][1] - 1} | {r['documents']} | {r['tokens']} | "
            f"{r['packed_s']:.3f} | {r['padded_s']:.3f} | {r['padded_over_packed']:.3f} |"
        )
    (args.out / "drafter_layout.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
