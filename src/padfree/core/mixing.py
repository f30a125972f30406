"""How wide each bucket's noise window is (bucketed's ``mix``, in micro-batches): set by hand, or chosen from
the data so that padding stays low and composition stays fresh at every dataset size.

Inside a bucket, a sample is cut together with samples drawn from a window of ``mix`` micro-batches' worth
of tokens of similar length (:func:`padfree.core.batching.bucketed_batches`). A wider window means fresher
partners (two samples meet again in the next epoch with probability about ``(2/3) / mix``) and wider
length spread inside a micro-batch (more padding). How much padding a window costs depends on how many
micro-batches the epoch has: on 900K samples 128 micro-batches are a sliver of the length range, on 2K
samples they are all of it.

The automatic rule (``PlanConfig(mix=None)``, the default) gives bucket ``b`` the window
``clip(round(scale * m_b), 1, 128)``, where ``m_b = budget // longest_b`` is how many samples its
micro-batches hold. Co-batch pairs concentrate where micro-batches hold many (short) samples, ``C(m_b, 2)``
pairs each, while padding is spread evenly over micro-batches; so a window proportional to ``m_b`` buys
freshness where the pairs are and saves padding where micro-batches hold a few long samples. ``scale`` is
the largest whose :func:`estimate`\\d padding efficiency is >= :data:`TARGET_EFFICIENCY`, raised when
needed until the estimated co-batch repeat is <= :func:`repeat_target`: :data:`TARGET_REPEAT`, or on a
short epoch (few steps of many micro-batches) a share of the repeat a step can afford there
(:func:`repeat_limit`, the limit ``padfree report`` judges by). Both estimates come from the length
histogram alone (no plan is made) and do not depend on the epoch, so every epoch uses one rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from padfree.core.buckets import bucket_of

MIX_MAX = 128
"""The widest window, in micro-batches (co-batch repeat ~0.007 on seed_mix at any scale that reaches it)."""
TARGET_EFFICIENCY = 0.96
"""The automatic rule widens windows while the estimated padding efficiency stays at or above this."""
TARGET_REPEAT = 0.10
"""... and, when padding alone would allow less, widens them until the estimated co-batch repeat is this
(or :func:`repeat_target`'s higher value on a short epoch)."""
REPEAT_FLOOR = 0.01
REPEAT_CAP = 0.25
"""The co-batch repeat limit (:func:`repeat_limit`) never exceeds this, however short the epoch: a quarter
of the pairs meeting again is a plan that trains on nearly the same micro-batches every epoch."""
SHORT_EPOCH_STEPS = 20
"""An epoch of fewer steps is short: its epoch-to-epoch numbers are noisy (``padfree analyze`` warns) and the
automatic window may aim above :data:`TARGET_REPEAT` (:func:`repeat_target`)."""
SLOT_FILL = 0.9
"""The share of the budget a bucketed micro-batch's padded slots fill (0.90-0.95 measured on the real sets:
the cut leaves room), so an epoch has about ``tokens / (budget x efficiency x SLOT_FILL)`` micro-batches."""
SHORT_EPOCH_SHARE = 0.8
"""On a short epoch the automatic window aims at this share of :func:`repeat_limit` (the estimate runs
above the measured repeat there, and the epoch's steps are estimated, so the plan stays under the limit)."""
_SCALES = 2.0 ** (np.arange(-28, 29) / 4.0)  # 1/128 .. 128 in quarter octaves
_POINTS = 4096


@dataclass(frozen=True)
class Mix:
    """The noise window of every bucket, in micro-batches.

    Attributes:
        uniform: every bucket gets this window (``PlanConfig(mix=N)``); None for the automatic rule.
        scale: automatic rule: bucket ``b`` gets ``clip(round(scale * m_b), 1, MIX_MAX)``.

    >>> Mix(scale=0.25).window(np.array([1, 8, 100, 1000])).tolist()
    [1.0, 2.0, 25.0, 128.0]
    >>> Mix(uniform=16).window(np.array([1, 100])).tolist()
    [16.0, 16.0]
    """

    uniform: int | None = None
    scale: float = 1.0

    def window(self, per_micro: np.ndarray) -> np.ndarray:
        """Window, in micro-batches, of buckets whose micro-batches hold ``per_micro`` samples."""
        if self.uniform is not None:
            return np.full(np.shape(per_micro), float(self.uniform))
        return np.clip(np.round(self.scale * np.asarray(per_micro, np.float64)), 1.0, float(MIX_MAX))

    def describe(self) -> str:
        """``"16"`` or ``"auto (scale 0.21)"``."""
        return str(self.uniform) if self.uniform is not None else f"auto (scale {self.scale:.3g})"


def repeat_limit(steps: float, micro_per_step: int) -> float:
    """The most co-batch repeat an epoch of ``steps`` steps of ``micro_per_step`` micro-batches affords:
    ``min(0.25, max(0.01, micro_per_step / steps))``. A pair sharing a micro-batch is 1 of
    ``micro_per_step`` micro-batch pairs among a sample's step partners, and a random order puts any pair in
    one step with probability ~``1 / steps``; a repeat ``r`` adds ~``r / micro_per_step`` to that, so this
    keeps pairs sharing a step again within twice a random order's rate, and stops at :data:`REPEAT_CAP`
    on short epochs where that would allow anything. ``padfree report`` judges plans by it.

    >>> repeat_limit(1000, 32), repeat_limit(4, 32), repeat_limit(10_000, 4)
    (0.032, 0.25, 0.01)
    """
    return min(REPEAT_CAP, max(REPEAT_FLOOR, micro_per_step / max(steps, 1.0)))


def repeat_target(tokens: float, budget: int, efficiency: float, micro_per_step: int) -> float:
    """The co-batch repeat the automatic window aims at: :data:`TARGET_REPEAT`, raised on a short epoch
    (fewer than :data:`SHORT_EPOCH_STEPS` estimated steps: ``tokens / (budget x efficiency x SLOT_FILL)``
    micro-batches, ``micro_per_step`` a step) to :data:`SHORT_EPOCH_SHARE` x its :func:`repeat_limit`.
    Where an epoch has a few steps of many micro-batches, random steps already share many pairs, so a
    narrower window buys padding efficiency within the limit ``padfree report`` judges by (2.3K samples at
    budget 4096, 8 x 4: 0.91 -> 0.94 at co-batch repeat 0.13, limit 0.25).

    >>> repeat_target(2e8, 16384, 0.96, 32), repeat_target(2e6, 16384, 0.96, 32)
    (0.1, 0.2)
    """
    steps = tokens / (budget * max(efficiency, 1e-6) * SLOT_FILL) / max(micro_per_step, 1)
    if steps >= SHORT_EPOCH_STEPS:
        return TARGET_REPEAT
    return max(TARGET_REPEAT, SHORT_EPOCH_SHARE * repeat_limit(steps, micro_per_step))


def merge_buckets(tokens: np.ndarray, longest: np.ndarray, budget: int, mix: Mix) -> np.ndarray:
    """Merge neighbouring buckets, shortest first, until each holds its window's worth of tokens (``window x
    budget``, the window of the merged group's longest sample); a short remainder joins the bucket below it.
    ``tokens`` and ``longest`` are per input bucket; returns the dense merged id of each input bucket.

    Without this, a sparse bucket of short samples fits in one or two micro-batches and those samples would
    meet the same partners every epoch. Merging costs little padding: such buckets carry few tokens.

    >>> merge_buckets(np.array([10.0, 10, 50, 5]), np.array([2, 4, 8, 9]), 10, Mix(uniform=2)).tolist()
    [0, 0, 1, 1]
    """
    n_in = tokens.shape[0]
    new_id = np.zeros(n_in, np.int64)
    cur, acc, acc_max, last_closed = 0, 0.0, 0, -1
    for k in range(n_in):  # loops over buckets (dozens), not samples
        new_id[k] = cur
        if tokens[k] == 0:
            continue
        acc += float(tokens[k])
        acc_max = max(acc_max, int(longest[k]))
        if acc >= float(mix.window(np.array([max(1, budget // acc_max)]))[0]) * budget:
            last_closed = cur
            cur, acc, acc_max = cur + 1, 0.0, 0
    if acc > 0 and last_closed >= 0:  # remainder at the long end joins the bucket below it
        new_id[new_id == cur] = last_closed
    return np.unique(new_id, return_inverse=True)[1].astype(np.int64)


def estimate(length: np.ndarray, budget: int, edges: np.ndarray, mix: Mix) -> tuple[float, float]:
    """``(padding efficiency, co-batch repeat)`` that bucketed plans should reach with ``mix``, from the
    length histogram alone.

    Efficiency: a sample at token position ``x`` of its bucket's length profile gets the key ``x + W u``
    (``W`` = its bucket's window in tokens); the micro-batch around a key holds the samples whose positions
    lie within ``W`` below it, so its longest sits near ``W / (m + 1)`` below the key (the top of ``m``
    uniform draws, ``m = budget // length``). The sample is padded to the mean of the profile over ``[x, x +
    W]`` shifted down by that much (the bucket's longest past its end):
    ``P = (shift * l + G(x + W - shift) - G(x)) / W``, ``G`` the integral of the profile; efficiency =
    ``sum l / sum P`` over 4,096 samples evenly spaced in length order. Repeat: a pair that shared a
    micro-batch meets again with probability ``(2/3) budget / W`` (uniform noise; the pair's distance in
    the window is triangular), at least ``budget / T_b`` (a bucket of ``T_b`` tokens shuffled whole),
    weighted by the bucket's pairs. Both track the measured values within ~0.01-0.02 on the real sets.
    """
    per_len = np.bincount(length)
    vals = np.flatnonzero(per_len)
    cnt = per_len[vals].astype(np.float64)
    v = vals.astype(np.float64)
    c_cnt = np.concatenate(([0.0], np.cumsum(cnt)))
    c_tok = np.concatenate(([0.0], np.cumsum(cnt * v)))
    c_sq = np.concatenate(([0.0], np.cumsum(cnt * v * v)))
    b_in = bucket_of(vals, edges)
    n_in = int(b_in.max()) + 1
    tokens_in = np.bincount(b_in, weights=cnt * v, minlength=n_in)
    longest_in = np.zeros(n_in, np.int64)
    np.maximum.at(longest_in, b_in, vals)
    bd = merge_buckets(tokens_in, longest_in, budget, mix)[b_in]  # merged bucket of each distinct length
    nb = int(bd[-1]) + 1
    first = np.searchsorted(bd, np.arange(nb), side="left")
    last = np.append(first[1:], vals.shape[0]) - 1
    t_end = c_tok[last + 1]
    longest = v[last]
    w_b = mix.window(np.maximum(1, budget // vals[last])) * budget

    n = int(c_cnt[-1])
    r = np.unique(np.linspace(0, n - 1, min(n, _POINTS)).round())
    d = np.searchsorted(c_cnt, r, side="right") - 1
    lp, bp = v[d], bd[d]
    x = c_tok[d] + (r - c_cnt[d]) * lp
    w = w_b[bp]
    shift = w / (np.maximum(1.0, np.floor(budget / lp)) + 1.0)

    def integral(t: np.ndarray) -> np.ndarray:  # G(t), the profile held at the bucket's longest past its end
        tc = np.minimum(t, t_end[bp])
        j = np.clip(np.searchsorted(c_tok, tc, side="right") - 1, first[bp], last[bp])
        return c_sq[j] + (tc - c_tok[j]) * v[j] + np.maximum(0.0, t - t_end[bp]) * longest[bp]

    padded = np.maximum((shift * lp + integral(x + w - shift) - integral(x)) / w, lp)
    efficiency = float(lp.sum() / padded.sum())

    n_b = np.bincount(bd, weights=cnt, minlength=nb)
    t_b = t_end - c_tok[first]
    pairs = n_b * np.maximum(budget * n_b / t_b - 1.0, 0.0) / 2.0
    again = np.minimum(1.0, np.maximum((2.0 / 3.0) * budget / w_b, budget / t_b))
    repeat = float((pairs * again).sum() / pairs.sum()) if pairs.sum() > 0 else 0.0
    return efficiency, repeat


def choose(length: np.ndarray, budget: int, edges: np.ndarray, micro_per_step: int = 1) -> Mix:
    """The automatic rule: the largest ``scale`` (quarter octaves from 1/128 to 128) whose estimated padding
    efficiency is >= :data:`TARGET_EFFICIENCY`; if its estimated co-batch repeat is above
    :func:`repeat_target` (:data:`TARGET_REPEAT` unless the epoch is short for ``micro_per_step``
    micro-batches a step), the smallest larger scale that brings it there (or the largest scale).

    ``edges`` should be the unjittered edges, so that every epoch of a dataset gets the same rule.
    """

    def first_failing(ok: object) -> int:  # binary search: ok(i) holds for i < answer, fails from it on
        lo, hi = 0, len(_SCALES)
        while lo < hi:
            mid = (lo + hi) // 2
            if ok(mid):  # type: ignore[operator]
                lo = mid + 1
            else:
                hi = mid
        return lo

    cache: dict[int, tuple[float, float]] = {}

    def est(i: int) -> tuple[float, float]:
        if i not in cache:
            cache[i] = estimate(length, budget, edges, Mix(scale=float(_SCALES[i])))
        return cache[i]

    tokens = float(np.asarray(length, np.float64).sum())

    def too_stale(j: int) -> bool:  # the estimated repeat at scale j is above its target
        eff, rep = est(j)
        return rep > repeat_target(tokens, budget, eff, micro_per_step)

    i = max(0, first_failing(lambda j: est(j)[0] >= TARGET_EFFICIENCY) - 1)
    if too_stale(i):
        rest = first_failing(lambda j: j < i or too_stale(j))
        i = min(rest, len(_SCALES) - 1)
    return Mix(scale=float(_SCALES[i]))
