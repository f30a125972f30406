"""A micro-batch's capacities beyond tokens (a drafter's anchor budget, eager EAGLE-3's attention memory),
folded into one size per item so that every strategy, tail re-cut and rank re-cut obeys them all.

A drafter micro-batch must fit three bounds (see :class:`~padfree.core.config.PlanConfig`): tokens
(``budget``), draft blocks (``anchor_budget``: anchors, the DFlash queries are ``anchors x block_size``) and,
for eager EAGLE-3, the attention weights it materialises (``attn_budget``: ``L x (L + attn_extra)`` per
row). Each item gets a *size* in budget tokens::

    size_i = max(l_i, ceil(anchors_i * budget / anchor_budget), ceil(l_i (l_i + k) * budget / attn_budget))

(the last term for padded rows, and packed rows whose attention is per document; a packed row's row-wide
attention bound is a token cap, :func:`token_cap`).

- Padded rows (``count x max(size) <= budget``): exact. ``count x max(size)`` is the largest of
  ``count x longest``, ``count x most anchors x budget / anchor_budget`` and the attention term, so the cut
  obeys every bound and is not tighter than any of them (up to the rounding of one token).
- A packed row (``sum(size) <= budget``): safe, and tight when one bound dominates every item; an item
  rich in anchors and one rich in tokens count their larger share each.

Without any of these bounds, sizes are the lengths and nothing changes.

>>> from padfree.core.config import PlanConfig
>>> cfg = PlanConfig(strategy="packed", budget=100, anchor_budget=10)
>>> sizes(np.array([50, 20, 30]), np.array([2, 5, 1]), cfg).tolist()
[50, 50, 30]
"""

from __future__ import annotations

import math

import numpy as np

from padfree.core.config import PlanConfig
from padfree.errors import ConfigError


def token_cap(config: PlanConfig) -> int:
    """The tokens a micro-batch may hold: the budget, lowered for a packed row under a row-wide attention
    bound to the largest ``T`` with ``T x (T + attn_extra) <= attn_budget`` (:func:`attention_cap`); under
    SP/CP the group's ``sp * cp * budget`` (:meth:`padfree.core.shard.Shard.capacity`).

    >>> cfg = PlanConfig(strategy="packed", budget=100, attn_budget=1000, attn_extra=6)
    >>> doc = cfg.with_(attn_per_document=True)
    >>> token_cap(cfg), token_cap(doc), item_cap(doc)
    (28, 100, 28)
    """
    if config.shard.pads:  # SP/CP or shapes: the group's padded row (attention bounds are refused with SP/CP)
        return config.shard.capacity(config.budget)
    if config.attn_budget is None or not config.packed or config.attn_per_document:
        return config.budget
    return attention_cap(config)


def item_cap(config: PlanConfig) -> int:
    """The tokens one item (a sample, or its piece) may hold: :func:`token_cap`, and under a per-document
    attention bound on packed rows the largest document it allows (:func:`attention_cap`)."""
    if config.attn_budget is not None and config.packed and config.attn_per_document:
        return attention_cap(config)
    return token_cap(config)


def attention_cap(config: PlanConfig) -> int:
    """The largest ``T`` (at most the budget) with ``T x (T + attn_extra) <= attn_budget``."""
    if config.attn_budget is None:
        return config.budget
    k, m = config.attn_extra, config.attn_budget
    t = int((-k + math.sqrt(k * k + 4.0 * m)) / 2)
    while t * (t + k) > m:
        t -= 1
    while (t + 1) * (t + 1 + k) <= m:
        t += 1
    return max(1, min(config.budget, t))


def bounded(config: PlanConfig) -> bool:
    """Whether the config has a capacity beyond tokens."""
    return config.anchor_budget is not None or config.attn_budget is not None


def sizes(
    length: np.ndarray, anchors: np.ndarray | None, config: PlanConfig, cap: int | None = None
) -> np.ndarray:
    """Each item's size in tokens of ``cap`` (a :class:`~padfree.core.budget.Budget`'s; default
    :func:`token_cap`) under every capacity in force (see the module). Raises a one-line
    :class:`ConfigError` for an item that no micro-batch can hold."""
    if not bounded(config):
        return config.shard.sizes(length, config.packed)  # the lengths unless SP/CP or shapes pad them
    cap = token_cap(config) if cap is None else cap
    size = length.astype(np.int64)
    if config.anchor_budget is not None and anchors is not None:
        a = anchors.astype(np.int64)
        over = a > config.anchor_budget
        if over.any():
            i = int(np.argmax(over))
            raise ConfigError(
                f"item {i} has {int(a[i])} anchors, more than the anchor budget of {config.anchor_budget} "
                "per micro-batch; raise anchor_budget or lower the anchor policy's cap"
            )
        size = np.maximum(size, -((-a * cap) // config.anchor_budget))
    if config.attn_budget is not None and (not config.packed or config.attn_per_document):
        lf = length.astype(np.float64)
        weights = lf * (lf + config.attn_extra)
        over = weights > config.attn_budget
        if over.any():
            i = int(np.argmax(over))
            raise ConfigError(
                f"item {i} of {int(length[i])} tokens needs {int(weights[i])} attention weights, more than "
                f"attn_budget {config.attn_budget}; raise attn_budget or choose overlong='split' at a "
                "smaller budget"
            )
        size = np.maximum(size, np.ceil(weights * cap / config.attn_budget).astype(np.int64))
    if config.shard.pads and not config.packed:  # a padded row's width is a declared shape
        size = config.shard.row_length(size)
    return size
