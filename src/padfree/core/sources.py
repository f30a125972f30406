"""Weighted sources: every optimizer step holds each source's share, in the chosen unit, within one document.

A plan of sources (``PlanConfig(sources=(("chat", 0.6), ("code", 0.25), ("math", 0.15)), unit="tokens")``)
is composed step by step::

    each source's stream (its samples in passes, each pass a fresh shuffle: exactly once per pass)
        --deficit rule over the step (in the unit)--> the step's samples
        --packed / bucketed--> k micro-batches --ranks balanced as for any plan--> the step

The deficit rule is Megatron's largest-error blend, per step and in the chosen unit: the next sample comes
from the source with the largest ``w_s * (U + v_s) - g_s`` (``U`` the step's units so far, ``g_s`` the
source's, ``v_s`` the unit value of its next sample: 1, its tokens or its loss tokens), plus the deficit the
source carries from earlier steps (``w_s * U_epoch - G_s``; in documents the step's counts are apportioned
instead: each source gets ``floor`` or ``ceil`` of ``w_s * n``, the extra samples to the largest carried
deficits). The step ends where the next sample no longer fits its ``world_size * grad_accum`` micro-batches.
Every step's share of each source is then within one document of ``w_s`` times the step's units: in
documents, ``|c_s - w_s n| < 1``; in tokens or loss tokens, within the longest document in that unit
(:func:`step_shares` measures it), and the carried deficits keep the epoch's totals on target.

An epoch is ``epoch_steps`` steps, or the steps that reach ``epoch_tokens`` tokens (default: the tokens of
all sources together). A source then goes through ``drawn / size`` passes (upsampled above 1, capped
below): :func:`repetition`. The state that continues an epoch at any step boundary, at any world size, is
the counters of :class:`Counters` (samples drawn and units per source, the epoch's units and tokens),
a pure function of the resume history (:func:`replay_sources`); the sampler's state records them and a
resume checks them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

from padfree.core import _cuts, cost, kernels, steps
from padfree.core.budget import Budget
from padfree.core.config import UNITS, check_source_config
from padfree.core.items import Report, validate_lengths
from padfree.core.kernels import njit
from padfree.core.plan import Plan
from padfree.core.strategies import REGISTRY
from padfree.errors import ConfigError, OverlongError, StateError

if TYPE_CHECKING:
    from padfree.core.config import PlanConfig
    from padfree.core.replay import Segment

__all__ = [
    "UNITS",
    "Counters",
    "SourceData",
    "assign_steps",
    "check_source_config",
    "plan_sources",
    "repetition",
    "replay_sources",
    "source_data",
    "source_token_sums",
    "step_shares",
]

_STREAM = 0x50C  # the sources' random streams (passes, within-step order)


@dataclass(frozen=True)
class SourceData:
    """The samples of every source, in the config's order, as one global id space: source ``s`` holds ids
    ``starts[s] .. starts[s+1]-1`` (a ``ConcatDataset`` of the sources in this order indexes them so).

    Attributes:
        names, weights: the config's sources; ``weights`` normalized to sum 1.
        lengths: every sample's tokens, source after source (validated).
        loss: every sample's loss-bearing tokens (``None``: ``length - 1``).
        starts: the sources' first ids (``len(names) + 1`` entries).
        unit: the config's unit.
    """

    names: tuple[str, ...]
    weights: np.ndarray
    lengths: np.ndarray
    loss: np.ndarray | None
    starts: np.ndarray
    unit: str
    _perm: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.starts)

    def source_of(self, ids: ArrayLike) -> np.ndarray:
        """The source index of each global sample id."""
        return np.searchsorted(self.starts, np.asarray(ids), side="right").astype(np.int64) - 1


def source_data(
    lengths: Mapping[str, ArrayLike] | SourceData,
    config: PlanConfig,
    loss_tokens: Mapping[str, ArrayLike] | ArrayLike | None = None,
) -> SourceData:
    """Validate the per-source lengths (and loss tokens) of ``config.sources``: a mapping name -> lengths
    with exactly the config's names, none empty; each problem one line naming the source."""
    if isinstance(lengths, SourceData):
        return lengths
    if config.sources is None:
        raise ConfigError("lengths per source need sources in the config (sources=((name, weight), ...))")
    if not isinstance(lengths, Mapping):
        raise ConfigError(
            "a plan of weighted sources takes its lengths per source: a mapping name -> lengths "
            f"(got {type(lengths).__name__})"
        )
    names = tuple(n for n, _ in config.sources)
    extra = sorted(set(map(str, lengths)) - set(names))
    if extra:
        raise ConfigError(f"source {extra[0]!r}: lengths given but not in the config's sources")
    arrays, losses = [], []
    loss_map = loss_tokens if isinstance(loss_tokens, Mapping) or loss_tokens is None else None
    if loss_tokens is not None and loss_map is None:
        raise ConfigError("loss tokens of weighted sources are given per source: a mapping name -> counts")
    for name in names:
        if name not in lengths:
            raise ConfigError(f"source {name!r}: no lengths given")
        if np.size(lengths[name]) == 0:
            raise ConfigError(f"source {name!r}: empty (a source needs at least one sample)")
        arr = validate_lengths(lengths[name], f"source {name!r}")  # its errors name the source
        arrays.append(arr.astype(np.int64, copy=False))
        if loss_map is not None:
            if name not in loss_map:
                raise ConfigError(f"source {name!r}: no loss tokens given (give them for every source)")
            lo = np.asarray(loss_map[name])
            if lo.shape != arr.shape or lo.dtype.kind not in "iu" or (lo < 0).any() or (lo >= arr).any():
                raise ConfigError(
                    f"source {name!r}: loss tokens must hold one integer per sample, each in 0 .. length-1"
                )
            losses.append(lo.astype(np.int64, copy=False))
    sizes = np.array([a.shape[0] for a in arrays], np.int64)
    total = np.array([float(w) for _, w in config.sources])
    return SourceData(
        names,
        total / total.sum(),
        np.concatenate(arrays),
        np.concatenate(losses) if losses else None,
        np.concatenate(([0], np.cumsum(sizes))),
        config.unit,
    )


