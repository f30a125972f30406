"""The samples ``padfree bench`` trains on: token ids per sample (real, or random ids drawn when indexed) and
the loss-bearing tokens of each."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from padfree.errors import ConfigError


class RandomIds(Sequence):
    """Random token ids (1 .. vocab-1) of sample ``i``, drawn when asked for from a generator seeded by
    ``(seed, i)``: the same ids every time, and a 902K-sample dataset costs its lengths, not its tokens.

    >>> ids = RandomIds(np.array([3, 5]), vocab=100, seed=0)
    >>> len(ids), ids[1].shape, bool((ids[1] == ids[1]).all()), int(ids[0].min()) >= 1
    (2, (5,), True, True)
    """

    def __init__(self, lengths: np.ndarray, vocab: int, seed: int) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.vocab = max(2, int(vocab))
        self.seed = int(seed)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, i):
        rng = np.random.default_rng((self.seed, int(i)))
        return rng.integers(1, self.vocab, size=int(self.lengths[i]), dtype=np.int64)


class _Items(Sequence):
    """``{"input_ids": ...}`` per sample, built when indexed."""

    def __init__(self, ids: Sequence) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


@dataclass(frozen=True)
class Samples:
    """Token ids per sample (a list, or a lazy :class:`RandomIds`) and the loss-bearing tokens of each
    (label positions after the first)."""

    input_ids: Sequence
    loss_tokens: np.ndarray
    source: str

    @property
    def lengths(self) -> np.ndarray:
        known = getattr(self.input_ids, "lengths", None)
        if known is not None:
            return known
        return np.array([a.shape[0] for a in self.input_ids], dtype=np.int64)

    def items(self) -> Sequence[dict]:
        return _Items(self.input_ids)


def fit_lengths(lengths: np.ndarray, budget: int, overlong: str = "truncate") -> np.ndarray:
    """Lengths that fit the budget: longer ones cut to it (``truncate``) or left out (``drop``; their
    entries become 0 and the caller removes them)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if overlong == "truncate":
        return np.minimum(lengths, budget)
    if overlong == "drop":
        return np.where(lengths > budget, 0, lengths)
    raise ConfigError(f"--overlong must be truncate or drop for bench (got {overlong!r})")


def random_samples(lengths: np.ndarray, vocab: int, seed: int, source: str) -> Samples:
    """Random token ids (1 .. vocab-1) of the given lengths, drawn per sample when trained
    (:class:`RandomIds`); every token after the first bears loss."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return Samples(RandomIds(lengths, vocab, seed), np.maximum(lengths - 1, 0), source)
