"""Does ``padfree report`` decide well on real length sets? Issue 19's done-when checked at every shape.

On every length set in ``--lengths`` (each ``*.npy``; an ``.assistant.npy`` holds the loss-bearing counts
of its set, not a set: ``padfree report`` takes no loss counts, so they are skipped) and in
``fixtures/lengths`` (files equal byte for byte are one set), at shapes 1x4, 2x4, 4x4, 8x4 and budgets
4096, 8192, 16384, the report's own :func:`padfree.advice.report.decision.build_report` (what
``padfree report --overlong truncate`` runs, window by window on large sets; only the page's figures are
left out) measures the strategies and the frontier, and its decision is taken with and without
``--no-packing`` (the same measured points; ``--no-packing`` is the call ``build_report`` makes itself).
Checked, per case:

- ``random_with_faster``: with ``--no-packing`` the pick is a padded plan that is not random and not frozen
  (co-batch repeat < decision.FROZEN) whenever such a plan models >= decision.SPEEDUP x random's throughput;
- ``frozen_pick``: never a frozen plan while one that is not frozen exists;
- ``limit_unreachable``: every limit the report prints on a fraction or a correlation (co-batch repeat,
  adjacent-step correlation; in the recommendation and in every rejection) is below 1, so it can be
  exceeded;
- ``readme``: the README's "What make demo shows" table (seed_mix, budget 16384, 8 x 4) against the
  report's own numbers for the same case, and the README's mixing claims (packed steps mix like a shuffle's;
  bucketed's gap is the price of few micro-batches) against the medians measured here.

    PYTHONPATH=src python benchmarks/decision_check.py --lengths ../shared/data/lengths \\
        --out benchmarks/results
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import time
from pathlib import Path
from unittest import mock

import numpy as np

from padfree.advice.report import decision
from padfree.core.config import PlanConfig

BUDGETS = (4096, 8192, 16384)
SHAPES = ((1, 4), (2, 4), (4, 4), (8, 4))
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "lengths"
_LIMITS = re.compile(
    r"(co-batch repeat|adjacent-step correlation)[^;()]*?(?:\(limit |> )([-+]?\d+(?:\.\d+)?(?:e-?\d+)?)"
)


def sets(folders: list[Path]) -> dict[str, tuple[Path, list[str]]]:
    """``name -> (file, [folders holding an identical file])``; ``.assistant.npy`` files are skipped."""
    out: dict[str, tuple[Path, list[str]]] = {}
    seen: dict[str, str] = {}
    for folder in folders:
        for f in sorted(folder.glob("*.npy")):
            if f.name.endswith(".assistant.npy"):
                continue
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            name = seen.setdefault(digest, f.name[: -len(".npy")])
            if name in out:
                out[name][1].append(str(folder))
            else:
                out[name] = (f, [str(folder)])
    return out


def printed_limits(rec: dict) -> list[tuple[str, float]]:
    """Every (metric, limit) the recommendation prints: its text and every rejected plan's reasons."""
    texts = [rec["text"], *(r for rules in rec["rejected"].values() for r in rules)]
    return [(m.group(1), float(m.group(2))) for t in texts for m in _LIMITS.finditer(t)]


def faster_padded(points: list[decision.Point]) -> list[decision.Point]:
    """Padded plans other than random that do not freeze and model >= SPEEDUP x random's throughput."""
    rand = float(next(p for p in points if p.label == "random").metrics["modeled_throughput"])
    return [
        p
        for p in points
        if not p.config.packed
        and p.label != "random"
        and not decision.frozen(p.metrics)
        and float(p.metrics["modeled_throughput"]) >= decision.SPEEDUP * rand
    ]


def check(points: list[decision.Point], rec: dict, packing: bool) -> list[str]:
    """The done-when rules the decision ``rec`` breaks (empty: none)."""
    by = {p.label: p for p in points}
    chosen, rand = by[rec["label"]], by["random"]
    bad = []
    if decision.frozen(chosen.metrics) and any(not decision.frozen(p.metrics) for p in points):
        bad.append("frozen_pick")
    faster = faster_padded(points)
    if not packing and faster and (chosen.config.packed or chosen is rand or decision.frozen(chosen.metrics)):
        bad.append(f"random_with_faster ({faster[0].label})")
    crit = rec["criteria"]
    if not crit["cobatch_repeat_max"] < 1 or (
        crit["adjacent_corr_max"] is not None and not crit["adjacent_corr_max"] < 1
    ):
        bad.append("limit_unreachable (criteria)")
    for metric, lim in printed_limits(rec):
        if not lim < 1:
            bad.append(f"limit_unreachable ({metric} limit {lim:g})")
    return bad


