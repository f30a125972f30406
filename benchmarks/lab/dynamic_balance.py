"""Static vs dynamic rank balancing, trained for real on several ranks (the worker of
``benchmarks/dynamic_balance.py``; run it under ``torchrun``).

Each rank trains a tiny model through :class:`padfree.torch.PlanBatchSampler`, once with the static
assignment (the plan's cost model) and once with the dynamic one (the sampler refits the cost model and a
speed per rank from the compute times the loop reports), *interleaved* step by step (static step ``s``,
dynamic step ``s``, alternating which goes first), so a slow spell of the shared machine hits both alike.
Both walk the same epoch: the same samples in every step.

A step on one rank: its micro-batches (collated untimed), each forward + backward timed with a monotonic
clock (the *compute time* the loop reports to the dynamic sampler), then one all-reduce of the gradients
(the wait for the slowest rank: not compute) and the AdamW update. No DDP: the gradient all-reduce is
explicit, so the compute time never holds the wait. ``busy`` of a rank = its summed compute times.

Slow rank (scenario ``slow_rank``): after each micro-batch, the slow rank sleeps ``(factor - 1)`` times the
compute time it just measured, and reports the inflated time (compute + sleep) as its compute time: it is
``factor`` times slower than the others, and its busy time says so. Nothing else differs.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from padfree.core.strategies import REGISTRY

SLOW_FACTOR = 1.5


@dataclass(frozen=True)
class Run:
    """One (scenario, strategy) run of the worker: every rank builds the same plan from it."""

    scenario: str
    strategy: str
    lengths_path: str
    budget: int
    grad_accum: int
    steps: int
    warmup: int
    slow_rank: int | None = None
    slow_factor: float = SLOW_FACTOR
    balance_every: int = 4
    seed: int = 0
    model_overrides: dict = field(default_factory=dict)
    lr: float = 1e-4
    threads: int = 1
    device: str = "cpu"


def has_dynamic() -> bool:
    """Whether this padfree's sampler offers ``balance="dynamic"``."""
    from padfree.torch import PlanBatchSampler

    return "balance" in inspect.signature(PlanBatchSampler.__init__).parameters


def _sampler(lengths: np.ndarray, run: Run, world: int, mode: str):
    from padfree import PlanConfig
    from padfree.torch import PlanBatchSampler

    cfg = PlanConfig(
        strategy=run.strategy, budget=run.budget, world_size=world, grad_accum=run.grad_accum, seed=run.seed
    )
    if mode == "dynamic":
        return PlanBatchSampler(lengths, cfg, balance="dynamic", balance_every=run.balance_every)
    if has_dynamic():
        return PlanBatchSampler(lengths, cfg, balance="static")
    return PlanBatchSampler(lengths, cfg)


def _all_reduce_grads(model) -> None:
    import torch
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    host = flat.cpu()  # gloo: the ranks may share one GPU, so the collective runs on the host
    dist.all_reduce(host)
    flat = host.to(flat.device)
    i = 0
    for p in params:
        n = p.numel()
        p.grad = flat[i : i + n].view_as(p).clone()
        i += n


def _step(it, trainer, ids, sampler, slow: float | None) -> dict:
    """One optimizer step on this rank: ``{"wall", "busy", "compute", "micro", "tokens"}`` (``busy`` is the
    reported compute time: ``compute`` itself, times the slow factor on the slow rank)."""
    import torch.distributed as dist

    dist.barrier()  # every rank starts the step together: the wall time is the step's, not a straggle
    t0 = time.perf_counter()
    busy, compute, n, tokens = 0.0, 0.0, 0, 0
    while True:
        mb = next(it)
        tokens = int(mb.info.step_tokens or 0)
        dt = 0.0
        if len(mb):
            batch = trainer.collate([{"input_ids": ids[i]} for i in mb])
            trainer.sync()
            t = time.perf_counter()
            trainer.backward(batch, tokens)
            trainer.sync()  # the device's work is done: the clock holds compute, not a queue
            dt = time.perf_counter() - t
            compute += dt
            if slow is not None:
                time.sleep(dt * (slow - 1.0))
                dt *= slow
        if sampler is not None:
            sampler.record_time(dt, info=mb.info)  # compute only: the all-reduce below is not in it
        busy += dt
        n += 1
        if mb.info.last:
            break
    _all_reduce_grads(trainer.model)
    trainer.update()
    return {"wall": time.perf_counter() - t0, "busy": busy, "compute": compute, "micro": n, "tokens": tokens}


