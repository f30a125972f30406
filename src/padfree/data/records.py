"""Reading training records for tokenization: ``.jsonl`` / ``.jsonl.gz``, ``.parquet`` and Hugging Face
``datasets`` folders written by ``save_to_disk``; and the content hashes that key the token-count cache.

Records come out in chunks (:class:`Chunk`) so that tokenization can run in worker processes: a ``.jsonl``
chunk carries raw lines (the workers parse them, so JSON errors are found in parallel too), a columnar
chunk carries the already decoded values of the one column that matters.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from padfree.errors import InputError

# files of a tokenizer folder that never change what a tokenizer does (weights can be gigabytes)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")


@dataclass(frozen=True)
class Chunk:
    """Consecutive records ``first .. first + len(values) - 1`` of one source.

    Attributes:
        first: index of the first record (0-based; for ``.jsonl`` also line ``first + 1``).
        values: raw ``bytes`` lines (``.jsonl``) or decoded column values (parquet, datasets).
        column: the column the values come from (columnar sources), else ``None``.
        progress: how far through the source this chunk reaches, in the units of :func:`source_size`.
    """

    first: int
    values: list
    column: str | None
    progress: int


def source_kind(path: Path) -> str:
    """``jsonl``, ``parquet`` or ``datasets`` (a ``save_to_disk`` folder); anything else is an InputError."""
    name = path.name.lower()
    if not path.exists():
        raise InputError("file not found", path=str(path))
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "state.json").exists():
            return "datasets"
        if (path / "dataset_dict.json").exists():
            raise InputError("a DatasetDict folder: give one split's folder (e.g. DIR/train)", path=str(path))
        raise InputError("a folder, but not a `datasets` save_to_disk folder", path=str(path))
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    raise InputError(
        "unknown data format: use .jsonl, .jsonl.gz, .parquet or a datasets save_to_disk folder",
        path=str(path),
    )


def source_size(path: Path) -> int | None:
    """Progress total: bytes for ``.jsonl`` (compressed bytes for ``.gz``), rows for columnar sources."""
    kind = source_kind(path)
    if kind == "jsonl":
        return path.stat().st_size
    if kind == "parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(path).metadata.num_rows)
    return len(_load_dataset(path))


def columns_of(path: Path) -> list[str] | None:
    """Column names of a columnar source (``None`` for ``.jsonl``, whose records may differ)."""
    kind = source_kind(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        return list(pq.ParquetFile(path).schema_arrow.names)
    if kind == "datasets":
        return list(_load_dataset(path).column_names)
    return None


def iter_chunks(path: Path, column: str | None, size: int = 512) -> Iterator[Chunk]:
    """Chunks of ``size`` records. ``column`` picks the column of a columnar source (ignored for .jsonl)."""
    kind = source_kind(path)
    if kind == "jsonl":
        yield from _jsonl_chunks(path, size)
    elif kind == "parquet":
        yield from _parquet_chunks(path, column, size)
    else:
        yield from _datasets_chunks(path, column, size)


def _jsonl_chunks(path: Path, size: int) -> Iterator[Chunk]:
    with path.open("rb") as raw:
        stream = gzip.GzipFile(fileobj=raw) if path.name.lower().endswith(".gz") else raw
        lines: list[bytes] = []
        first = 0
        try:
            for line in stream:
                lines.append(line)
                if len(lines) == size:
                    yield Chunk(first, lines, None, raw.tell())
                    first += size
                    lines = []
        except (OSError, EOFError) as exc:  # damaged gzip stream
            raise InputError(
                f"cannot read the file near line {first + len(lines) + 1} ({exc})", path=str(path)
            ) from None
        if lines:
            yield Chunk(first, lines, None, raw.tell())


def _parquet_chunks(path: Path, column: str | None, size: int) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises many types for damaged files
        raise InputError(f"not a readable parquet file ({exc})", path=str(path)) from None
    if column not in f.schema_arrow.names:
        raise InputError(f"missing column {column!r}", path=str(path))
    first = 0
    for batch in f.iter_batches(batch_size=size, columns=[column]):
        values = batch.column(0).to_pylist()
        yield Chunk(first, values, column, first + len(values))
        first += len(values)


def _load_dataset(path: Path):  # -> datasets.Dataset
    try:
        import datasets
    except ImportError:  # pragma: no cover
        raise InputError("reading a datasets folder needs `datasets`: pip install 'padfree[hf]'") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises FileNotFoundError, ValueError, ... for foreign folders
        first = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise InputError(f"not a readable datasets folder ({first})", path=str(path)) from None
    if isinstance(ds, datasets.DatasetDict):
        raise InputError("a DatasetDict folder: give one split's folder (e.g. DIR/train)", path=str(path))
    return ds


def _datasets_chunks(path: Path, column: str | None, size: int) -> Iterator[Chunk]:
    ds = _load_dataset(path)
    if column not in ds.column_names:
        raise InputError(f"missing column {column!r}", path=str(path))
    ds = ds.select_columns([column])
    first = 0
    for batch in ds.iter(batch_size=size):
        values = batch[column]
        yield Chunk(first, values, column, first + len(values))
        first += len(values)


def content_hash(path: str | Path, skip_weights: bool = False) -> str:
    """sha256 of a file's bytes, or of a folder's files (relative names and bytes, in sorted order).

    ``skip_weights`` leaves model weight files out (for tokenizer folders that sit beside a model).

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp(); p = os.path.join(d, "a.txt"); _ = open(p, "w").write("x")
    >>> content_hash(p) == hashlib.sha256(b"x").hexdigest()
    True
    """
    p = Path(path)
    if p.is_file():
        return _file_hash(p).hexdigest()
    h = hashlib.sha256()
    for f in sorted(q for q in p.rglob("*") if q.is_file()):
        rel = f.relative_to(p).as_posix()
        if skip_weights and rel.lower().endswith(_WEIGHT_SUFFIXES):
            continue
        h.update(json.dumps(rel).encode() + b"\0" + _file_hash(f).digest())
    return h.hexdigest()


def _file_hash(p: Path) -> hashlib._Hash:
    h = hashlib.sha256()
    with p.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h
