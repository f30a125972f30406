"""``padfree check-drafter`` over every real sample file and tokenizer in ../shared (both methods, every
recipe; per document packed and padded, and ``--leaky``): a markdown table and JSON of what each run reports.

Runs the check in one process (``padfree.drafter.check.check_drafter``, what the CLI calls) to pay the
imports once; each row states the equivalent CLI command. A file that cannot be read is a row with the
reason.

    python benchmarks/check_drafter_sweep.py --out benchmarks/results/check_drafter_sweep
    python benchmarks/check_drafter_sweep.py --layouts packed --shard 0/2 --out DIR0 &   # half the files
    python benchmarks/check_drafter_sweep.py --layouts packed --shard 1/2 --out DIR1     # the other half

At the recipes' density (every valid position an anchor, up to 512) the drafter's LM head over the
tokenizer's vocabulary dominates: a row of the 129K-token tokenizer takes about a minute on one core.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "samples"
TOKENIZERS = Path(__file__).resolve().parents[1] / ".." / "shared" / "tokenizers"
RUNS = (("packed", False), ("padded", False), ("packed", True), ("padded", True))


def main() -> None:
    from padfree.commands.check_drafter import SCAN, drafting_documents, supervised_window
    from padfree.data.samples import load_samples
    from padfree.drafter import recipes
    from padfree.drafter.check import check_drafter
    from padfree.drafter.methods import METHODS
    from padfree.errors import PadfreeError

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--tokenizers", type=Path, default=TOKENIZERS)
    p.add_argument("--docs", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--recipes", default=",".join(recipes.NAMES), help="comma-separated recipe presets")
    p.add_argument("--layouts", default="packed,padded", help="comma-separated: packed, padded")
    p.add_argument("--shard", default="0/1", help="I/N: run every N-th file from the I-th (N processes)")
    a = p.parse_args()
    shard, shards = (int(x) for x in a.shard.split("/"))
    layouts = a.layouts.split(",")
    toks = sorted(t for t in a.tokenizers.iterdir() if t.suffix in (".model", ".json"))
    rows = []
    for f in sorted(a.data.glob("*.jsonl*"))[shard::shards]:
        for tok in toks:
            try:
                read = [
                    supervised_window(d, a.max_tokens) for d in load_samples([f], tok, limit=SCAN * a.docs)
                ]
            except PadfreeError as e:
                rows.append({"file": f.name, "tokenizer": tok.name, "error": str(e)})
                print(f.name, tok.name, "unreadable:", e, flush=True)
                continue
            for method, name, layout, leaky in (
                (m, n, lay, lk)
                for m in METHODS
                for n in a.recipes.split(",")
                for lay, lk in RUNS
                if lay in layouts
            ):
                cmd = (
                    f"padfree check-drafter --method {method} --recipe {name} --data {f.name} --tokenizer "
                    f"{tok.name} --docs {a.docs} --max-tokens {a.max_tokens} --layout {layout}"
                    + (" --leaky" if leaky else "")
                )
                row: dict = {"file": f.name, "tokenizer": tok.name, "method": method, "recipe": name}
                row |= {"layout": layout, "leaky": leaky, "command": cmd}
                try:
                    recipe = recipes.get(name, method)
                    samples, row["passed_over"] = drafting_documents(read, a.docs, recipe)
                    r = check_drafter(method, samples, recipe=recipe, leaky=leaky, layout=layout)
                except PadfreeError as e:  # what the CLI prints on one line with exit 2
                    row |= {"exit": 2, "verdict": "refused", "reason": str(e)}
                else:
                    row |= {
                        "exit": 0 if r.ok else 1,
                        "verdict": "OK" if r.ok else "LEAK",
                        "reason": r.reason,
                        "max_hidden_diff": r.max_hidden_diff,
                        "docs_differ": r.docs_differ,
                        "cross_pairs": r.cross_pairs,
                        "cross_inputs": r.cross_inputs,
                        "cross_labels": r.cross_labels,
                        "cross_supervised": r.cross_supervised,
                    }
                rows.append(row)
                print(json.dumps(row), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "| file | tokenizer | method | recipe | layout | leaky | exit | docs differ | cross pairs"
        " | cross inputs | cross labels | of which supervised | reason |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for x in rows:
        head = f"| {x['file']} | {x['tokenizer']} | "
        if "error" in x:
            lines.append(head + f"- | - | - | - | - | | | | | | unreadable: {x['error']} |")
            continue
        keys = ("docs_differ", "cross_pairs", "cross_inputs", "cross_labels", "cross_supervised")
        counts = " | ".join(str(x.get(k, "")) for k in keys)
        run = f"{x['method']} | {x['recipe']} | {x['layout']} | {'yes' if x['leaky'] else 'no'} | {x['exit']}"
        lines.append(head + f"{run} | {counts} | {x['reason'] or 'OK'} |")
    (a.out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
