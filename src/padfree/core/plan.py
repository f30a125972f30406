"""The epoch plan: a pure function of (lengths, config, seed, epoch).

``make_plan`` is the one place the pieces meet: items (``lengths``), micro-batches (``batching``), steps
and ranks (``steps``). A :class:`Plan` holds flat arrays so that millions of samples stay cheap.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from padfree.core import _kernels, batching, steps
from padfree.core.config import PlanConfig
from padfree.core.items import Items, make_items, validate_lengths
from padfree.errors import ConfigError

_STREAM = {"sorted": 11, "random": 12, "bucketed": 13, "packed": 14}


def epoch_rng(seed: int, epoch: int, strategy: str) -> np.random.Generator:
    """The generator behind every random choice of one epoch: PCG64 seeded by (seed, epoch, strategy).

    The same inputs give the same stream on every machine and in every process.
    """
    return np.random.Generator(
        np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch), _STREAM[strategy]]))
    )


@dataclass(frozen=True)
class Plan:
    """Micro-batches, in plan order, of one epoch.

    Micro-batch ``k`` holds samples ``indices[offsets[k]:offsets[k+1]]``; it belongs to step
    ``k // (world_size*grad_accum)``, rank ``(k % (world_size*grad_accum)) // grad_accum`` and is that rank's
    accumulation micro-batch ``k % grad_accum``.

    Attributes:
        config, epoch: what made it.
        indices: sample ids, micro-batch after micro-batch.
        offsets: micro-batch boundaries into ``indices`` (``n_micro + 1`` entries).
        lengths: tokens of each entry of ``indices`` (after truncation or splitting).
        starts: first token of each entry inside its sample (``None`` unless ``overlong='split'``).
        edges: the bucket upper edges used this epoch (bucketed only).
        n_samples, truncated, split, dropped: the overlong policy's report.
        plan_seconds: wall time to make the plan.
    """

    config: PlanConfig
    epoch: int
    indices: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    starts: np.ndarray | None = None
    edges: np.ndarray | None = None
    n_samples: int = 0
    truncated: int = 0
    split: int = 0
    dropped: int = 0
    plan_seconds: float = 0.0
    _shapes: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def n_micro(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def n_steps(self) -> int:
        return self.n_micro // self.config.micro_per_step

    def micro(self, k: int) -> np.ndarray:
        """Sample ids of micro-batch ``k``."""
        return self.indices[self.offsets[k] : self.offsets[k + 1]]

    def micro_batches(self) -> list[np.ndarray]:
        """All micro-batches as a list of arrays (convenient for small plans)."""
        return np.split(self.indices, self.offsets[1:-1])

    def micro_ids(self, rank: int) -> np.ndarray:
        """The micro-batch numbers rank ``rank`` runs, in order (``grad_accum`` per step)."""
        c = self.config
        if not 0 <= rank < c.world_size:
            raise ConfigError(f"rank {rank} outside world size {c.world_size}")
        k = c.micro_per_step
        base = np.arange(self.n_steps, dtype=np.int64)[:, None] * k + rank * c.grad_accum
        return (base + np.arange(c.grad_accum, dtype=np.int64)[None, :]).ravel()

    def shapes(self) -> dict[str, np.ndarray]:
        """Per micro-batch counts, real tokens, slots and attention (see ``steps.micro_shapes``)."""
        if not self._shapes:
            self._shapes.update(
                steps.micro_shapes(self.lengths, self.offsets, self.config.packed, self.config.budget)
            )
        return self._shapes

    def costs(self) -> np.ndarray:
        return steps.micro_costs(self.shapes(), self.config.cost)

    def records(self) -> Iterator[dict]:
        """One dict per micro-batch: ``{"epoch", "step", "rank", "micro", "indices"}`` (plus token ``starts``
        and ``lengths`` when samples were split)."""
        c = self.config
        k = c.micro_per_step
        for j in range(self.n_micro):
            a, b = int(self.offsets[j]), int(self.offsets[j + 1])
            rec = {
                "epoch": self.epoch,
                "step": j // k,
                "rank": (j % k) // c.grad_accum,
                "micro": j % c.grad_accum,
                "indices": self.indices[a:b].tolist(),
            }
            if self.starts is not None:
                rec["starts"] = self.starts[a:b].tolist()
                rec["lengths"] = self.lengths[a:b].tolist()
            yield rec


STREAM_THRESHOLD = 20_000_000
"""``make_plan`` plans above this many samples window by window (see :mod:`padfree.core.stream`)."""


def make_plan(
    lengths: np.ndarray,
    config: PlanConfig,
    epoch: int = 0,
    *,
    path: str | None = None,
    stream: bool | None = None,
    window: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Plan:
    """Plan one epoch.

    Above :data:`STREAM_THRESHOLD` samples (or with ``stream=True``) the epoch is planned in windows of
    about ``window`` samples (default :data:`padfree.core.stream.DEFAULT_WINDOW`) to bound memory; see
    :func:`padfree.core.stream.plan_stream`. ``stream=False`` forces the in-memory path.
    ``progress(done, total)`` is called after each window of a stream plan.

    >>> import numpy as np
    >>> cfg = PlanConfig(strategy="bucketed", budget=64, world_size=2, grad_accum=2, seed=1)
    >>> plan = make_plan(np.arange(1, 41), cfg, epoch=0)
    >>> plan.n_micro % 4, sorted(plan.indices.tolist()) == list(range(40))
    (0, True)
    """
    t0 = time.perf_counter()
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ConfigError(f"epoch must be an integer >= 0 (got {epoch!r})")
    try:
        n = len(lengths)
    except TypeError:  # a scalar: validate_lengths reports it
        n = 0
    if stream or (stream is None and n > STREAM_THRESHOLD):
        from padfree.core.stream import DEFAULT_WINDOW, plan_stream

        return plan_stream(
            lengths, config, int(epoch), window=window or DEFAULT_WINDOW, path=path, progress=progress, t0=t0
        )
    lengths = validate_lengths(lengths, path)
    items = make_items(lengths, config.budget, config.overlong, path)
    return plan_items(items, config, int(epoch), t0=t0)


def plan_items(
    items: Items,
    config: PlanConfig,
    epoch: int,
    *,
    t0: float | None = None,
    rng: np.random.Generator | None = None,
    assign: bool = True,
) -> Plan:
    """Plan one epoch of already prepared items (see :func:`padfree.core.items.make_items`).

    ``rng`` replaces the epoch's generator (:func:`epoch_rng`); the stream planner gives each window its own.
    ``assign=False`` leaves each step's micro-batches in their stratified order, not yet given to ranks: the
    same steps (the same micro-batches in each) whatever the cost model, which the sampler then assigns one
    step at a time (:func:`padfree.core.steps.assign_ranks` on one step gives what ``assign=True`` gives).
    """
    t0 = time.perf_counter() if t0 is None else t0
    k = config.micro_per_step
    if len(items) < k:
        raise ConfigError(
            f"{len(items)} samples cannot fill one step of {k} micro-batches "
            f"(world_size {config.world_size} x grad_accum {config.grad_accum})"
        )
    rng = epoch_rng(config.seed, epoch, config.strategy) if rng is None else rng
    length = items.length
    edges = None
    s = config.strategy
    if s == "sorted":
        order, offsets, strata = batching.sorted_batches(length, config.budget, rng)
    elif s == "random":
        order, offsets, strata = batching.random_batches(length, config.budget, rng)
    elif s == "packed":
        order, offsets, strata = batching.packed_batches(length, config.budget, rng)
    else:
        edges = batching.bucket_edges(length, config.growth, config.buckets, rng)
        order, offsets, strata = batching.bucketed_batches(length, config.budget, rng, edges, config.mix)
    if strata is not None:
        tokens = np.add.reduceat(length[order].astype(np.float64), offsets[:-1])
        order, offsets = _kernels.gather_segments(order, offsets, steps.stratified_order(strata, tokens, rng))
    offsets = steps.spread_tail(offsets, k)
    lens = length[order]
    shapes = steps.micro_shapes(lens, offsets, config.packed, config.budget)
    if assign and config.world_size > 1:
        costs = steps.micro_costs(shapes, config.cost)
        perm = steps.assign_ranks(costs, config.world_size, config.grad_accum)
        order, offsets = _kernels.gather_segments(order, offsets, perm)
        lens = length[order]
        shapes = {}
    sample_ids = order if items.sample is None else items.sample[order]
    starts = None if items.start is None else items.start[order]
    return Plan(
        config=config,
        epoch=epoch,
        indices=sample_ids,
        offsets=offsets,
        lengths=lens,
        starts=starts,
        edges=edges,
        n_samples=items.n_samples,
        truncated=items.truncated,
        split=items.split,
        dropped=items.dropped,
        plan_seconds=time.perf_counter() - t0,
        _shapes=shapes,
    )
