"""padfree: padding-free, well-mixed batching plans for variable-length LLM training.

The planning core is pure numpy::

    >>> import numpy as np
    >>> from padfree import PlanConfig, make_plan
    >>> lengths = np.array([5, 9, 3, 7, 2, 8, 4, 6])
    >>> plan = make_plan(lengths, PlanConfig(strategy="packed", budget=16, world_size=2), epoch=0)
    >>> sorted(np.concatenate(plan.micro_batches()).tolist())
    [0, 1, 2, 3, 4, 5, 6, 7]
"""

from padfree.core import STRATEGIES, CostModel, Plan, PlanConfig, make_plan, plan_metrics
from padfree.errors import ConfigError, InputError, OverlongError, PadfreeError, StateError

__all__ = [
    "STRATEGIES",
    "ConfigError",
    "CostModel",
    "InputError",
    "OverlongError",
    "PadfreeError",
    "Plan",
    "PlanConfig",
    "StateError",
    "make_plan",
    "plan_metrics",
]
__version__ = "0.1.0"
