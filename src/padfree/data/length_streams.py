"""Length streams read from files for streamed plans (:mod:`padfree.core.lookahead`): parquet shards."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from padfree.errors import ConfigError

__all__ = ["ParquetLengths"]


class ParquetLengths:
    """A stream over a length column of parquet shards read in order: seekable (each shard's row count comes
    from its footer; a read opens only the row groups it needs). Needs ``pyarrow`` (the ``io`` extra)."""

    def __init__(self, files: Iterable[str], column: str = "length") -> None:
        import pyarrow.parquet as pq

        self.files = [str(f) for f in files]
        if not self.files:
            raise ConfigError("a parquet stream needs at least one shard")
        self.column = column
        self.name = (
            self.files[0] if len(self.files) == 1 else f"{self.files[0]} (+{len(self.files) - 1} shards)"
        )
        self._meta = []
        for f in self.files:
            try:
                meta = pq.ParquetFile(f).metadata
            except (OSError, ValueError) as exc:
                raise ConfigError(f"source {f!r}: not a readable parquet shard ({str(exc)[:80]})") from None
            rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            self._meta.append(np.concatenate(([0], np.cumsum(rows, dtype=np.int64))))
        self._starts = np.concatenate(([0], np.cumsum([m[-1] for m in self._meta])))

    def read(self, start: int, count: int) -> np.ndarray:
        import pyarrow.parquet as pq

        out: list[np.ndarray] = []
        pos, end = start, min(start + count, int(self._starts[-1]))
        while pos < end:
            f = int(np.searchsorted(self._starts, pos, side="right")) - 1
            local, stop = (
                pos - int(self._starts[f]),
                min(end, int(self._starts[f + 1])) - int(self._starts[f]),
            )
            groups = self._meta[f]
            g0 = int(np.searchsorted(groups, local, side="right")) - 1
            g1 = int(np.searchsorted(groups, stop, side="left"))
            table = pq.ParquetFile(self.files[f]).read_row_groups(list(range(g0, g1)), columns=[self.column])
            col = table.column(self.column).to_numpy()
            out.append(np.asarray(col[local - int(groups[g0]) : stop - int(groups[g0])], dtype=np.int64))
            pos = int(self._starts[f]) + stop
        return np.concatenate(out) if out else np.zeros(0, np.int64)
