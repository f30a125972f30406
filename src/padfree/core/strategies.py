"""The strategies, by name: one registry is the one place a strategy is added.

A strategy lays out one epoch. Most form micro-batches from item lengths (``form``, see
:mod:`padfree.core.batching`) and leave the rest to the default layout, the same for all of them: strata
mixed into steps, whole steps, ranks balanced (:func:`padfree.core.plan.form_steps_ranks`). A strategy with a
``layout`` of its own lays out the whole epoch itself, steps given to ranks (``chunked``,
:mod:`padfree.core.chunked`).

Adding one::

    register(Strategy("my_packer", stream_id=20, packed=True, form=my_form))
    PlanConfig(strategy="my_packer")      # now valid everywhere a strategy name is taken
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from padfree.core import batching, chunked, mixing
from padfree.core.batching import Formed, Laid

if TYPE_CHECKING:
    from padfree.core.budget import Budget
    from padfree.core.config import PlanConfig
    from padfree.core.items import Items

__all__ = ["REGISTRY", "STRATEGIES", "Formed", "Laid", "Strategy", "register", "resolved_mix"]

Form = Callable[[np.ndarray, "PlanConfig", np.random.Generator], Formed]
"""``form(sizes, config, rng)``: one epoch's micro-batches (and their strata) of items of these sizes."""

Layout = Callable[["Items", "PlanConfig", "Budget", np.random.Generator], Laid]
"""``layout(items, config, budget, rng)``: one whole epoch, in plan order, steps given to ranks."""


@dataclass(frozen=True)
class Strategy:
    """A named way to lay out an epoch.

    Attributes:
        name: what ``PlanConfig.strategy`` says.
        stream_id: the random stream of its epochs; plans depend on it, so it never changes once released
            and no two strategies share one.
        packed: micro-batches are packed rows (``sum(lengths) <= budget``) rather than padded ones
            (``count * longest <= budget``): collated by ``PackCollator``, run with per-document attention.
        form: ``form(sizes, config, rng) -> Formed``: its micro-batches, which the default layout makes into
            steps and gives to ranks; ``None`` when it has a ``layout`` of its own.
        bucketed: forms micro-batches inside length buckets: the config's ``buckets``, ``growth`` and ``mix``
            apply, and its plans report their bucket ``edges``.
        fixed_batches: its micro-batches are the same every epoch (formed from the seed alone); only their
            order changes.
        layout: ``layout(items, config, budget, rng) -> Laid``: the whole epoch laid out by the strategy
            itself, steps given to ranks. Its plan is then the same assigned or not, a step runs on the ranks
            it was laid out for (no balancing or re-cut at run time), and it is planned in memory (not window
            by window).
        chunks: ``chunks(config)``: how many micro-batches of one rank's step a document may span, trained
            whole, each chunk attending to its earlier ones (``Plan.starts`` are then their context);
            ``None``: one (a document longer than a micro-batch falls under the overlong policy).
        check: ``check(config)`` raises a :class:`~padfree.errors.ConfigError` for a config the strategy
            does not plan (called when the config is made).
    """

    name: str
    stream_id: int
    packed: bool
    form: Form | None = None
    bucketed: bool = False
    fixed_batches: bool = False
    layout: Layout | None = None
    chunks: Callable[[PlanConfig], int] | None = None
    check: Callable[[PlanConfig], None] | None = None

    def __post_init__(self) -> None:
        if (self.form is None) == (self.layout is None):
            raise ValueError(f"strategy {self.name!r}: give it a form or a layout of its own, one of them")

    @property
    def context(self) -> bool:
        """A document spans micro-batches as chunks that see their earlier ones (``chunks`` is set)."""
        return self.chunks is not None


REGISTRY: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    """Add a strategy (its name and stream id must be new)."""
    if strategy.name in REGISTRY:
        raise ValueError(f"strategy {strategy.name!r} is already registered")
    if any(s.stream_id == strategy.stream_id for s in REGISTRY.values()):
        raise ValueError(f"stream id {strategy.stream_id} is taken")
    REGISTRY[strategy.name] = strategy
    return strategy


def _sorted(length: np.ndarray, cfg: PlanConfig, rng: np.random.Generator) -> Formed:
    return Formed(*batching.sorted_batches(length, cfg.budget, rng), None)


def _random(length: np.ndarray, cfg: PlanConfig, rng: np.random.Generator) -> Formed:
    return Formed(*batching.random_batches(length, cfg.budget, rng), None)


def _bucketed(length: np.ndarray, cfg: PlanConfig, rng: np.random.Generator) -> Formed:
    mix = resolved_mix(length, cfg)
    edges = batching.bucket_edges(length, cfg.growth, cfg.buckets, rng)
    return batching.bucketed_batches(length, cfg.budget, rng, edges, mix)


def resolved_mix(length: np.ndarray, cfg: PlanConfig) -> mixing.Mix:
    """The bucketed noise windows: ``cfg.mix`` for every bucket, or when it is None the rule chosen from
    these item lengths and the step's micro-batch count (:func:`padfree.core.mixing.choose` on the
    unjittered bucket edges)."""
    if cfg.mix is not None:
        return mixing.Mix(uniform=cfg.mix)
    edges = batching.bucket_edges(length, cfg.growth, cfg.buckets, None)
    return mixing.choose(length, cfg.budget, edges, cfg.micro_per_step)


def _packed(length: np.ndarray, cfg: PlanConfig, rng: np.random.Generator) -> Formed:
    return Formed(*batching.packed_batches(length, cfg.budget, rng), None)


register(Strategy("sorted", 11, packed=False, form=_sorted, fixed_batches=True))
register(Strategy("random", 12, packed=False, form=_random))
register(Strategy("bucketed", 13, packed=False, form=_bucketed, bucketed=True))
register(Strategy("packed", 14, packed=True, form=_packed))

STRATEGIES: tuple[str, ...] = tuple(REGISTRY)
"""The strategies tables compare by default, in the order they show them."""

register(
    Strategy("chunked", 15, packed=True, layout=chunked.layout, chunks=chunked.chunks, check=chunked.check)
)
"""Chosen by name (``--strategy chunked``): packed rows, and documents up to ``grad_accum`` budgets long
trained whole in chunks, laid out by :mod:`padfree.core.chunked`."""
