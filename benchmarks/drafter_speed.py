"""Drafter training speed by batching, in one run on this CPU: supervised draft positions per second, anchor
coverage and anchor-slot efficiency (every registered method, or ``--methods``: tiny frozen target + one-layer
drafter, trained under a published recipe: ``--recipe specforge``, the default, or ``speculators``), and
modeled rank imbalance at 8 ranks on the seed_mix. Methods with anchors plan at the anchor share
``--anchor-share auto`` picks from their cost on the data (:func:`lab.drafter.auto_share`), recorded per
method.

    PYTHONPATH=src python benchmarks/drafter_speed.py --quick --out benchmarks/results
    PYTHONPATH=src python benchmarks/drafter_speed.py --out benchmarks/results
    PYTHONPATH=src python benchmarks/drafter_speed.py --imbalance-only --out benchmarks/results  # no models

Arms and protocol: :mod:`lab.drafter` and benchmarks/README.md. Data: real chat, math and code
samples (/work/shared/data/samples, or ``--data``) tokenized with the 32K SentencePiece tokenizer, loss on
assistant turns, cut to the budget; token ids folded modulo ``--vocab`` (a speed knob: the tiny models'
LM heads). The recipe sets the collators (anchors per document, EAGLE-3 gating and step weights), the anchor
counts the planner is given, the cost model and the loss. Writes ``NAME.json`` ({"recipe": ..., "method":
{"dflash": {ARM: {"draft_pos_per_s", "anchor_coverage", "imbalance", "same_as_alone",
"anchor_slot_efficiency", ...}}, "eagle3": ...}, "recipes": {METHOD: {..., "anchor_share": {"share", "rule",
...}}}, ...}) and ``NAME.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from lab.drafter import (
    ARMS,
    PUBLIC_TARGETS,
    auto_share,
    bench_models,
    cost_folded_imbalance,
    coverage,
    epoch_rate,
    make_arms,
    modeled_imbalance,
    sample_anchors,
    speed,
    supervised_after_first,
)
from padfree.bench.machine import machine_info
from padfree.core.config import CostModel, PlanConfig
from padfree.drafter import recipes
from padfree.drafter.methods import METHODS
from padfree.drafter.recipes import Recipe
from padfree.drafter.setup import TargetShape, drafter_setup
from padfree.options import device_option

SHARED = Path("/work/shared")
CHAT = ["self_instruct_t0", "hh_rlhf_harmless_test", "gsm8k", "gpteacher_codegen",
        "gpteacher_roleplay_toolformer", "humaneval", "python_stdlib_code"]  # fmt: skip


def share_option(text: str) -> float | str:
    """``--anchor-share``: ``auto`` or a number from 0 to 1."""
    if text == "auto":
        return text
    try:
        share = float(text)
    except ValueError:
        share = -1.0
    if not 0 <= share <= 1:
        raise argparse.ArgumentTypeError(f"--anchor-share takes auto or a number from 0 to 1 (got {text!r})")
    return share


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--quick", action="store_true", help="fewer samples and micro-batches (~9 CPU minutes)")
    p.add_argument("--out", type=Path, required=True, help="directory for NAME.json and NAME.md")
    p.add_argument("--name", default=None, help="file stem (default drafter_speed[_quick])")
    p.add_argument("--data", nargs="*", default=None, help="sample files (default: shared chat/code sets)")
    p.add_argument("--tokenizer", default=str(SHARED / "tokenizers/llama_sp32k.model"))
    p.add_argument("--per-file", type=int, default=None, help="samples per file (quick 150, full 400)")
    p.add_argument("--budget", type=int, default=2048,
                   help="tokens per micro-batch (2048: random padded batches keep about the share of "
                   "real tokens they kept in the motivating case)")  # fmt: skip
    p.add_argument("--anchor-share", type=share_option, default="auto",
                   help="methods with anchors: padfree's plans hold at most max(max_anchors, budget x this) "
                   "anchors a micro-batch (0: no anchor budget); auto (default): per method, the share of "
                   "0.05..1.0 (steps of 0.05) that gives the packed plan of the imbalance lengths the lowest "
                   "modeled imbalance under the method's recipe and cost (lab.drafter.auto_share), recorded "
                   "in NAME.json/md")  # fmt: skip
    p.add_argument("--micro", type=int, default=None, help="timed micro-batches per arm (quick 8, full 24)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=16, help="target layers (the drafter has one)")
    p.add_argument(
        "--recipe",
        choices=recipes.NAMES,
        default=recipes.DEFAULT,
        help="the published recipe trained, counted, costed and planned (default specforge)",
    )
    p.add_argument("--ttt", type=int, default=None, help="EAGLE-3 steps (default: the recipe's)")
    p.add_argument("--block-size", type=int, default=None, help="DFlash block (default: the recipe's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", nargs="*", default=None, choices=sorted(METHODS),
                   help="the drafter methods to time (default: every registered one)")  # fmt: skip
    p.add_argument("--lengths", type=Path, default=None,
                   help="lengths for the modeled imbalance (default: the bundled seed_mix)")  # fmt: skip
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--imbalance-only", action="store_true",
                   help="recompute only the modeled imbalance of NAME.json under --out, with the recipe, "
                   "anchor share, budget and seed it was run with, and rewrite NAME.json and NAME.md (the "
                   "timed arms are planned at one rank: rank balancing does not change them)")  # fmt: skip
    p.add_argument("--imbalance-budget", type=int, default=16384)
    p.add_argument(
        "--target-config",
        choices=sorted(PUBLIC_TARGETS),
        default=None,
        help="a public target's sizes (random weights) instead of --hidden/--layers/--vocab",
    )
    p.add_argument(
        "--device",
        type=device_option,
        default="cpu",
        help="cpu, or cuda (seconds are then synchronized wall seconds)",
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
    only = "" if args.methods is None else "_" + "_".join(args.methods)
    args.name = args.name or (f"drafter_speed{only}_quick" if args.quick else f"drafter_speed{only}")
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


def recipe_of(args: argparse.Namespace, method: str) -> Recipe:
    return recipes.override(recipes.get(args.recipe, method), ttt=args.ttt, block_size=args.block_size)


def method_cost(recipe: Recipe, *, hidden: int, layers: int, vocab: int) -> CostModel:
    """The drafter cost model of ``recipe``'s method for a target of these sizes (the recipe's block size, ttt
    and draft vocabulary, where it is smaller than the target's)."""
    target = TargetShape.common(hidden=hidden, layers=layers, vocab=vocab)
    return drafter_setup(recipe, PlanConfig(), target=target, lengths=np.zeros(0, np.int64)).cost


