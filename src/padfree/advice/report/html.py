"""The report's page: one self-contained HTML file (inline CSS, base64 images, no request to anywhere)."""

from __future__ import annotations

import html

from padfree.advice.labels import pick

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,Helvetica,Arial,sans-serif;max-width:1120px;
margin:24px auto;padding:0 18px;color:#222;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}h2{font-size:1.25em;margin-top:1.8em;border-bottom:1px solid #ddd}
.sub{color:#666;margin-top:0}.rec{background:#f2f8f2;border-left:5px solid #2ca02c;padding:10px 16px}
.rec .pick{font-size:1.15em;font-weight:600}.rec ul{margin:.4em 0}
table{border-collapse:collapse;font-size:.88em;margin:8px 0}
th,td{padding:3px 9px;text-align:right;border-bottom:1px solid #eee}
th:first-child,td:first-child{text-align:left}
th{background:#fafafa}tr.chosen td{background:#fff6d5;font-weight:600}
img{max-width:100%;display:block;margin:6px 0}.note{color:#555;font-size:.9em}
"""

_SCRIPT = """
(function(){
  function count(){
    var imgs=document.images, n=0;
    for(var i=0;i<imgs.length;i++){ if(imgs[i].complete && imgs[i].naturalWidth>0){ n++; } }
    document.body.setAttribute('data-images-loaded', String(n));
    document.body.setAttribute('data-images-total', String(imgs.length));
  }
  if(document.readyState==='complete'){ count(); } else { window.addEventListener('load', count); }
})();
"""

_COLUMNS = pick(
    "padding_efficiency",
    "relative_throughput",
    "step_divergence",
    "cobatch_repeat",
    "adjacent_corr",
    "imbalance",
    "steps",
)


def render_html(numbers: dict, figures: dict[str, tuple[str, str]]) -> str:
    """The page: inline CSS, base64 images, and one inline script that records how many images loaded."""
    e = html.escape
    d, c, rec = numbers["dataset"], numbers["config"], numbers["recommendation"]
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>padfree report: {e(str(d.get('name', '')))}</title><style>{_CSS}</style></head><body>",
        f"<h1>padfree report: {e(str(d.get('name', '')))}</h1>",
        f"<p class='sub'>{d['samples']:,} samples, {d['tokens']:,} tokens; length p50 {d['p50']:.0f}, "
        f"p90 {d['p90']:.0f}, p99 {d['p99']:.0f}, max {d['max']:,}. Budget {c['budget']:,} tokens per "
        f"micro-batch, world size {c['world_size']} x grad-accum {c['grad_accum']}, seed {c['seed']}, "
        f"cost model a={c['cost']['a']:g} b={c['cost']['b']:.3g} c={c['cost']['c']:g} "
        f"({e(str(c['cost']['source']))}).</p>",
        *([_drafter(numbers["drafter"])] if numbers.get("drafter") else []),
        "<h2 id='recommendation'>Recommendation"
        + (" for the plain language model" if numbers.get("drafter") else "")
        + "</h2><div class='rec'>",
        f"<p class='pick'>{e(rec['label'])}</p><p>{e(rec['why'])}.</p><ul>",
        *[f"<li>{e(r)}</li>" for r in rec["reasons"]],
        "</ul>",
    ]
    if rec.get("alternative"):
        parts.append(f"<p>{e(rec['alternative']['text'])}</p>")
    if rec.get("near_miss"):
        parts.append(f"<p>Close but rejected: {e(rec['near_miss'])}</p>")
    if rec.get("short_epoch"):
        parts.append(
            f"<p><b>Short epoch.</b> {e(rec['short_epoch'][0].upper() + rec['short_epoch'][1:])}.</p>"
        )
    if numbers.get("chunked"):
        parts.append(f"<p><b>Long documents.</b> {e(numbers['chunked']['text'])}.</p>")
    crit = rec["criteria"]
    parts.append(
        f"<p class='note'>Rules, scaled to each plan's epoch: {e(crit['rule'])} (for the pick: co-batch "
        f"repeat &le; {crit['cobatch_repeat_max']:.4g}, adjacent-step correlation "
        + (
            "not judged on so short an epoch"
            if crit["adjacent_corr_max"] is None
            else f"&le; {crit['adjacent_corr_max']:.3g}"
        )
        + f", step divergence &le; {crit['step_divergence_max']:.3f}). "
        f"{len(rec['eligible'])} of {len(numbers['frontier'])} plans pass. Packing supported: "
        f"{'yes' if numbers['packing_supported'] else 'no'}.</p></div>"
    )
    cap = {
        "histogram": "Samples per length (bars) and share of tokens (line); orange lines are the bucket "
        "upper edges the bucketed plan used in epoch 1, after sparse buckets merged (the recommended plan's "
        "when it is bucketed, else the --growth/--buckets plan's).",
        "strategies": "Modeled throughput = real tokens / sum over steps of the most loaded rank's modeled "
        "cost, relative to length-sorted batches.",
        "frontier": "Each point is one plan (epoch 1, co-batch repeat against epoch 0), labelled g (growth), "
        "n (optimal buckets) or m (explicit --mix). Up and to the left is better; dashed lines mark random's "
        "step divergence and the recommended plan's co-batch repeat limit.",
        "rank_load": "Modeled cost of every rank in each step of the recommended plan, relative to the "
        "step's mean rank (1.00 = balanced); a step lasts as long as its most loaded rank.",
        "sources": "Each step's share of each weighted source (stacked); dashed lines are the weights. "
        "Every step holds each share within one document of its weight.",
    }
    for key, (title, b64) in figures.items():
        parts.append(f"<h2 id='{key}'>{e(title)}</h2>")
        parts.append(f"<img alt='{e(title)}' src='data:image/png;base64,{b64}'>")
        parts.append(f"<p class='note'>{e(cap.get(key, ''))}</p>")
        if key == "strategies":
            front = {p["label"]: p for p in numbers["frontier"]}
            parts.append(_table(numbers, [front[lab] for lab in numbers["strategy_labels"].values()]))
        if key == "frontier":
            parts.append(_table(numbers, numbers["frontier"]))
        if key == "sources":
            parts.append(_sources_table(numbers["sources"]))
    parts.append(
        f"<p class='note'>Generated by padfree in {numbers['seconds']:.1f} s (reading the lengths, measuring "
        f"{len(numbers['frontier'])} plans over two epochs each and drawing); the numbers are in "
        "report.json beside this page.</p>"
    )
    parts.append(f"<script>{_SCRIPT}</script></body></html>")
    return "\n".join(parts)


def _sources_table(src: dict) -> str:
    """What the weights cost: per source, its weight and share, samples drawn and passes over it."""
    e = html.escape
    head = "".join(f"<th>{h}</th>" for h in ["source", "weight", "share", "samples", "drawn", "passes"])
    rows = [
        f"<tr><td>{e(n)}</td><td>{r['weight']:.3f}</td><td>{r['share']:.3f}</td><td>{r['samples']:,}</td>"
        f"<td>{r['drawn']:,}</td><td>{r['passes']:.2f}</td></tr>"
        for n, r in src["sources"].items()
    ]
    return (
        f"<p class='note'>{src['strategy']} plan, {src['steps']:,} steps, unit {e(src['unit'])}; worst step "
        f"share error {src['share_error_max']:.3f} document(s). Passes above 1 upsample a source, below 1 "
        f"cap it.</p><table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def _table(numbers: dict, rows: list[dict]) -> str:
    rec = numbers["recommendation"]["label"]
    head = "".join(f"<th>{e}</th>" for e in ["plan", *[m.short for m in _COLUMNS]])
    body = []
    for p in rows:
        cells = "".join(f"<td>{m.show(p.get(m.key))}</td>" for m in _COLUMNS)
        cls = " class='chosen'" if p["label"] == rec else ""
        body.append(f"<tr{cls}><td>{html.escape(p['label'])}</td>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _drafter(d: dict) -> str:
    """The drafter setup's section, first on the page when the report has one: its recommendation beside what
    users run today (SpecForge-style random padded batches), predicted throughput, padding (tokens and anchor
    slots), rank imbalance and the activation peak per strategy, and the offline cache size."""
    from padfree.advice.report import memory_sentence

    e = html.escape
    secs = any("tokens_per_second" in r for r in d["strategies"].values())
    anchored = d.get("uses_anchors", False)
    cols = ["batches", "throughput vs sorted", "tokens / cost unit", "padding eff.", "rank imbalance"]
    cols += ["anchor-slot eff."] if anchored else []
    cols += ["activation peak", "tokens/s"] if secs else ["activation peak"]
    rows = {**d["strategies"], "SpecForge random padded": d["specforge_random"]}
    rec = d["recommendation"]
    body = []
    for name, r in rows.items():
        cells = [
            f"{r['ratio_to_sorted']:.3f}",
            f"{r['tokens_per_unit']:.4g}",
            f"{r['padding_efficiency']:.4f}",
            f"{r['imbalance']:.4f}",
        ]
        if anchored:
            cells.append(f"{r.get('draft_block_efficiency', 1.0):.4f}")
        cells.append(f"{r['peak_bytes'] / 2**30:,.2f} GiB" if "peak_bytes" in r else "-")
        if secs:
            cells.append(f"{r['tokens_per_second']:,.0f}" if "tokens_per_second" in r else "-")
        cls = " class='chosen'" if name == rec["strategy"] else ""
        body.append(f"<tr{cls}><td>{e(name)}</td>{''.join(f'<td>{c}</td>' for c in cells)}</tr>")
    head = "".join(f"<th>{c}</th>" for c in cols)
    c = d["cost"]
    blocks = f", {d['draft_blocks']:,} {e(d.get('title', ''))} blocks per epoch" if anchored else ""
    per = f" ({d['anchors_per_sample']:.1f} anchors per sample)" if anchored else ""
    base, pick = d["specforge_random"], d["strategies"][rec["strategy"]]
    slots = f", their anchor slots {base.get('draft_block_efficiency', 1.0):.1%} real" if anchored else ""
    return (
        f"<h2 id='drafter'>Drafter setup: {e(d['method'])}, recipe {e(str(d.get('recipe', '')))}</h2>"
        f"<div class='rec'><p class='pick'>{e(rec['strategy'])}</p><p>For this "
        f"{e(d.get('title', d['method']))} drafter, padfree's {e(rec['strategy'])} plan is predicted "
        f"{rec['over_specforge_random']:.2f}x the throughput of SpecForge-style random padded batches at "
        f"{d['world_size']} ranks: their tokens are {base['padding_efficiency']:.1%} real{slots}, their "
        f"rank imbalance {base['imbalance']:.3f} (padfree's {pick['imbalance']:.3f}); "
        f"{e(memory_sentence(d))}.</p></div>"
        f"<p class='note'>{e(d.get('recipe_line', ''))}{per}. Predicted throughput of a frozen target + "
        f"drafter step (the drafter's anchors in every plan{blocks}; cost model a={c['a']:.3g} "
        f"b={c['b']:.3g} c={c['c']:.3g} d={c['d']:.3g} e={c['e']:.3g}, {e(str(c['source']))}). An offline "
        f"hidden-state cache of this dataset: <b>{d['cache_bytes'] / 2**30:,.1f} GiB</b> ({d['tokens']:,} "
        f"tokens x {d['cache_layers']} layers x {d['hidden']} x {d['cache_bytes_per_value']} bytes). Loss "
        f"counts: {e(str(d['loss_counts']))}.</p>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    )
