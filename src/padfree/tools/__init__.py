"""Tools built on the planning core: ``analyze`` (compare strategies), ``report`` (a decision with figures
and HTML), ``calibrate`` (fit the cost model), ``simulate`` (predict throughput at scale) and
``packing_check`` (does a packed row leak across documents?)."""
