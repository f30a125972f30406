"""The strategies, by name: one registry is the one place a strategy is added.

A strategy forms one epoch's micro-batches from item lengths (see :mod:`padfree.core.batching`) and says
whether its micro-batches are packed rows. Everything after that (mixing strata into steps, whole steps,
rank balancing) is the same for every strategy (:func:`padfree.core.plan.plan_items`).

Adding one::

    register(Strategy("my_packer", stream_id=20, packed=True, form=my_form))
    PlanConfig(strategy="my_packer")      # now valid everywhere a strategy name is taken
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from padfree.core import batching, mixing
from padfree.core.batching import Formed

if TYPE_CHECKING:
    from padfree.core.config import PlanConfig

__all__ = ["REGISTRY", "STRATEGIES", "Formed", "Strategy", "register", "resolved_mix"]


@dataclass(frozen=True)
class Strategy:
    """A named way to form micro-batches.

    Attributes:
        name: what ``PlanConfig.strategy`` says.
        stream_id: the random stream of its epochs; plans depend on it, so it never changes once released
            and no two strategies share one.
        packed: micro-batches are packed rows (``sum(lengths) <= budget``) rather than padded ones
            (``count * longest <= budget``): collated by ``PackCollator``, run with per-document attention.
        form: ``form(lengths, config, rng) -> Formed``.
        bucketed: forms micro-batches inside length buckets: the config's ``buckets``, ``growth`` and ``mix``
            apply, and its plans report their bucket ``edges``.
        fixed_batches: its micro-batches are the same every epoch (formed from the seed alone); only their
            order changes.
        chunked: a document longer than the budget becomes consecutive chunks on one rank in one step
            (:mod:`padfree.core.chunked` lays out the whole plan; ``form`` is not used).
    """

    name: str
    stream_id: int
    packed: bool
    form: Callable[[np.ndarray, PlanConfig, np.random.Generator], Formed]
    bucketed: bool = False
    fixed_batches: bool = False
    chunked: bool = False


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

register(Strategy("chunked", 15, packed=True, form=_packed, chunked=True))
"""Chosen by name (``--strategy chunked``): packed rows, and documents up to ``grad_accum`` budgets long
trained whole in chunks (:mod:`padfree.core.chunked`)."""