def anchor_budget(share: float | None, recipe: Recipe, budget: int) -> int | None:
    """The anchor budget of padfree's plans: ``max(max_anchors, budget x share)`` (None for a method without
    anchors, or a share of None or 0)."""
    if not METHODS[recipe.method].uses_anchors or not share:
        return None
    return max(recipe.max_anchors, round(budget * share))


def seed_mix(args: argparse.Namespace, recipe: Recipe) -> tuple[np.ndarray, np.ndarray | None]:
    """The imbalance lengths (the bundled seed_mix, or ``--lengths``) cut to ``--imbalance-budget``, and
    their anchors under the recipe's rule with every token but the first supervised (None without anchors:
    the seed_mix has no loss masks)."""
    from padfree.data.length_files import bundled_seed_mix

    raw = bundled_seed_mix() if args.lengths is None else np.load(args.lengths)
    lengths = np.minimum(raw.astype(np.int64), args.imbalance_budget)
    uses = METHODS[recipe.method].uses_anchors
    return lengths, supervised_after_first(lengths, recipe.anchor_policy()) if uses else None


def method_share(args: argparse.Namespace, recipe: Recipe, cost: CostModel) -> dict:
    """The anchor share the method's plans use and where it comes from: ``--anchor-share`` as given, or
    under ``auto`` :func:`lab.drafter.auto_share` on the imbalance lengths at ``--world`` ranks (``cost``:
    the method's at the imbalance target's size), with their anchors per token and the imbalance of every
    share tried. None for a method without anchors."""
    if not METHODS[recipe.method].uses_anchors:
        return {"share": None, "rule": "no anchors"}
    if args.anchor_share != "auto":
        return {"share": args.anchor_share, "rule": "--anchor-share"}
    lengths, anchors = seed_mix(args, recipe)
    assert anchors is not None
    share, tried = auto_share(lengths, anchors, args.imbalance_budget, args.world, cost, args.seed,
                              recipe.max_anchors)  # fmt: skip
    return {
        "share": share,
        "rule": "auto: lowest modeled packed imbalance over shares 0.05..1.0 (lab.drafter.auto_share)",
        "anchors_per_token_seed_mix": float(anchors.sum() / max(lengths.sum(), 1)),
        "imbalance_by_share": {f"{s:.2f}": v for s, v in tried.items()},
    }


