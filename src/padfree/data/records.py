"""Reading training records: ``.jsonl`` / ``.jsonl.gz``, ``.json`` / ``.json.gz``, ``.parquet`` and Hugging
Face ``datasets`` folders written by ``save_to_disk`` (a ``DatasetDict`` with a split); several files, globs
and folders in one call; and the content hashes that key the token-count cache.

A ``.json`` file is read by what it holds, not by its name: one JSON array of records (the original Alpaca
release) or JSON lines (many ``.jsonl`` files are named ``.json``), told apart by its first character. Blank
lines at the end of a JSON-lines file are ignored; one between records is an error naming its line.

Records come out in chunks (:class:`Chunk`) so that tokenization can run in worker processes: a ``.jsonl``
chunk carries raw lines (the workers parse them, so JSON errors are found in parallel too), a columnar
chunk carries rows (dicts of the columns its format reads).

JSON text with a lone UTF-16 surrogate (``"\\ud83d"``: half an emoji, common in scraped text) cannot be
encoded by any tokenizer; :func:`parse_line` replaces each lone surrogate by U+FFFD and says so.
"""

from __future__ import annotations

import functools
import glob
import gzip
import hashlib
import json
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from padfree.data.formats import RecordError
from padfree.errors import InputError

SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
# files of a tokenizer folder that never change what a tokenizer does (weights can be gigabytes)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF][0-9a-fA-F]{2}")
_LONE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Source:
    """One file or ``datasets`` folder (``split``: the split of a DatasetDict folder)."""

    path: Path
    kind: str  # "jsonl", "json" (one JSON array), "parquet" or "datasets"
    split: str | None = None

    @property
    def name(self) -> str:
        return str(self.path) if self.split is None else f"{self.path}[{self.split}]"


@dataclass(frozen=True)
class Chunk:
    """Consecutive records ``first .. first + len(values) - 1`` of one source.

    Attributes:
        first: index of the first record in its source (0-based; for ``.jsonl`` also line ``first + 1``).
        values: raw ``bytes`` lines (``.jsonl``) or records (a ``.json`` array's; row dicts of parquet and
            datasets).
        progress: how far through the source this chunk reaches, in the units of :func:`source_size`.
    """

    first: int
    values: list
    progress: int


def resolve_sources(specs: str | Path | Sequence[str | Path], split: str | None = None) -> list[Source]:
    """Files, globs and folders, in the order given (a glob's or a folder's files sorted by name).

    A folder is a ``datasets`` folder when it holds one, else the ``.jsonl``, ``.jsonl.gz`` and
    ``.parquet`` files directly in it. ``split`` picks the split of every DatasetDict folder.
    """
    if isinstance(specs, (str, Path)):
        specs = [specs]
    out: list[Source] = []
    for spec in specs:
        p = Path(spec)
        if not p.exists() and glob.has_magic(str(spec)):
            matches = sorted(glob.glob(str(spec)))
            if not matches:
                raise InputError("no files match this pattern", path=str(spec))
            out += [_source(Path(m), split) for m in matches]
        elif p.is_dir() and _datasets_folder(p) is None:
            files = sorted(q for q in p.iterdir() if q.is_file() and q.name.lower().endswith(SUFFIXES))
            if not files:
                raise InputError(
                    "a folder with no .jsonl, .jsonl.gz or .parquet files in it (nor a datasets folder)",
                    path=str(p),
                )
            out += [_source(q, split) for q in files]
        else:
            out.append(_source(p, split))
    if not out:
        raise InputError("no data given")
    return out


def _datasets_folder(p: Path) -> str | None:
    if (p / "dataset_dict.json").exists():
        return "dict"
    if (p / "dataset_info.json").exists() or (p / "state.json").exists():
        return "dataset"
    return None


