"""Real training throughput of every strategy, padfree's and the peers', side by side (``padfree bench``).

Every strategy trains its own copy of the same model (same config, same initial weights): forward,
backward, gradient clipping and an AdamW update per micro-batch, on the same samples and the same token
budget per micro-batch. The micro-batches come from padfree's plan (``sorted``, ``random``, ``bucketed``,
``packed``) or from a peer's adapter (:mod:`padfree.bench.peers`); padded micro-batches go through
:class:`~padfree.torch.PadCollator` (one row per sample, right-padded, ``sdpa``), packed ones through
:class:`~padfree.torch.PackCollator` (one row, documents attend only to themselves, through
:func:`padfree.torch.attention_implementation`: padfree's varlen attention when present). So a packed
peer's number is its *bin choice* trained on padfree's packed path, and the result says so.

Protocol:

- every strategy plans the same samples (one epoch); ``select="stratified"`` (the default) measures
  ``steps`` of its micro-batches: the epoch's micro-batches are ordered by modeled work per loss token
  (slots plus attention pairs weighted by the model's shape: what padding and attention length cost), cut
  into ``steps`` strata of equal count, and the middle one of each is trained
  (:func:`.sampling.stratified`). ``real_tok_per_s`` is then the *epoch's* loss tokens over the epoch's
  estimated seconds: each pick's measured seconds per unit of modeled work times its stratum's modeled
  work (:func:`.sampling.epoch_seconds`), so a few measured steps stand for the whole epoch's padding and
  length mix, and strategies are compared on the same samples; ``measured_real_tok_per_s`` is the
  measured steps' own ratio;
  ``select="epoch"`` trains every micro-batch of the epoch: with a small sample set
  (:func:`.sampling.bench_subset`: about ``steps x budget`` tokens) all strategies then do exactly the same
  useful work, though plans over so few samples pad more than over a real dataset (and ``bucketed``, whose
  buckets merge until each holds ``mix`` micro-batches, falls back to near-random order);
- strategies run interleaved in rounds (A B C D ... A B C D ...), so a slow spell of a shared machine
  hits every strategy alike; a strategy with fewer micro-batches (less padding) simply stops earlier;
- ``warmup`` untimed rounds come first, on seeded random micro-batches of the same epoch;
  with ``repeats`` > 1 all measured rounds run that many times and every step keeps its fastest time;
- a step is timed from the collated batch to the end of the optimizer update (the device synchronized);
  collation is not timed;
- loss-bearing tokens are the real (non-padding) tokens after each document's first; per-step medians and
  ranges of the measured steps are reported too;
- an arm that cannot run does not take the others down: before the rounds (``isolate``, the default) each
  arm's heaviest micro-batch trains once in a child process capped at ``memory_limit`` bytes
  (:mod:`.isolation`; default 80% of the memory available), and an arm that fails there is left out with
  ``{"error", "out_of_memory", "peak_rss_mb"}``; an arm whose step raises during the rounds (an
  allocation failure included) is recorded the same way and the others go on;
- peak memory: on CUDA ``torch.cuda.max_memory_allocated`` during the strategy's steps; on CPU the
  process RSS sampled every 2 ms during its steps (``peak_rss_mb``, which includes every strategy's
  model and optimizer state) and its rise over the RSS before the step (``peak_step_mb``: the step's own
  activations and gradients).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from padfree.bench import isolation
from padfree.bench.machine import machine
from padfree.bench.measure import Batching, batching_stats
from padfree.bench.peers import PEERS, missing
from padfree.bench.samples import Samples
from padfree.bench.sampling import (
    STRATEGIES,
    attention_weight,
    epoch_seconds,
    micro_ids,
    micro_work,
    strategy_batching,
    stratified,
)
from padfree.bench.trainer import MemoryWatch, ModelRun, Trainer, return_freed_memory
from padfree.errors import ConfigError


@dataclass(frozen=True)
class BenchConfig(ModelRun):
    """What ``padfree bench`` measures, on top of the model run (:class:`~.trainer.ModelRun`).

    Attributes:
        steps: measured steps per strategy; ``warmup``: untimed steps per strategy before them.
        select: ``stratified`` measures ``steps`` micro-batches of each strategy's epoch over all the
            samples, one per stratum of modeled work per loss token, and estimates the epoch's seconds
            from them (:func:`.sampling.epoch_seconds`); ``epoch`` trains every micro-batch of the epoch
            (give it a small sample set, e.g. :func:`.sampling.bench_subset`, so that every strategy does
            exactly the same work).
        repeats: passes over the measured rounds; each micro-batch keeps its fastest time (on a shared
            machine the minimum drops the steps another process slowed down).
        strategies: names from :data:`STRATEGIES` (padfree's and the peers'), in round order.
        isolate: first train each arm's heaviest micro-batch in a child process under ``memory_limit``
            bytes (None: :func:`.isolation.default_limit`; 0: uncapped) and leave out an arm that fails.
    """

    steps: int = 10
    warmup: int = 2
    select: str = "stratified"
    repeats: int = 1
    strategies: tuple[str, ...] = STRATEGIES
    isolate: bool = True
    memory_limit: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.steps < 1 or self.warmup < 0:
            raise ConfigError(f"steps must be >= 1 and warmup >= 0 (got {self.steps}, {self.warmup})")
        if self.repeats < 1:
            raise ConfigError(f"repeats must be >= 1 (got {self.repeats})")
        if self.select not in ("stratified", "epoch"):
            raise ConfigError(f"select must be 'stratified' or 'epoch' (got {self.select!r})")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown or not self.strategies:
            raise ConfigError(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")


def run_bench(
    samples: Samples,
    cfg: BenchConfig,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Train every strategy in interleaved rounds; returns ``{"machine", "config", "order", "strategies"}``.

    A strategy that cannot run here (a peer's module missing, a peer failing) gets ``{"error": why}``.
    """
    import torch

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    if not cfg.device.startswith("cuda"):
        return_freed_memory()
    say = progress or (lambda _m: None)
    lengths = samples.lengths
    if lengths.size == 0 or int(lengths.min()) < 1:
        raise ConfigError("every sample needs at least one token")
    if int(lengths.max()) > cfg.budget:
        raise ConfigError(f"samples longer than the budget {cfg.budget}: cut or drop them first")
    attn_weight = attention_weight(cfg.model, cfg.model_overrides)

    results: dict[str, dict] = {}
    runners: dict[str, dict] = {}
    for name in cfg.strategies:
        run = _runner(name, lengths, cfg, attn_weight)
        results[name] = {"error": run["error"]} if "error" in run else {}
        if "error" not in run:
            runners[name] = run
            say(f"{name}: {run['batching'].n_micro} micro-batches, attention {run['trainer'].attn}")

    items = samples.items()
    if cfg.isolate and runners:
        limit = isolation.default_limit() if cfg.memory_limit is None else cfg.memory_limit
        for name in list(runners):
            run = runners[name]
            candidates = np.concatenate((run["picks"], run["warm"]))
            heaviest = int(candidates[np.argmax(run["work"][candidates])])
            heavy_items = [items[i] for i in micro_ids(run["batching"], heaviest)]
            check = isolation.preflight(heavy_items, cfg, run["batching"].packed, limit)
            if not check["ok"]:
                where = f"its heaviest micro-batch alone in a child process capped at {limit / 2**30:.1f} GiB"
                results[name] = _failed(check, where)
                say(f"{name}: left out: {results[name]['error']}")
                del runners[name]

    order, rec, watches, failed = _train_rounds(runners, items, cfg, say)
    for name, run in runners.items():
        if name in failed:
            peak = {"peak_rss_mb": max(watches[name].peak, MemoryWatch.rss()) / 2**20}
            results[name] = _failed(failed[name] | peak, "during the interleaved rounds")
            continue
        results[name] = summarize(name, run, rec[name], watches[name], lengths, cfg)
    base = results.get("sorted", {}).get("real_tok_per_s")
    for res in results.values():
        if base and "real_tok_per_s" in res:
            res["vs_sorted"] = res["real_tok_per_s"] / base
    return {
        "machine": machine(cfg.device, cfg.dtype),
        "config": _config_record(cfg, samples),
        "order": order,
        "strategies": results,
    }