def seed_mix_imbalance(
    args: argparse.Namespace, recipe: Recipe, cost: CostModel, share: float | None
) -> dict:
    """Modeled imbalance of every arm at ``args.world`` ranks on the seed_mix lengths (:func:`seed_mix`), the
    anchor ``share`` given to padfree's plans (and each arm's micro-batch count; DFlash: the what-if of
    :func:`cost_folded_imbalance`)."""
    lengths, anchors = seed_mix(args, recipe)
    planned = anchors if anchors is not None else np.zeros_like(lengths)
    arms = make_arms(lengths, planned, args.imbalance_budget, args.seed, cost, world_size=args.world,
                     anchor_budget=anchor_budget(share, recipe, args.imbalance_budget))  # fmt: skip
    cap = recipe.max_anchors
    out: dict = {n: modeled_imbalance(a, lengths, anchors, args.world, cost, cap) for n, a in arms.items()}
    out["micro_batches"] = {n: a.batching.n_micro for n, a in arms.items()}
    if anchors is not None:
        budget, world = args.imbalance_budget, args.world
        imb, n_micro = cost_folded_imbalance(lengths, anchors, budget, world, cost, args.seed)
        out["what_if_cost_folded_packed"] = {"imbalance": imb, "micro_batches": n_micro}
    return out


