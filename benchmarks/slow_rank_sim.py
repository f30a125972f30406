"""Dynamic vs static balancing with one slow rank, ranks as threads and simulated seconds (no model, no
torchrun): the harness of tests/torch/test_sampler_dynamic.py (its in-process all-gather, its cost model
``(1e-4*slots + 2e-8*attention + 2e-3) / speed``), on a length file. Prints, per strategy, dynamic/static
real tokens per simulated second and the busy imbalance (mean over steps of max/mean rank time), steps from
the 5th on. A quick check of the step layouts; benchmarks/dynamic_balance.py measures real training.

    PYTHONPATH=src python benchmarks/slow_rank_sim.py fixtures/lengths/self_instruct_t0.cl100k.npy \\
        --samples 6000 --strategies bucketed,sorted,random,packed --slow 1.5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "torch"))
from test_sampler_dynamic import group, run, seconds  # noqa: E402

from padfree import PlanConfig  # noqa: E402


def measure(per_rank: list, speeds: tuple, packed: bool, first_step: int = 4) -> tuple[float, float]:
    """Real tokens per simulated second (each step lasts as long as its slowest rank) and busy imbalance."""
    steps: dict[int, list[float]] = {}
    tokens = 0
    for r, mbs in enumerate(per_rank):
        for mb in mbs:
            if mb.info.step >= first_step:
                row = steps.setdefault(mb.info.step, [0.0] * len(per_rank))
                row[r] += seconds(mb.info, packed, speeds[r])
                tokens += sum(mb.info.lengths)
    per = np.array(list(steps.values()))
    return tokens / per.max(1).sum(), float((per.max(1) / per.mean(1)).mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("lengths", help="a .npy length file")
    p.add_argument("--samples", type=int, default=6000, help="a random subset of this many samples")
    p.add_argument("--strategies", default="bucketed,sorted,random,packed")
    p.add_argument("--slow", type=float, default=1.5, help="rank 1 is this many times slower")
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--headroom", type=float, default=None, help="balance_headroom (default: the sampler's)")
    args = p.parse_args()
    lengths = np.load(args.lengths)
    lengths = lengths[np.random.default_rng(0).permutation(len(lengths))[: args.samples]]
    lengths = np.maximum(np.minimum(lengths, args.budget), 2)
    speeds = (1.0, 1 / args.slow)
    for strategy in args.strategies.split(","):
        cfg = PlanConfig(strategy=strategy, budget=args.budget, grad_accum=4, seed=1, overlong="truncate")
        static = measure(run(group(lengths, cfg, 2), speeds), speeds, cfg.packed)
        kw = {"balance": "dynamic", "balance_every": 2, "balance_headroom": args.headroom}
        dynamic = measure(run(group(lengths, cfg, 2, **kw), speeds), speeds, cfg.packed)
        print(
            f"{strategy:9s} dynamic/static real tok/s {dynamic[0] / static[0]:.4f}  busy imbalance "
            f"static {static[1]:.4f} dynamic {dynamic[1]:.4f}"
        )


if __name__ == "__main__":
    main()
