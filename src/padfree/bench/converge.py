"""Does the batching change what the model learns? (``padfree bench --converge``)

The same model (same config, same initial weights) is trained on the same real text under ``sorted``,
``random``, ``bucketed`` and ``packed``, each to the same number of loss-bearing tokens, with the same
learning-rate schedule *as a function of tokens seen* (linear warm-up, then cosine down to
``min_lr_frac``), through :class:`~padfree.torch.PlanBatchSampler` with ``grad_accum`` micro-batches per
optimizer step and every micro-batch's loss normalized by the step's loss tokens. The optimizer steps are
held to the same size too (``equal_steps``, the default): ``packed`` plans at ``budget`` and every other
strategy at the smallest budget whose epoch has no more optimizer steps than packed's
(:func:`matched_budgets`), so all of them take about the same number of steps of about the same real
tokens, as a training run that fixes its batch size would. Without it a padded plan's steps carry fewer real
tokens (its slots hold padding), it takes more, smaller steps for the same tokens, and early in training that
alone moves the held-out loss by percents. A fixed held-out set
(samples never trained on, chosen by seed) is evaluated every ``eval_every`` tokens: the token-mean
next-token loss over padded batches. The training loss of every optimizer step is recorded too, with the
mean length of its samples, so a plan whose steps are length-homogeneous (``sorted``) shows its
oscillation.

Held-out losses are compared at equal tokens: each curve is interpolated (linearly in tokens) onto the
common eval marks, and the last mark (the token target) is the headline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from padfree.bench.machine import machine
from padfree.bench.samples import Samples
from padfree.bench.sampling import PADFREE
from padfree.bench.trainer import ModelRun, Trainer
from padfree.core.config import PlanConfig
from padfree.core.strategies import REGISTRY
from padfree.errors import ConfigError

STRATEGIES = PADFREE


@dataclass(frozen=True)
class ConvergeConfig(ModelRun):
    """A convergence comparison, on top of the model run (:class:`~.trainer.ModelRun`; here a larger
    learning rate and masked padded rows by default). ``train_tokens``: loss-bearing tokens per run;
    ``eval_every``: tokens between held-out evaluations (default: 1/12 of ``train_tokens``)."""

    lr: float = 2e-3
    padded_mask: bool = True
    grad_accum: int = 4
    train_tokens: int = 1_500_000
    eval_every: int | None = None
    eval_samples: int = 200
    strategies: tuple[str, ...] = STRATEGIES
    warmup_frac: float = 0.05
    min_lr_frac: float = 0.1
    equal_steps: bool = True

    def __post_init__(self) -> None:
        if self.train_tokens < 1 or self.budget < 2 or self.grad_accum < 1 or self.eval_samples < 1:
            raise ConfigError("train_tokens, budget, grad_accum and eval_samples must be positive")
        super().__post_init__()
        if not 0 <= self.warmup_frac < 1:
            raise ConfigError(f"warmup_frac must be in [0, 1) (got {self.warmup_frac})")
        bad = [s for s in self.strategies if s not in STRATEGIES]
        if bad or not self.strategies:
            raise ConfigError(f"--converge compares {', '.join(STRATEGIES)} (got {bad})")

    @property
    def every(self) -> int:
        return self.eval_every or max(1, self.train_tokens // 12)


def lr_at(tokens: float, cfg: ConvergeConfig) -> float:
    """The learning rate after ``tokens`` loss tokens: linear warm-up, then cosine to ``min_lr_frac``.

    >>> cfg = ConvergeConfig(train_tokens=1000, warmup_frac=0.1, lr=1.0, min_lr_frac=0.0)
    >>> [round(lr_at(t, cfg), 3) for t in (0, 50, 100, 550, 1000)]
    [0.01, 0.5, 1.0, 0.5, 0.0]
    """
    warm = cfg.warmup_frac * cfg.train_tokens
    if tokens < warm:
        return cfg.lr * max(tokens, 0.01 * warm) / warm
    frac = min(1.0, (tokens - warm) / max(1.0, cfg.train_tokens - warm))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def epoch_steps(lengths: np.ndarray, strategy: str, budget: int, cfg: ConvergeConfig) -> int:
    """Optimizer steps in one epoch of ``strategy`` at ``budget`` (one rank, ``grad_accum`` micro-batches)."""
    from padfree.core.planner import make_plan

    config = PlanConfig(strategy=strategy, budget=budget, grad_accum=cfg.grad_accum, seed=cfg.seed)
    return make_plan(lengths, config, 0).n_steps


def matched_budgets(lengths: np.ndarray, cfg: ConvergeConfig) -> dict[str, int]:
    """Micro-batch budget per strategy so that every strategy's optimizer steps carry about the same real
    tokens: ``packed`` keeps ``cfg.budget``; each other strategy gets the smallest budget (found by bisection,
    between ``cfg.budget`` and 16x it) whose epoch has no more steps than packed's. The total real tokens of
    an epoch are the same for all, so equal step counts mean equal mean tokens per step.

    >>> cfg = ConvergeConfig(budget=64, grad_accum=2, strategies=("random", "packed"))
    >>> b = matched_budgets(np.random.default_rng(0).integers(1, 64, 400), cfg)
    >>> b["packed"], b["random"] > 64
    (64, True)
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    target = epoch_steps(lengths, "packed", cfg.budget, cfg)
    out = {}
    for name in cfg.strategies:
        if REGISTRY[name].packed or not cfg.equal_steps:
            out[name] = cfg.budget
            continue
        lo, hi = cfg.budget, 16 * cfg.budget
        if epoch_steps(lengths, name, hi, cfg) > target:
            out[name] = hi
            continue
        while lo < hi:  # smallest budget with at most `target` steps (steps fall as the budget grows)
            mid = (lo + hi) // 2
            if epoch_steps(lengths, name, mid, cfg) <= target:
                hi = mid
            else:
                lo = mid + 1
        out[name] = lo
    return out


