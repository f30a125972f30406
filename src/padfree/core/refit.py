"""Refitting the cost model and the rank speeds from measured micro-batch times, the same on every rank.

Every rank measures its micro-batches; the ranks exchange ``(rank, slots, attention, seconds)`` records and
each one refits, from the same numbers, the model

    seconds = (a*slots + b*attention + c) / speed[rank],    a, b, c >= 0, mean(speed) = 1

by alternating least squares: with the speeds fixed, ``(a, b, c)`` is an exact non-negative least squares
(every support of the 3 coefficients solved, the best feasible kept) with a light ridge toward the previous
coefficients (which settles what the data cannot tell apart, e.g. ``a`` and ``c`` when every packed bin is
equally full); with ``(a, b, c)`` fixed, each speed has a closed form.

All ranks must reach the *same* numbers, or they would give a step to ranks differently and lose samples.
So the per-rank sums are exactly rounded (``math.fsum``: independent of summation order, BLAS or SIMD), the
3x3 solves are plain Python floats in a fixed order, and the results are rounded to 6 significant digits.
"""

from __future__ import annotations

import math

import numpy as np

N_STATS = 11
"""Per rank: n, then sums of x x^T (6: ss, sa, s1, aa, a1, 11), x*y (3) and y^2, with x = (s, a, 1)."""

_RIDGE = 1e-4
_ROUNDS = 12
_SPEED_RANGE = (0.05, 20.0)
SPEED_RATIO = _SPEED_RANGE[1] / _SPEED_RANGE[0]
"""The most one rank's fitted speed can differ from another's (400x): speeds are clipped to 0.05 .. 20
before they are normalized to mean 1, so every fitted speed lies in ``1/400 .. 400``."""
MAX_COEF = 1e30
"""The largest fitted coefficient (as :data:`padfree.core.config.MAX_COST`): costs stay finite on any plan."""
MIN_SECONDS = 1e-7
"""Measured micro-batch times below this (0.1 microseconds: no real forward and backward) are dropped."""
MAX_SECONDS = 86_400.0
"""Measured micro-batch times above this (a day) are dropped as absurd."""
OUTLIER = 100.0
"""A time whose rate (seconds per share of a full micro-batch, :func:`screen`) is more than this factor above
or below the median rate of a rank's recent accepted times is dropped."""
MIN_SHARE = 1 / 16
"""The least share of a full micro-batch a rate is computed over (an empty tail micro-batch still costs its
fixed overhead)."""
MEDIAN_MIN = 8
"""Accepted times a rank needs before the outlier test applies (before that: only the absolute bounds)."""


def rank_stats(records: np.ndarray, world_size: int, scale: tuple[float, float]) -> np.ndarray:
    """Exactly rounded sums per rank of ``records`` (rows ``rank, slots, attention, seconds``); features are
    divided by ``scale`` (e.g. ``(budget, budget**2)``) so the sums stay well conditioned.

    >>> st = rank_stats(np.array([[0, 2.0, 4.0, 1.0], [1, 1.0, 1.0, 3.0]]), 2, (1.0, 1.0))
    >>> st[:, 0].tolist(), float(st[1, -1])
    ([1.0, 1.0], 9.0)
    """
    out = np.zeros((world_size, N_STATS))
    for r in range(world_size):
        rows = records[records[:, 0] == r]
        if rows.shape[0] == 0:
            continue
        s, a, y = rows[:, 1] / scale[0], rows[:, 2] / scale[1], rows[:, 3]
        one = np.ones_like(s)
        cols = (one, s * s, s * a, s, a * a, a, one, s * y, a * y, y, y * y)
        out[r] = [math.fsum(col.tolist()) for col in cols]
    return out


