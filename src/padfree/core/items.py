"""Turning raw per-sample lengths into plannable items: validation and the overlong policy.

An *item* is what the planner places: a whole sample, a truncated sample, or one piece of a split sample.
Without ``split``, item ``i`` is sample ``i`` (or the i-th kept sample under ``drop``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from padfree.errors import InputError, OverlongError

MAX_LENGTH = 2**31 - 1


def validate_lengths(values: object, path: str | None = None, *, compact: bool = False) -> np.ndarray:
    """Check that ``values`` is a non-empty 1-D array of positive integers and return it as int64.

    With ``compact=True`` an array that is already int32 (or a narrower integer type) comes back as int32
    (without a copy when it is int32), so 100M lengths cost 400 MB instead of 800 MB; anything else is still
    returned as int64.

    >>> validate_lengths([3, 1, 2]).tolist()
    [3, 1, 2]
    >>> validate_lengths([3, 0])
    Traceback (most recent call last):
    ...
    padfree.errors.InputError: sample 1: length must be a positive integer (got 0)
    """
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError):  # ragged or mixed sequences
        raise InputError("lengths must be a 1-D array of integers", path=path) from None
    if arr.ndim != 1:
        raise InputError(f"lengths must be a 1-D array (got shape {arr.shape})", path=path)
    if arr.size == 0:
        raise InputError("no samples: the lengths are empty", path=path)
    if arr.dtype.kind == "b" or arr.dtype.kind not in "iuf":
        raise InputError(f"lengths must be integers (got dtype {arr.dtype})", path=path)
    if arr.dtype.kind == "f":
        arr = arr.astype(np.float64, copy=False)  # float16/32 would overflow comparing with the limit
        bad = ~np.isfinite(arr)
        if bad.any():
            i = int(np.argmax(bad))
            raise InputError(f"length must be a positive integer (got {arr[i]})", path=path, sample=i)
        frac = arr != np.floor(arr)
        if frac.any():
            i = int(np.argmax(frac))
            raise InputError(f"length must be a positive integer (got {arr[i]})", path=path, sample=i)
    low = arr < 1
    if low.any():
        i = int(np.argmax(low))
        raise InputError(f"length must be a positive integer (got {_num(arr[i])})", path=path, sample=i)
    narrow = arr.dtype.kind in "iu" and np.iinfo(arr.dtype).max <= MAX_LENGTH
    if not narrow:
        high = arr > MAX_LENGTH
        if high.any():
            i = int(np.argmax(high))
            raise InputError(
                f"length {_num(arr[i])} is absurdly large (limit {MAX_LENGTH} tokens)", path=path, sample=i
            )
    if compact and narrow:
        return arr.astype(np.int32, copy=False)
    return arr.astype(np.int64, copy=False)


def _num(x: object) -> object:
    if isinstance(x, (int, np.integer)):
        return int(x)
    f = float(x)  # type: ignore[arg-type]
    return int(f) if f.is_integer() and abs(f) < 1e30 else f  # 1.5e+300, not its 301 digits


class Report(NamedTuple):
    """What the overlong policy did to an epoch's samples (a plan carries it)."""

    n_samples: int
    truncated: int = 0
    split: int = 0
    dropped: int = 0


@dataclass(frozen=True)
class Items:
    """The units the planner places, with their sample of origin.

    Attributes:
        length: tokens of each item (every one ``<= budget``).
        sample: the sample each item comes from (``None``: item ``i`` is sample ``i``).
        start: first token of each item inside its sample (``None``: every item starts at 0).
        n_samples: samples in the input.
        truncated, split, dropped: how many samples the overlong policy touched.
        anchors: drafter plans: draft blocks (anchors) of each item (``None``: not a drafter plan). A
            truncated or split piece keeps its sample's count, a bound on its own (anchor quotas grow with a
            document's supervised tokens).
    """

    length: np.ndarray
    sample: np.ndarray | None
    start: np.ndarray | None
    n_samples: int
    truncated: int = 0
    split: int = 0
    dropped: int = 0
    anchors: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.length.shape[0])

    @property
    def report(self) -> Report:
        return Report(self.n_samples, self.truncated, self.split, self.dropped)

    def sample_ids(self) -> np.ndarray:
        if self.sample is None:
            return np.arange(len(self), dtype=np.int64)
        return self.sample


def check_overlong(
    n_over: int,
    n: int,
    first: int,
    longest: int,
    budget: int,
    overlong: str,
    path: str | None,
    chunks: int = 1,
) -> None:
    """Raise what the overlong policy forbids, the same for every planner: any sample over the budget under
    ``overlong='error'``; every sample over it under ``'drop'`` (nothing would be left to train on).
    ``chunks > 1``: ``budget`` is a chunked plan's reach, ``chunks`` (grad_accum) budgets, said so; chunked
    cannot split.

    >>> try:
    ...     check_overlong(1, 3, 2, 9000, 8192, "error", None, chunks=4)
    ... except OverlongError as exc:
    ...     print(str(exc)[:85])
    1 sample(s) longer than the chunked reach of 8192 tokens (grad_accum 4 x budget 2048)
    """
    limit = f"the budget of {budget} tokens"
    how = "raise the budget (budget=, --budget) or choose an overlong policy (overlong=, --overlong: "
    how += "truncate, split or drop)"
    if chunks > 1:
        limit = f"the chunked reach of {budget} tokens (grad_accum {chunks} x budget {budget // chunks})"
        how = (
            "raise the budget or grad_accum (budget=, grad_accum=, --budget, --grad-accum) or choose an "
            "overlong policy (overlong=, --overlong: truncate or drop; chunked trains a document whole or "
            "not at all, it cannot split one)"
        )
    if n_over and overlong == "error":
        raise OverlongError(
            f"{n_over} sample(s) longer than {limit} (first: sample {first}, longest: {longest} tokens); "
            + how,
            path=path,
        )
    if overlong == "drop" and n_over == n:
        raise OverlongError(f"every sample is longer than {limit}", path=path)