def split(n: int, eval_samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train ids, held-out ids)``, both sorted: a seeded random ``eval_samples`` are held out."""
    if eval_samples >= n:
        raise ConfigError(f"{eval_samples} held-out samples leave nothing to train on ({n} samples)")
    perm = np.random.default_rng(seed + 7).permutation(n)
    return np.sort(perm[eval_samples:]), np.sort(perm[:eval_samples])


def eval_batches(lengths: np.ndarray, budget: int) -> list[np.ndarray]:
    """Held-out samples sorted by length, cut into padded batches under the budget."""
    from padfree.core.batching import cut

    order = np.argsort(lengths, kind="stable")
    offsets = cut(lengths[order].astype(np.int64), budget)
    return [order[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def evaluate(trainer: Trainer, items: list[dict], batches: list[np.ndarray]) -> float:
    """Token-mean next-token loss of the held-out items (padded batches, no gradient)."""
    import torch

    from padfree.torch import PadCollator

    collate = PadCollator()
    total, count = 0.0, 0
    trainer.model.eval()
    with torch.no_grad():
        for ids in batches:
            batch = collate([items[i] for i in ids])
            total += float(trainer.loss_sum(batch))
            count += batch.loss_tokens
    trainer.model.train()
    return total / max(count, 1)


def train_one(
    strategy: str,
    items: list[dict],
    lengths: np.ndarray,
    loss_tokens: np.ndarray,
    eval_items: list[dict],
    eval_plan: list[np.ndarray],
    cfg: ConvergeConfig,
    say: Callable[[str], None],
    budget: int | None = None,
) -> dict:
    """One strategy's run: held-out curve, per-step train losses, wall time."""
    from padfree.torch import PlanBatchSampler, PlannedDataset
    from padfree.torch.run.loop import steps_of

    trainer = Trainer.of(cfg, REGISTRY[strategy].packed)
    budget = budget or cfg.budget
    config = PlanConfig(strategy=strategy, budget=budget, grad_accum=cfg.grad_accum, seed=cfg.seed)
    sampler = PlanBatchSampler(lengths, config, loss_tokens=loss_tokens, rank=0, world_size=1)
    data = PlannedDataset(items)
    t_start = time.perf_counter()
    curve = [{"tokens": 0, "loss": evaluate(trainer, eval_items, eval_plan), "step": 0}]
    steps: list[dict] = []
    tokens, next_eval, epoch, train_s = 0, cfg.every, 0, 0.0
    while tokens < cfg.train_tokens:
        sampler.set_epoch(epoch)
        for group in steps_of(sampler):
            step_tokens = int(group[-1].info.step_tokens or 0)
            lr = lr_at(tokens, cfg)
            t0 = time.perf_counter()
            loss = 0.0
            for m in group:
                loss += trainer.backward(trainer.collate(data.__getitems__(m)), step_tokens)
            trainer.update(lr)
            train_s += time.perf_counter() - t0
            n_samples = sum(len(m) for m in group)
            real = sum(sum(m.info.lengths) for m in group)
            tokens += step_tokens
            steps.append(
                {
                    "tokens": tokens,
                    "loss": loss / max(step_tokens, 1),
                    "lr": lr,
                    "mean_length": real / max(n_samples, 1),
                    "samples": n_samples,
                    "epoch": epoch,
                }
            )
            if tokens >= next_eval or tokens >= cfg.train_tokens:
                curve.append(
                    {"tokens": tokens, "loss": evaluate(trainer, eval_items, eval_plan), "step": len(steps)}
                )
                say(
                    f"  {strategy}: {tokens:,} tokens, step {len(steps)}, held-out {curve[-1]['loss']:.4f}, "
                    f"train {steps[-1]['loss']:.4f}, {tokens / max(train_s, 1e-9):,.0f} tok/s"
                )
                while next_eval <= tokens:
                    next_eval += cfg.every
            if tokens >= cfg.train_tokens:
                break
        epoch += 1
    return {
        "curve": curve,
        "steps": steps,
        "tokens": tokens,
        "final_loss": curve[-1]["loss"],
        "initial_loss": curve[0]["loss"],
        "epochs_touched": steps[-1]["epoch"] + 1 if steps else 1,
        "steps_per_epoch": sampler.steps_in_epoch,
        "train_seconds": train_s,
        "wall_seconds": time.perf_counter() - t_start,
        "attention": trainer.attn,
        "budget": budget,
        "mean_step_tokens": tokens / max(len(steps), 1),
    }


