"""The numba set-up the planner's compiled loops share (``njit``, a pure-Python fallback when numba is not
importable, a writable kernel cache) and the few loops every stage uses: gathering segments, a counting
argsort and best-fit bin packing.

Each compiled loop is a sequential scan that numpy cannot vectorize; it sits beside the stage that calls it
(:mod:`padfree.core._cuts`, :mod:`padfree.core._ranks`, :mod:`padfree.core.batching`,
:mod:`padfree.core.buckets`, :mod:`padfree.core.stream`, :mod:`padfree.core.sources`). Every one takes and
returns plain numpy arrays and is deterministic.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np


def writable_cache_dir(candidates: list[Path]) -> Path | None:
    """The first of ``candidates`` that is (or can be made) a folder a file can be created in; else None."""
    for d in candidates:
        try:
            d.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=d).close()
            return d
        except OSError:
            continue
    return None


def _numba_cache_fallback() -> None:
    """numba caches compiled kernels beside this file, else in ``~/.cache/numba``, and fails at import when
    neither is writable (a read-only install and a home folder that is not writable). Then use a folder in
    the temporary directory instead (``NUMBA_CACHE_DIR``, when set, is the user's choice and is kept)."""
    import numba
    from numba.misc.appdirs import AppDirs

    if numba.config.CACHE_DIR:  # type: ignore[attr-defined]
        return
    usual = [
        Path(__file__).parent / "__pycache__",
        Path(AppDirs(appname="numba", appauthor=False).user_cache_dir),
    ]
    if writable_cache_dir(usual) is None:
        fallback = (
            Path(tempfile.gettempdir()) / f"padfree-numba-{os.getuid() if hasattr(os, 'getuid') else 0}"
        )
        if writable_cache_dir([fallback]) is not None:
            numba.config.CACHE_DIR = str(fallback)  # type: ignore[attr-defined]


try:  # pragma: no cover - exercised by the import itself
    from numba import njit

    _numba_cache_fallback()
except ImportError:  # pragma: no cover

    def njit(*args, **kwargs):  # type: ignore[no-redef]
        if args and callable(args[0]):
            return args[0]
        return lambda f: f


@njit(cache=True, nogil=True)
def best_fit(lens: np.ndarray, budget: int) -> tuple:
    """Online best-fit bin packing in the given order: each item goes to the open bin with the least room
    that still fits it, else to a new bin (an item longer than ``budget`` gets a bin of its own). O(n log
    budget) with a segment tree over remaining capacity.

    Returns ``(bin_of_item, n_bins)``; bins are numbered in the order they were opened.
    """
    n = lens.shape[0]
    size = 1
    while size < budget + 1:
        size *= 2
    tree = np.zeros(2 * size, np.int64)  # number of open bins per remaining capacity
    head = np.full(budget + 1, -1, np.int64)  # a stack of bins per remaining capacity
    nxt = np.empty(n, np.int64)
    room = np.empty(n, np.int64)
    bin_of = np.empty(n, np.int64)
    n_bins = 0
    for i in range(n):
        length = lens[i]
        if length > budget:  # longer than the bins (a plan that leaves headroom): a bin of its own
            bin_of[i] = n_bins
            room[n_bins] = 0
            n_bins += 1
            continue
        # smallest remaining capacity >= length that has an open bin
        found = -1
        node = size + length
        if tree[node] > 0:
            found = length
        else:
            while node > 1:
                if (node & 1) == 0 and tree[node + 1] > 0:
                    node = node + 1
                    while node < size:
                        node = 2 * node if tree[2 * node] > 0 else 2 * node + 1
                    found = node - size
                    break
                node >>= 1
        if found < 0:
            b = n_bins
            n_bins += 1
            r = budget - length
        else:
            b = head[found]
            head[found] = nxt[b]
            node = size + found
            while node >= 1:
                tree[node] -= 1
                node >>= 1
            r = found - length
        bin_of[i] = b
        room[b] = r
        if r > 0:
            nxt[b] = head[r]
            head[r] = b
            node = size + r
            while node >= 1:
                tree[node] += 1
                node >>= 1
    return bin_of, n_bins


@njit(cache=True, nogil=True)
def counting_argsort(keys: np.ndarray, n_keys: int) -> np.ndarray:
    """Stable argsort of small non-negative integer keys (< n_keys) in O(n + n_keys)."""
    out = np.empty(keys.shape[0], np.int64)
    counting_sort_into(keys, n_keys, out)
    return out


@njit(cache=True, nogil=True)
def counting_sort_into(keys: np.ndarray, n_keys: int, out: np.ndarray) -> np.ndarray:
    """The stable argsort of small non-negative integer keys (< n_keys) written into ``out`` (of any
    integer dtype: a huge epoch's ids fit int32); returns where each key's ids start (``n_keys + 1``)."""
    starts = np.zeros(n_keys + 1, np.int64)
    for i in range(keys.shape[0]):
        starts[keys[i] + 1] += 1
    for k in range(n_keys):
        starts[k + 1] += starts[k]
    fill = starts[:-1].copy()
    for i in range(keys.shape[0]):
        k = keys[i]
        out[fill[k]] = i
        fill[k] += 1
    return starts


@njit(cache=True, nogil=True)
def gather_segments(values: np.ndarray, offsets: np.ndarray, order: np.ndarray) -> tuple:
    """Concatenate segments ``values[offsets[j]:offsets[j+1]]`` for ``j`` in ``order``.

    Returns ``(new_values, new_offsets)``.
    """
    m = order.shape[0]
    new_off = np.empty(m + 1, np.int64)
    new_off[0] = 0
    for j in range(m):
        s = order[j]
        new_off[j + 1] = new_off[j] + offsets[s + 1] - offsets[s]
    out = np.empty(new_off[m], values.dtype)
    for j in range(m):
        s = order[j]
        a = offsets[s]
        w = new_off[j]
        for t in range(offsets[s + 1] - a):
            out[w + t] = values[a + t]
    return out, new_off