def _gather(rec: dict, world: int) -> dict:
    import torch
    import torch.distributed as dist

    t = torch.tensor([rec["wall"], rec["busy"], rec["compute"], rec["micro"]], dtype=torch.float64)
    out = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    m = torch.stack(out).numpy()
    return {"wall": float(m[:, 0].max()), "busy": m[:, 1].tolist(), "compute": m[:, 2].tolist(),
            "micro": m[:, 3].astype(int).tolist(), "tokens": rec["tokens"]}  # fmt: skip


def run_one(run: Run, rank: int, world: int, modes: tuple[str, ...]) -> dict:
    """Train ``run`` in every mode, interleaved; returns per mode the per-step records (every rank gets the
    same)."""
    import torch

    from padfree.bench.samples import RandomIds
    from padfree.bench.trainer import Trainer

    torch.set_num_threads(run.threads)
    if run.device.startswith("cuda"):
        torch.cuda.set_device(0)  # the ranks share the device (one GPU machine)
    lengths = np.minimum(np.load(run.lengths_path).astype(np.int64), run.budget)
    lengths = lengths[lengths > 1]
    ids = RandomIds(lengths, int(run.model_overrides.get("vocab_size", 32000)), run.seed)
    samplers = {m: _sampler(lengths, run, world, m) for m in modes}
    packed = REGISTRY[run.strategy].packed
    trainers = {
        m: Trainer(
            "tiny-llama", run.model_overrides, run.seed, run.device, run.lr, 1.0, packed, padded_mask=False
        )
        for m in modes
    }
    its = {m: iter(s) for m, s in samplers.items()}
    n_steps = min(run.warmup + run.steps, min(s.steps_in_epoch for s in samplers.values()))
    slow = run.slow_factor if run.slow_rank == rank else None
    steps: dict[str, list] = {m: [] for m in modes}
    for s in range(n_steps):
        for m in modes if s % 2 == 0 else modes[::-1]:
            rec = _step(its[m], trainers[m], ids, samplers[m] if m == "dynamic" else None, slow)
            steps[m].append(_gather(rec, world))
    out = {"steps": steps, "samples": int(lengths.shape[0]), "tokens": int(lengths.sum()),
           "steps_in_epoch": int(samplers[modes[0]].steps_in_epoch)}  # fmt: skip
    if "dynamic" in samplers and hasattr(samplers["dynamic"], "balance_stats"):
        out["balance_stats"] = _jsonable(samplers["dynamic"].balance_stats())
    return out


def _jsonable(x):
    return json.loads(json.dumps(x, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))


def summarize(steps: list[dict], warmup: int) -> dict:
    """Per mode: real tok/s (the steps' loss tokens over their summed wall times, after ``warmup``), busy
    imbalance (mean over steps of the max / mean rank compute time), and the same over every step.

    >>> st = [{"wall": 2.0, "busy": [1.0, 3.0], "tokens": 10}, {"wall": 1.0, "busy": [2.0, 2.0], "tokens": 5}]
    >>> r = summarize(st, warmup=0)
    >>> r["real_tok_per_s"], r["busy_imbalance"], r["steps"]
    (5.0, 1.25, 2)
    """

    def one(part: list[dict]) -> tuple[float, float]:
        wall = sum(x["wall"] for x in part)
        tok = sum(x["tokens"] for x in part)
        busy = np.array([x["busy"] for x in part], dtype=np.float64)
        mean = busy.mean(axis=1)
        imb = float(np.mean(busy.max(axis=1) / np.where(mean > 0, mean, 1.0)))
        return tok / wall, imb

    measured = steps[warmup:] or steps
    tps, imb = one(measured)
    tps_all, imb_all = one(steps)
    busy = np.array([x["busy"] for x in measured], dtype=np.float64)
    return {
        "real_tok_per_s": tps,
        "busy_imbalance": imb,
        "steps": len(measured),
        "warmup_steps": len(steps) - len(measured),
        "step_seconds_mean": float(np.mean([x["wall"] for x in measured])),
        "busy_seconds_per_rank": busy.sum(axis=0).tolist(),
        "real_tok_per_s_all_steps": tps_all,
        "busy_imbalance_all_steps": imb_all,
    }


def worker_main(argv: list[str]) -> int:
    """``--spec JSON --modes static,dynamic --out FILE``: train one run under torchrun; rank 0 writes FILE."""
    import argparse

    import torch.distributed as dist

    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--spec", required=True)
    p.add_argument("--modes", default="static,dynamic")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    run = Run(**json.loads(args.spec))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        t0 = time.perf_counter()
        res = run_one(run, rank, world, tuple(args.modes.split(",")))
        if rank == 0:
            res |= {"run": asdict(run), "world_size": world, "seconds": time.perf_counter() - t0,
                    "load_average": list(os.getloadavg())}  # fmt: skip
            Path(args.out).write_text(json.dumps(res) + "\n")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