@dataclass(frozen=True)
class Counters:
    """Where an epoch of sources stands after some steps: ``drawn[s]`` samples and ``got[s]`` units of
    source ``s``, ``units`` and ``tokens`` of the epoch, in ``steps`` steps. The carried deficits are
    ``w * units - got`` (:attr:`deficits`). JSON-able as :meth:`to_state`."""

    drawn: tuple[int, ...]
    got: tuple[float, ...]
    units: float
    tokens: int
    steps: int

    @classmethod
    def zero(cls, k: int) -> Counters:
        return cls((0,) * k, (0.0,) * k, 0.0, 0, 0)

    def deficits(self, weights: np.ndarray) -> np.ndarray:
        return weights * self.units - np.asarray(self.got, np.float64)

    def to_state(self) -> dict:
        return {
            "drawn": list(self.drawn),
            "got": list(self.got),
            "units": self.units,
            "tokens": self.tokens,
            "steps": self.steps,
        }


def _pass_perm(data: SourceData, config: PlanConfig, epoch: int, s: int, p: int) -> np.ndarray:
    """Pass ``p`` of source ``s`` in ``epoch``: a shuffle of its local ids (each exactly once)."""
    key = (config.seed, epoch, s, p)
    perm = data._perm.get(key)
    if perm is None:
        if len(data._perm) > 64:
            data._perm.clear()
        words = [config.seed, epoch, REGISTRY[config.strategy].stream_id, _STREAM, s, p]
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(words)))
        perm = rng.permutation(int(data.sizes[s]))
        data._perm[key] = perm
    return perm


def _stream(data: SourceData, config: PlanConfig, epoch: int, s: int, pos: int, count: int) -> np.ndarray:
    """Global ids of source ``s``'s samples ``pos .. pos+count-1`` of the epoch (passes of shuffles)."""
    n = int(data.sizes[s])
    out = np.empty(count, np.int64)
    done = 0
    while done < count:
        p, i = divmod(pos + done, n)
        take = min(n - i, count - done)
        out[done : done + take] = _pass_perm(data, config, epoch, s, p)[i : i + take]
        done += take
    return out + data.starts[s]


