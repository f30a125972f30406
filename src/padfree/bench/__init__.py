"""Benchmark library code: peer samplers and packers behind one adapter signature (the
field's simple baselines are :mod:`padfree.baselines`), and the planning-speed harness used by
``benchmarks/plan_speed.py``.

Nothing here is imported by the planning core; peers are optional (the ``bench`` extra).
"""
