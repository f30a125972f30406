"""The token budget of one plan segment, made once (:meth:`Budget.of`) and passed whole: where samples are cut
into items, what micro-batches are filled to, and what one micro-batch may hold.

A segment (:class:`padfree.core.replay.Segment`) records only its planning budget (``None``: the config's);
everything else follows from the config. Three numbers, because three stages read the budget differently:

- the overlong policy cuts samples at ``item``, the config's budget (lowered for a packed row under an
  attention bound, row-wide or per document): an item never exceeds what a micro-batch of the run may hold,
  or the ``chunks`` micro-batches a strategy's document may span (``chunked``: ``grad_accum`` budgets,
  :mod:`padfree.core.chunked`); it is the *reach*, the longest document a plan trains whole
  (:attr:`Budget.reach`);
- the strategy fills micro-batches to ``plan``: the config's budget, or less where a dynamic plan leaves
  headroom for re-cuts among ranks (:func:`padfree.core.balance.dynamic_budget`);
- ``cap`` is what one micro-batch formed at ``plan`` may hold: ``plan`` lowered by the attention bound, the
  unit every capacity is folded into (:func:`padfree.core.capacity.sizes`).

>>> from padfree.core.config import PlanConfig
>>> cfg = PlanConfig(strategy="packed", budget=1000, attn_budget=250_000)
>>> Budget.of(cfg), Budget.of(cfg, 400)
(Budget(item=500, plan=1000, cap=500, chunks=1), Budget(item=500, plan=400, cap=400, chunks=1))
>>> Budget.of(PlanConfig(strategy="chunked", budget=1000, grad_accum=4)).reach
4000
"""

from __future__ import annotations

from dataclasses import dataclass

from padfree.core.capacity import item_cap, token_cap
from padfree.core.config import PlanConfig


@dataclass(frozen=True)
class Budget:
    """Tokens per micro-batch of one plan segment, as each stage reads them (see the module).

    Attributes:
        item: where the overlong policy cuts samples into items; a re-cut among ranks (no drafter capacity)
            fills a micro-batch up to it, using the headroom a dynamic plan left.
        plan: what the strategy fills micro-batches to (the segment's config budget).
        cap: what one micro-batch formed at ``plan`` may hold; item sizes are counted in these tokens.
        chunks: the micro-batches one item may span (the strategy's ``chunks``: a chunked plan's
            grad_accum; else 1).
    """

    item: int
    plan: int
    cap: int
    chunks: int = 1

    @classmethod
    def of(cls, config: PlanConfig, plan: int | None = None) -> Budget:
        """The budget of a segment of ``config`` (the run's) planned at ``plan`` tokens (``None``: the
        config's budget)."""
        at = config if plan is None or plan == config.budget else config.with_(budget=plan)
        chunks = 1 if config.spec.chunks is None else config.spec.chunks(config)
        return cls(item_cap(config) * chunks, at.budget, token_cap(at), chunks)

    @property
    def reach(self) -> int:
        """The longest document a plan of this segment trains whole: ``item``, one micro-batch's item cap
        times the ``chunks`` it may span (``budget`` for packed, ``grad_accum * budget`` for chunked)."""
        return self.item