@njit(cache=True, nogil=True)
def _greedy(
    vals: np.ndarray, toks: np.ndarray, off: np.ndarray, w: np.ndarray, carry: np.ndarray, cap: int
) -> tuple[np.ndarray, int]:
    """The deficit rule over one step: picks (a source index each) until the next pick's tokens pass
    ``cap``. Returns ``(picks, exhausted)``: ``exhausted`` is a source whose buffer ran out (-1: none)."""
    k = w.shape[0]
    ptr = off[:-1].copy()
    g = np.zeros(k)
    picks = np.empty(off[-1], np.int64)
    n = 0
    units = 0.0
    tokens = 0
    while True:
        best = -1
        score = -np.inf
        for s in range(k):
            if ptr[s] >= off[s + 1]:
                return picks[:n], s
            sc = w[s] * (units + vals[ptr[s]]) - g[s] + carry[s]
            if sc > score:
                score = sc
                best = s
        t = toks[ptr[best]]
        if tokens + t > cap:
            return picks[:n], -1
        tokens += t
        units += vals[ptr[best]]
        g[best] += vals[ptr[best]]
        ptr[best] += 1
        picks[n] = best
        n += 1


def apportion(n: int, w: np.ndarray, carry: np.ndarray) -> np.ndarray:
    """Counts of ``n`` samples over sources of weights ``w``: ``floor`` or ``ceil`` of ``w * n`` each
    (so within one sample of the target), the extra samples to the sources owed most (``carry``).

    >>> apportion(10, np.array([0.6, 0.25, 0.15]), np.array([0.0, -0.5, 0.5])).tolist()
    [6, 2, 2]
    """
    exact = w * n
    base = np.floor(exact).astype(np.int64)
    rest = n - int(base.sum())
    if rest > 0:
        frac = exact - base
        order = np.lexsort(
            (-(frac + carry), (frac <= 1e-12).astype(np.int64))
        )  # fractional ones first, most owed first
        base[order[:rest]] += 1
    return base


class _Step:
    """One step being composed: each source's buffer of coming samples and the feasibility checks."""

    def __init__(self, data: SourceData, config: PlanConfig, epoch: int, item: int, budget: int) -> None:
        self.data, self.config, self.epoch, self.item, self.budget = data, config, epoch, item, budget
        self.want = np.full(len(data.names), 64, np.int64)
        self.one = one_document(data, config)

    def buffers(self, drawn: tuple[int, ...]) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
        ids = [
            _stream(self.data, self.config, self.epoch, s, drawn[s], int(c)) for s, c in enumerate(self.want)
        ]
        flat = np.concatenate(ids)
        lens = np.minimum(self.data.lengths[flat], self.item)
        if self.data.unit == "documents":
            vals = np.ones(flat.shape[0])
        elif self.data.unit == "tokens":
            vals = lens.astype(np.float64)
        else:
            vals = self._loss(flat, lens)
        off = np.concatenate(([0], np.cumsum([a.shape[0] for a in ids])))
        return ids, lens, vals, off

    def ended(self, s: int) -> bool:
        """Whether source ``s`` has no more samples (passes of a source in memory never end)."""
        return False

    def _loss(self, flat: np.ndarray, lens: np.ndarray) -> np.ndarray:
        loss = self.data.lengths[flat] - 1 if self.data.loss is None else self.data.loss[flat]
        return np.minimum(loss, lens).astype(np.float64)

    def form(self, lens: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray] | None:
        """The step's ``k`` micro-batches of these items (their order, the offsets), or ``None`` when they
        do not fit: packed rows dealt longest first to the least loaded; padded rows cut from the length
        order where the largest is smallest (each within the budget)."""
        k = self.config.micro_per_step
        n = lens.shape[0]
        if n < k:
            return None
        shuffled = rng.permutation(n)
        if self.config.packed:
            bins = _cuts.lpt_bins(lens[shuffled], k, self.budget)
            if bins.shape[0] == 0:
                return None
            counts = np.bincount(bins, minlength=k)
            if counts.min() == 0:
                return None
            order = shuffled[kernels.counting_argsort(bins, k)]
            return order, np.concatenate(([0], np.cumsum(counts)))
        order = shuffled[np.argsort(lens[shuffled], kind="stable")]
        ends = steps.split_largest(_cuts.cut_into(lens[order], k, self.budget, False), k)
        if ends.shape[0] - 1 != k:
            return None
        return order, ends