def _failed(check: dict, where: str) -> dict:
    """The result of an arm that failed: why, whether it ran out of memory, its peak, and where."""
    kind = "out of memory" if check.get("out_of_memory") else "failed"
    out = {
        "error": f"{kind} ({where}): {check.get('error', '')}",
        "out_of_memory": bool(check.get("out_of_memory")),
    }
    if check.get("peak_rss_mb") is not None:
        out["peak_rss_mb"] = float(check["peak_rss_mb"])
    return out


def _runner(name: str, lengths: np.ndarray, cfg: BenchConfig, attn_weight: float) -> dict:
    """A strategy's epoch of micro-batches, its trainer and its measured picks; ``{"error": why}`` when it
    cannot run here."""
    why = missing(PEERS[name]) if name in PEERS else None
    if why:
        return {"error": why}
    try:
        t0 = time.perf_counter()
        b = strategy_batching(name, lengths, cfg.budget, cfg.seed)
        plan_s = time.perf_counter() - t0
    except Exception as exc:  # a peer failing here is a result, not a crash
        return {"error": f"{type(exc).__name__}: {exc}"}
    work, loss = micro_work(lengths, b, attn_weight)
    if cfg.select == "epoch":
        picks = stratum = np.arange(b.n_micro, dtype=np.int64)
    else:
        picks, stratum = stratified(work / np.maximum(loss, 1.0), cfg.steps)
    return {
        "batching": b,
        "warm": np.random.default_rng(cfg.seed + 1).integers(0, b.n_micro, size=max(cfg.warmup, 1)),
        "trainer": Trainer.of(cfg, packed=b.packed),
        "plan_s": plan_s,
        "picks": picks,
        "stratum": stratum,
        "work": work,
        "epoch_loss_tokens": float(loss.sum()),
    }


