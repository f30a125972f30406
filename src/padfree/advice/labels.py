"""How each metric of a planned epoch is named and printed: one label, one short label and one format per
metric, for the terminal table of ``padfree analyze`` and the HTML report's table.

>>> METRICS["imbalance"].show(1.0123456)
'1.0123'
>>> [m.short for m in pick("steps", "imbalance")]
['steps', 'rank imbalance']
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    short: str
    fmt: str

    def show(self, value: object) -> str:
        """The value as printed (``-`` where it was not measured)."""
        return "-" if value is None else self.fmt.format(value)


_TABLE = (
    # key, label (terminal), short (HTML column), format
    ("padding_efficiency", "padding efficiency", "padding eff.", "{:.4f}"),
    ("relative_throughput", "modeled throughput vs sorted", "throughput vs sorted", "{:.3f}"),
    ("fill", "budget fill", "fill", "{:.4f}"),
    ("compute_efficiency", "compute efficiency", "compute eff.", "{:.4f}"),
    ("imbalance", "rank imbalance (max/mean)", "rank imbalance", "{:.4f}"),
    ("step_divergence", "step divergence (W1/mean)", "step divergence", "{:.4f}"),
    ("cobatch_repeat", "co-batch repeat e->e+1", "co-batch repeat", "{:.4f}"),
    ("adjacent_corr", "adjacent-step corr", "adjacent corr", "{:+.3f}"),
    ("steps", "steps", "steps", "{:,}"),
    ("micro_batches", "micro-batches", "micro-batches", "{:,}"),
    ("tokens_per_step_min", "tokens/step min", "tokens/step min", "{:,.0f}"),
    ("tokens_per_step_median", "tokens/step median", "tokens/step median", "{:,.0f}"),
    ("tokens_per_step_max", "tokens/step max", "tokens/step max", "{:,.0f}"),
    ("plan_seconds", "plan seconds (1 epoch)", "plan seconds", "{:.3f}"),
    ("truncated", "samples truncated", "truncated", "{:,}"),
    ("split", "samples split (pieces without their beginning)", "split", "{:,}"),
    ("chunked", "documents chunked (whole context)", "chunked", "{:,}"),
)
METRICS: dict[str, Metric] = {row[0]: Metric(*row) for row in _TABLE}
"""Every metric a planned epoch reports that a table shows, by key."""


def pick(*keys: str) -> tuple[Metric, ...]:
    """The metrics of ``keys``, in that order."""
    return tuple(METRICS[k] for k in keys)
