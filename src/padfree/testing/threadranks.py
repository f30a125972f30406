"""Ranks as threads of one process: an all-gather board for testing what ranks exchange (dynamic balancing)
without a process group."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np


class Board:
    """An all-gather for ``world`` ranks that are threads of one process: ``exchange(rank)`` is the function
    a sampler's ``balance_exchange`` takes (its payload in, every rank's payloads stacked out).

    >>> import threading
    >>> board, out = Board(2), {}
    >>> def run(r):
    ...     out[r] = board.exchange(r)(np.array([r, 10 * r])).tolist()
    >>> ts = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    >>> for t in ts: t.start()
    >>> for t in ts: t.join()
    >>> out[0] == out[1] == [[0, 0], [1, 10]]
    True
    """

    def __init__(self, world: int, timeout: float = 60.0) -> None:
        self.slots: list[np.ndarray | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=timeout)

    def exchange(self, rank: int) -> Callable[[np.ndarray], np.ndarray]:
        def gather(payload: np.ndarray) -> np.ndarray:
            self.slots[rank] = payload.copy()
            self.barrier.wait()
            out = np.stack(self.slots)  # type: ignore[arg-type]
            self.barrier.wait()
            return out

        return gather


def run_ranks(samplers: list, seconds: Callable[[int, int, Any], float], limit: int | None = None) -> list:
    """Every rank's sampler in its own thread takes ``limit`` micro-batches (None: to the end) and records
    ``seconds(rank, i, micro_batch)`` for its ``i``-th one; returns each rank's micro-batches. An exception in
    any rank is raised here after all threads end."""
    out: list[list] = [[] for _ in samplers]
    errors: list[BaseException] = []

    def work(r: int) -> None:
        try:
            for i, mb in enumerate(itertools.islice(iter(samplers[r]), limit)):
                samplers[r].record_time(seconds(r, i, mb))
                out[r].append(mb)
        except Exception as exc:  # noqa: BLE001 - reported by the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(len(samplers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out
