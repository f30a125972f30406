"""Sampler overhead per optimizer step vs one training step of the tiny model.

For each strategy, on the bundled seed mix (902K real sample lengths): plan the epoch once (the cost paid at
``set_epoch`` / resume, also reported amortized per step), then time how long rank 0's sampler takes to yield
one step's ``grad_accum`` micro-batches. The reference is one optimizer step of ``tiny-llama`` (random
weights, 4 layers, hidden 256) on CPU over ``grad_accum`` packed micro-batches of ``--train-budget`` tokens.
With ``balance="dynamic"`` (``dynamic_balance`` rows) the per-step cost also holds recording the times, the
speed-aware layout (and packed re-cut) of every step and, every ``--balance-every`` steps, the refit; the
timing hooks' cost per backward is measured on the tiny model (``timing_hooks``).

    PYTHONPATH=$PWD/src python benchmarks/sampler_overhead.py

writes benchmarks/results/sampler_overhead.json. Timings are wall-clock on whatever machine runs it (the JSON
records the CPU count); the CPU training step is a *lower* bound on a real step's cost, so the ratio is an
upper bound on the sampler's share.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from padfree import PlanConfig
from padfree.data.length_files import bundled_seed_mix
from padfree.models import build_model
from padfree.torch import PackCollator, PlanBatchSampler, step_loss, token_loss_sum

ROOT = Path(__file__).resolve().parents[1]


def sampler_costs(
    lengths: np.ndarray, strategy: str, budget: int, world: int, accum: int, steps: int
) -> dict:
    cfg = PlanConfig(strategy=strategy, budget=budget, grad_accum=accum, overlong="truncate", seed=0)
    sampler = PlanBatchSampler(lengths, cfg, rank=0, world_size=world)
    t0 = time.perf_counter()
    n_steps = sampler.steps_in_epoch  # plans the epoch
    plan_s = time.perf_counter() - t0
    it = iter(sampler)
    per_step = []
    for _ in range(min(steps, n_steps)):
        t = time.perf_counter()
        for _ in range(accum):
            next(it)
        per_step.append(time.perf_counter() - t)
    # a resume: load a mid-epoch state at another world size (re-plans the rest of the epoch)
    state = sampler.state_dict()
    other = PlanBatchSampler(lengths, cfg, rank=0, world_size=world * 2)
    t = time.perf_counter()
    other.load_state_dict(state)
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    next(iter(other))
    elastic_s = time.perf_counter() - t
    return {
        "strategy": strategy,
        "steps_in_epoch": n_steps,
        "plan_epoch_s": round(plan_s, 4),
        "plan_amortized_per_step_us": round(plan_s / n_steps * 1e6, 2),
        "yield_step_median_us": round(float(np.median(per_step)) * 1e6, 2),
        "yield_step_p99_us": round(float(np.percentile(per_step, 99)) * 1e6, 2),
        "load_state_dict_s": round(load_s, 6),
        "elastic_replan_first_batch_s": round(elastic_s, 4),
    }


def dynamic_costs(
    lengths: np.ndarray, strategy: str, budget: int, world: int, accum: int, steps: int, every: int
) -> dict:
    """Rank 0 of a dynamically balanced run: per-step cost of yielding its micro-batches, recording their
    times, and (every ``every`` steps) the exchange's refit and the speed-aware layout. The other ranks'
    timings are rank 0's, scaled by their speeds (0.7 .. 1.3), so the refit has something to learn; the
    collective itself is local here (its network time is measured by the torchrun run in the README)."""
    cfg = PlanConfig(strategy=strategy, budget=budget, grad_accum=accum, overlong="truncate", seed=0)
    speeds = np.linspace(0.7, 1.3, world)

    def exchange(payload: np.ndarray) -> np.ndarray:
        rows = np.tile(payload, (world, 1))
        n = int(payload[1])
        for r in range(world):
            rows[r, 4 : 2 + 3 * n : 3] *= speeds[0] / speeds[r]
        return rows

    kw = {"balance": "dynamic", "balance_every": every, "balance_exchange": exchange}
    sampler = PlanBatchSampler(lengths, cfg, rank=0, world_size=world, **kw)
    n_steps = sampler.steps_in_epoch  # plans the epoch (timed in sampler_costs)
    it = iter(sampler)
    per_step, exchange_steps = [], []
    for s in range(min(steps, n_steps)):
        t = time.perf_counter()
        for _ in range(accum):
            mb = next(it)
            lens = np.asarray(mb.info.lengths, dtype=np.float64)
            sampler.record_time(float(2e-5 * lens.sum() + 1e-9 * (lens**2).sum() + 1e-3) / speeds[0])
        dt = time.perf_counter() - t
        (exchange_steps if s and s % every == 0 else per_step).append(dt)
    st = sampler.balance_stats()
    return {
        "strategy": strategy,
        "balance_every": every,
        "yield_step_median_us": round(float(np.median(per_step)) * 1e6, 2),
        "exchange_step_median_us": round(float(np.median(exchange_steps)) * 1e6, 2),
        "mean_step_us": round(float(np.mean(per_step + exchange_steps)) * 1e6, 2),
        "refit_per_exchange_us": round(st["sync_seconds"] / max(st["exchanges"], 1) * 1e6, 2),
        "learned_speeds_rank0_last": [st["speeds"][0], st["speeds"][-1]],
        "true_speed_ratio_last_to_first": round(float(speeds[-1] / speeds[0]), 4),
    }


def hook_seconds(repeats: int) -> dict:
    """What timing a micro-batch with ``sampler.timed(model)`` adds to a backward of the tiny model: the
    per-parameter gradient hooks (median of with/without, interleaved)."""
    from padfree.torch.feed.balance import _GradClock

    model = build_model("tiny-llama", seed=0)
    ids = torch.randint(1, 32000, (1, 512))
    plain, hooked = [], []
    clock = None
    for i in range(2 * repeats + 2):
        if i == repeats + 1:
            clock = _GradClock(model)
        if clock is not None:
            clock.arm()
        t = time.perf_counter()
        model(input_ids=ids).logits.float().pow(2).mean().backward()
        (plain if clock is None else hooked).append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
    per_call = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10000):
            clock._hook(None)
        per_call.append((time.perf_counter() - t) / 10000)
    return {
        "params_hooked": clock.n,
        "hook_call_us": round(min(per_call) * 1e6, 3),
        "hooks_per_backward_us": round(min(per_call) * clock.n * 1e6, 2),
        "backward_median_s_plain": round(float(np.median(plain[1:])), 4),
        "backward_median_s_hooked": round(float(np.median(hooked[1:])), 4),
    }


def train_step_seconds(train_budget: int, accum: int, repeats: int) -> tuple[float, float]:
    """Median seconds of one optimizer step on the tiny model, and of collating its micro-batches."""
    rng = np.random.default_rng(0)
    model = build_model("tiny-llama", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    collate = PackCollator()
    times, collate_times = [], []
    for _ in range(repeats + 1):
        docs = []
        while sum(len(d["input_ids"]) for d in docs) < train_budget - 64:
            docs.append({"input_ids": rng.integers(1, 32000, int(rng.integers(16, 512)))})
        t = time.perf_counter()
        batches = [collate(docs) for _ in range(accum)]
        collate_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        total = sum(b.loss_tokens for b in batches)
        for b in batches:
            inputs = {k: v for k, v in b.items() if k != "labels"}
            step_loss(token_loss_sum(model(**inputs).logits, b["labels"]), total).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    return float(np.median(times[1:])), float(np.median(collate_times[1:]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--budget", type=int, default=16384, help="sampler token budget per micro-batch")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--steps", type=int, default=200, help="steps timed per strategy")
    p.add_argument("--train-budget", type=int, default=2048, help="tokens per micro-batch of the train step")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--balance-every", type=int, default=4, help="dynamic rows: steps between exchanges")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/sampler_overhead.json"))
    args = p.parse_args()

    lengths = bundled_seed_mix().astype(np.int64)
    rows = [
        sampler_costs(lengths, s, args.budget, args.world_size, args.grad_accum, args.steps)
        for s in ("sorted", "random", "bucketed", "packed")
    ]
    shape = (args.budget, args.world_size, args.grad_accum, args.steps, args.balance_every)
    dynamic = [dynamic_costs(lengths, s, *shape) for s in ("sorted", "random", "bucketed", "packed")]
    hooks = hook_seconds(args.repeats)
    train_s, collate_s = train_step_seconds(args.train_budget, args.grad_accum, args.repeats)
    for r in dynamic:
        hooks_step = hooks["hooks_per_backward_us"] * args.grad_accum
        r["mean_step_with_hooks_vs_train_step"] = round((r["mean_step_us"] + hooks_step) * 1e-6 / train_s, 8)
    for r in rows:
        r["yield_step_vs_train_step"] = round(r["yield_step_median_us"] * 1e-6 / train_s, 8)
        r["with_amortized_plan_vs_train_step"] = round(
            (r["yield_step_median_us"] + r["plan_amortized_per_step_us"]) * 1e-6 / train_s, 8
        )
    result = {
        "samples": int(lengths.shape[0]),
        "budget": args.budget,
        "world_size": args.world_size,
        "grad_accum": args.grad_accum,
        "train_step": {
            "model": "tiny-llama (4 layers, hidden 256, vocab 32000, random weights)",
            "device": "cpu",
            "micro_batches": args.grad_accum,
            "tokens_per_micro_batch": args.train_budget,
            "seconds_median": round(train_s, 4),
            "collate_seconds_median": round(collate_s, 5),
        },
        "sampler": rows,
        "dynamic_balance": dynamic,
        "timing_hooks": hooks,
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version(), "load_avg_1m": round(os.getloadavg()[0], 2)},
        "command": "PYTHONPATH=$PWD/src python benchmarks/sampler_overhead.py " + " ".join(sys.argv[1:]),
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
