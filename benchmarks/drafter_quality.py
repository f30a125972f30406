"""Acceptance length per training CPU second: DFlash, DFlash2 (and EAGLE-3) drafters trained with padfree's
packed plans, SpecForge-style random padded batches and the field's length-sorted batches, measured by the
engines' own code.

    PYTHONPATH=src python benchmarks/drafter_quality.py --quick --out /tmp/dq      # a few minutes
    PYTHONPATH=src python benchmarks/drafter_quality.py --out benchmarks/results   # the full run (hours)
    PYTHONPATH=src python benchmarks/drafter_quality.py --smoke --out /tmp/dq      # plumbing only (~2 min)

Protocol (:mod:`lab.quality`): a byte-level BPE tokenizer and a small Qwen3 target are trained on the bundled
chats (``fixtures/samples``; rebuilt deterministically into ``--target-dir``, reused when its spec matches);
each training chat's first user turn is answered greedily by that target and the answers are the drafters'
training responses; held-out prompts (never trained on, by target or drafter) are decoded by the ``dflash``
package's ``dflash_generate`` with each exported DFlash drafter (DFlash2: z-lab's folder loaded by their
``DFlash2DraftModel``), EAGLE-3 drafters by speculators' ``Eagle3DraftModel`` forward on the target's greedy
output with chain verification. Every arm trains under the ``specforge`` recipe (DFlash2, which SpecForge has
none of: ``speculators``' with its window off) with one micro-batch of about ``--budget`` real tokens per
optimizer step, for ``--seconds`` CPU seconds (``time.process_time`` of one process, torch on one thread,
evaluation excluded), evaluated at ``--evals`` equal fractions of it and at each epoch's end (equal tokens).
Writes ``NAME.json``, ``NAME.md`` and ``NAME.png`` into ``--out``; one method's run beside another's takes its
own ``--name`` (``--methods dflash2 --name drafter_quality_dflash2``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lab.quality import (  # noqa: E402
    ARMS,
    Job,
    TargetSpec,
    build_target_folder,
    greedy,
    load_decoder,
    prompts_of,
    read_chats,
    regenerate,
    response_samples,
    run_job,
    save_data,
    split,
)
from padfree.options import device_option  # noqa: E402

MODES = {
    "smoke": {
        "spec": TargetSpec(
            vocab=384, hidden=32, layers=8, heads=2, kv_heads=1, intermediate=64, budget=512, epochs=1
        ),
        "per_file": 12,
        "heldout": 3,
        "max_new": 16,
        "max_prompt": 96,
        "seconds": 3.0,
        "evals": 2,
        "epoch_evals": 2,
        "seeds": 1,
        "budget": 512,
        "block_size": 4,
        "ttt": 2,
        "methods": "dflash,dflash2,eagle3",
    },
    "quick": {
        "spec": TargetSpec(
            vocab=1024, hidden=64, layers=8, heads=2, kv_heads=1, intermediate=192, budget=1024
        ),
        "per_file": 60,
        "heldout": 12,
        "max_new": 48,
        "max_prompt": 160,
        "seconds": 15.0,
        "evals": 3,
        "epoch_evals": 2,
        "seeds": 2,
        "budget": 1024,
        "block_size": None,
        "ttt": None,
        "methods": "dflash,dflash2",
    },
    "full": {
        "spec": TargetSpec(vocab=1536, hidden=96, layers=8, heads=3, kv_heads=1, intermediate=288),
        "per_file": 150,
        "heldout": 24,
        "max_new": 96,
        "max_prompt": 320,
        "seconds": 150.0,
        "evals": 5,
        "epoch_evals": 2,
        "seeds": 3,
        "budget": 2048,
        "block_size": None,
        "ttt": None,
        "methods": "dflash,dflash2,eagle3",
    },
    "gpu": {  # Qwen3-0.6B's shape (its vocabulary replaced by the benchmark tokenizer's), trained briefly
        "spec": TargetSpec(
            vocab=8192,
            hidden=1024,
            layers=28,
            heads=16,
            kv_heads=8,
            head_dim=128,
            intermediate=3072,
            budget=8192,
            epochs=2,
            lr=1e-3,
        ),
        "per_file": 150,
        "heldout": 16,
        "max_new": 96,
        "max_prompt": 384,
        "seconds": 30.0,
        "evals": 3,
        "epoch_evals": 2,
        "seeds": 1,
        "budget": 8192,
        "block_size": None,
        "ttt": None,
        "methods": "dflash,dflash2",
    },
}
"""Sizes per mode: the target (:class:`lab.quality.TargetSpec`), chats per set (None: all), held-out
chats, answer and prompt tokens, CPU seconds per arm (GPU: synchronized wall seconds), evaluations along them
and at epoch ends, seeds, tokens per micro-batch, block size and ttt (None: the recipe's), methods."""


DECODERS = {
    "dflash": "z-lab's `dflash` package: `DFlashDraftModel.from_pretrained` + `dflash_generate`",
    "dflash2": "z-lab's `dflash` package: `DFlash2DraftModel.from_pretrained` (its candidate selector) + "
    "`dflash_generate`",
    "eagle3": "speculators' `Eagle3DraftModel.forward` on the target's greedy output, chain-verified",
}
"""What measures each method's acceptance length (:mod:`lab.quality`): the engines' own code."""


def method_lines(methods: list[str]) -> str:
    """One line per method: the package that decodes it and the recipe preset it trains under (the
    ``specforge`` preset, or the method's first where SpecForge has none)."""
    from padfree.drafter import recipes

    off = " (its sliding window off: z-lab's decoder has no per-anchor window)"
    lines = []
    for m in methods:
        r = recipes.get("specforge", m)
        lines.append(
            f"- {m}: decoded by {DECODERS[m]}; trained under the `{r.name}` preset"
            + (off if m == "dflash2" else "")
        )
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--out", type=Path, required=True, help="directory for NAME.json, NAME.md and NAME.png")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smaller target, data and budgets (a few minutes)")
    mode.add_argument("--smoke", action="store_true", help="toy sizes: the plumbing only")
    mode.add_argument(
        "--gpu", action="store_true", help="a Qwen3-0.6B-shaped target, for a GPU (--device cuda)"
    )
    p.add_argument("--name", default=None, help="file stem (default drafter_quality[_quick|_smoke])")
    p.add_argument(
        "--methods", default=None, help="comma-separated: dflash, dflash2, eagle3 (default: the mode's)"
    )
    p.add_argument("--seconds", type=float, default=None, help="training CPU seconds per arm")
    p.add_argument("--evals", type=int, default=None, help="evaluations along the seconds (plus epoch ends)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per arm")
    p.add_argument("--workers", type=int, default=2, help="jobs run at once (one thread each)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the jobs OUT/NAME.partial.json finished (a run cut short, same options) and run the rest",
    )
    p.add_argument("--target-dir", type=Path, default=None, help="the target folder (default OUT/target)")
    p.add_argument("--data", type=Path, default=ROOT / "fixtures" / "samples", help="folder of the chat sets")
    p.add_argument("--device", type=device_option, default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the target's dtype")
    p.add_argument(
        "--attention",
        default=None,
        choices=["dense", "mask", "flex"],
        help="the drafters' attention (default dense on a CPU, flex on a GPU)",
    )
    args = p.parse_args(argv)
    args.attention = args.attention or ("flex" if args.device.startswith("cuda") else "dense")
    args.mode = "smoke" if args.smoke else "quick" if args.quick else "gpu" if args.gpu else "full"
    m = MODES[args.mode]
    args.seconds = args.seconds or m["seconds"]
    args.evals = args.evals or m["evals"]
    args.seeds = args.seeds or m["seeds"]
    args.name = args.name or ("drafter_quality" + ("" if args.mode == "full" else f"_{args.mode}"))
    args.methods = [x for x in (args.methods or m["methods"]).split(",") if x]
    return args


def prepare(args: argparse.Namespace, say=print) -> tuple[dict, Path, int]:
    """The target folder, the drafters' training samples and the held-out prompts with the target's greedy
    outputs (``OUT/data-MODE.npz``); returns ``(target info, data path, held-out prompts)``."""
    m = MODES[args.mode]
    chats = read_chats(args.data, per_file=m["per_file"])
    train, held = split(len(chats), m["heldout"], seed=0)
    folder = args.target_dir or args.out / "target"
    t0 = time.perf_counter()
    info = build_target_folder(
        folder, [chats[i] for i in train], m["spec"], say=say, device=args.device, dtype=args.dtype
    )
    say(f"target ready ({time.perf_counter() - t0:.0f} s): {info['parameters'] / 1e6:.2f}M parameters")
    decoder = load_decoder(folder, dtype=args.dtype, device=args.device)
    eos, pad = int(decoder.config.eos_token_id), int(decoder.config.pad_token_id)
    todo = prompts_of(folder, [chats[i] for i in train], m["max_prompt"])
    prompts = [p for _, p, _ in todo]
    t0 = time.perf_counter()
    answers = regenerate(decoder, prompts, max_new=m["max_new"], eos=eos, pad=pad)
    ended = float(np.mean([len(a) > 0 and a[-1] == eos for a in answers]))
    mean = float(np.mean([len(a) for a in answers]))
    say(
        f"regenerated {len(answers)} answers ({time.perf_counter() - t0:.0f} s): mean {mean:.1f} tokens, "
        f"{ended:.0%} ended by the end marker"
    )
    held_prompts = [p for _, p, _ in prompts_of(folder, [chats[i] for i in held], m["max_prompt"])]
    refs = [greedy(decoder, p, max_new=m["max_new"], eos=eos) for p in held_prompts]
    data = args.out / f"data-{args.mode}.npz"
    save_data(data, response_samples(prompts, answers, [u for _, _, u in todo]), held_prompts, refs)
    lengths = [len(p) + len(a) for p, a in zip(prompts, answers, strict=True)]
    info = {
        **info,
        "regenerated": len(answers),
        "answer_mean_tokens": mean,
        "answers_ended": ended,
        "sample_tokens": {
            "mean": float(np.mean(lengths)),
            "max": int(np.max(lengths)),
            "p10": float(np.percentile(lengths, 10)),
            "p90": float(np.percentile(lengths, 90)),
        },
    }
    return info, data, len(held_prompts)


def jobs_of(args: argparse.Namespace, folder: Path, data: Path) -> list[Job]:
    """Every (method, seed, arm), arms interleaved so that the workers run different arms side by side."""
    m = MODES[args.mode]
    marks = tuple((i + 1) / args.evals for i in range(args.evals))
    return [
        Job(
            method=method,
            arm=arm,
            seed=seed,
            seconds=args.seconds,
            marks=marks,
            target=str(folder),
            data=str(data),
            workdir=str(args.out / "work" / f"{method}-{arm}-{seed}"),
            budget=m["budget"],
            max_new=m["max_new"],
            block_size=m["block_size"],
            ttt=m["ttt"],
            device=args.device,
            dtype=args.dtype,
            attention=args.attention,
            epoch_evals=m["epoch_evals"],
        )
        for method in args.methods
        for seed in range(args.seeds)
        for arm in ARMS
    ]


def finished(partial: Path, key: dict) -> list[dict]:
    """The job results a run cut short wrote to ``partial`` under the same ``key`` (mode, seconds,
    evaluations); refuses a partial file of other options."""
    if not partial.is_file():
        return []
    got = json.loads(partial.read_text())
    if got.get("key", key) != key:
        raise SystemExit(f"{partial}: written under {got['key']}, not {key} (--resume needs the same)")
    return list(got["raw"])


def run_all(jobs: list[Job], workers: int, say=print, partial: Path | None = None, key: dict | None = None,
            done_before: list[dict] | None = None) -> list[dict]:  # fmt: skip
    """The jobs in ``workers`` spawned processes (one torch thread each; in this process when ``workers`` is
    1); CPU seconds are per process. Each finished job is said and, with ``partial``, every result so far is
    written there with ``key`` (a run cut short keeps what it finished). ``done_before``: results kept from
    such a run; their (method, arm, seed) are not run again."""
    out: list[dict] = list(done_before or [])
    kept = {(r["method"], r["arm"], r["seed"]) for r in out}
    jobs = [j for j in jobs if (j.method, j.arm, j.seed) not in kept]
    if kept:
        say(f"{len(kept)} jobs kept from {partial}, {len(jobs)} to run")

    def done(r: dict) -> None:
        last = r["curve"][-1]
        say(
            f"{r['method']} {r['arm']} seed {r['seed']}: acceptance {last['acceptance_length']:.3f} after "
            f"{last['seconds']:.0f} s, {last['epochs']:.2f} epochs"
        )
        out.append(r)
        if partial is not None:
            partial.write_text(json.dumps({"key": key, "raw": out}) + "\n")

    if workers <= 1:
        for j in jobs:
            done(run_job(j))
        return out
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for f in concurrent.futures.as_completed([pool.submit(run_job, j) for j in jobs]):
            done(f.result())
    return out


def reach_time(curve: list[dict], level: float) -> float | None:
    """The first CPU second at which ``curve`` (its mark evaluations) reaches ``level``, interpolated
    linearly between evaluations; ``None`` if it never does."""
    pts = [(c["seconds"], c["acceptance_length"]) for c in curve if c["why"] == "mark"]
    for (s0, a0), (s1, a1) in zip(pts, pts[1:], strict=False):
        if a1 >= level:
            return s0 if a0 >= level else s0 + (s1 - s0) * (level - a0) / (a1 - a0)
    return pts[0][0] if pts and pts[0][1] >= level else None


def summarize(results: list[dict], method: str, seeds: int) -> dict:
    """Per arm: the mean curve over seeds at the marks (and each seed's), the epoch evaluations; the
    targets."""
    by = {(r["arm"], r["seed"]): r["curve"] for r in results if r["method"] == method}
    arms: dict = {}
    for arm in ARMS:
        curves = [by[(arm, s)] for s in range(seeds) if (arm, s) in by]
        marks = [[c for c in cv if c["why"] == "mark"] for cv in curves]
        n = min(len(m) for m in marks)
        al = np.array([[c["acceptance_length"] for c in m[:n]] for m in marks])
        sec = np.array([[c["seconds"] for c in m[:n]] for m in marks])
        tok = np.array([[c["tokens"] for c in m[:n]] for m in marks])
        epochs: dict[str, list[float]] = {}
        for cv in curves:
            for c in cv:
                if c["why"] == "epoch":
                    epochs.setdefault(str(int(c["epochs"])), []).append(c["acceptance_length"])
        arms[arm] = {
            "seconds": sec.mean(0).round(2).tolist(),
            "acceptance_length": al.mean(0).round(4).tolist(),
            "min": al.min(0).round(4).tolist(),
            "max": al.max(0).round(4).tolist(),
            "tokens": tok.mean(0).round(0).tolist(),
            "per_seed": [
                {
                    "seconds": s.round(2).tolist(),
                    "acceptance_length": a.round(4).tolist(),
                    "tokens": t.tolist(),
                }
                for s, a, t in zip(sec, al, tok, strict=True)
            ],
            "at_epoch_end": {
                e: {
                    "mean": float(np.mean(v)),
                    "min": float(np.min(v)),
                    "max": float(np.max(v)),
                    "seeds": len(v),
                }
                for e, v in sorted(epochs.items())
            },
        }
    return {"arms": arms, "targets": targets(by, arms, seeds)}


def targets(by: dict, arms: dict, seeds: int) -> dict:
    """The issue's targets, measured: packed reaches random padded's final acceptance in at most half its CPU
    seconds (per seed); packed's acceptance at equal seconds is above random's beyond the seeds' spread (every
    packed seed above every random seed); at equal tokens (epoch ends all arms reached), sorted vs
    shuffled."""
    p, r = arms["padfree_packed"], arms["specforge_random"]
    ratios = []
    for s in range(seeds):
        if ("padfree_packed", s) not in by or ("specforge_random", s) not in by:
            continue
        rc = [c for c in by[("specforge_random", s)] if c["why"] == "mark"]
        t = reach_time(by[("padfree_packed", s)], rc[-1]["acceptance_length"])
        ratios.append(None if t is None else t / rc[-1]["seconds"])
    beyond = [pm > rM for pm, rM in zip(p["min"], r["max"], strict=False)][1:]  # the first mark is untrained
    common = sorted(set.intersection(*(set(a["at_epoch_end"]) for a in arms.values())), key=int)
    equal_tokens = {e: {arm: arms[arm]["at_epoch_end"][e] for arm in ARMS} for e in common}
    sorted_lower = {
        e: {
            "sorted_mean": v["sorted_fixed"]["mean"],
            "random_mean": v["specforge_random"]["mean"],
            "lower": v["sorted_fixed"]["mean"] < v["specforge_random"]["mean"],
            "beyond_spread": v["sorted_fixed"]["max"] < v["specforge_random"]["min"],
        }
        for e, v in equal_tokens.items()
    }
    return {
        "packed_time_to_random_final_over_random_time": ratios,
        "half_time_met": bool(ratios) and all(x is not None and x <= 0.5 for x in ratios),
        "equal_time_beyond_spread_at_marks": beyond,
        "equal_time_met_at_final": bool(beyond) and beyond[-1],
        "equal_tokens": equal_tokens,
        "sorted_vs_shuffled_at_equal_tokens": sorted_lower,
    }


def table(summary: dict, method: str) -> str:
    arms = summary["arms"]
    lines = [f"\n### {method}: acceptance length (mean over seeds, [min, max]) at equal CPU seconds\n"]
    head = "| arm | " + " | ".join(f"{s:.0f} s" for s in arms["padfree_packed"]["seconds"]) + " |"
    lines += [head, "|---" * (len(arms["padfree_packed"]["seconds"]) + 1) + "|"]
    for arm in ARMS:
        a = arms[arm]
        cells = [
            f"{m:.3f} [{lo:.3f}, {hi:.3f}]"
            for m, lo, hi in zip(a["acceptance_length"], a["min"], a["max"], strict=True)
        ]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines.append(
        "\ntokens trained by the last mark: "
        + ", ".join(f"{arm} {arms[arm]['tokens'][-1]:,.0f}" for arm in ARMS)
    )
    t = summary["targets"]
    if t["equal_tokens"]:
        lines.append(f"\n### {method}: acceptance length at equal tokens (epoch ends every arm reached)\n")
        lines += ["| epochs | " + " | ".join(ARMS) + " |", "|---" * (len(ARMS) + 1) + "|"]
        for e, v in t["equal_tokens"].items():
            cells = [f"{v[a]['mean']:.3f} [{v[a]['min']:.3f}, {v[a]['max']:.3f}]" for a in ARMS]
            lines.append(f"| {e} | " + " | ".join(cells) + " |")
    ratios = ", ".join(
        "never" if x is None else f"{x:.2f}" for x in t["packed_time_to_random_final_over_random_time"]
    )
    lines.append(
        f"\ntargets: packed reaches random's final acceptance at {ratios} of random's CPU time per seed "
        f"(<= 0.5: {'met' if t['half_time_met'] else 'not met'}); packed above random beyond the seeds' "
        f"spread at the final mark: {'met' if t['equal_time_met_at_final'] else 'not met'} (marks: "
        f"{t['equal_time_beyond_spread_at_marks']})"
    )
    for e, v in t["sorted_vs_shuffled_at_equal_tokens"].items():
        lines.append(
            f"- at {e} epoch(s): sorted {v['sorted_mean']:.3f} vs shuffled (random) {v['random_mean']:.3f}: "
            f"sorted {'lower' if v['lower'] else 'not lower'}"
            + (" beyond the spread" if v["beyond_spread"] else "")
        )
    return "\n".join(lines) + "\n"


def plot(summaries: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(summaries)
    fig, axes = plt.subplots(len(methods), 2, figsize=(11, 4 * len(methods)), squeeze=False)
    colors = dict(zip(ARMS, ("tab:green", "tab:red", "tab:blue"), strict=True))
    for row, method in zip(axes, methods, strict=True):
        for arm in ARMS:
            a = summaries[method]["arms"][arm]
            for s in a["per_seed"]:
                row[0].plot(s["seconds"], s["acceptance_length"], color=colors[arm], alpha=0.25, lw=0.8)
                row[1].plot(s["tokens"], s["acceptance_length"], color=colors[arm], alpha=0.25, lw=0.8)
            row[0].plot(
                a["seconds"], a["acceptance_length"], color=colors[arm], lw=2, label=arm, marker="o", ms=3
            )
            row[1].plot(
                a["tokens"], a["acceptance_length"], color=colors[arm], lw=2, label=arm, marker="o", ms=3
            )
        row[0].set(xlabel="training CPU seconds", ylabel="acceptance length", title=f"{method}: equal time")
        row[1].set(xlabel="tokens trained (K)", ylabel="acceptance length", title=f"{method}: equal tokens")
        row[1].xaxis.set_major_formatter(lambda x, _: f"{x / 1e3:.0f}")
        row[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def say(line: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f} s] {line}", file=sys.stderr, flush=True)

    info, data, n_prompts = prepare(args, say)
    folder = args.target_dir or args.out / "target"
    jobs = jobs_of(args, folder, data)
    say(f"{len(jobs)} jobs of {args.seconds:.0f} CPU s each, {args.workers} at once")
    partial = args.out / f"{args.name}.partial.json"
    key = {"mode": args.mode, "seconds": args.seconds, "evals": args.evals}
    before = finished(partial, key) if args.resume else []
    results = run_all(jobs, args.workers, say, partial=partial, key=key, done_before=before)
    seeds = {m: 1 + max((r["seed"] for r in results if r["method"] == m), default=-1) for m in args.methods}
    summaries = {m: summarize(results, m, seeds[m]) for m in args.methods}
    first = args.methods[0]
    out = {
        "arms": summaries[first]["arms"],
        "method": first,
        "methods": summaries,
        "target": info,
        "prompts": n_prompts,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "mode": {k: (str(v) if k == "spec" else v) for k, v in MODES[args.mode].items()},
        "wall_seconds": time.perf_counter() - t0,
        "raw": results,
    }
    (args.out / f"{args.name}.json").write_text(json.dumps(out, indent=1) + "\n")
    md = (
        f"# {args.name}\n\nTarget: {info['parameters'] / 1e6:.2f}M-parameter Qwen3 trained on "
        f"{info['chats']} bundled chats; {info['regenerated']} regenerated answers (mean "
        f"{info['answer_mean_tokens']:.0f} tokens, {info['answers_ended']:.0%} ended by the end marker); "
        f"{n_prompts} held-out prompts; seeds: "
        + ", ".join(f"{m} {n}" for m, n in seeds.items())
        + f"; {args.seconds:.0f} CPU s per arm (one thread).\n\n"
        + method_lines(args.methods)
    )
    md += "".join(table(summaries[m], m) for m in args.methods)
    (args.out / f"{args.name}.md").write_text(md)
    plot(summaries, args.out / f"{args.name}.png")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
