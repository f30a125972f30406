"""Checks that packed training is correct on a model: ``packing`` (does a packed row leak across documents?),
``sharded`` (the same over SP/CP ranks) and ``families`` (every decoder family transformers has)."""
