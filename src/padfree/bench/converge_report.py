"""``padfree bench --converge``'s result as a markdown table and a plot of the held-out curves."""

from __future__ import annotations


def markdown(result: dict, command: str = "") -> str:
    c, m, comp = result["config"], result["machine"], result["comparison"]
    lines = [
        "# Convergence per strategy (held-out loss at equal tokens)",
        "",
        f"Command: `{command}`" if command else "",
        "",
        f"Machine: {m.get('processor')} ({m.get('cpus')} CPUs), torch {m.get('torch')} "
        f"({m.get('torch_threads')} threads), device {m.get('device')}.",
        "",
        f"Model {c['model']} {c['model_overrides']}; data {c['data']}: {c['train_samples']} training samples "
        f"({c['train_samples_tokens']:,} loss tokens), {c['eval_samples']} held out ({c['eval_tokens']:,} "
        f"loss tokens); budget {c['budget']} tokens per micro-batch x grad_accum {c['grad_accum']}"
        + (
            " (steps held to the same size: packed at that budget, every other strategy at the smallest "
            "budget whose epoch has no more optimizer steps than packed's; budgets "
            + ", ".join(f"{n} {b}" for n, b in c["budgets"].items())
            + ")"
            if c.get("equal_steps")
            else " for every strategy (steps not matched: padded plans take more, smaller steps)"
        )
        + "; "
        f"{c['train_tokens']:,} loss tokens per run; lr {c['lr']:g}, {c['schedule']}; eval every "
        f"{c['eval_every']:,} tokens.",
        "",
        "| strategy | held-out loss at start | at the target | vs random | steps | real tokens/step | "
        "step-loss jitter (std of diffs) | corr(step loss, log mean length) | train s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rel = comp.get("final_rel_diff_vs_random", {})
    for name, r in result["strategies"].items():
        final = comp["loss_at_marks"][name][-1]
        o = r["oscillation"]
        jit = "—" if o["step_diff_std"] is None else f"{o['step_diff_std']:.3f}"
        cor = "—" if o["loss_length_corr"] is None else f"{o['loss_length_corr']:+.2f}"
        vs = f"{rel[name]:+.2%}" if name in rel else "—"
        lines.append(
            f"| {name} | {r['initial_loss']:.4f} | {final:.4f} | {vs} | {len(r['steps'])} | "
            f"{r.get('mean_step_tokens', 0):,.0f} | {jit} | {cor} | "
            f"{r['train_seconds']:.0f} |"
        )
    if "equal_steps_rel_diff_vs_random" in comp:
        sm = int(comp["step_marks"][-1])
        lines += [
            "",
            f"At equal optimizer steps instead (step {sm}, the fewest any strategy took; held-out loss "
            "interpolated in steps): "
            + ", ".join(
                f"{n} {comp['loss_at_step_marks'][n][-1]:.4f} ({v:+.2%} vs random)"
                for n, v in comp["equal_steps_rel_diff_vs_random"].items()
            )
            + ". Steps taken to reach the token target: "
            + ", ".join(f"{n} {v}" for n, v in comp["final_steps"].items())
            + ".",
        ]
    lines += ["", "Held-out loss at each eval mark (interpolated in tokens):", ""]
    names = list(result["strategies"])
    lines.append("| tokens | " + " | ".join(names) + " |")
    lines.append("|---:|" + "---:|" * len(names))
    for i, t in enumerate(comp["marks"]):
        lines.append(
            f"| {int(t):,} | " + " | ".join(f"{comp['loss_at_marks'][n][i]:.4f}" for n in names) + " |"
        )
    lines.append("")
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"sorted": "tab:red", "random": "tab:gray", "bucketed": "tab:blue", "packed": "tab:green"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    ax = axes[0]
    for name, r in result["strategies"].items():
        t = [c["tokens"] for c in r["curve"]]
        ax.plot(t, [c["loss"] for c in r["curve"]], marker="o", ms=3, label=name, color=colors.get(name))
    ax.set_xlabel("loss tokens seen")
    ax.set_ylabel("held-out loss")
    ax.set_title("held-out loss (same tokens, same LR schedule)")
    ax.legend()
    ax = axes[1]
    for name, r in result["strategies"].items():
        t = [s["tokens"] for s in r["steps"]]
        ax.plot(t, [s["loss"] for s in r["steps"]], lw=0.8, alpha=0.8, label=name, color=colors.get(name))
    ax.set_xlabel("loss tokens seen")
    ax.set_ylabel("training loss per optimizer step")
    ax.set_title("training loss per step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
