"""The planning core: lengths in, a plan of micro-batches, steps and ranks out. numpy and numba only.

Pipeline (one module per arrow)::

    lengths --items--> items --batching--> micro-batches --steps--> steps x ranks --plan--> Plan
                                  (strategies)        (cost, balance)          \\--metrics--> numbers

``planner`` decides once between in memory and window by window (``stream`` plans huge epochs on top of
``plan``); ``replay`` rebuilds an epoch's plan after world-size changes; ``cursor`` walks one rank through
it (the pure path the torch sampler and the Trainer share; ``position`` is its saved state);
``fingerprint`` identifies the data a plan was made for.
"""

from padfree.core.config import STRATEGIES, CostModel, PlanConfig
from padfree.core.metrics import plan_metrics
from padfree.core.plan import Plan
from padfree.core.planner import make_plan

__all__ = ["STRATEGIES", "CostModel", "Plan", "PlanConfig", "make_plan", "plan_metrics"]
