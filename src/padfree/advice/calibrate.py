"""Calibrating the cost model on this machine: time a training step over padded shapes, fit
``seconds = A*slots + B*attention + C`` by non-negative least squares, report the fit's error.

A shape is ``count`` rows of ``length`` tokens: ``slots = count*length``, ``attention = count*length^2``.
The fit minimizes *relative* squared error (each row weighted by 1/time), so short and long steps count
alike. The saved :class:`~padfree.core.config.CostModel` is normalized to token-equivalents (``a = 1``,
``b = B/A``, ``c = C/A``) and keeps ``seconds_per_slot = A`` so that costs convert back to seconds.

The timed step is forward + backward + the AdamW update, so ``c`` holds the update's time; with gradient
accumulation the update runs once per ``grad_accum`` micro-batches, so ``c`` overstates the per-micro-batch
overhead somewhat (it weighs against plans with many small micro-batches).

The measuring is separate from the fitting: :func:`measure` takes any ``step(count, length)`` callable
and a clock, so a synthetic step (tests) and a real torch training step (:func:`torch_train_step`) go
through the same code.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from padfree.core.config import CostModel
from padfree.errors import ConfigError


@dataclass(frozen=True)
class Shape:
    """``count`` padded rows of ``length`` tokens."""

    count: int
    length: int

    @property
    def slots(self) -> int:
        return self.count * self.length

    @property
    def attention(self) -> int:
        return self.count * self.length * self.length

    @property
    def call(self) -> tuple[int, ...]:
        """The arguments the timed step takes for this shape."""
        return (self.count, self.length)


@dataclass(frozen=True)
class DrafterShape(Shape):
    """``count`` documents of ``length`` tokens, each with ``anchors`` DFlash blocks (a drafter step):
    ``blocks = count x anchors`` and ``reach = blocks x length / 2`` (:mod:`padfree.core.cost`)."""

    anchors: int = 0

    @property
    def blocks(self) -> int:
        return self.count * self.anchors

    @property
    def reach(self) -> float:
        return self.blocks * self.length / 2.0

    @property
    def call(self) -> tuple[int, ...]:
        return (self.count, self.length, self.anchors)


def drafter_grid(
    shapes: Sequence[Shape], per_token: Sequence[float] = (1 / 32, 1 / 16, 1 / 8)
) -> list[Shape]:
    """Each shape with DFlash anchors per document at the given rates per token (at least 1, at most
    ``length - 1``), so that blocks vary at fixed tokens.

    >>> [(s.count, s.length, s.anchors) for s in drafter_grid([Shape(2, 64)], (1 / 32, 1 / 8))]
    [(2, 64, 2), (2, 64, 8)]
    """
    out: list[Shape] = []
    for s in shapes:
        seen = set()
        for r in per_token:
            a = max(1, min(s.length - 1, round(s.length * r)))
            if a not in seen:
                seen.add(a)
                out.append(DrafterShape(s.count, s.length, a))
    return out


def shape_grid(
    budget: int, lengths: Sequence[int], fractions: Sequence[float] = (1.0, 0.5, 0.25)
) -> list[Shape]:
    """For each length, the counts that fill ``fraction`` of the budget (at least one row, no duplicates),
    so that slots vary at every length and attention varies at fixed slots.

    >>> [(s.count, s.length) for s in shape_grid(256, [64, 256], (1.0, 0.5))]
    [(4, 64), (2, 64), (1, 256)]
    """
    out: list[Shape] = []
    for L in lengths:
        if L < 1 or budget < L:
            raise ConfigError(f"calibration length {L} must be between 1 and the budget {budget}")
        counts = []
        for f in fractions:
            c = int(budget * f) // int(L)
            if c >= 1 and c not in counts:
                counts.append(c)
        out += [Shape(c, int(L)) for c in counts]
    return out


def held_out_grid(budget: int, lengths: Sequence[int]) -> list[Shape]:
    """Shapes the fit never sees: geometric midpoints of every other pair of grid lengths, at the full and
    half budget."""
    ls = sorted(set(int(x) for x in lengths))
    mids = [round(math.sqrt(a * b)) for a, b in itertools.pairwise(ls)][::2]
    return shape_grid(budget, [m for m in mids if 1 <= m <= budget], (1.0, 0.5))


def default_lengths(budget: int, lo: int = 64, hi: int = 4096) -> list[int]:
    """Powers of two from ``lo`` up to ``min(hi, budget)``."""
    out, L = [], lo
    while min(hi, budget) >= L:
        out.append(L)
        L *= 2
    return out


def measure(
    shapes: Sequence[Shape],
    step: Callable[..., object],
    repeats: int = 3,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
    progress: Callable[[int, Shape, float], None] | None = None,
    prime: bool = False,
) -> np.ndarray:
    """Median seconds of ``step(count, length)`` per shape.

    Shapes are timed in rounds (every shape once per round, ``warmup`` untimed rounds first) rather than
    one shape at a time, so a slow spell of a shared machine spreads over all shapes instead of skewing a
    few of them. ``prime``: one untimed step of the largest shape before anything else, which absorbs the
    one-time setup (optimizer state, allocator, kernel selection) for the price of one step instead of a
    whole warm-up round.
    """
    times = np.empty((max(1, repeats), len(shapes)))
    if prime and shapes:
        big = max(shapes, key=lambda s: (s.slots, s.attention))
        step(*big.call)
    for _ in range(warmup):
        for s in shapes:
            step(*s.call)
    for r in range(times.shape[0]):
        for i, s in enumerate(shapes):
            t = clock()
            step(*s.call)
            times[r, i] = clock() - t
    out = np.median(times, axis=0)
    if progress is not None:
        for i, s in enumerate(shapes):
            progress(i, s, float(out[i]))
    return out


def design(shapes: Sequence[Shape]) -> np.ndarray:
    """The regression matrix: columns slots, attention, 1 (and blocks, reach for drafter shapes)."""
    if shapes and all(isinstance(s, DrafterShape) for s in shapes):
        rows = [[s.slots, s.attention, 1.0, s.blocks, s.reach] for s in shapes]  # type: ignore[attr-defined]
        return np.array(rows, dtype=np.float64)
    return np.array([[s.slots, s.attention, 1.0] for s in shapes], dtype=np.float64)


def nnls(x: np.ndarray, y: np.ndarray, keep: tuple[int, ...] = ()) -> np.ndarray:
    """Least squares with non-negative coefficients, exact for a few columns: the best of the
    unconstrained solutions on every subset of columns whose coefficients are all >= 0. Columns in
    ``keep`` are in every subset tried (their coefficients are positive unless no such subset fits).

    >>> nnls(np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([2.0, -1.0])).tolist()
    [2.0, 0.0]
    """
    n = x.shape[1]
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    best, best_res = np.zeros(n), float(np.sum(y * y))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            if not set(keep) <= set(cols):
                continue
            sol, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
            if np.any(sol < 0):
                continue
            kept = [sol[cols.index(j)] for j in keep]
            if any(v <= 1e-6 * float(np.abs(sol).max()) for v in kept):  # a kept column must matter
                continue
            res = float(np.sum((xs[:, cols] @ sol - y) ** 2))
            if res < best_res - 1e-15 * max(1.0, best_res):
                best_res = res
                best = np.zeros(n)
                best[list(cols)] = sol
    return best / scale


def fit_seconds(shapes: Sequence[Shape], seconds: np.ndarray) -> np.ndarray:
    """``(A, B, C)`` >= 0 minimizing the relative error of ``A*slots + B*attention + C`` vs ``seconds``
    (``(A, B, C, D, E)`` with ``+ D*blocks + E*reach`` for drafter shapes)."""
    y = np.asarray(seconds, dtype=np.float64)
    n_coef = design(shapes[:1]).shape[1] if shapes else 3
    if y.shape[0] != len(shapes) or len(shapes) < n_coef:
        raise ConfigError(
            f"need at least {n_coef} timed shapes to fit {n_coef} coefficients (got {len(shapes)})"
        )
    if np.any(~np.isfinite(y)) or np.any(y <= 0):
        raise ConfigError("every timed step must take a positive, finite time")
    w = 1.0 / y
    # every token costs something: the slots coefficient stays in the model (alone it fits y > 0 with
    # A > 0), so noisy timings give a poor fit that says so, never a model without a per-token cost
    return nnls(design(shapes) * w[:, None], y * w, keep=(0,))


def relative_errors(coef: np.ndarray, shapes: Sequence[Shape], seconds: np.ndarray) -> dict:
    """Relative RMS and max relative error of the fitted times."""
    if not shapes:
        return {"rel_rms": None, "max_rel": None, "n": 0}
    pred = design(shapes) @ coef
    rel = (pred - seconds) / seconds
    return {
        "rel_rms": float(np.sqrt(np.mean(rel**2))),
        "max_rel": float(np.max(np.abs(rel))),
        "n": len(shapes),
    }


@dataclass(frozen=True)
class Calibration:
    """The fitted cost model and how well it fits.

    Attributes:
        cost: normalized to token-equivalents (``a = 1``).
        seconds_per_slot: seconds per token-equivalent (``A``): cost units x this = seconds.
        coef_seconds: the raw fit ``(A, B, C)`` in seconds.
        fit, held_out: ``{"rel_rms", "max_rel", "n"}`` on the fitted and on the held-out shapes.
        rows: every timed shape: count, length, slots, attention, seconds, predicted, held_out.
        meta: what was measured (model, attention, device, grid).
    """

    cost: CostModel
    seconds_per_slot: float
    coef_seconds: tuple[float, ...]
    fit: dict
    held_out: dict
    rows: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "seconds_per_slot": self.seconds_per_slot,
            "seconds_per_unit": self.seconds_per_slot,
            "coef_seconds": dict(zip("ABCDE", self.coef_seconds, strict=False)),
            "fit": self.fit,
            "held_out": self.held_out,
            "held_out_rel_rms": self.held_out["rel_rms"],
            "meta": self.meta,
            "rows": self.rows,
        }

    def save(self, path) -> None:
        """Write the cost file that ``padfree analyze/plan/simulate --cost`` read."""
        self.cost.save(path, **self.to_json())


def calibrate(
    step: Callable[[int, int], object],
    budget: int,
    lengths: Sequence[int],
    fractions: Sequence[float] = (1.0, 0.5, 0.25),
    repeats: int = 3,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
    held_out: bool = True,
    source: str = "calibrate",
    meta: dict | None = None,
    progress: Callable[[int, Shape, float], None] | None = None,
    prime: bool = False,
    anchors_per_token: Sequence[float] | None = None,
) -> Calibration:
    """Time ``step`` on the grid (and on held-out shapes), fit, normalize. With ``anchors_per_token`` (a
    DFlash drafter setup) every shape comes at those anchor rates (:func:`drafter_grid`), ``step`` takes
    ``(count, length, anchors)`` and the fit adds ``d*blocks + e*reach``.

    >>> clock = [0.0]
    >>> def step(count, length):  # a synthetic machine: 2 us per slot, 1 ns per attention unit, 5 ms
    ...     clock[0] += 2e-6 * count * length + 1e-9 * count * length**2 + 5e-3
    >>> cal = calibrate(step, 1024, [64, 128, 256, 512, 1024], repeats=1, warmup=0, clock=lambda: clock[0])
    >>> round(cal.cost.b, 6), round(cal.cost.c, 1), round(cal.seconds_per_slot * 1e6, 3)
    (0.0005, 2500.0, 2.0)
    """
    fit_shapes = shape_grid(budget, lengths, fractions)
    test_shapes = held_out_grid(budget, lengths) if held_out else []
    if anchors_per_token:
        fit_shapes = drafter_grid(fit_shapes, anchors_per_token)
        test_shapes = drafter_grid(test_shapes, (float(np.mean(anchors_per_token)),))
    n_fit = len(fit_shapes)
    seconds = measure(fit_shapes + test_shapes, step, repeats, warmup, clock, progress, prime)
    y_fit, y_test = seconds[:n_fit], seconds[n_fit:]
    coef = fit_seconds(fit_shapes, y_fit)
    a_raw, b_raw, c_raw = (float(v) for v in coef[:3])
    d_raw, e_raw = (float(v) for v in coef[3:5]) if coef.shape[0] == 5 else (0.0, 0.0)
    if not a_raw > 0:  # pragma: no cover - fit_seconds keeps the slots term positive
        raise ConfigError("the fit found no per-token cost; use a larger budget or more repeats")
    pred = design(fit_shapes + test_shapes) @ coef
    rows = [
        {
            "count": s.count,
            "length": s.length,
            "slots": s.slots,
            "attention": s.attention,
            **({"anchors": s.anchors} if isinstance(s, DrafterShape) else {}),
            "seconds": float(t),
            "predicted": float(p),
            "held_out": i >= n_fit,
        }
        for i, (s, t, p) in enumerate(zip(fit_shapes + test_shapes, seconds, pred, strict=True))
    ]
    return Calibration(
        cost=CostModel(
            a=1.0, b=b_raw / a_raw, c=c_raw / a_raw, source=source, d=d_raw / a_raw, e=e_raw / a_raw
        ),
        seconds_per_slot=a_raw,
        coef_seconds=(a_raw, b_raw, c_raw, d_raw, e_raw) if anchors_per_token else (a_raw, b_raw, c_raw),
        fit=relative_errors(coef, fit_shapes, y_fit),
        held_out=relative_errors(coef, test_shapes, y_test),
        rows=rows,
        meta={"budget": budget, "lengths": list(lengths), "repeats": repeats, "warmup": warmup}
        | (meta or {}),
    )


def torch_train_step(
    model_name: str = "tiny-llama",
    attn: str = "sdpa",
    device: str = "cpu",
    seed: int = 0,
    lr: float = 1e-4,
    **overrides,
) -> Callable[[int, int], None]:
    """A ``step(count, length)`` that runs forward, backward and an AdamW step of
    :func:`padfree.models.build_model` on random token ids (made once per shape, on the first call,
    which the warm-up absorbs), synchronizing the device so the clock sees the work."""
    import torch

    from padfree.models import build_model

    model = build_model(model_name, attn_implementation=attn, seed=seed, **overrides).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    vocab = int(model.config.vocab_size)
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def step(count: int, length: int) -> None:
        x = inputs.get((count, length))
        if x is None:
            g = torch.Generator().manual_seed(seed * 1_000_003 + count * 7919 + length)
            x = inputs[(count, length)] = torch.randint(0, vocab, (count, length), generator=g).to(device)
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()

    return step


CALIBRATION_TARGET = {
    "hidden_size": 128,
    "num_hidden_layers": 8,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
"""The target (and drafter width) ``calibrate --drafter`` times: small enough for a CPU, big enough that the
drafter's terms stand out of the timing noise."""