def _train_rounds(
    runners: dict[str, dict], items: Sequence[dict], cfg: BenchConfig, say: Callable[[str], None]
) -> tuple[list[list], dict[str, dict], dict[str, MemoryWatch], dict[str, dict]]:
    """Warm-up rounds, then the measured rounds (``repeats`` times), one micro-batch per strategy per
    round: ``(order of what ran, measurements per strategy, memory watch per strategy, failed arms)``. An
    arm whose step raises is out of the later rounds, with ``{"error", "out_of_memory"}``."""
    failed: dict[str, dict] = {}
    order: list[list] = []
    rec: dict[str, dict[str, list]] = {
        name: {"sec": [], "loss_tok": [], "tok": [], "slots": [], "rows": []} for name in runners
    }
    watches = {name: MemoryWatch(cfg.device) for name in runners}
    measured = max([r["picks"].shape[0] for r in runners.values()], default=0)
    rounds = cfg.warmup + cfg.repeats * measured
    for r in range(rounds):
        for name, run in runners.items():
            if name in failed:
                continue
            trainer = run["trainer"]
            try:
                if r < cfg.warmup:
                    k = int(run["warm"][r])  # a seeded random micro-batch of the same epoch
                    batch = trainer.collate([items[i] for i in micro_ids(run["batching"], k)])
                    trainer.step(batch, batch.loss_tokens)
                    order.append([r, name, "warmup"])
                    continue
                rep, k = divmod(r - cfg.warmup, measured)
                if k >= run["picks"].shape[0]:
                    continue
                batch = trainer.collate([items[i] for i in micro_ids(run["batching"], int(run["picks"][k]))])
                with watches[name]:
                    sec, _ = trainer.step(batch, batch.loss_tokens)
            except Exception as exc:  # an arm's failure (out of memory included) is its result
                first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
                failed[name] = {
                    "error": f"{type(exc).__name__}: {first}",
                    "out_of_memory": isolation.is_oom(exc),
                }
                run["trainer"] = None  # free its model and optimizer for the others
                say(f"{name}: failed in round {r + 1}: {failed[name]['error']}")
                continue
            order.append([r, name, "measured"])
            x = rec[name]
            if rep > 0:  # the same micro-batch again: keep its fastest time
                x["sec"][k] = min(x["sec"][k], sec)
                continue
            x["sec"].append(sec)
            x["loss_tok"].append(batch.loss_tokens)
            x["tok"].append(batch.tokens)
            x["slots"].append(int(batch["input_ids"].numel()))
            x["rows"].append(int(batch["input_ids"].shape[0]))
        say(f"round {r + 1}/{rounds} done" + (" (warm-up)" if r < cfg.warmup else ""))
    return order, rec, watches, failed