def _rng(config: PlanConfig, epoch: int, step: int) -> np.random.Generator:
    words = [config.seed, epoch, REGISTRY[config.strategy].stream_id, _STREAM, 1, step]
    words += [config.world_size, config.grad_accum, config.budget]
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(words)))


def epoch_length(data: SourceData, config: PlanConfig) -> tuple[int | None, int]:
    """``(steps, tokens)``: the epoch's steps when set in steps, else ``None`` and its tokens (default: every
    source's tokens together, truncated at the item budget)."""
    if config.epoch_steps is not None:
        return config.epoch_steps, 0
    if config.epoch_tokens is not None:
        return None, config.epoch_tokens
    return None, int(np.minimum(data.lengths, Budget.of(config).item).sum())


def _check_overlong(data: SourceData, config: PlanConfig, item: int) -> int:
    over = data.lengths > item
    n_over = int(over.sum())
    if n_over and config.overlong == "error":
        i = int(np.argmax(over))
        s = int(data.source_of([i])[0])
        raise OverlongError(
            f"source {data.names[s]!r}: {n_over} sample(s) longer than the budget of {item} tokens (first: "
            f"its sample {i - int(data.starts[s])}, {int(data.lengths[i])} tokens); raise the budget or "
            "choose overlong='truncate'"
        )
    return n_over


CARRY_SCALES = (1.0, 0.5, 0.0)
"""In tokens or loss tokens the carried deficits enter the step's rule at these scales, the first whose
step is within one document of its targets (the carry keeps the epoch on target; without it a step is)."""


def _compose(
    step: _Step,
    cur: Counters,
    tie: np.ndarray,
    carry: np.ndarray,
    cap: int,
    rng: np.random.Generator,
) -> tuple[float, list[np.ndarray], np.ndarray, np.ndarray, np.ndarray, np.ndarray, tuple] | None:
    """One step from the counters ``cur``: the deficit rule's picks (carried deficits ``tie`` in the
    score), cut to the largest prefix that forms ``k`` micro-batches. Returns its share error (in
    documents), the buffers, the chosen entries and the formed micro-batches (``None``: a source's stream
    ended first)."""
    data, k = step.data, step.config.micro_per_step
    k_src = len(data.names)
    w = data.weights
    while True:
        ids, lens, vals, off = step.buffers(cur.drawn)
        picks, exhausted = _greedy(vals, lens.astype(np.int64), off, w, tie, cap)
        if exhausted < 0:
            break
        if step.ended(exhausted):
            return None
        step.want[exhausted] *= 2

    def chosen(m: int) -> np.ndarray:
        if data.unit == "documents":
            counts = apportion(m, w, carry)
        else:
            counts = np.bincount(picks[:m], minlength=k_src)
        return np.concatenate([np.arange(off[s], off[s] + counts[s]) for s in range(k_src)])

    m = picks.shape[0]
    state = rng.bit_generator.state
    formed = step.form(lens[chosen(m)], rng)
    if formed is None:  # the largest prefix of picks that fits (k always does: one item a row)
        lo, hi, best = k, m - 1, k
        while lo <= hi:
            mid = (lo + hi) // 2
            rng.bit_generator.state = state
            if step.form(lens[chosen(mid)], rng) is None:
                hi = mid - 1
            else:
                best, lo = mid, mid + 1
        m = best
        rng.bit_generator.state = state
        formed = step.form(lens[chosen(m)], rng)
        if formed is None:
            raise ConfigError(f"step {cur.steps}: {m} samples cannot fill {k} micro-batches")
    sel = chosen(m)
    src = np.searchsorted(off, sel, side="right") - 1
    units = np.bincount(src, weights=vals[sel], minlength=k_src)
    err = float(np.abs(units - w * units.sum()).max()) / step.one
    return err, ids, lens, vals, off, sel, formed


