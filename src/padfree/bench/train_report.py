"""``padfree bench``'s throughput result as a markdown table and a bar chart."""

from __future__ import annotations

import numpy as np

from padfree.bench.sampling import PADFREE


def markdown(result: dict, command: str = "") -> str:
    c, m = result["config"], result["machine"]
    lines = [
        "# Training throughput per strategy",
        "",
        f"Command: `{command}`" if command else "",
        "",
        f"Machine: {m.get('processor')} ({m.get('cpus')} CPUs), {m.get('platform')}, torch {m.get('torch')} "
        f"({m.get('torch_threads')} threads), transformers {m.get('transformers', '?')}, device "
        f"{m.get('device')}{', ' + m['gpu'] if 'gpu' in m else ''}, precision "
        f"{m.get('precision', 'float32')}; load average at the end "
        f"{m.get('load_average')}.",
        "",
        f"Model {c['model']} {c['model_overrides'] or ''}, budget {c['budget']} tokens per micro-batch, "
        f"{c['samples']} samples ({c['tokens']} tokens) from {c['data']}; "
        + (
            "every strategy trains one whole epoch of them"
            if c["select"] == "epoch"
            else f"{c['steps']} micro-batches per strategy measured, one from each of {c['steps']} equal "
            "strata of its epoch ordered by modeled work per loss token"
        )
        + f", {c['warmup']} warm-up steps first, interleaved in rounds"
        + (f", every round run {c['repeats']} times, fastest time kept" if c.get("repeats", 1) > 1 else "")
        + f"; step = {c['step']}"
        + (
            "; padded rows are right-padded and given the attention mask (transformers then runs a masked "
            "SDPA kernel whenever a micro-batch has a pad)."
            if c.get("padded_mask")
            else "; padded rows are right-padded and trained without an attention mask (a causal LM needs "
            "none: real tokens only see earlier, real ones; pads carry no loss), so SDPA runs is_causal for "
            "every strategy and only the slots differ."
        ),
        "",
        "| strategy | real tok/s | vs sorted | step tok/s median [min, max] | slots/s | padding eff. "
        "(measured / epoch) | steps | rows/step | peak step MB | attention |",
        "|---|---:|---:|---|---:|---|---:|---:|---:|---|",
    ]
    for name, r in result["strategies"].items():
        if "error" in r:
            peak = f" (peak {r['peak_rss_mb']:,.0f} MB)" if r.get("peak_rss_mb") is not None else ""
            lines.append(f"| {name} | — | — | not run: {r['error']}{peak} | | | | | | |")
            continue
        s = r["step_real_tok_per_s"]
        vs = f"{r['vs_sorted']:.2f}x" if "vs_sorted" in r else "—"
        lines.append(
            f"| {name} | {r['real_tok_per_s']:,.0f} | {vs} | {s['median']:,.0f} "
            f"[{s['min']:,.0f}, {s['max']:,.0f}] | {r['slots_per_s']:,.0f} | {r['padding_efficiency']:.3f} / "
            f"{r['bin_padding_efficiency']:.3f} | {r['steps']} | {r['rows_per_step']['median']:.0f} | "
            f"{r['peak_memory_mb']:.0f} | {r['attention']}"
            f"{' — ' + r['attention_path'] if r.get('attention_path') else ''} |"
        )
    lines += [
        "",
        (
            "real tok/s: loss-bearing (non-padding) tokens of the epoch / its seconds, every micro-batch "
            "trained (the same tokens for every strategy)"
            if c["select"] == "epoch"
            else "real tok/s: the epoch's loss-bearing (non-padding) tokens / its estimated seconds (each "
            "measured step's seconds per unit of modeled work x the modeled work of the micro-batches it "
            "stands for: every strategy is compared on the same samples)"
        )
        + "; step tok/s: loss tokens / seconds of each measured step. Padding efficiency: real tokens / "
        "slots the model computed, over the measured steps and over the whole epoch (a packed row computes "
        "its tokens: 1.0; `padfree.core.cost`). Peak step MB: see `memory` in the JSON.",
        "",
    ]
    notes = [f"- `{n}`: {r['note']}" for n, r in result["strategies"].items() if r.get("note")]
    if notes:
        lines += ["Peers:", "", *notes, ""]
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in result["strategies"].items() if "error" not in r]
    rs = [result["strategies"][n] for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    ax = axes[0]
    y = [r["real_tok_per_s"] for r in rs]
    lo = [r["real_tok_per_s"] - r["step_real_tok_per_s"]["min"] for r in rs]
    hi = [r["step_real_tok_per_s"]["max"] - r["real_tok_per_s"] for r in rs]
    colors = ["tab:blue" if n in PADFREE else "tab:gray" for n in names]
    ax.bar(names, y, color=colors, yerr=[np.maximum(lo, 0), np.maximum(hi, 0)], capsize=3)
    ax.set_ylabel("real (loss-bearing) tokens / s")
    ax.set_title(f"training throughput, budget {result['config']['budget']}")
    ax.tick_params(axis="x", rotation=35)
    ax = axes[1]
    ax.bar(names, [r["padding_efficiency"] for r in rs], color=colors)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("padding efficiency (measured steps)")
    ax.tick_params(axis="x", rotation=35)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