def _config_record(cfg: BenchConfig, samples: Samples) -> dict:
    lengths = samples.lengths
    return {
        "budget": cfg.budget,
        "steps": cfg.steps,
        "warmup": cfg.warmup,
        "select": cfg.select,
        "repeats": cfg.repeats,
        "seed": cfg.seed,
        "model": cfg.model,
        "model_overrides": cfg.model_overrides,
        "padded_mask": cfg.padded_mask,
        "lr": cfg.lr,
        "clip": cfg.clip,
        "samples": int(lengths.shape[0]),
        "tokens": int(lengths.sum()),
        "data": samples.source,
        "step": "forward + backward + clip + AdamW per micro-batch (collation untimed)",
    }


def _stats(values: ArrayLike) -> dict:
    v = np.asarray(values, dtype=np.float64)
    return {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max())}


def summarize(
    name: str, run: dict, x: dict, watch: MemoryWatch, lengths: np.ndarray, cfg: BenchConfig
) -> dict:
    b: Batching = run["batching"]
    sec = np.asarray(x["sec"])
    loss_tok, tok, slots = (np.asarray(x[k], dtype=np.float64) for k in ("loss_tok", "tok", "slots"))
    epoch = batching_stats(lengths, b, cfg.budget)
    packed = b.packed
    est = epoch_seconds(sec, run["picks"], run["stratum"], run["work"])
    out = {
        "real_tok_per_s": run["epoch_loss_tokens"] / est,
        "measured_real_tok_per_s": float(loss_tok.sum() / sec.sum()),
        "epoch_seconds_estimate": est,
        "epoch_loss_tokens": int(run["epoch_loss_tokens"]),
        "slots_per_s": float(slots.sum() / sec.sum()),
        "step_real_tok_per_s": _stats(loss_tok / sec),
        "step_seconds": _stats(sec),
        "padding_efficiency": float(tok.sum() / slots.sum()),
        "bin_padding_efficiency": epoch["padding_efficiency"],
        "steps": int(sec.shape[0]),
        "micro_batches_in_epoch": b.n_micro,
        "measured_micro_batches": [int(k) for k in run["picks"]],
        "warmup_steps": cfg.warmup,
        "loss_tokens": int(loss_tok.sum()),
        "real_tokens": int(tok.sum()),
        "slots": int(slots.sum()),
        "rows_per_step": _stats(x["rows"]),
        "packed": packed,
        "attention": run["trainer"].attn,
        "attention_path": run["trainer"].attention_path,
        "collator": "PackCollator (one row per micro-batch)"
        if packed
        else "PadCollator (one row per sample)",
        "plan_seconds": run["plan_s"],
    }
    if cfg.device.startswith("cuda"):
        out["peak_memory_mb"] = watch.peak / 2**20
        out["memory"] = "torch.cuda.max_memory_allocated during the strategy's measured steps"
    else:
        out["peak_rss_mb"] = watch.peak / 2**20
        out["peak_step_mb"] = watch.rise / 2**20
        out["peak_memory_mb"] = out["peak_step_mb"]
        out["memory"] = (
            "process RSS sampled every 2 ms during the strategy's steps; step = rise over the RSS before it"
        )
    if name in PEERS:
        out["peer"] = PEERS[name].describe
        out["note"] = b.note + (
            "; trained as packed rows through padfree's PackCollator and attention (the kernel is padfree's)"
            if packed
            else "; trained as padded rows through padfree's PadCollator"
        )
    return out