def table(result: dict) -> str:
    lines = []
    for method in result["method"]:
        rows = result["method"][method]
        base = rows["padfree_packed"]["draft_pos_per_s"]
        slot = "anchor slot eff." if METHODS[method].uses_anchors else "query slot eff. (per position)"
        share = result["recipes"][method].get("anchor_share", {"share": result["config"]["anchor_share"]})
        lines += [
            f"\n### {method}: {result['recipes'][method]['describe']}\n",
            *(
                [f"anchor share {share['share']} ({share.get('rule', '--anchor-share')})\n"]
                if METHODS[method].uses_anchors
                else []
            ),  # fmt: skip
            "| arm | draft positions/s (epoch) | packed is x faster | timed micro-batches alone | "
            f"padding eff. (tokens, epoch) | {slot} | anchor coverage | "
            f"same as alone | imbalance ({result['config']['world']} ranks, seed_mix) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for arm in ARMS:
            r = rows[arm]
            ratio = base / r["draft_pos_per_s"] if r["draft_pos_per_s"] else float("nan")
            sampled = r.get("sampled_pos_per_s", r["draft_pos_per_s"])
            eff = r.get("epoch_padding_efficiency", r["padding_efficiency"])
            lines.append(
                f"| {arm} | {r['draft_pos_per_s']:.0f} | {ratio:.2f} | {sampled:.0f} | {eff:.3f} | "
                f"{r['anchor_slot_efficiency']:.3f} | {r['anchor_coverage']:.3f} | "
                f"{r['same_as_alone']} | {r['imbalance']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def targets(result: dict) -> dict:
    """The issue's targets, per method: packed >= 2.5x SpecForge-style random padded, not slower than the
    field's length-sorted padded (``sorted_fixed``), modeled imbalance <= 1.05 (values and whether met)."""
    out = {}
    for method in result["method"]:
        rows = result["method"][method]
        p = rows["padfree_packed"]
        vs_random = p["draft_pos_per_s"] / rows["specforge_random"]["draft_pos_per_s"]
        vs_sorted = p["draft_pos_per_s"] / rows["sorted_fixed"]["draft_pos_per_s"]
        out[method] = {
            "vs_specforge_random": vs_random,
            "vs_specforge_random_met_2.5x": vs_random >= 2.5,
            "vs_sorted_fixed": vs_sorted,
            "vs_sorted_fixed_met_1.0x": vs_sorted >= 1.0,
            "vs_sorted_budget": p["draft_pos_per_s"] / rows["sorted_budget"]["draft_pos_per_s"],
            "vs_speculators_rows": p["draft_pos_per_s"] / rows["speculators_rows"]["draft_pos_per_s"],
            "coverage_same_as_alone": bool(p["same_as_alone"]),
            "imbalance": p["imbalance"],
            "imbalance_met_1.05": p["imbalance"] <= 1.05,
        }
    return out


def rebalance(args: argparse.Namespace) -> int:
    """``--imbalance-only``: the seed_mix imbalance columns and targets of an existing result, recomputed."""
    path = args.out / f"{args.name}.json"
    result = json.loads(path.read_text())
    for key in ("recipe", "anchor_share", "imbalance_budget", "world", "seed", "ttt", "block_size"):
        setattr(args, key, result["config"][key])
    args.lengths = None if result["config"]["lengths"] is None else Path(result["config"]["lengths"])
    for method, rows in result["method"].items():
        recipe = recipe_of(args, method)
        big = method_cost(recipe, hidden=4096, layers=32, vocab=128256)
        share = method_share(args, recipe, big)
        result["recipes"].setdefault(method, {})["anchor_share"] = share
        imb = seed_mix_imbalance(args, recipe, big, share["share"])
        for name in rows:
            rows[name]["imbalance"] = imb.pop(name)
        result["seed_mix"][method] = imb
    result["targets"] = targets(result)
    path.write_text(json.dumps(result, indent=2) + "\n")
    md = (
        f"# {args.name}\n\nrecipe {result['recipe']}; {result['samples']} samples, budget "
        f"{result['config']['budget']}, {result['config']['micro']} micro-batches per arm; "
        f"{result['seconds']:.0f} s (imbalance recomputed with --imbalance-only)\n"
    )
    md += table(result) + "\ntargets: " + json.dumps(result["targets"]) + "\n"
    (args.out / f"{args.name}.md").write_text(md)
    print(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.imbalance_only:
        return rebalance(args)
    import torch

    from padfree.drafter.train import token_counts

    if not args.device.startswith("cuda"):
        torch.set_num_threads(1)  # CPU seconds of one thread are the compute time on a shared machine
    t0 = time.perf_counter()
    samples = load(args)
    lengths = np.array([len(s["input_ids"]) for s in samples], np.int64)
    counts = token_counts(samples, args.vocab)
    result: dict = {
        "recipe": args.recipe,
        "recipes": {},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "samples": len(samples),
        "tokens": int(lengths.sum()),
        "supervised_tokens": int(sum(int(s["loss_mask"][1:].sum()) for s in samples)),
        "machine": machine_info(),
        "method": {},
    }
    for method in args.methods or list(METHODS):
        recipe = recipe_of(args, method)
        result["recipes"][method] = {**dataclasses.asdict(recipe), "describe": recipe.describe()}
        uses = METHODS[method].uses_anchors
        anchors = sample_anchors(samples, recipe.anchor_policy()) if uses else None
        if anchors is not None:
            result["recipes"][method]["anchors_per_sample"] = float(anchors.mean())
            result["recipes"][method]["anchors_per_token"] = float(anchors.sum() / max(lengths.sum(), 1))
        big = method_cost(recipe, hidden=4096, layers=32, vocab=128256)
        share = method_share(args, recipe, big)
        result["recipes"][method]["anchor_share"] = share
        print(f"{method}: anchor share {share['share']} ({share['rule']})", file=sys.stderr, flush=True)
        cost = method_cost(recipe, hidden=args.hidden, layers=args.layers, vocab=args.vocab)
        planned = anchors if anchors is not None else np.zeros_like(lengths)
        arms = make_arms(lengths, planned, args.budget, args.seed, cost,
                         anchor_budget=anchor_budget(share["share"], recipe, args.budget))  # fmt: skip
        sz = args.sizes
        models = bench_models(method, vocab=args.vocab, hidden=args.hidden, layers=args.layers,
                              intermediate=sz["intermediate"], recipe=recipe, seed=args.seed, counts=counts,
                              heads=sz.get("heads"), kv_heads=sz.get("kv_heads"), head_dim=sz.get("head_dim"),
                              device=args.device)  # fmt: skip
        print(f"{method}: {recipe.describe()}; timing {len(arms)} arms x {args.micro} micro-batches",
              file=sys.stderr, flush=True)  # fmt: skip
        rows = speed(method, arms, samples, models, micro=args.micro, seed=args.seed, cost=cost,
                     anchors=anchors, attention=args.attention, dtype=args.dtype)  # fmt: skip
        print(f"{method}: coverage", file=sys.stderr, flush=True)
        for name, arm in arms.items():
            rows[name].update(coverage(method, arm, samples, recipe, seed=args.seed))
            rows[name] = epoch_rate(rows[name])
        imb = seed_mix_imbalance(args, recipe, big, share["share"])
        for name in arms:
            rows[name]["imbalance"] = imb.pop(name)
        result.setdefault("seed_mix", {})[method] = imb
        result["method"][method] = rows
        print(json.dumps({k: round(v["draft_pos_per_s"]) for k, v in rows.items()}), file=sys.stderr)
    result["targets"] = targets(result)
    result["seconds"] = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = (
        f"# {args.name}\n\nrecipe {args.recipe}; {len(samples)} samples, budget {args.budget}, "
        f"{args.micro} micro-batches per arm; {result['seconds']:.0f} s\n"
    )
    md += table(result) + "\ntargets: " + json.dumps(result["targets"]) + "\n"
    (args.out / f"{args.name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
