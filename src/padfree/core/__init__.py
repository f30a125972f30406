"""The planning core: lengths in, a plan of micro-batches, steps and ranks out. numpy and numba only.

Pipeline (one module per arrow)::

    lengths --items--> items --batching--> micro-batches --steps--> steps x ranks --plan--> Plan
                                  (strategies)        (cost, balance)          \\--metrics--> numbers

``stream`` plans huge epochs window by window on top of ``plan``; ``replay`` rebuilds an epoch's plan after
world-size changes; ``fingerprint`` identifies the data a plan was made for.
"""

from padfree.core.config import STRATEGIES, CostModel, PlanConfig
from padfree.core.metrics import plan_metrics
from padfree.core.plan import Plan
from padfree.core.planner import make_plan

__all__ = ["STRATEGIES", "CostModel", "Plan", "PlanConfig", "make_plan", "plan_metrics"]
