"""Static vs dynamic rank balancing, trained for real on gloo ranks: equal ranks, one rank 1.5x slower, and
long documents whose attention the default cost model underweights.

    PYTHONPATH=src python benchmarks/dynamic_balance.py --quick --out benchmarks/results   # ~15 min, 2 ranks
    PYTHONPATH=src python benchmarks/dynamic_balance.py --out benchmarks/results           # 2 and 4 ranks

Every (world size, scenario, strategy) is one ``torchrun`` launch of :mod:`lab.dynamic_balance`,
which trains the static and the dynamic assignment interleaved step by step (protocol there and in
benchmarks/README.md). Data: real lengths, a seeded subset of the bundled seed_mix (or ``--lengths``) and,
for ``long_docs``, the vendored long-document sets (c4 wiki documents and Python stdlib files, or
``--long-docs``), cut to the budget. Writes ``NAME.json`` and ``NAME.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from lab import child_env
from lab.dynamic_balance import SLOW_FACTOR, Run, has_dynamic, summarize
from padfree.bench.machine import machine_info
from padfree.data.length_files import bundled_seed_mix
from padfree.options import device_option

ROOT = Path(__file__).resolve().parents[1]
LONG_DOCS = ["llamafactory_c4_wiki_docs.mistral_v1.npy", "python_stdlib_code.mistral_v1.npy"]
SCENARIOS = ("equal_ranks", "slow_rank", "long_docs")
TINY = {"vocab_size": 4096, "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2}  # fmt: skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--quick", action="store_true", help="2 ranks, fewer steps (~15 min on 2 shared cores)")
    p.add_argument("--out", type=Path, default=None, help="directory for NAME.json and NAME.md")
    p.add_argument("--name", default=None, help="file stem (default dynamic_balance[_quick])")
    p.add_argument("--worlds", default=None, help="comma-separated rank counts (default 2; full run 2,4)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--strategies", default="packed,bucketed")
    p.add_argument("--lengths", type=Path, default=None, help=".npy lengths (default: bundled seed_mix)")
    p.add_argument("--samples", type=int, default=6000, help="seeded subset of --lengths (default 6000)")
    p.add_argument("--long-docs", type=Path, nargs="*", default=None, help=".npy long-document lengths")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per rank per step (default 4)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per mode (quick 12, full 30)")
    p.add_argument("--warmup", type=int, default=None, help="steps first, not measured (quick 6, full 8)")
    p.add_argument("--balance-every", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--static-only", action="store_true", help="run the static assignment alone")
    p.add_argument(
        "--device", type=device_option, default="cpu", help="cpu, or cuda: every rank trains on the one GPU"
    )
    p.add_argument("--model-set", action="append", default=[], metavar="KEY=VALUE", help="model field")
    args = p.parse_args(argv)
    args.worlds = [int(w) for w in (args.worlds or ("2" if args.quick else "2,4")).split(",")]
    args.steps = args.steps or (12 if args.quick else 30)
    args.warmup = args.warmup if args.warmup is not None else (6 if args.quick else 8)
    args.name = args.name or ("dynamic_balance_quick" if args.quick else "dynamic_balance")
    return args


def datasets(args: argparse.Namespace, tmp: Path) -> dict[str, Path]:
    """The two length sets, saved as .npy for the workers: ``mixed`` and ``long_docs``."""
    base = np.load(args.lengths) if args.lengths else bundled_seed_mix()
    rng = np.random.default_rng(args.seed)
    mixed = base[np.sort(rng.permutation(base.shape[0])[: args.samples])].astype(np.int64)
    long_paths = args.long_docs or [ROOT / "fixtures" / "lengths" / f for f in LONG_DOCS]
    long_docs = np.concatenate([np.load(p).astype(np.int64) for p in long_paths])
    out = {}
    for name, arr in (("mixed", mixed), ("long_docs", long_docs)):
        out[name] = tmp / f"{name}.npy"
        np.save(out[name], arr)
    return out


def launch(run: Run, world: int, modes: str, tmp: Path) -> dict:
    out = tmp / f"{run.scenario}_{run.strategy}_w{world}.json"
    env = child_env(OMP_NUM_THREADS=str(run.threads))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           "-m", "lab.dynamic_balance", "--spec", json.dumps(asdict(run)), "--modes", modes,
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise SystemExit(f"dynamic_balance: {run.scenario}/{run.strategy} on {world} ranks failed:\n{tail}")
    return json.loads(out.read_text())


def combine(per_strategy: dict[str, dict], warmup: int, modes: list[str]) -> dict:
    """A scenario's result: per mode over all its strategies' measured steps, and each strategy's own."""
    out: dict = {}
    for m in modes:
        steps = [x for r in per_strategy.values() for x in r["steps"][m][warmup:]]
        out[m] = summarize(steps, 0)
    strategies = {}
    for name, r in per_strategy.items():
        strategies[name] = {m: summarize(r["steps"][m], warmup) for m in modes}
        if "balance_stats" in r:
            strategies[name]["balance_stats"] = r["balance_stats"]
    if "dynamic" in out:
        out["dynamic_over_static"] = out["dynamic"]["real_tok_per_s"] / out["static"]["real_tok_per_s"]
        for s in strategies.values():
            s["dynamic_over_static"] = s["dynamic"]["real_tok_per_s"] / s["static"]["real_tok_per_s"]
    out["strategies"] = strategies
    return out