def _source(path: Path, split: str | None) -> Source:
    name = path.name.lower()
    if not path.exists():
        raise InputError("file not found", path=str(path))
    if path.is_dir():
        kind = _datasets_folder(path)
        if kind == "dict":
            splits = _splits(path)
            if split is None:
                raise InputError(
                    f"a DatasetDict folder: choose a split with --split ({', '.join(splits)})", path=str(path)
                )
            if split not in splits:
                raise InputError(f"no split {split!r} (splits: {', '.join(splits)})", path=str(path))
            return Source(path, "datasets", split)
        if kind == "dataset":
            return Source(path, "datasets")
        raise InputError("a folder, but not a `datasets` save_to_disk folder", path=str(path))
    if not path.is_file():
        raise InputError("not a regular file (a pipe, socket or device cannot be read)", path=str(path))
    if name.endswith((".jsonl", ".jsonl.gz")):
        return Source(path, "jsonl")
    if name.endswith((".json", ".json.gz")):
        return Source(path, _json_kind(path))
    if name.endswith(".parquet"):
        return Source(path, "parquet")
    raise InputError(
        "unknown data format: use .jsonl, .jsonl.gz, .json, .parquet or a datasets save_to_disk folder",
        path=str(path),
    )


def _json_kind(path: Path) -> str:
    """``"json"`` for a ``.json`` file holding one JSON array, ``"jsonl"`` for JSON lines (by the first
    character)."""
    try:
        with path.open("rb") as raw:
            stream = gzip.GzipFile(fileobj=raw) if path.name.lower().endswith(".gz") else raw
            head = stream.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    except (OSError, EOFError, zlib.error) as exc:
        raise InputError(f"cannot read the file ({_short(exc)})", path=str(path)) from None
    if head[:1] == b"[":
        return "json"
    if head[:1] in (b"{", b""):
        return "jsonl"
    raise InputError(
        "a .json file must hold one JSON array of records or one JSON object per line "
        f"(it starts with {head[:20]!r})",
        path=str(path),
    )


def _json_array(path: Path) -> list:
    """The records of a ``.json`` file holding one JSON array."""
    try:
        with path.open("rb") as raw:
            stream = gzip.GzipFile(fileobj=raw) if path.name.lower().endswith(".gz") else raw
            value = json.loads(stream.read().lstrip(b"\xef\xbb\xbf"))
    except (OSError, EOFError, zlib.error) as exc:
        raise InputError(f"cannot read the file ({_short(exc)})", path=str(path)) from None
    except (ValueError, RecursionError) as exc:
        raise InputError(f"malformed JSON ({_short(exc)[:100]})", path=str(path)) from None
    if not isinstance(value, list):
        raise InputError(f"a JSON {type(value).__name__}, not an array of records", path=str(path))
    return value


