"""Drafter training speed by batching, in one run on this CPU: supervised draft positions per second and
anchor coverage (DFlash and EAGLE-3, tiny frozen target + one-layer drafter), and modeled rank imbalance at 8
ranks on the seed_mix.

    PYTHONPATH=src python benchmarks/drafter_speed.py --quick --out benchmarks/results
    PYTHONPATH=src python benchmarks/drafter_speed.py --out benchmarks/results

Arms and protocol: :mod:`padfree.bench.drafter` and benchmarks/README.md. Data: real chat, math and code
samples (/work/shared/data/samples, or ``--data``) tokenized with the 32K SentencePiece tokenizer, loss on
assistant turns, cut to the budget; token ids folded modulo ``--vocab`` (a speed knob: the tiny models'
LM heads). Writes ``NAME.json`` ({"method": {"dflash": {ARM: {"draft_pos_per_s", "anchor_coverage",
"imbalance"}}, "eagle3": ...}, ...}) and ``NAME.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from padfree.bench.drafter import (
    ARMS,
    PUBLIC_TARGETS,
    bench_models,
    coverage,
    epoch_rate,
    make_arms,
    modeled_imbalance,
    sample_anchors,
    speed,
)
from padfree.bench.machine import machine_info
from padfree.core.anchors import AnchorPolicy, anchor_quota
from padfree.core.config import CostModel
from padfree.drafter.methods import METHODS, cost_model

SHARED = Path("/work/shared")
CHAT = ["self_instruct_t0", "hh_rlhf_harmless_test", "gsm8k", "gpteacher_codegen",
        "gpteacher_roleplay_toolformer", "humaneval", "python_stdlib_code"]  # fmt: skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer samples and micro-batches (~5 min)")
    p.add_argument("--out", type=Path, required=True, help="directory for NAME.json and NAME.md")
    p.add_argument("--name", default=None, help="file stem (default drafter_speed[_quick])")
    p.add_argument("--data", nargs="*", default=None, help="sample files (default: shared chat/code sets)")
    p.add_argument("--tokenizer", default=str(SHARED / "tokenizers/llama_sp32k.model"))
    p.add_argument("--per-file", type=int, default=None, help="samples per file (quick 150, full 400)")
    p.add_argument("--budget", type=int, default=2048,
                   help="tokens per micro-batch (2048: random padded batches keep about the share of "
                   "real tokens they kept in the motivating case)")  # fmt: skip
    p.add_argument("--micro", type=int, default=None, help="timed micro-batches per arm (quick 8, full 24)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=16, help="target layers (the drafter has one)")
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lengths", type=Path, default=SHARED / "data/lengths/seed_mix.cl100k.npy",
                   help="lengths for the modeled imbalance (default: the seed_mix)")  # fmt: skip
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--imbalance-budget", type=int, default=16384)
    p.add_argument(
        "--target-config",
        choices=sorted(PUBLIC_TARGETS),
        default=None,
        help="a public target's sizes (random weights) instead of --hidden/--layers/--vocab",
    )
    p.add_argument(
        "--device", default="cpu", help="cpu, or cuda (seconds are then synchronized wall seconds)"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="bfloat16: autocast")
    p.add_argument("--attention", default=None, choices=["dense", "mask", "flex"],
                   help="the drafters' attention (default dense on a CPU, flex on a GPU)")  # fmt: skip
    args = p.parse_args(argv)
    args.attention = args.attention or ("flex" if args.device.startswith("cuda") else "dense")
    own = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "intermediate": 4 * args.hidden}
    args.sizes = dict(PUBLIC_TARGETS[args.target_config]) if args.target_config else own
    args.hidden, args.layers, args.vocab = args.sizes["hidden"], args.sizes["layers"], args.sizes["vocab"]
    args.per_file = args.per_file or (150 if args.quick else 400)
    args.micro = args.micro or (8 if args.quick else 24)
    args.name = args.name or ("drafter_speed_quick" if args.quick else "drafter_speed")
    return args


def load(args: argparse.Namespace) -> list[dict]:
    from padfree.data.samples import load_samples

    files = args.data or [str(SHARED / f"data/samples/{n}.jsonl.gz") for n in CHAT]
    samples = load_samples(files, args.tokenizer, None, "assistant", args.budget, per_file=args.per_file)
    out = []
    for s in samples:
        ids = np.asarray(s["input_ids"]) % args.vocab
        if ids.shape[0] >= 2:
            out.append({"input_ids": ids, "loss_mask": np.asarray(s["loss_mask"], bool)})
    return out


def seed_mix_imbalance(args: argparse.Namespace, method: str, cost: CostModel) -> dict[str, float]:
    """Modeled imbalance of every arm at ``args.world`` ranks on the seed_mix lengths; anchors from the
    default policy with every token but the first supervised (the seed_mix has no loss masks)."""
    if args.lengths.is_file():
        raw = np.load(args.lengths)
    else:  # a machine without the shared data (a GPU run): the bundled seed_mix
        from padfree.data.length_files import bundled_seed_mix

        raw = bundled_seed_mix()
    lengths = np.minimum(raw.astype(np.int64), args.imbalance_budget)
    uses = METHODS[method].uses_anchors
    anchors = anchor_quota(lengths - 1, AnchorPolicy()) if uses else np.zeros_like(lengths)
    arms = make_arms(lengths, anchors, args.imbalance_budget, args.seed, cost, world_size=args.world)
    return {n: modeled_imbalance(a, lengths, anchors, args.world, cost) for n, a in arms.items()}


def table(result: dict) -> str:
    lines = []
    for method in METHODS:
        rows = result["method"][method]
        base = rows["padfree_packed"]["draft_pos_per_s"]
        lines += [
            f"\n### {method}\n",
            "| arm | draft positions/s (epoch) | packed is x faster | timed micro-batches alone | "
            "padding eff. (tokens, epoch) | anchor coverage | "
            f"same as alone | imbalance ({result['config']['world']} ranks, seed_mix) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for arm in ARMS:
            r = rows[arm]
            ratio = base / r["draft_pos_per_s"] if r["draft_pos_per_s"] else float("nan")
            sampled = r.get("sampled_pos_per_s", r["draft_pos_per_s"])
            eff = r.get("epoch_padding_efficiency", r["padding_efficiency"])
            lines.append(
                f"| {arm} | {r['draft_pos_per_s']:.0f} | {ratio:.2f} | {sampled:.0f} | {eff:.3f} | "
                f"{r['anchor_coverage']:.3f} | "
                f"{r['same_as_alone']} | {r['imbalance']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def targets(result: dict) -> dict:
    out = {}
    for method in METHODS:
        rows = result["method"][method]
        p = rows["padfree_packed"]
        out[method] = {
            "vs_random_2.5x": p["draft_pos_per_s"] / rows["specforge_random"]["draft_pos_per_s"],
            "vs_sorted_fixed_1.2x": p["draft_pos_per_s"] / rows["sorted_fixed"]["draft_pos_per_s"],
            "vs_sorted_budget_1.2x": p["draft_pos_per_s"] / rows["sorted_budget"]["draft_pos_per_s"],
            "coverage_same_as_alone": bool(p["same_as_alone"]),
            "imbalance_le_1.05": p["imbalance"],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    if not args.device.startswith("cuda"):
        torch.set_num_threads(1)  # CPU seconds of one thread are the compute time on a shared machine
    t0 = time.perf_counter()
    samples = load(args)
    lengths = np.array([len(s["input_ids"]) for s in samples], np.int64)
    policy = AnchorPolicy()
    anchors = sample_anchors(samples, policy)
    result: dict = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "samples": len(samples),
        "tokens": int(lengths.sum()),
        "supervised_tokens": int(sum(int(s["loss_mask"][1:].sum()) for s in samples)),
        "machine": machine_info(),
        "method": {},
    }
    for method in METHODS:
        shape = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "ttt": args.ttt}
        cost = cost_model(method, **shape)
        arms = make_arms(lengths, anchors, args.budget, args.seed, cost)
        sz = args.sizes
        models = bench_models(method, vocab=args.vocab, hidden=args.hidden, layers=args.layers,
                              intermediate=sz["intermediate"], ttt=args.ttt, seed=args.seed,
                              heads=sz.get("heads"), kv_heads=sz.get("kv_heads"), head_dim=sz.get("head_dim"),
                              device=args.device)  # fmt: skip
        print(f"{method}: timing {len(arms)} arms x {args.micro} micro-batches", file=sys.stderr, flush=True)
        rows = speed(method, arms, samples, models, policy, micro=args.micro, seed=args.seed, ttt=args.ttt,
                     cost=cost, anchors=anchors if METHODS[method].uses_anchors else None,
                     attention=args.attention, dtype=args.dtype)  # fmt: skip
        print(f"{method}: coverage", file=sys.stderr, flush=True)
        for name, arm in arms.items():
            rows[name].update(coverage(method, arm, samples, policy, seed=args.seed, ttt=args.ttt))
            rows[name] = epoch_rate(rows[name])
        big = cost_model(method, hidden=4096, layers=32, vocab=128256, ttt=args.ttt)
        for name, imb in seed_mix_imbalance(args, method, big).items():
            rows[name]["imbalance"] = imb
        result["method"][method] = rows
        print(json.dumps({k: round(v["draft_pos_per_s"]) for k, v in rows.items()}), file=sys.stderr)
    result["targets"] = targets(result)
    result["seconds"] = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = (
        f"# {args.name}\n\n{len(samples)} samples, budget {args.budget}, {args.micro} micro-batches per arm\n"
    )
    md += table(result) + "\ntargets: " + json.dumps(result["targets"]) + "\n"
    (args.out / f"{args.name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