def run_case(lengths: np.ndarray, path: Path, name: str, budget: int, world: int, accum: int) -> dict:
    base = PlanConfig(
        strategy="bucketed", budget=budget, world_size=world, grad_accum=accum, overlong="truncate"
    )
    t0 = time.perf_counter()
    with mock.patch.object(decision, "recommend", wraps=decision.recommend) as spy:
        numbers, _ = decision.build_report(lengths, base, name=name, path=str(path), packing=False)
    seconds = time.perf_counter() - t0
    points = spy.call_args.args[0]
    mps = world * accum
    recs = {"no_packing": numbers["recommendation"], "packing": decision.recommend(points, True, mps)}
    by = {p.label: p.metrics for p in points}
    rand = by["random"]
    row: dict = {
        "set": name,
        "samples": int(lengths.shape[0]),
        "overlong": int((lengths > budget).sum()),
        "budget": budget,
        "shape": f"{world}x{accum}",
        "micro_per_step": mps,
        "seconds": round(seconds, 2),
        "plans": {
            lab: {
                "padding_efficiency": round(float(by[lab]["padding_efficiency"]), 4),
                "vs_random_throughput": round(
                    float(by[lab]["modeled_throughput"]) / float(rand["modeled_throughput"]), 3
                ),
                "step_divergence": round(float(by[lab]["step_divergence"]), 4),
                "cobatch_repeat": None
                if by[lab]["cobatch_repeat"] is None
                else round(float(by[lab]["cobatch_repeat"]), 4),
                "steps": int(by[lab]["steps"]),
            }
            for lab in ("random", "sorted", "packed", decision._label(base))
        },
    }
    for key, rec in recs.items():
        m = by[rec["label"]]
        row[key] = {
            "pick": rec["label"],
            "padding_efficiency": round(float(m["padding_efficiency"]), 4),
            "vs_random_throughput": round(
                float(m["modeled_throughput"]) / float(rand["modeled_throughput"]), 3
            ),
            "divergence_ratio": round(float(m["step_divergence"]) / float(rand["step_divergence"]), 3)
            if rand["step_divergence"] > 0
            else None,
            "cobatch_repeat": None if m["cobatch_repeat"] is None else round(float(m["cobatch_repeat"]), 4),
            "steps": int(m["steps"]),
            "mixing_gap_said": rec["mixing_gap"] is not None,
            "faster_padded": [p.label for p in faster_padded(points)],
            "near_miss": rec["near_miss"],
            "limits": printed_limits(rec),
            "violations": check(points, rec, key == "packing"),
        }
    return row


def readme_claims(rows: list[dict], readme: Path) -> dict:
    """The README's demo table against the report's numbers for seed_mix at 16384, 8 x 4, and its mixing
    claims against the medians measured here."""
    out: dict = {"table": [], "claims": []}
    text = readme.read_text(encoding="utf-8") if readme.exists() else ""
    demo = next(
        (r for r in rows if r["set"] == "seed_mix.cl100k" and r["budget"] == 16384 and r["shape"] == "8x4"),
        None,
    )
    cols = ("sorted", "random", "bucketed (growth 1.25)", "packed")
    for metric, key, digits in (
        ("padding efficiency", "padding_efficiency", None),
        ("step divergence", "step_divergence", 2),
        ("co-batch repeat", "cobatch_repeat", 3),
    ):
        row = re.search(rf"^\| {metric}[^|]*\|([^\n]*)\|$", text, re.M)
        if row is None or demo is None:
            continue
        said = [c.strip() for c in row.group(1).split("|")]
        for col, s in zip(cols, said, strict=False):
            got = demo["plans"][col][key]
            d = digits if digits is not None else len(s.split(".")[1]) if "." in s else 0
            out["table"].append(
                {"metric": metric, "plan": col, "readme": s, "measured": got, "ok": f"{got:.{d}f}" == s}
            )
    ratio: dict[int, list[float]] = {
        k: [] for k in (4, 8, 16, 32)
    }  # bucketed / random step divergence by micro-batches per step
    packed: list[float] = []
    for r in rows:
        p = r["plans"]
        rd = p["random"]["step_divergence"]
        if rd > 0:
            ratio[r["micro_per_step"]].append(p["bucketed (growth 1.25)"]["step_divergence"] / rd)
            packed.append(p["packed"]["step_divergence"] / rd)
    med = {k: round(statistics.median(v), 2) for k, v in ratio.items() if v}
    out["bucketed_median_ratio"] = med
    out["packed_ratio_max"] = round(max(packed), 3) if packed else None
    out["packed_within_1_2"] = f"{sum(x <= decision.DIVERGENCE_RATIO for x in packed)} of {len(packed)}"
    within = sum(x <= decision.DIVERGENCE_RATIO for x in packed)
    count = re.search(r"within 1\.2x random's\s+step\s+divergence\s+in\s+(\d[\d,]*)\s+of\s+(\d[\d,]*)", text)
    out["claims"] = [
        {
            "claim": "packed steps mix like a shuffle's: "
            + (
                " ".join(count.group(0).split())
                if count
                else "(no count of cases within 1.2x random's found in the README)"
            ),
            "ok": count is not None
            and (int(count.group(1).replace(",", "")), int(count.group(2).replace(",", "")))
            == (within, len(packed)),
            "measured": f"{out['packed_within_1_2']} cases; worst {out['packed_ratio_max']} x",
        },
        {
            "claim": "bucketed's gap is the price of few micro-batches per step (median ratio > 1 at 4, "
            "falling with micro-batches per step, < 1 at >= 16)",
            "ok": len(med) == 4
            and med[4] > 1
            and med[16] < 1
            and med[32] < 1
            and all(med[a] >= med[b] for a, b in ((4, 8), (8, 16), (16, 32))),
            "measured": ", ".join(f"{v:.2f} x at {k}" for k, v in med.items()),
        },
    ]
    return out