def make_items(
    lengths: np.ndarray,
    budget: int,
    overlong: str,
    path: str | None = None,
    anchors: np.ndarray | None = None,
    chunks: int = 1,
) -> Items:
    """Apply the overlong policy: samples longer than ``budget`` raise, are truncated, split or dropped.
    ``anchors`` (per sample, drafter plans) follow their samples: see :class:`Items`; ``chunks``: see
    :func:`check_overlong`.

    >>> it = make_items(np.array([3, 10, 4]), budget=4, overlong="split")
    >>> it.length.tolist(), it.sample.tolist(), it.start.tolist()
    ([3, 4, 4, 2, 4], [0, 1, 1, 1, 2], [0, 0, 4, 8, 0])
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    over = lengths > budget
    n_over = int(over.sum())
    n = int(lengths.shape[0])
    if n_over == 0:
        return Items(lengths, None, None, n, anchors=anchors)
    check_overlong(n_over, n, int(np.argmax(over)), int(lengths.max()), budget, overlong, path, chunks)
    if overlong == "truncate":
        return Items(np.minimum(lengths, budget), None, None, n, truncated=n_over, anchors=anchors)
    if overlong == "drop":
        keep = np.flatnonzero(~over)
        kept = None if anchors is None else anchors[keep]
        return Items(lengths[keep], keep, None, n, dropped=n_over, anchors=kept)
    # split: pieces of `budget` tokens, the last one shorter
    pieces = (lengths + budget - 1) // budget
    sample = np.repeat(np.arange(n, dtype=np.int64), pieces)
    first_item = np.cumsum(pieces) - pieces
    piece_no = np.arange(sample.shape[0], dtype=np.int64) - np.repeat(first_item, pieces)
    start = piece_no * budget
    length = np.minimum(lengths[sample] - start, budget)
    return Items(length, sample, start, n, split=n_over, anchors=None if anchors is None else anchors[sample])


def planned_tokens(lengths: np.ndarray, budget: int, overlong: str) -> int:
    """Tokens the plan trains on once ``overlong`` has been applied to ``lengths``.

    >>> planned_tokens(np.array([3, 10, 5]), 4, "truncate"), planned_tokens(np.array([3, 10, 5]), 4, "drop")
    (11, 3)
    """
    if overlong == "truncate":
        return int(np.minimum(lengths, budget).sum())
    if overlong == "drop":
        return int(lengths[lengths <= budget].sum())
    return int(lengths.sum())


def dropped_samples(lengths: np.ndarray, budget: int, overlong: str) -> np.ndarray:
    """The samples ``--overlong drop`` leaves out (those longer than the budget; none under other policies).

    >>> dropped_samples(np.array([3, 10, 5]), 4, "drop").tolist(), dropped_samples(np.array([10]), 4, "split")
    ([1, 2], array([], dtype=int64))
    """
    if overlong != "drop":
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.asarray(lengths) > budget).astype(np.int64)


def overlong_line(lengths: np.ndarray, budget: int, overlong: str, limit: str | None = None) -> str | None:
    """The one line that says what ``--overlong`` did to the samples longer than ``budget`` tokens, where the
    plan cuts them (None when there are none; under ``error`` the plan has refused them already). ``limit``
    says what sets that cut (default: ``the budget of N tokens``).

    >>> print(overlong_line(np.array([3, 10, 5]), 4, "truncate"))  # doctest: +NORMALIZE_WHITESPACE
    --overlong truncate: 2 of 3 samples are longer than the budget of 4 tokens (longest 10): truncated to
    4 tokens, 7 of 18 tokens not trained (38.9%)
    """
    over = lengths > budget
    n = int(over.sum())
    if n == 0 or overlong == "error":
        return None
    total = int(lengths.sum())
    lost = total - planned_tokens(lengths, budget, overlong)
    what = {
        "truncate": f"truncated to {budget} tokens, {lost} of {total} tokens not trained",
        "split": f"split into pieces of at most {budget} tokens, every token trained",
        "drop": f"dropped, {lost} of {total} tokens not trained",
    }[overlong]
    limit = limit or f"the budget of {budget} tokens"
    pct = f" ({100.0 * lost / total:.1f}%)" if lost else ""
    return (
        f"--overlong {overlong}: {n} of {lengths.shape[0]} samples are longer than {limit} "
        f"(longest {int(lengths.max())}): {what}{pct}"
    )
