"""Samples streamed in order for a streamed plan (:class:`padfree.torch.feed.streamed.StreamBatchSampler`):
parquet or JSONL shards read in order, a ``datasets`` streaming ``IterableDataset``, or any iterator.

A source reads the samples at stream positions ``start .. start+count-1`` (``read``), in order. A resume
reads the window's buffered samples again, so exact resume needs a source that can go back to a saved
position: shards seek by shard and row, a ``datasets`` stream by its own ``state_dict`` (a snapshot at each
read, the oldest still needed kept in the sampler's state); an iterator cannot, and a resume over it is one
line naming the source and the rule (:meth:`IteratorSamples.load_resume_state`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from padfree.errors import ConfigError, StateError

__all__ = ["HFStreamSamples", "IteratorSamples", "SampleSource", "ShardSamples"]


class SampleSource(Protocol):
    """Where a streamed plan reads samples (items as the collators take them: dicts with ``input_ids``)."""

    name: str

    def read(self, start: int, count: int) -> list: ...

    def restart(self, epoch: int) -> None: ...

    def resume_state(self, oldest: int) -> dict: ...

    def load_resume_state(self, state: dict) -> None: ...


def _cannot_seek(name: str, why: str) -> ConfigError:
    return ConfigError(
        f"source {name!r} cannot seek ({why}): exact resume reads the window's samples again from their "
        "positions; stream from shards in order or a datasets IterableDataset without a shuffle buffer"
    )


class IteratorSamples:
    """An iterator of samples (tokenized on the fly): read forward only, one pass; it cannot seek, so a
    resume over it is refused in one line."""

    def __init__(self, samples: Iterable[Any], name: str = "iterator") -> None:
        self._it, self._pos, self.name = iter(samples), 0, name

    def read(self, start: int, count: int) -> list:
        if start != self._pos:
            raise _cannot_seek(self.name, f"an iterator at position {self._pos}, asked for {start}")
        out = [x for _, x in zip(range(count), self._it, strict=False)]
        self._pos += len(out)
        return out

    def restart(self, epoch: int) -> None:
        if self._pos:
            raise _cannot_seek(self.name, f"an iterator read once; epoch {epoch} would read it again")

    def resume_state(self, oldest: int) -> dict:
        return {"seekable": False}

    def load_resume_state(self, state: dict) -> None:
        raise _cannot_seek(self.name, "an iterator")


def _shuffle_buffered(dataset: Any) -> bool:
    """Whether a ``datasets.IterableDataset`` draws through a shuffle buffer (``.shuffle(buffer_size=)``)."""
    node = getattr(dataset, "_ex_iterable", None)
    while node is not None:
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            return True
        node = getattr(node, "ex_iterable", None)
    return False


class HFStreamSamples:
    """A ``datasets.IterableDataset`` (``load_dataset(..., streaming=True)``, ``to_iterable_dataset()``):
    read in order; a read elsewhere than where it stands goes back through the dataset's own
    ``state_dict`` snapshot taken at an earlier read, and skips forward from there. Epoch ``e`` reads the
    dataset from its start with ``set_epoch(e)``. A shuffled one (a shuffle buffer, lost at a resume) is
    refused for exact resume."""

    def __init__(self, dataset: Any, name: str | None = None) -> None:
        if not hasattr(dataset, "state_dict") or not hasattr(dataset, "load_state_dict"):
            raise ConfigError(
                f"source {name or type(dataset).__name__!r}: a datasets IterableDataset with state_dict and "
                "load_state_dict is needed (datasets >= 2.18)"
            )
        self.dataset, self.name = dataset, name or "datasets stream"
        self._start = copy.deepcopy(dataset.state_dict())
        self._snaps: dict[int, dict] = {}
        self._it: Iterator | None = None
        self._pos = -1  # where the open iterator stands (-1: none open)

    def _open(self, at: int, state: dict) -> None:
        self.dataset.load_state_dict(copy.deepcopy(state))
        self._it, self._pos = iter(self.dataset), at

    def read(self, start: int, count: int) -> list:
        if self._pos != start:
            back = [p for p in self._snaps if p <= start]
            if self._pos < 0 or self._pos > start:
                if not back and start:
                    raise StateError(f"source {self.name!r}: no snapshot at or before position {start}")
                at = max(back) if back else 0
                self._open(at, self._snaps[at] if back else self._start)
            assert self._it is not None
            for _ in range(start - self._pos):
                next(self._it, None)
            self._pos = start
        assert self._it is not None
        self._snaps[start] = copy.deepcopy(self.dataset.state_dict())
        out = [x for _, x in zip(range(count), self._it, strict=False)]
        self._pos += len(out)
        return out

    def restart(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        self._snaps.clear()
        self._open(0, {**self._start, "epoch": epoch} if "epoch" in self._start else self._start)

    def resume_state(self, oldest: int) -> dict:
        """The snapshot to read position ``oldest`` again (older snapshots are forgotten)."""
        if _shuffle_buffered(self.dataset):
            return {"seekable": False}
        back = [p for p in self._snaps if p <= oldest]
        if not back:
            return {"position": 0, "state": self._start}
        at = max(back)
        for p in [p for p in self._snaps if p < at]:
            del self._snaps[p]
        return {"position": at, "state": self._snaps[at]}

    def load_resume_state(self, state: dict) -> None:
        if _shuffle_buffered(self.dataset) or state.get("seekable") is False:
            raise _cannot_seek(self.name, "a shuffle buffer, lost at a resume")
        try:
            at, snap = int(state["position"]), dict(state["state"])
        except (KeyError, TypeError, ValueError):
            raise StateError(f"source {self.name!r}: malformed stream state (position, state)") from None
        self._snaps = {at: snap}
        self._open(at, snap)


class ShardSamples:
    """Parquet or JSONL shards read in order (a sample per row or line): seekable by shard and row. Rows
    per shard come from parquet footers or one count of a JSONL shard's lines; a read opens only the rows it
    needs (parquet: their row groups; JSONL: the shard from where the last read stopped, else its start)."""

    def __init__(self, files: Iterable[str | Path], columns: tuple[str, ...] | None = None) -> None:
        self.files = [str(f) for f in files]
        if not self.files:
            raise ConfigError("a stream of shards needs at least one shard")
        self.columns = columns
        n = len(self.files)
        self.name = self.files[0] if n == 1 else f"{self.files[0]} (+{n - 1} shards)"
        self._groups: list[np.ndarray | None] = []
        rows = []
        for f in self.files:
            if f.endswith(".parquet"):
                import pyarrow.parquet as pq

                try:
                    meta = pq.ParquetFile(f).metadata
                except (OSError, ValueError) as exc:
                    raise ConfigError(
                        f"source {f!r}: not a readable parquet shard ({str(exc)[:80]})"
                    ) from None
                g = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
                self._groups.append(np.concatenate(([0], np.cumsum(g, dtype=np.int64))))
                rows.append(int(meta.num_rows))
            elif f.endswith((".jsonl", ".json")):
                try:
                    with open(f, "rb") as fh:
                        rows.append(sum(1 for line in fh if line.strip()))
                except OSError as exc:
                    raise ConfigError(f"source {f!r}: not readable ({exc.strerror})") from None
                self._groups.append(None)
            else:
                raise ConfigError(f"source {f!r}: a shard is .parquet or .jsonl")
        if not sum(rows):
            raise ConfigError(f"source {self.name!r}: empty (a source needs at least one sample)")
        self._starts = np.concatenate(([0], np.cumsum(rows, dtype=np.int64)))
        self._jsonl: tuple[int, int, Any] | None = None  # (shard, next row, open file)

    def read(self, start: int, count: int) -> list:
        out: list = []
        pos, end = start, min(start + count, int(self._starts[-1]))
        while pos < end:
            f = int(np.searchsorted(self._starts, pos, side="right")) - 1
            local = pos - int(self._starts[f])
            stop = min(end, int(self._starts[f + 1])) - int(self._starts[f])
            out += (
                self._parquet(f, local, stop) if self._groups[f] is not None else self._lines(f, local, stop)
            )
            pos = int(self._starts[f]) + stop
        return out

    def _parquet(self, f: int, a: int, b: int) -> list:
        import pyarrow.parquet as pq

        groups = self._groups[f]
        assert groups is not None
        g0 = int(np.searchsorted(groups, a, side="right")) - 1
        g1 = int(np.searchsorted(groups, b, side="left"))
        cols = list(self.columns) if self.columns else None
        table = pq.ParquetFile(self.files[f]).read_row_groups(list(range(g0, g1)), columns=cols)
        return table.slice(a - int(groups[g0]), b - a).to_pylist()

    def _lines(self, f: int, a: int, b: int) -> list:
        if self._jsonl is None or self._jsonl[0] != f or self._jsonl[1] > a:
            if self._jsonl is not None:
                self._jsonl[2].close()
            self._jsonl = (f, 0, open(self.files[f], "rb"))  # noqa: SIM115 - kept open between reads
        _, row, fh = self._jsonl
        out = []
        for line in fh:
            if not line.strip():
                continue
            if row >= a:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    raise ConfigError(f"source {self.files[f]!r}: row {row}: not a JSON line") from None
                out.append({k: rec[k] for k in self.columns if k in rec} if self.columns else rec)
            row += 1
            if row >= b:
                break
        self._jsonl = (f, row, fh)
        return out

    def restart(self, epoch: int) -> None:
        return None  # positions are the stream's own: epoch e reads it from position 0 again

    def resume_state(self, oldest: int) -> dict:
        return {"position": int(oldest)}

    def load_resume_state(self, state: dict) -> None:
        return None