def next_step(
    step: _Step, cur: Counters, cap: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray, Counters] | None:
    """The step after the counters ``cur``: its samples (global ids) and tokens micro-batch after
    micro-batch (cut at the offsets), and the counters after it; ``None`` when a source's stream ended
    before the step could be composed (streams: the epoch ends there). The carried deficits enter the
    rule at the first of :data:`CARRY_SCALES` whose step is within one document of its targets."""
    w, k_src = step.data.weights, len(step.data.names)
    carry = cur.deficits(w)
    composed = None
    state = rng.bit_generator.state
    for alpha in CARRY_SCALES if step.data.unit != "documents" else (0.0,):
        rng.bit_generator.state = state
        got = _compose(step, cur, carry * alpha, carry, cap, rng)
        if got is None:
            return None
        if composed is None or got[0] < composed[0]:
            composed = got
        if got[0] <= 1.0:
            break
    assert composed is not None
    _, ids, lens, vals, off, sel, formed = composed
    order, offsets = formed
    taken = sel[order]
    src = np.searchsorted(off, sel, side="right") - 1
    counts = np.bincount(src, minlength=k_src)
    units = np.bincount(src, weights=vals[sel], minlength=k_src)
    step.want = np.maximum(64, 2 * counts + 16)
    after = Counters(
        tuple(int(a + b) for a, b in zip(cur.drawn, counts, strict=True)),
        tuple(float(a + b) for a, b in zip(cur.got, units, strict=True)),
        float(cur.units + units.sum()),
        int(cur.tokens + int(lens[sel].sum())),
        cur.steps + 1,
    )
    return np.concatenate(ids)[taken], lens[taken], offsets, after


def plan_sources(
    data: SourceData,
    config: PlanConfig,
    epoch: int,
    *,
    start: Counters | None = None,
    assign: bool = True,
    budget: int | None = None,
) -> tuple[Plan, list[Counters]]:
    """Plan the rest of an epoch of weighted sources from ``start`` (default: its beginning) at
    ``config``'s shape: steps composed by the deficit rule (see the module), then formed into micro-batches
    and (``assign``) given to ranks. Returns the plan and the :class:`Counters` after each of its steps
    (``counters[0]`` is ``start``)."""
    k_src = len(data.names)
    start = Counters.zero(k_src) if start is None else start
    if len(start.drawn) != k_src:
        raise StateError(f"source counters for {len(start.drawn)} sources, the config has {k_src}")
    bud = Budget.of(config, budget)
    item, plan_budget = bud.item, bud.plan
    n_over = _check_overlong(data, config, item)
    n_steps, n_tokens = epoch_length(data, config)
    k = config.micro_per_step
    cap = k * plan_budget
    step = _Step(data, config, epoch, item, plan_budget)
    trace = [start]
    cur = start
    parts_ids: list[np.ndarray] = []
    parts_lens: list[np.ndarray] = []
    parts_off: list[np.ndarray] = []
    while (cur.steps < n_steps) if n_steps is not None else (cur.tokens < n_tokens):
        nxt = next_step(step, cur, cap, _rng(config, epoch, cur.steps))
        assert nxt is not None  # passes of shuffles never run out
        ids, lens, offsets, cur = nxt
        parts_ids.append(ids)
        parts_lens.append(lens)
        parts_off.append(offsets)
        trace.append(cur)
    if parts_ids:
        indices = np.concatenate(parts_ids)
        lengths = np.concatenate(parts_lens)
        sizes = np.concatenate([np.diff(o) for o in parts_off])
        offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    else:
        indices = lengths = np.empty(0, np.int64)
        offsets = np.zeros(1, np.int64)
    report = Report(int(data.lengths.shape[0]), truncated=n_over if config.overlong == "truncate" else 0)
    at = config if plan_budget == config.budget else config.with_(budget=plan_budget)
    if assign and config.world_size > 1 and indices.shape[0]:
        indices, offsets, lengths = assign_steps(indices, offsets, lengths, at)
    return Plan.of(at, epoch, indices, offsets, lengths, report, assigned=assign), trace


