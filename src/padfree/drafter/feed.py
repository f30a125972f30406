"""Moved to :mod:`padfree.integrations.feed`; this name stays only for ``padfree.testing.drafters`` until that
module leaves the wheel (issue 34 item 3)."""

from padfree.integrations.feed import their_layer_ids

__all__ = ["their_layer_ids"]