def _gram(st: np.ndarray) -> tuple[list[list[float]], list[float]]:
    g = [float(v) for v in st[1:7]]
    gram = [[g[0], g[1], g[2]], [g[1], g[3], g[4]], [g[2], g[4], g[5]]]
    return gram, [float(v) for v in st[7:10]]


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting, plain floats, fixed order; None when singular."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(n):
        piv = max(range(col, n), key=lambda i: abs(a[i][col]))
        if abs(a[piv][col]) <= 1e-300:
            return None
        a[col], a[piv] = a[piv], a[col]
        for i in range(col + 1, n):
            f = a[i][col] / a[col][col]
            for j in range(col, n + 1):
                a[i][j] -= f * a[col][j]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        x[i] = (a[i][n] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return x


def nnls3(gram: list[list[float]], rhs: list[float]) -> list[float]:
    """``argmin theta^T G theta - 2 rhs^T theta`` over ``theta >= 0`` (G symmetric positive definite),
    exactly: the best of the unconstrained solutions on each of the 7 supports that are feasible (KKT).

    >>> nnls3([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0]], [2.0, -1.0, 0.5])
    [2.0, 0.0, 0.5]
    """
    best, best_obj = [0.0, 0.0, 0.0], 0.0
    for mask in range(1, 8):
        sup = [j for j in range(3) if mask >> j & 1]
        sol = _solve([[gram[i][j] for j in sup] for i in sup], [rhs[i] for i in sup])
        if sol is None or any(v < 0 for v in sol):
            continue
        obj = -sum(rhs[i] * v for i, v in zip(sup, sol, strict=True))
        if obj < best_obj:
            best_obj, best = obj, [0.0] * 3
            for i, v in zip(sup, sol, strict=True):
                best[i] = v
    return best


def rate(seconds: float, slots: float, budget: float) -> float:
    """Seconds per share of a full micro-batch (``slots / budget``, at least :data:`MIN_SHARE`): what the
    outlier test compares, so that a small micro-batch at the tail of an epoch is no outlier."""
    return seconds / max(slots / budget, MIN_SHARE)


def screen(seconds: float, rate_now: float, recent: list[float], empty: bool = False) -> str | None:
    """Why a measured time must be dropped (``None``: keep it): non-finite, <= 0, below :data:`MIN_SECONDS`
    or above :data:`MAX_SECONDS`, or its :func:`rate` ``rate_now`` more than :data:`OUTLIER` times off the
    median of ``recent`` (the rates of this rank's last accepted times, once there are :data:`MEDIAN_MIN`).
    An ``empty`` micro-batch (no rows) that took no time at all (a loop that skips it) is kept: it says what
    a micro-batch costs with nothing in it.

    >>> screen(0.5, 0.5, []), screen(float("nan"), 0.0, []), screen(1e160, 1e160, [])
    (None, 'not a finite number > 0', 'absurd')
    >>> screen(80.0, 80.0, [0.5] * 8), screen(0.01, 0.16, [0.5] * 8)  # the 2nd: a small micro-batch
    ('outlier', None)
    >>> screen(0.0, 0.0, [0.5] * 8), screen(0.0, 0.0, [0.5] * 8, empty=True)
    ('not a finite number > 0', None)
    """
    if empty and seconds == 0.0:
        return None
    if not (math.isfinite(seconds) and seconds > 0):
        return "not a finite number > 0"
    if not MIN_SECONDS <= seconds <= MAX_SECONDS:
        return "absurd"
    if len(recent) >= MEDIAN_MIN:
        mid = sorted(recent)[len(recent) // 2]
        if not mid / OUTLIER <= rate_now <= mid * OUTLIER:
            return "outlier"
    return None


def valid_records(records: np.ndarray) -> np.ndarray:
    """The rows of ``records`` (``rank, slots, attention, seconds``) a refit can use: finite features >= 0
    and seconds within :data:`MIN_SECONDS` .. :data:`MAX_SECONDS` (what every rank screened already; a rank
    that did not cannot poison the others)."""
    if records.shape[0] == 0:
        return records
    feats, sec = records[:, 1:3], records[:, 3]
    ok = np.isfinite(records).all(axis=1) & (feats >= 0).all(axis=1) & (feats <= 1e30).all(axis=1)
    skipped = (sec == 0) & (feats == 0).all(axis=1)  # an empty micro-batch a loop did not run (screen)
    ok &= ((sec >= MIN_SECONDS) | skipped) & (sec <= MAX_SECONDS)
    return records[ok]


def _sig(x: float, digits: int = 6) -> float:
    return float(f"{x:.{digits}g}")


def fit(
    stats: np.ndarray,
    prior: tuple[float, float, float],
    speeds: tuple[float, ...] | None,
    scale: tuple[float, float],
) -> tuple[tuple[float, float, float], tuple[float, ...]]:
    """Refit ``(a, b, c)`` (seconds per slot, per attention unit, per micro-batch) and the rank speeds.

    ``stats`` come from :func:`rank_stats` with the same ``scale``; ``prior`` is what the ridge leans on
    (the previous fit, or a configured model rescaled by :func:`prior_scale`); ``speeds`` the previous
    speeds (``None``: equal). A rank without records keeps its speed. Deterministic in plain floats.

    >>> rec = np.array([[r, s, 0.0, (2e-3 * s + 0.01) / (1.0 if r == 0 else 0.5)]
    ...                 for r in (0, 1) for s in (100.0, 300.0, 800.0, 1000.0)])
    >>> (a, b, c), speeds = fit(rank_stats(rec, 2, (1000.0, 1e6)), (1e-3, 0.0, 0.0), None, (1000.0, 1e6))
    >>> round(a * 0.75, 5), b, round(c * 0.75, 3), speeds      # true: a=2e-3, c=0.01, speeds 1 : 0.5
    (0.002, 0.0, 0.01, (1.33333, 0.666667))
    """
    world = stats.shape[0]
    n = [float(v) for v in stats[:, 0]]
    prior = _bounded(prior)
    speeds = _safe_speeds(speeds, world)
    if math.fsum(n) == 0 or not np.isfinite(stats).all():
        return prior, (tuple([1.0] * world) if speeds is None else speeds)
    unit = (scale[0], scale[1], 1.0)
    prior_s = [prior[j] * unit[j] for j in range(3)]
    inv = [1.0] * world if speeds is None else [1.0 / s for s in speeds]
    grams = [_gram(stats[r]) for r in range(world)]
    penalty = [
        _RIDGE * math.fsum(grams[r][0][j][j] for r in range(world)) for j in range(3)
    ]  # 1e-4 of the data
    theta = prior_s
    for it in range(_ROUNDS + 1):
        gram = [
            [math.fsum(inv[r] * inv[r] * grams[r][0][i][j] for r in range(world)) for j in range(3)]
            for i in range(3)
        ]
        rhs = [math.fsum(inv[r] * grams[r][1][i] for r in range(world)) for i in range(3)]
        for j in range(3):
            gram[j][j] += penalty[j]
            rhs[j] += penalty[j] * prior_s[j]
        theta = nnls3(gram, rhs)
        if it == _ROUNDS:
            break
        for r in range(world):
            g, h = grams[r]
            den = sum(theta[i] * g[i][j] * theta[j] for i in range(3) for j in range(3))
            num = sum(theta[i] * h[i] for i in range(3))
            if n[r] > 0 and den > 0 and num > 0:
                inv[r] = min(max(num / den, 1.0 / _SPEED_RANGE[1]), 1.0 / _SPEED_RANGE[0])
        mean_speed = math.fsum(1.0 / u for u in inv) / world
        inv = [u * mean_speed for u in inv]
    a, b, c = (_sig(theta[j] / unit[j]) for j in range(3))
    fitted = tuple(_sig(1.0 / u) for u in inv)
    if not all(math.isfinite(v) for v in (a, b, c, *fitted)) or a + b + c <= 0:
        return prior, (tuple([1.0] * world) if speeds is None else speeds)  # nothing usable was learned
    return _bounded((a, b, c)), fitted


def _bounded(cost: tuple[float, float, float]) -> tuple[float, float, float]:
    """Coefficients clipped to ``0 .. MAX_COEF`` (NaN: 0), and ``(1, 0, 0)`` if none is left > 0."""
    out = [min(max(v, 0.0), MAX_COEF) if math.isfinite(v) else (MAX_COEF if v > 0 else 0.0) for v in cost]
    return (out[0], out[1], out[2]) if sum(out) > 0 else (1.0, 0.0, 0.0)


def _safe_speeds(speeds: tuple[float, ...] | None, world: int) -> tuple[float, ...] | None:
    """``speeds`` clipped to ``1/SPEED_RATIO .. SPEED_RATIO`` (where every fitted speed lies); ``None``
    (equal) when not one finite number > 0 per rank."""
    if speeds is None or len(speeds) != world or not all(math.isfinite(v) and v > 0 for v in speeds):
        return None
    return tuple(min(max(float(v), 1.0 / SPEED_RATIO), SPEED_RATIO) for v in speeds)


def prior_scale(
    stats: np.ndarray, model: tuple[float, float, float], scale: tuple[float, float]
) -> tuple[float, float, float]:
    """A configured model (token units) rescaled to seconds by least squares on ``stats`` (equal speeds)."""
    m = (model[0] * scale[0], model[1] * scale[1], model[2])
    parts_num, parts_den = [], []
    for r in range(stats.shape[0]):
        g, h = _gram(stats[r])
        parts_num.append(sum(m[i] * h[i] for i in range(3)))
        parts_den.append(sum(m[i] * g[i][j] * m[j] for i in range(3) for j in range(3)))
    num, den = math.fsum(parts_num), math.fsum(parts_den)
    k = num / den if den > 0 and num > 0 else 1.0
    if not math.isfinite(k):
        k = 1.0
    return _bounded((model[0] * k, model[1] * k, model[2] * k))


def relative_error(
    records: np.ndarray, model: tuple[float, float, float], speeds: tuple[float, ...] | None
) -> float | None:
    """Mean of ``|predicted - measured| / measured`` over ``records`` (``None`` when there are none)."""
    rows = records[records[:, 3] > 0]
    if rows.shape[0] == 0:
        return None
    s = 1.0 if speeds is None else np.asarray(speeds)[rows[:, 0].astype(np.int64)]
    pred = (model[0] * rows[:, 1] + model[1] * rows[:, 2] + model[2]) / s
    return float(np.mean(np.abs(pred - rows[:, 3]) / rows[:, 3]))
