"""One document's own random generator, keyed by (seed, epoch, sample id, piece start, purpose) alone.

Everything random that belongs to a document (its DFlash anchors, the uniform noise on the target's hidden
states it is trained on) is drawn from :func:`document_rng`, so a document gets the same draws packed or
alone, on any rank, at any world size, after any resume, and through padfree's trainer or a peer's trainer
fed by padfree (:mod:`padfree.integrations.feed`). ``start`` is the offset of a split sample's piece in its
sample (0 for a whole sample), so two pieces of one sample draw independently; ``purpose`` keeps the streams
of different uses apart. Pure numpy (the planner's anchors use it).

>>> a = document_rng(0, 1, 17).random(3)
>>> same, piece = document_rng(0, 1, 17).random(3), document_rng(0, 1, 17, start=5).random(3)
>>> bool((a == same).all()), bool((a == piece).any())
(True, False)
>>> noise = document_noise((2, 3), 0.5, seed=0, epoch=1, sample_id=17)
>>> noise.dtype.name, bool((abs(noise) <= 0.5).all())
('float32', True)
"""

from __future__ import annotations

import numpy as np

from padfree.errors import ConfigError

__all__ = ["PURPOSES", "document_noise", "document_rng"]

PURPOSES = {"anchors": (), "noise": (0x6E6F6973,)}
"""The purposes a document draws for, each with the words that follow its key (the anchors' stream has none,
the key they have always been drawn from)."""


def _check_id(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 0:
        raise ConfigError(f"document key: {name} must be a non-negative integer (got {v!r})")
    return int(v)


def document_rng(
    seed: int, epoch: int, sample_id: int, start: int = 0, purpose: str = "anchors"
) -> np.random.Generator:
    """The generator of one document (the piece at ``start`` of sample ``sample_id``) in ``epoch`` of a run
    seeded ``seed``, for ``purpose`` (one of :data:`PURPOSES`): a Philox stream of that key alone."""
    if purpose not in PURPOSES:
        raise ConfigError(f"document_rng: purpose must be one of {', '.join(PURPOSES)} (got {purpose!r})")
    named = (("seed", seed), ("epoch", epoch), ("sample_id", sample_id), ("start", start))
    key = [_check_id(n, v) for n, v in named] + list(PURPOSES[purpose])
    return np.random.Generator(np.random.Philox(np.random.SeedSequence(key)))


def document_noise(
    shape: tuple[int, ...], amount: float, *, seed: int, epoch: int, sample_id: int, start: int = 0
) -> np.ndarray:
    """Uniform noise in ``[-amount, amount)`` of ``shape`` (float32) for one document: its ``noise`` stream of
    :func:`document_rng`."""
    u = document_rng(seed, epoch, sample_id, start, "noise").random(shape, dtype=np.float32)
    return (u * 2 - 1) * np.float32(amount)