def at_marks(curve: list[dict], marks: np.ndarray) -> np.ndarray:
    """Held-out loss interpolated linearly in tokens at the given marks."""
    t = np.array([c["tokens"] for c in curve], dtype=np.float64)
    y = np.array([c["loss"] for c in curve], dtype=np.float64)
    return np.interp(marks, t, y)


def compare(results: dict, train_tokens: int, every: int) -> dict:
    """Held-out losses side by side: at equal tokens (the eval marks ``every, 2*every, ..., train_tokens``)
    and, since a strategy whose steps carry more real tokens takes fewer optimizer steps for the same
    tokens, also at equal optimizer steps (ten marks up to the fewest steps any strategy took); each
    relative to ``random`` when it ran."""
    marks = np.arange(every, train_tokens + 1, every, dtype=np.float64)
    if marks.size == 0 or marks[-1] != train_tokens:
        marks = np.append(marks, float(train_tokens))
    table = {n: at_marks(r["curve"], marks) for n, r in results.items()}
    fewest = min(r["curve"][-1]["step"] for r in results.values())
    step_marks = np.unique(np.round(np.linspace(0, fewest, 11)[1:]).astype(np.int64)).astype(np.float64)
    by_step = {
        n: np.interp(step_marks, [c["step"] for c in r["curve"]], [c["loss"] for c in r["curve"]])
        for n, r in results.items()
    }
    out = {
        "marks": marks.tolist(),
        "loss_at_marks": {n: v.tolist() for n, v in table.items()},
        "step_marks": step_marks.tolist(),
        "loss_at_step_marks": {n: v.tolist() for n, v in by_step.items()},
        "final_steps": {n: r["curve"][-1]["step"] for n, r in results.items()},
    }
    if "random" in table:
        ref, sref = table["random"], by_step["random"]
        out["rel_diff_vs_random"] = {n: ((v - ref) / ref).tolist() for n, v in table.items()}
        out["final_rel_diff_vs_random"] = {n: float((v[-1] - ref[-1]) / ref[-1]) for n, v in table.items()}
        out["equal_steps_rel_diff_vs_random"] = {
            n: float((v[-1] - sref[-1]) / sref[-1]) for n, v in by_step.items()
        }
    return out


