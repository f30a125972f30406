"""What ``padfree bench`` runs: training speed and convergence under each batching, the peer samplers and
packers behind one adapter signature (the field's simple baselines are :mod:`padfree.baselines`), the
measures, samples and timing harness they share.

Nothing here is imported by the planning core; peers are optional (the ``bench`` extra). Protocols that only
benchmarks/ runs live beside it, in ``benchmarks/lab`` (not in the wheel).
"""