def torch_drafter_step(method: str, seed: int = 0, recipe=None, **sizes) -> Callable[..., None]:
    """A ``step(count, length[, anchors])`` of a drafter setup under ``recipe`` (default: the ``specforge``
    preset): ``count`` synthetic documents of ``length`` tokens (every token supervised) packed in one row,
    the frozen target's forward, the drafter's loss (DFlash with exactly ``anchors`` blocks per document),
    backward and an AdamW step (:func:`padfree.drafter.train.train_micro`), on the CPU. ``sizes``: ``vocab``
    and the target's transformers sizes (:func:`padfree.drafter.train.build_models`)."""
    from padfree.core.anchors import AnchorPolicy
    from padfree.drafter.collate import DrafterCollator
    from padfree.drafter.train import build_models, train_micro

    sizes = {"vocab": 2048, **CALIBRATION_TARGET, **sizes}
    models = build_models(method, seed=seed, lr=1e-4, recipe=recipe, **sizes)
    block = models.recipe.block_size
    batches: dict[tuple, Any] = {}

    def step(count: int, length: int, anchors: int = 1) -> None:
        key = (count, length, anchors)
        batch = batches.get(key)
        if batch is None:
            g = np.random.default_rng([seed, count, length, anchors])
            docs = [
                {"input_ids": g.integers(2, sizes["vocab"], length), "loss_mask": np.ones(length, bool),
                 "sample_id": i}
                for i in range(count)
            ]  # fmt: skip
            policy = AnchorPolicy(block_size=block, max_anchors=max(1, anchors), density=1.0)
            col = DrafterCollator(method, policy, recipe=models.recipe, seed=seed, mask_token_id=1)
            batch = batches[key] = col(docs)
        train_micro(models, batch)

    return step
