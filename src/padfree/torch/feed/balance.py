"""Dynamic balancing, the torch side: time each micro-batch's compute, exchange the timings of all ranks in
one small collective every few steps, and refit the balance from them (:mod:`padfree.core.refit`).

What a rank measures is its *compute*: from the start of a micro-batch's forward to the moment its last
gradient is ready, not the wait in the gradient all-reduce that ends a step (that wait is the other ranks'
slowness, which is what balancing removes). On a GPU the times are CUDA events, read once they completed
(never a synchronization); on a CPU ``time.perf_counter``.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from padfree.core import refit
from padfree.core.balance import Balance
from padfree.core.cost import Coefficients
from padfree.core.cursor import MicroInfo
from padfree.errors import ConfigError, StateError
from padfree.torch.execution.distributed import is_distributed

WINDOW = 4
"""Exchanges whose records the refit pools (older ones are forgotten: speeds may drift)."""


def all_gather_rows(payload: np.ndarray) -> np.ndarray:
    """Every rank's ``payload`` (same length on all), stacked: one ``all_gather_into_tensor``."""
    if not is_distributed():
        return payload[None, :]
    dist = torch.distributed
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    mine = torch.from_numpy(np.ascontiguousarray(payload, dtype=np.float64)).to(device)
    out = torch.empty(dist.get_world_size() * mine.numel(), dtype=torch.float64, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer name first
    gather(out, mine)
    return out.cpu().numpy().reshape(dist.get_world_size(), -1)


class _Event:
    """A CUDA-event timing, read when both events have completed."""

    __slots__ = ("end", "start")

    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self.start, self.end = start, end

    def seconds(self) -> float | None:
        if not self.end.query():
            return None
        return self.start.elapsed_time(self.end) / 1000.0


class _GradClock:
    """Marks the moment a model's last gradient of a backward is ready (post-accumulate-grad hooks): the end
    of the compute, before DDP waits for the other ranks in its final all-reduce."""

    def __init__(self, model: torch.nn.Module) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        self.n = len(params)
        self.count = 0
        self.cuda = any(p.is_cuda for p in params)
        self.end: Any = None  # perf_counter seconds, or a CUDA event
        for p in params:
            p.register_post_accumulate_grad_hook(self._hook)

    def arm(self) -> None:
        self.count, self.end = 0, None

    def _hook(self, _param: torch.Tensor) -> None:
        self.count += 1
        if self.count == self.n:
            if self.cuda:
                self.end = torch.cuda.Event(enable_timing=True)
                self.end.record()
            else:
                self.end = time.perf_counter()


class Timed:
    """``with sampler.timed(model):`` around one micro-batch's forward and backward (see
    :meth:`padfree.torch.PlanBatchSampler.timed`)."""

    def __init__(self, sink: Callable, clock: _GradClock | None, cuda: bool, info: MicroInfo | None) -> None:
        self.sink, self.clock, self.cuda, self.info = sink, clock, cuda, info
        self.start: Any = None  # perf_counter seconds, or a CUDA event

    def __enter__(self) -> Timed:
        if self.clock is not None:
            self.clock.arm()
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            return
        end = None if self.clock is None or self.clock.count < self.clock.n else self.clock.end
        if self.cuda:
            if end is None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
            self.sink(_Event(self.start, end), self.info)
        else:
            self.sink((time.perf_counter() if end is None else end) - self.start, self.info)


class DynamicBalancer:
    """The measurements of one rank and the refit they feed (every rank holds an identical refit state).

    ``capacity``: records a rank sends per exchange (the most recent ones).
    """

    def __init__(self, world_size: int, capacity: int, scale: tuple[float, float], exchange=None) -> None:
        self.world_size, self.capacity, self.scale = world_size, capacity, scale
        self.exchange = all_gather_rows if exchange is None else exchange
        self.pending: deque = deque(maxlen=8 * capacity)  # (key, slots, attn) of yielded micro-batches
        self.timed: deque = deque(maxlen=8 * capacity)  # [slots, attn, seconds or _Event]
        self.window: deque = deque(maxlen=WINDOW)
        self.clocks: dict[int, _GradClock] = {}
        self.exchanges = 0
        self.heldout_error: float | None = None
        self.sync_seconds = 0.0
        self.records = 0
        self.recent: deque = deque(maxlen=64)  # rates of this rank's last accepted times (refit.rate)
        self.dropped = 0  # measured times screened out (refit.screen): non-finite, <= 0, absurd, outliers
        if exchange is None and is_distributed() and torch.distributed.get_world_size() != world_size:
            ranks = torch.distributed.get_world_size()
            raise ConfigError(
                f"dynamic balancing exchanges timings over torch.distributed ({ranks} ranks), but the "
                f"sampler has world size {world_size}"
            )

    def reset(self) -> None:
        """Forget measurements and pooled records (after a resume: every rank starts from the state alone)."""
        self.pending.clear()
        self.timed.clear()
        self.window.clear()
        self.recent.clear()

    # ----- measurements ------------------------------------------------------------------------------------
    def yielded(self, key: tuple, slots: float, attn: float) -> None:
        self.pending.append((key, slots, attn))

    def record(self, seconds: object, info: MicroInfo | None = None) -> None:
        """Pair a time with the oldest yielded micro-batch not yet timed (or with ``info``'s)."""
        if info is not None:
            key = (info.epoch, info.step, info.micro)
            while self.pending and self.pending[0][0] != key:
                self.pending.popleft()
        if not self.pending:
            return
        if isinstance(seconds, bool) or not (
            isinstance(seconds, numbers.Real) or hasattr(seconds, "seconds")
        ):  # numbers.Real: numpy's floats and ints too (a float32 from a timer is a number)
            raise ConfigError(f"record_time needs seconds as a number (got {seconds!r:.40})")
        _, slots, attn = self.pending.popleft()
        if isinstance(seconds, numbers.Real):
            seconds = float(seconds)  # screened when read (non-finite, <= 0, absurd, outliers are dropped)
        self.timed.append([slots, attn, seconds])

    def timer(self, sink: Callable, model: torch.nn.Module | None, info: MicroInfo | None) -> Timed:
        clock = None
        if model is not None:
            clock = self.clocks.get(id(model))
            if clock is None:
                clock = self.clocks[id(model)] = _GradClock(model)
        cuda = clock.cuda if clock is not None else torch.cuda.is_available() and torch.cuda.is_initialized()
        return Timed(sink, clock, cuda, info)

    def _ready(self) -> np.ndarray:
        """Resolved records (rows ``slots, attn, seconds``), removed from the queue; unfinished CUDA timings
        wait for the next exchange. Times :func:`padfree.core.refit.screen` refuses are dropped and counted
        (``dropped``): one absurd time must not poison the balance of every rank."""
        out: list = []
        keep: deque = deque(maxlen=self.timed.maxlen)
        for rec in self.timed:
            sec = rec[2] if isinstance(rec[2], float) else rec[2].seconds()
            if sec is None:
                keep.append(rec)
                continue
            per = refit.rate(sec, rec[0], self.scale[0]) if np.isfinite(sec) else sec
            empty = rec[0] == 0 and rec[1] == 0
            if refit.screen(sec, per, list(self.recent), empty) is not None:
                self.dropped += 1
            else:
                if not (empty and sec == 0.0):
                    self.recent.append(per)
                out.append((rec[0], rec[1], sec))
        self.timed = keep
        return np.array(out[-self.capacity :], dtype=np.float64).reshape(-1, 3)

    # ----- the exchange -----------------------------------------------------------------------------------
    def sync(self, balance: Balance, where: tuple) -> Balance:
        """Exchange this rank's records with all ranks (one collective) and refit; every rank returns the
        same :class:`Balance`. ``where`` (epoch, step) and ``balance`` are checked equal on all ranks."""
        t0 = time.perf_counter()
        mine = self._ready()
        payload = np.zeros(2 + 3 * self.capacity)
        payload[0] = _digest(balance, where)
        payload[1] = mine.shape[0]
        payload[2 : 2 + mine.size] = mine.ravel()
        rows = np.asarray(self.exchange(payload), dtype=np.float64)
        if rows.shape != (self.world_size, payload.shape[0]):
            raise StateError(
                f"the timing exchange returned shape {rows.shape}, not {(self.world_size, payload.shape[0])}"
            )
        if not np.all(rows[:, 0] == rows[0, 0]):
            raise StateError(
                f"ranks disagree on the balance at epoch {where[0]} step {where[1]}: they did not resume "
                "from the same sampler state; stop and resume all ranks from one checkpoint"
            )
        parts = []
        for r in range(self.world_size):
            n = int(rows[r, 1]) if np.isfinite(rows[r, 1]) and 0 <= rows[r, 1] <= self.capacity else 0
            recs = rows[r, 2 : 2 + 3 * n].reshape(n, 3)
            parts.append(np.column_stack([np.full(n, float(r)), recs]))
        records = np.concatenate(parts) if parts else np.zeros((0, 4))
        records = refit.valid_records(
            records
        )  # what every rank screened already: a buggy rank poisons nothing
        self.exchanges += 1
        if records.shape[0] == 0:
            self.sync_seconds += time.perf_counter() - t0
            return balance
        self.records += records.shape[0]
        if balance.fitted:
            self.heldout_error = refit.relative_error(records, balance.cost, balance.speeds)
        self.window.append(refit.rank_stats(records, self.world_size, self.scale))
        pooled = self.window[0].copy()
        for st in list(self.window)[1:]:
            pooled = pooled + st
        prior = balance.cost if balance.fitted else refit.prior_scale(pooled, balance.cost, self.scale)
        cost, speeds = refit.fit(pooled, prior, balance.speeds, self.scale)
        self.sync_seconds += time.perf_counter() - t0
        return Balance(Coefficients(*cost), speeds, fitted=True, recut=balance.recut, drafter=balance.drafter)


def _digest(balance: Balance, where: tuple) -> float:
    text = json.dumps([list(where), balance.to_state()], sort_keys=True)
    return float(int(hashlib.sha256(text.encode()).hexdigest()[:12], 16))


def balance_summary(stats: dict[str, Any]) -> str:
    """One human line for :meth:`padfree.torch.PlanBatchSampler.balance_stats` (what a run prints at its end,
    in place of the raw dict): the balance in force, how it was learned, and the sampler's own time.
    A ``"dynamic"`` balance fitted to measured times says so: ``"cost fitted to measured times"``.

    >>> stats = {"mode": "static", "fitted": False, "speeds": (1.0, 1.0), "plan_budget": 256,
    ...     "sampler_seconds": 0.0012, "sampler_first_step_seconds": 0.0004, "exchanges": 0}
    >>> print(balance_summary(stats))  # doctest: +ELLIPSIS
    static balance (configured cost model, 2 ranks), plan budget 256, sampler time 1.2 ms (0.4 ms to the ...
    """
    speeds = tuple(stats.get("speeds") or (1.0,))
    ranks = f"{len(speeds)} rank{'s' if len(speeds) != 1 else ''}"
    parts = [f"{stats.get('mode', 'static')} balance"]
    if stats.get("fitted"):
        err = stats.get("heldout_rel_error")
        held = f", held-out error {err:.1%}" if isinstance(err, float) and np.isfinite(err) else ""
        parts[0] += f" (cost fitted to measured times{held}, {ranks}"
        if len(speeds) > 1:
            parts[0] += f", rank speeds {min(speeds):.2f}-{max(speeds):.2f}"
        parts[0] += ")"
    else:
        parts[0] += f" (configured cost model, {ranks})"
    if stats.get("exchanges"):
        dropped = int(stats.get("dropped_times") or 0)
        parts.append(
            f"{stats['exchanges']} timing exchanges of {stats.get('records', 0)} micro-batch times"
            + (f" ({dropped} screened out)" if dropped else "")
            + f", {_duration(float(stats.get('sync_seconds') or 0.0))} in them"
        )
    if stats.get("plan_budget"):
        parts.append(f"plan budget {stats['plan_budget']}")
    busy, first = stats.get("sampler_seconds"), stats.get("sampler_first_step_seconds")
    if busy is not None:
        parts.append(
            f"sampler time {_duration(float(busy))}"
            + (f" ({_duration(float(first))} to the first step)" if first else "")
        )
    return ", ".join(parts)


def _duration(seconds: float) -> str:
    """``seconds`` as ms below a second, else s.

    >>> _duration(0.0123), _duration(2.5)
    ('12.3 ms', '2.50 s')
    """
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def balancer(
    world_size: int, every: int, grad_accum: int, budget: int, exchange=None
) -> DynamicBalancer | None:
    """The sampler's balancer: exchanges every ``every`` steps (0: none, static or one rank), room for two
    exchanges' micro-batches, times scaled by the budget's tokens and their square."""
    if every == 0:
        return None
    scale = (float(budget), float(budget) ** 2)
    return DynamicBalancer(world_size, 2 * every * grad_accum, scale, exchange)


def check_balance(balance: str, every: object) -> None:
    """Refuse, in one line, a balance mode other than static/dynamic or an exchange interval below 1 step."""
    if balance not in ("static", "dynamic"):
        raise ConfigError(f"balance must be 'static' or 'dynamic' (got {balance!r})")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"balance_every must be an integer >= 1 (got {every!r})")


