"""The decision tools on the planning core: which batching to use and what it will cost: ``analyze`` (compare
strategies), ``report`` (a decision with figures and HTML), ``calibrate`` (fit the cost model), ``simulate``
(predict throughput at scale)."""