def assign_steps(
    indices: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, config: PlanConfig
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every step given to ranks by modeled cost and evened out, as :func:`padfree.core.plan.plan_items`
    does (no item leaves its step)."""
    shapes = cost.micro_shapes(lengths, offsets, config.packed)
    costs = cost.micro_costs(shapes, config.cost)
    perm = steps.assign_ranks(costs, config.world_size, config.grad_accum)
    pos = np.arange(indices.shape[0], dtype=np.int64)
    pos, offsets = kernels.gather_segments(pos, offsets, perm)
    lens = lengths[pos]
    if steps.evens_ranks(config, False):
        coefs = config.cost.coefficients
        if config.packed:
            rows, offsets = steps.even_ranks(lens, offsets, config, coefs, config.budget, costs=costs[perm])
        else:
            rows, offsets = steps.even_ranks(lens, offsets, config, coefs, config.budget)
        if rows is not None:
            pos = pos[rows]
    return indices[pos], offsets, lengths[pos]


def replay_sources(
    data: SourceData, config: PlanConfig, epoch: int, history: list[Segment]
) -> tuple[Plan, int, list[Counters]]:
    """The unassigned plan the last segment of ``history`` runs, the steps before it, and the counters
    after each of its steps: each earlier segment planned at its shape from the counters its predecessor
    left, and cut where it stopped. A pure function of the history (the resume state)."""
    cur: Counters | None = None
    before = 0
    for i, seg in enumerate(history):
        seg_cfg = config.with_(world_size=seg.world_size, grad_accum=seg.grad_accum)
        plan, trace = plan_sources(data, seg_cfg, epoch, start=cur, assign=False, budget=seg.budget)
        if i == len(history) - 1:
            return plan, before, trace
        if seg.steps > plan.n_steps:
            raise StateError(
                f"malformed sampler state: history[{i}] says {seg.steps} steps were run, but that segment's "
                f"plan has {plan.n_steps}"
            )
        cur = trace[seg.steps]
        before += seg.steps
    raise StateError("empty resume history")


# ----- measuring -------------------------------------------------------------------------------------------
def step_shares(plan: Plan, data: SourceData) -> np.ndarray:
    """Each step's units per source, shape ``(n_steps, n_sources)`` (in the data's unit)."""
    k = plan.config.micro_per_step
    n = plan.n_steps
    step_of = np.repeat(np.arange(n * k, dtype=np.int64) // k, np.diff(plan.offsets[: n * k + 1]))
    m = step_of.shape[0]
    src = data.source_of(plan.indices[:m])
    vals = _values_of(plan, data, m)
    out = np.zeros((n, len(data.names)))
    np.add.at(out, (step_of, src), vals)
    return out


def _values_of(plan: Plan, data: SourceData, m: int) -> np.ndarray:
    if data.unit == "documents":
        return np.ones(m)
    lens = plan.lengths[:m].astype(np.float64)
    if data.unit == "tokens":
        return lens
    ids = plan.indices[:m]
    loss = data.lengths[ids] - 1 if data.loss is None else data.loss[ids]
    return np.minimum(loss, lens)


def share_error(plan: Plan, data: SourceData) -> np.ndarray:
    """Each step's largest ``|units_s - w_s * units|`` over sources, in units of one document: 1 in
    documents, else the longest document of the sources in that unit (tokens up to the item budget)."""
    shares = step_shares(plan, data)
    if shares.shape[0] == 0:
        return np.zeros(0)
    err = np.abs(shares - data.weights[None, :] * shares.sum(axis=1, keepdims=True)).max(axis=1)
    return err / one_document(data, plan.config)


def one_document(data: SourceData, config: PlanConfig) -> float:
    """What "one document" is in the data's unit: 1 sample, or the longest sample of the sources in tokens
    (up to the item budget) or in loss tokens."""
    if data.unit == "documents":
        return 1.0
    lens = np.minimum(data.lengths, Budget.of(config).item)
    if data.unit == "tokens":
        return max(float(lens.max()), 1.0)
    loss = data.lengths - 1 if data.loss is None else data.loss
    return max(float(np.minimum(loss, lens).max()), 1.0)


def repetition(plan: Plan, data: SourceData) -> dict[str, dict]:
    """Per source: samples, samples drawn in the plan, passes (drawn / samples: > 1 upsampled, < 1
    capped), tokens, and its realized share of the plan's units next to its weight."""
    m = int(plan.offsets[plan.n_steps * plan.config.micro_per_step])
    src = data.source_of(plan.indices[:m])
    k = len(data.names)
    drawn = np.bincount(src, minlength=k)
    tokens = np.bincount(src, weights=plan.lengths[:m].astype(np.float64), minlength=k)
    units = np.bincount(src, weights=_values_of(plan, data, m), minlength=k)
    total = max(float(units.sum()), 1e-300)
    return {
        name: {
            "samples": int(data.sizes[s]),
            "drawn": int(drawn[s]),
            "passes": float(drawn[s] / data.sizes[s]),
            "tokens": int(tokens[s]),
            "weight": float(data.weights[s]),
            "share": float(units[s] / total),
        }
        for s, name in enumerate(data.names)
    }


