"""What an example says before it trains about the samples longer than its run trains whole (its reach).

>>> import numpy as np
>>> from padfree import PlanConfig
>>> config = PlanConfig(strategy="chunked", budget=4, grad_accum=2, overlong="truncate")
>>> print(overlong_note(config, np.array([3, 10, 5])))  # doctest: +NORMALIZE_WHITESPACE
--overlong truncate: 1 of 3 samples are longer than the chunked reach of 8 tokens (--grad-accum 2 x --budget
4) (longest 10): truncated to 8 tokens, 2 of 18 tokens not trained (11.1%)
"""

from __future__ import annotations

import numpy as np

from padfree.core.config import PlanConfig
from padfree.core.items import overlong_line
from padfree.torch.execution.runner import reach


def reach_limit(config: PlanConfig) -> str | None:
    """What sets the reach, in the examples' options (``None``: the budget itself)."""
    tokens, group = reach(config), config.sp * config.cp
    if config.chunked:
        accum, budget = config.grad_accum, config.budget
        return f"the chunked reach of {tokens} tokens (--grad-accum {accum} x --budget {budget})"
    if group > 1:
        return f"the row of {tokens} tokens (--budget {config.budget} x {group} ranks)"
    return None


def overlong_note(config: PlanConfig, lengths: np.ndarray) -> str | None:
    """The one line that says what ``--overlong`` does to the samples over the reach (``None``: there are
    none, or the plan refuses them)."""
    return overlong_line(np.asarray(lengths), reach(config), config.overlong, reach_limit(config))


__all__ = ["overlong_note", "reach_limit"]