def balance_stats(
    mode: str,
    b: Balance,
    d: DynamicBalancer | None,
    world_size: int,
    busy: tuple[float, float],
    budget: int,
) -> dict:
    """:meth:`padfree.torch.PlanBatchSampler.balance_stats` from the balance in force ``b``, the balancer
    ``d`` (``None``: static or one rank), the sampler's ``busy`` seconds (all, until the first step) and the
    segment's planning ``budget``: ``mode``, ``cost`` (a, b, c: seconds per slot, per attention unit and per
    micro-batch once fitted, else the configured token units), ``fitted``, ``speeds`` (per rank, mean 1),
    ``heldout_rel_error`` (the previous fit's mean relative error on the micro-batches of the last exchange,
    which it had not seen), ``exchanges``, ``records`` (timed micro-batches received, all ranks),
    ``dropped_times`` (this rank's times screened out: non-finite, <= 0, absurd or far off the median of its
    recent times, see :func:`padfree.core.refit.screen`), ``sync_seconds`` (this rank's time in exchanges
    and refits), ``sampler_seconds`` (all of its time yielding micro-batches: planning, layouts,
    exchanges), of which ``sampler_first_step_seconds`` until its first step was out (planning, loading
    compiled kernels), and ``plan_budget``."""
    return {
        "mode": mode,
        "cost": b.cost,
        "fitted": b.fitted,
        "speeds": b.speeds or (1.0,) * world_size,
        "recut": b.recut,
        "heldout_rel_error": None if d is None else d.heldout_error,
        "exchanges": 0 if d is None else d.exchanges,
        "records": 0 if d is None else d.records,
        "dropped_times": 0 if d is None else d.dropped,
        "sync_seconds": 0.0 if d is None else d.sync_seconds,
        "sampler_seconds": busy[0],
        "sampler_first_step_seconds": busy[1],
        "plan_budget": budget,
    }