def summary_lines(plan: Plan, data: SourceData) -> list[str]:
    """What the weights cost: one line per source (passes over it, its share against its weight) and the
    worst step's share error."""
    rep = repetition(plan, data)
    err = share_error(plan, data)
    lines = [
        f"sources ({data.unit}): {plan.n_steps} steps; worst step share error "
        f"{(float(err.max()) if err.size else 0.0):.3f} document(s)"
    ]
    for name, r in rep.items():
        kind = "upsampled" if r["passes"] > 1 + 1e-9 else "capped" if r["passes"] < 1 - 1e-9 else "once"
        lines.append(
            f"  {name}: weight {r['weight']:.3f}, share {r['share']:.3f}; {r['drawn']:,} of {r['samples']:,} "
            f"samples drawn = {r['passes']:.2f} passes ({kind})"
        )
    return lines


def source_token_sums(
    source_ids: ArrayLike, values: ArrayLike, n_sources: int, mask: ArrayLike | None = None
) -> np.ndarray:
    """Per-source sums of per-token ``values`` (losses, or ones for token counts) under ``mask`` (the
    positions that count; default all): what DoReMi-style reweighting reads. ``source_ids`` are the
    collators' per-token source column (-1: padding).

    >>> source_token_sums([0, 0, 1, -1], [1.0, 2.0, 3.0, 9.0], 2).tolist()
    [3.0, 3.0]
    """
    s = np.asarray(source_ids).reshape(-1)
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    keep = s >= 0
    if mask is not None:
        keep &= np.asarray(mask, dtype=bool).reshape(-1)
    return np.bincount(s[keep], weights=v[keep], minlength=n_sources)[:n_sources]


def measure(plan: Plan, data: SourceData) -> dict:
    """A plan of sources in numbers: steps, padding efficiency, rank imbalance (max / mean modeled cost over
    a step's ranks: mean and p99 over steps), each step's share error (in documents: max and mean) and
    the repetition per source (:func:`repetition`)."""
    from padfree.core import metrics

    err = share_error(plan, data)
    ratio = np.zeros(0)
    if plan.n_steps and plan.assigned:
        ranks = plan.rank_costs()
        ratio = ranks.max(axis=1) / np.maximum(ranks.mean(axis=1), 1e-300)
    return {
        "unit": data.unit,
        "steps": plan.n_steps,
        "padding_efficiency": metrics.padding_efficiency(plan) if plan.n_micro else 1.0,
        "imbalance_mean": float(ratio.mean()) if ratio.size else 1.0,
        "imbalance_p99": float(np.quantile(ratio, 0.99)) if ratio.size else 1.0,
        "share_error_max": float(err.max()) if err.size else 0.0,
        "share_error_mean": float(err.mean()) if err.size else 0.0,
        "sources": repetition(plan, data),
    }


def report_numbers(plan: Plan, data: SourceData) -> dict:
    """The report's section of weighted sources: :func:`measure`, the strategy and every step's units per
    source (:func:`step_shares`) for its plot."""
    return {
        **measure(plan, data),
        "strategy": plan.config.strategy,
        "step_shares": step_shares(plan, data).round(3).tolist(),
    }