def predict(scenario: dict, lengths_path: Path, args: argparse.Namespace, worlds=(2, 8)) -> dict:
    """What ``padfree simulate --speeds ... --true-cost ...`` predicts for the scenario: the plan balances
    by padfree's default cost model, the true cost is the dynamic run's own refit (seconds), the slow rank
    takes 1.5x as long; dynamic / static per strategy at each world size."""
    from padfree.advice.simulate import simulate
    from padfree.core.config import CostModel, PlanConfig

    lengths = np.minimum(np.load(lengths_path).astype(np.int64), args.budget)
    lengths = lengths[lengths > 1]
    out: dict = {}
    for world in worlds:
        factors = np.ones(world)
        if scenario["scenario"] == "slow_rank":
            factors[-1] = SLOW_FACTOR
        out[str(world)] = {}
        for strategy, r in scenario["strategies"].items():
            fitted = r.get("balance_stats", {}).get("cost")
            if not fitted or not r.get("balance_stats", {}).get("fitted"):
                continue
            cfg = PlanConfig(
                strategy=strategy, budget=args.budget, world_size=world, grad_accum=args.grad_accum
            )
            row = simulate(
                lengths, cfg, (strategy,), naive=False, speeds=factors, true_cost=CostModel(*fitted)
            )
            out[str(world)][strategy] = row["strategies"][strategy]["dynamic_over_static"]
    return out