def markdown(result: dict) -> str:
    s = result["summary"]
    lines = [
        "# The report's decision on real length sets (issue 19's done-when)",
        "",
        f"Command: `{result['command']}` ({result['seconds']:.0f} s). Each case is `build_report` as "
        "`padfree report --overlong truncate` runs it; the decision taken with `--no-packing` and without.",
        "",
        f"{s['cases']} cases ({s['sets']} sets x budgets {', '.join(map(str, BUDGETS))} x shapes "
        f"{', '.join(f'{w}x{g}' for w, g in SHAPES)}), x 2 decisions. Violations: **{s['violations']}**"
        + (f" ({'; '.join(s['violation_list'])})" if s["violation_list"] else "")
        + ".",
        "",
        f"- `--no-packing`: a padded plan that does not freeze models >= {decision.SPEEDUP} x random's "
        f"throughput in {s['faster_exists']} cases; the pick is one of them in {s['faster_picked']}. "
        f"Random is picked in {s['random_picked']} cases, a frozen plan in {s['frozen_picked']}. The pick "
        f"models a median {s['median_speedup']:.2f} x random's throughput (min {s['min_speedup']:.2f}) at "
        f"padding efficiency median {s['median_eff']:.3f}; its steps mix worse than random's (and the "
        f"report says so) in {s['gap_said']} cases.",
        f"- Limits printed: {s['limits_printed']}, the largest co-batch repeat limit "
        f"{s['max_repeat_limit']:g}, the largest adjacent-step correlation limit "
        f"{s['max_adj_limit']:g}: every one below 1.",
        f"- Slowest case: {s['slowest']['set']} {s['slowest']['budget']} {s['slowest']['shape']}, "
        f"{s['slowest']['seconds']:.0f} s (window by window).",
        "",
        "## The README against the report's numbers",
        "",
        "Demo table (seed_mix.cl100k = the bundled seed_mix, budget 16384, 8 x 4):",
        "",
        "| metric | plan | README | measured | same |",
        "|---|---|---:|---:|---|",
    ]
    rc = result["readme"]
    for t in rc["table"]:
        lines.append(
            f"| {t['metric']} | {t['plan']} | {t['readme']} | {t['measured']} | "
            f"{'yes' if t['ok'] else 'NO'} |"
        )
    lines += ["", "| claim | measured here | holds |", "|---|---|---|"]
    for c in rc["claims"]:
        lines.append(f"| {c['claim']} | {c['measured']} | {'yes' if c['ok'] else 'NO'} |")
    lines += [
        "",
        "## Every case, `--no-packing`",
        "",
        "pick: the recommendation; x random: its modeled throughput over random's; div: its step divergence "
        "over random's (- where random's is 0: a one-step epoch); repeat: its co-batch repeat; gap said: the "
        "report says its steps mix worse than random's, and why.",
        "",
        "| set | budget | shape | steps | pick | eff | x random | div | repeat | gap said | violations |",
        "|---|---:|---|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for r in result["cases"]:
        n = r["no_packing"]
        lines.append(
            f"| {r['set']} | {r['budget']} | {r['shape']} | {n['steps']} | {n['pick']} | "
            f"{n['padding_efficiency']:.3f} | {n['vs_random_throughput']:.2f} | "
            f"{'-' if n['divergence_ratio'] is None else format(n['divergence_ratio'], '.2f')} | "
            f"{n['cobatch_repeat']} | {'yes' if n['mixing_gap_said'] else ''} | "
            f"{', '.join(n['violations'] + ['packing: ' + v for v in r['packing']['violations']])} |"
        )
    lines += [
        "",
        "## With packing: the pick",
        "",
        "| pick | cases |",
        "|---|---:|",
    ]
    for k, v in s["packing_picks"].items():
        lines.append(f"| {k} | {v} |")
    return "\n".join(lines) + "\n"


def summarize(rows: list[dict]) -> dict:
    viol = [
        f"{r['set']} {r['budget']} {r['shape']} {key}: {v}"
        for r in rows
        for key in ("no_packing", "packing")
        for v in r[key]["violations"]
    ]
    nop = [r["no_packing"] for r in rows]
    faster = [r for r in rows if r["no_packing"]["faster_padded"]]
    lims = [x for r in rows for key in ("no_packing", "packing") for x in r[key]["limits"]]
    picks: dict[str, int] = {}
    for r in rows:
        picks[r["packing"]["pick"]] = picks.get(r["packing"]["pick"], 0) + 1
    slow = max(rows, key=lambda r: r["seconds"])
    return {
        "cases": len(rows),
        "sets": len({r["set"] for r in rows}),
        "violations": len(viol),
        "violation_list": viol,
        "faster_exists": len(faster),
        "faster_picked": sum(r["no_packing"]["pick"] in r["no_packing"]["faster_padded"] for r in faster),
        "random_picked": sum(n["pick"] == "random" for n in nop),
        "frozen_picked": sum((n["cobatch_repeat"] or 0) >= decision.FROZEN for n in nop),
        "median_speedup": statistics.median(n["vs_random_throughput"] for n in nop),
        "min_speedup": min(n["vs_random_throughput"] for n in nop),
        "median_eff": statistics.median(n["padding_efficiency"] for n in nop),
        "gap_said": sum(n["mixing_gap_said"] for n in nop),
        "limits_printed": len(lims),
        "max_repeat_limit": max((v for m, v in lims if m == "co-batch repeat"), default=0.0),
        "max_adj_limit": max((v for m, v in lims if m != "co-batch repeat"), default=0.0),
        "packing_picks": dict(sorted(picks.items(), key=lambda kv: -kv[1])),
        "slowest": {k: slow[k] for k in ("set", "budget", "shape", "seconds")},
    }


def rescore(args: argparse.Namespace) -> None:
    """Rewrite the summary, the README comparison and the markdown of ``OUT/NAME.json`` from its cases (the
    README is read anew; nothing is measured again)."""
    path = args.out / f"{args.name}.json"
    result = json.loads(path.read_text(encoding="utf-8"))
    rows = result["cases"]
    result["summary"] = summarize(rows)
    result["readme"] = readme_claims(rows, Path(__file__).resolve().parent.parent / "README.md")
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (args.out / f"{args.name}.md").write_text(markdown(result), encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--lengths", type=Path, action="append", required=True, help="folder of *.npy sets")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default=None, help="comma-separated substrings: only matching sets")
    ap.add_argument("--name", default="decision_check", help="output file stem")
    ap.add_argument(
        "--rescore",
        action="store_true",
        help="re-read the README and rewrite OUT/NAME.{json,md}; no measuring",
    )
    args = ap.parse_args()
    if args.rescore:
        return rescore(args)
    t0 = time.perf_counter()
    found = sets([*args.lengths, FIXTURES])
    if args.only:
        found = {k: v for k, v in found.items() if any(s in k for s in args.only.split(","))}
    rows: list[dict] = []
    # large sets last, and the results written after every set, so a cut-short run still says what it did
    for name, (path, where) in sorted(found.items(), key=lambda kv: kv[1][0].stat().st_size):
        lengths = np.load(path)
        for budget in BUDGETS:
            for world, accum in SHAPES:
                row = run_case(lengths, path, name, budget, world, accum)
                row["found_in"] = where
                rows.append(row)
                flag = row["no_packing"]["violations"] + row["packing"]["violations"]
                print(
                    f"{name:40s} {budget:5d} {world}x{accum} {row['seconds']:6.1f}s -> "
                    f"{row['no_packing']['pick']} | packing: {row['packing']['pick']}"
                    + (f"  VIOLATION {flag}" if flag else ""),
                    flush=True,
                )
        write(args, rows, t0)


def write(args: argparse.Namespace, rows: list[dict], t0: float) -> None:
    result: dict = {
        "command": "PYTHONPATH=src python benchmarks/decision_check.py "
        + " ".join(f"--lengths {p}" for p in args.lengths)
        + f" --out {args.out}"
        + (f" --only {args.only}" if args.only else ""),
        "seconds": round(time.perf_counter() - t0, 1),
        "summary": summarize(rows),
        "readme": readme_claims(rows, Path(__file__).resolve().parent.parent / "README.md"),
        "cases": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (args.out / f"{args.name}.md").write_text(markdown(result), encoding="utf-8")
    s = result["summary"]
    print(f"{s['cases']} cases, {s['violations']} violations; {result['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