def run_converge(
    samples: Samples, loss_masks: list, cfg: ConvergeConfig, progress: Callable[[str], None] | None = None
) -> dict:
    """Train every strategy in turn; returns ``{"machine", "config", "strategies", "comparison"}``."""
    import torch

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    say = progress or (lambda _m: None)
    lengths = samples.lengths
    train_ids, eval_ids = split(lengths.shape[0], cfg.eval_samples, cfg.seed)
    items = [{"input_ids": samples.input_ids[i], "loss_mask": loss_masks[i]} for i in range(lengths.shape[0])]
    train_items = [items[i] for i in train_ids]
    eval_items = [items[i] for i in eval_ids]
    eval_plan = eval_batches(lengths[eval_ids], cfg.budget)
    budgets = matched_budgets(lengths[train_ids], cfg)
    results = {}
    for name in cfg.strategies:
        say(f"{name}: training {cfg.train_tokens:,} tokens at a budget of {budgets[name]} per micro-batch")
        results[name] = train_one(
            name,
            train_items,
            lengths[train_ids],
            samples.loss_tokens[train_ids],
            eval_items,
            eval_plan,
            cfg,
            say,
            budgets[name],
        )
    comparison = compare(results, cfg.train_tokens, cfg.every)
    for r in results.values():
        r["oscillation"] = oscillation(r["steps"])
    return {
        "machine": machine(cfg.device),
        "config": {
            "budget": cfg.budget,
            "budgets": budgets,
            "equal_steps": cfg.equal_steps,
            "grad_accum": cfg.grad_accum,
            "train_tokens": cfg.train_tokens,
            "eval_every": cfg.every,
            "eval_samples": int(eval_ids.shape[0]),
            "eval_tokens": int(samples.loss_tokens[eval_ids].sum()),
            "train_samples": int(train_ids.shape[0]),
            "train_samples_tokens": int(samples.loss_tokens[train_ids].sum()),
            "seed": cfg.seed,
            "model": cfg.model,
            "model_overrides": cfg.model_overrides,
            "lr": cfg.lr,
            "schedule": f"linear warm-up over {cfg.warmup_frac:.0%} of the tokens, cosine to "
            f"{cfg.min_lr_frac:g} x lr at {cfg.train_tokens:,} tokens (a function of tokens seen)",
            "clip": cfg.clip,
            "weight_decay": cfg.weight_decay,
            "data": samples.source,
        },
        "strategies": results,
        "comparison": comparison,
    }


def oscillation(steps: list[dict]) -> dict:
    """How much a run's per-step training loss jumps around, and how much of that follows the steps'
    mean sample length: std of step-to-step loss differences over the second half of the run, and the
    correlation of step loss with log mean length there."""
    half = steps[len(steps) // 2 :]
    if len(half) < 3:
        return {"step_diff_std": None, "loss_length_corr": None}
    loss = np.array([s["loss"] for s in half])
    length = np.log(np.array([s["mean_length"] for s in half]))
    corr = float(np.corrcoef(loss, length)[0, 1]) if loss.std() > 0 and length.std() > 0 else 0.0
    return {"step_diff_std": float(np.diff(loss).std()), "loss_length_corr": corr}