def targets(scenarios: dict) -> dict:
    """The issue's targets, checked on each scenario's combined numbers (2 ranks)."""
    out = {}
    slow, equal = scenarios.get("slow_rank", {}), scenarios.get("equal_ranks", {})
    if "dynamic" in slow:
        r, imb = slow["dynamic_over_static"], slow["dynamic"]["busy_imbalance"]
        out["slow_rank_dynamic_over_static_ge_1.15"] = {"value": r, "met": r >= 1.15}
        out["slow_rank_dynamic_busy_imbalance_le_1.08"] = {"value": imb, "met": imb <= 1.08}
    if "dynamic" in equal:
        r = equal["dynamic_over_static"]
        out["equal_ranks_dynamic_over_static_ge_0.98"] = {"value": r, "met": r >= 0.98}
    return out


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [
        "# Static vs dynamic rank balancing (gloo ranks, CPU)",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Model tiny-llama {c['model_overrides']}; budget {c['budget']} tokens per micro-batch, grad accum "
        f"{c['grad_accum']}, {c['warmup']} warm-up steps then {c['steps']} measured steps per mode, static "
        f"and dynamic interleaved; dynamic refits every {c['balance_every']} steps. Slow rank: the last rank "
        "sleeps half of each measured compute time and reports the inflated time (1.5x slower). Real tok/s: "
        "loss tokens of the measured steps / their wall time; busy imbalance: mean over steps of the max / "
        "mean rank compute time.",
        "",
    ]
    if not result["dynamic_available"]:
        lines += ["**The sampler here has no dynamic mode: static only.**", ""]
    lines += [
        "| ranks | scenario | strategy | static tok/s | dynamic tok/s | dynamic / static | busy imbalance "
        "static | dynamic | refit held-out error |",
        "|---:|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for sc in result["scenarios"].values():
        rows = [("all", sc)] + list(sc["strategies"].items())
        for strat, r in rows:
            d = r.get("dynamic")
            err = _refit_error(r.get("balance_stats")) if strat != "all" else ""
            lines.append(
                f"| {sc['world_size']} | {sc['scenario']} | {strat} | {r['static']['real_tok_per_s']:,.0f} | "
                + (f"{d['real_tok_per_s']:,.0f} | {r['dynamic_over_static']:.3f} | " if d else "— | — | ")
                + f"{r['static']['busy_imbalance']:.3f} | "
                + (f"{d['busy_imbalance']:.3f}" if d else "—")
                + f" | {err} |"
            )
    preds = [
        f"- {key} {strategy}: "
        + ", ".join(
            f"{w} ranks {p[strategy]:.3f}"
            for w, p in sc["predicted_dynamic_over_static"].items()
            if strategy in p
        )
        for key, sc in result["scenarios"].items()
        if sc.get("predicted_dynamic_over_static")
        for strategy in sc["strategies"]
    ]
    if preds:
        lines += [
            "",
            "`padfree simulate` (true cost: the run's own refit; static plans balance by the default "
            "cost model) predicts dynamic / static:",
            "",
            *preds,
        ]
    if result.get("targets"):
        lines += ["", "Targets (2 ranks, all strategies together):", ""]
        for k, t in result["targets"].items():
            lines.append(f"- {k}: {t['value']:.3f} — {'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines) + "\n"


def _refit_error(stats: dict | None) -> str:
    if not stats:
        return "—"
    for k in ("heldout_rel_error",):
        if k in stats and stats[k] is not None:
            return f"{float(stats[k]):.3f}"
    return "see JSON"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    command = "python benchmarks/dynamic_balance.py " + " ".join(
        shlex.quote(a) for a in (argv or sys.argv[1:])
    )
    dynamic = has_dynamic() and not args.static_only
    modes = ["static", "dynamic"] if dynamic else ["static"]
    tmp = Path(tempfile.mkdtemp(prefix="padfree-dynbal-"))
    data = datasets(args, tmp)
    model = TINY | {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.model_set)}
    result = {"command": command, "machine": machine_info(), "dynamic_available": has_dynamic(),
              "config": {k: v for k, v in vars(args).items() if k not in ("out", "lengths", "long_docs")}
              | {"model_overrides": model, "data": {k: str(v) for k, v in data.items()}},
              "scenarios": {}}  # fmt: skip
    t_start = time.perf_counter()
    for world in args.worlds:
        for scenario in args.scenarios.split(","):
            per = {}
            for strategy in args.strategies.split(","):
                run = Run(
                    scenario=scenario,
                    strategy=strategy,
                    lengths_path=str(data["long_docs" if scenario == "long_docs" else "mixed"]),
                    budget=args.budget,
                    grad_accum=args.grad_accum,
                    steps=args.steps,
                    warmup=args.warmup,
                    slow_rank=world - 1 if scenario == "slow_rank" else None,
                    balance_every=args.balance_every,
                    seed=args.seed,
                    model_overrides=model,
                    device=args.device,
                )
                t = time.perf_counter()
                per[strategy] = launch(run, world, ",".join(modes), tmp)
                print(
                    f"{world} ranks {scenario:12s} {strategy:9s} {time.perf_counter() - t:6.0f} s", flush=True
                )
            key = scenario if world == args.worlds[0] else f"{scenario}_{world}ranks"
            result["scenarios"][key] = {"scenario": scenario, "world_size": world} | combine(
                per, args.warmup, modes
            )
    for sc in result["scenarios"].values():
        if "dynamic" in modes:
            path = data["long_docs" if sc["scenario"] == "long_docs" else "mixed"]
            sc["predicted_dynamic_over_static"] = predict(sc, path, args)
    result["targets"] = targets({k: v for k, v in result["scenarios"].items() if v["world_size"] == 2})
    result["seconds"] = time.perf_counter() - t_start
    result["machine"]["load_average_end"] = list(os.getloadavg())
    md = markdown(result)
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / f"{args.name}.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