def _splits(path: Path) -> list[str]:
    try:
        return [str(s) for s in json.loads((path / "dataset_dict.json").read_text())["splits"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"unreadable dataset_dict.json ({_short(exc)})", path=str(path)) from None


def source_size(src: Source) -> int:
    """Progress total: bytes for ``.jsonl`` and ``.json`` (compressed bytes for ``.gz``), rows for columnar
    sources."""
    if src.kind in ("jsonl", "json"):
        return src.path.stat().st_size
    if src.kind == "parquet":
        return int(_parquet(src).metadata.num_rows)
    return len(_load_dataset(src))


def columns_of(src: Source) -> list[str] | None:
    """Column names of a columnar source (``None`` for ``.jsonl``, whose records may differ)."""
    if src.kind == "parquet":
        return list(_parquet(src).schema_arrow.names)
    if src.kind == "datasets":
        return list(_load_dataset(src).column_names)
    return None


def first_record(src: Source) -> object:
    """The first record of a ``.jsonl`` or ``.json`` source (``None`` when it has none); RecordError when
    malformed."""
    if src.kind == "json":
        rows = _json_array(src.path)
        return rows[0] if rows else None
    for chunk in _jsonl_chunks(src.path, 1):
        return parse_line(chunk.values[0])[0]
    return None


def parse_line(raw: bytes) -> tuple[object, bool]:
    """One ``.jsonl`` line -> ``(value, lone surrogates replaced)``; RecordError when it is not JSON."""
    if raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark (files saved by some editors)
        raw = raw[3:]
    if not raw.strip():
        raise RecordError("empty line (one JSON object per line expected)")
    try:
        rec = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, too deep
        raise RecordError(f"malformed JSON ({_short(exc)[:100]})") from None
    if _SURROGATE_ESCAPE.search(raw):
        fixed = _replace_lone(rec)
        return fixed, fixed != rec
    return rec, False


def _replace_lone(v: object) -> object:
    if isinstance(v, str):
        return _LONE.sub("\ufffd", v)
    if isinstance(v, list):
        return [_replace_lone(x) for x in v]
    if isinstance(v, dict):
        return {_replace_lone(k): _replace_lone(x) for k, x in v.items()}
    return v


def iter_chunks(src: Source, columns: list[str] | None, size: int = 512) -> Iterator[Chunk]:
    """Chunks of ``size`` records; ``columns``: what a columnar source's rows carry (ignored for .jsonl)."""
    if src.kind == "jsonl":
        yield from _jsonl_chunks(src.path, size)
    elif src.kind == "json":
        rows, total = _json_array(src.path), src.path.stat().st_size
        for a in range(0, len(rows), size):
            yield Chunk(a, rows[a : a + size], total * min(len(rows), a + size) // max(len(rows), 1))
    elif src.kind == "parquet":
        yield from _parquet_chunks(src, columns or [], size)
    else:
        yield from _datasets_chunks(src, columns or [], size)


def _jsonl_chunks(path: Path, size: int) -> Iterator[Chunk]:
    lines: list[bytes] = []
    first = 0
    try:
        with path.open("rb") as raw:
            stream = gzip.GzipFile(fileobj=raw) if path.name.lower().endswith(".gz") else raw
            blank: list[bytes] = []  # blank lines not yet followed by a record: dropped at the end
            for line in stream:
                if not line.strip():
                    blank.append(line)
                    continue
                for held in (*blank, line):
                    lines.append(held)
                    if len(lines) == size:
                        yield Chunk(first, lines, raw.tell())
                        first += size
                        lines = []
                blank = []
            if lines:
                yield Chunk(first, lines, raw.tell())
    except (OSError, EOFError, zlib.error) as exc:  # damaged gzip stream, I/O error
        raise InputError(
            f"cannot read the file near line {first + len(lines) + 1} ({_short(exc)})", path=str(path)
        ) from None


def _parquet(src: Source):  # -> pyarrow.parquet.ParquetFile
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(src.path)
    except Exception as exc:  # pyarrow raises many types for damaged files
        raise InputError(f"not a readable parquet file ({_short(exc)})", path=str(src.path)) from None


def _parquet_chunks(src: Source, columns: list[str], size: int) -> Iterator[Chunk]:
    f = _parquet(src)
    missing = [c for c in columns if c not in f.schema_arrow.names]
    if missing:
        raise InputError(f"missing column {missing[0]!r}", path=str(src.path))
    first = 0
    batches = f.iter_batches(batch_size=size, columns=columns)
    while True:
        try:
            batch = next(batches, None)
            rows = None if batch is None else batch.to_pylist()
        except Exception as exc:  # truncated or corrupt pages: pyarrow's OSError, ArrowInvalid, ...
            raise InputError(
                f"cannot read the parquet data near record {first} ({_short(exc)})", path=str(src.path)
            ) from None
        if rows is None:
            return
        yield Chunk(first, rows, first + len(rows))
        first += len(rows)


@functools.lru_cache(maxsize=8)
def _load_dataset(src: Source):  # -> datasets.Dataset
    try:
        import datasets
    except ImportError:  # pragma: no cover
        raise InputError("reading a datasets folder needs `datasets`: pip install 'padfree[hf]'") from None
    try:
        ds = datasets.load_from_disk(str(src.path))
        if src.split is not None:
            ds = ds[src.split]
    except Exception as exc:  # datasets raises FileNotFoundError, ValueError, ... for foreign folders
        raise InputError(f"not a readable datasets folder ({_short(exc)})", path=src.name) from None
    if isinstance(ds, datasets.DatasetDict):
        raise InputError(
            f"a DatasetDict folder: choose a split with --split ({', '.join(ds)})", path=str(src.path)
        )
    return ds


def _datasets_chunks(src: Source, columns: list[str], size: int) -> Iterator[Chunk]:
    ds = _load_dataset(src)
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise InputError(f"missing column {missing[0]!r}", path=src.name)
    first = 0
    for batch in ds.select_columns(columns).iter(batch_size=size):
        rows = [
            dict(zip(columns, vals, strict=True)) for vals in zip(*(batch[c] for c in columns), strict=True)
        ]
        yield Chunk(first, rows, first + len(rows))
        first += len(rows)


def source_hash(src: Source) -> str:
    """sha256 naming a source's content (and its split)."""
    h = content_hash(src.path)
    return h if src.split is None else hashlib.sha256(f"{h}:{src.split}".encode()).hexdigest()


def _short(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__


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
