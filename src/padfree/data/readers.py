"""Lengths others wrote: per-sample token counts read from already tokenized data, without tokenizing again.

Four formats, each picked by what the path is (:func:`tokenized_kind`):

* ``datasets`` folders (``save_to_disk``) and parquet files with a ``seq_len`` column (integers) or an
  ``input_ids`` column (lists of token ids): speculators, SpecForge and most SFT stacks keep one of them.
  Loss-bearing counts come from a ``loss_mask`` column (lists of 0/1) or a ``labels`` column (lists, -100
  where no loss, unshifted) when the data holds one;
* Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``, ``MMIDIDX`` version 1): the ``.idx`` holds
  every sequence's length. It holds no loss mask (Megatron builds it at training time);
* datatrove tokenized shards (``NAME.ds`` + ``NAME.ds.index``, a folder of them): the index holds every
  document's end in tokens; an optional ``NAME.ds.loss`` holds one byte per token (1: loss).

Loss-bearing counts are label positions after a sample's first token (nothing predicts it), the count
``padfree lengths`` writes to ``OUT.assistant.npy`` and the collators derive. Where a format holds no loss
mask, :attr:`TokenizedLengths.loss_tokens` is ``None`` and :attr:`TokenizedLengths.note` says so.

>>> import tempfile, os, pyarrow as pa, pyarrow.parquet as pq
>>> p = os.path.join(tempfile.mkdtemp(), "ids.parquet")
>>> pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4, 5]], "loss_mask": [[0, 1, 1], [0, 0]]}), p)
>>> r = read_tokenized([p])
>>> r.lengths.tolist(), r.loss_tokens.tolist(), r.fmt
([3, 2], [2, 0], 'parquet')
"""

from __future__ import annotations

import glob
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from padfree.errors import InputError

__all__ = ["TokenizedLengths", "read_tokenized", "tokenized_kind", "tokenized_sources"]

LENGTH_COLUMNS = ("seq_len", "input_ids")
"""Columns read as lengths, in order of preference: an integer per sample, or a list of token ids."""
LOSS_COLUMNS = ("loss_mask", "labels")
"""Columns read as loss masks: lists of 0/1, or lists of labels with -100 where no loss."""
IGNORE = -100
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
_MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                    7: np.float32, 8: np.uint16}  # fmt: skip


@dataclass(frozen=True)
class TokenizedLengths:
    """Lengths read from tokenized data (its sources concatenated in order).

    Attributes:
        lengths: tokens per sample (int64).
        loss_tokens: loss-bearing label positions per sample (int64), ``None`` when the format holds none.
        fmt: ``datasets``, ``parquet``, ``megatron`` or ``datatrove`` (the first source's, when mixed).
        sources: ``(source, rows)`` of every source, in order.
        note: how the loss-bearing counts were found, or why there are none.
    """

    lengths: np.ndarray
    loss_tokens: np.ndarray | None
    fmt: str
    sources: tuple[tuple[str, int], ...]
    note: str


@dataclass(frozen=True)
class _Part:
    lengths: np.ndarray
    loss: np.ndarray | None
    note: str


def tokenized_kind(path: str | Path, split: str | None = None) -> str | None:
    """``megatron``, ``datatrove``, ``datasets`` or ``parquet`` when ``path`` is tokenized data of that
    format, else ``None`` (raw records, or no such path)."""
    p = Path(path)
    name = p.name
    if name.endswith((".ds", ".ds.index")) or (p.is_dir() and any(p.glob("*.ds.index"))):
        return "datatrove"
    if name.endswith((".idx", ".bin")) or (not p.exists() and p.with_name(name + ".idx").is_file()):
        return "megatron"
    if name.lower().endswith(".parquet") and p.is_file():
        return "parquet" if _parquet_column(p) is not None else None
    if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()):
        return "datasets" if _datasets_column(p, split, probe=True) is not None else None
    return None


def tokenized_sources(specs: Sequence[str | Path], split: str | None = None) -> list[tuple[Path, str]]:
    """Every spec (files, globs, datatrove folders) as ``(path, format)``, or ``[]`` when none is tokenized
    data. A mix of tokenized and raw sources is one :class:`InputError` (count them in two calls)."""
    found: list[tuple[Path, str | None]] = []
    for spec in specs:
        s = str(spec)
        paths = [Path(m) for m in sorted(glob.glob(s))] if not Path(s).exists() and glob.has_magic(s) else []
        for p in paths or [Path(s)]:
            kind = tokenized_kind(p, split)
            if kind == "datatrove" and p.is_dir():
                found += [(q, kind) for q in sorted(p.glob("*.ds.index"))]
            else:
                found.append((p, kind))
    kinds = {k is not None for _, k in found}
    if kinds == {True, False}:
        raw = next(str(p) for p, k in found if k is None)
        tok = next(str(p) for p, k in found if k is not None)
        raise InputError(
            f"raw records mixed with token ids ({tok}): count the records and read the token ids in two "
            "calls, or pass --tokenize to tokenize every source",
            path=raw,
        )
    return [(p, k) for p, k in found if k is not None]


def read_tokenized(
    specs: Sequence[str | Path], column: str | None = None, split: str | None = None
) -> TokenizedLengths:
    """Lengths (and loss-bearing counts where held) of tokenized sources, concatenated in order.

    ``column``: the lengths column of ``datasets``/parquet sources (default: ``seq_len``, else
    ``input_ids``). Every problem is one :class:`InputError` naming the file, the sample and the rule.
    """
    srcs = tokenized_sources(specs, split)
    if not srcs:
        raise InputError(
            "no tokenized data (a datasets folder or parquet file with a seq_len or input_ids column, a "
            "Megatron .bin/.idx, a datatrove .ds/.ds.index)",
            path=", ".join(map(str, specs)),
        )
    parts: list[_Part] = []
    for p, kind in srcs:
        if kind == "megatron":
            parts.append(_megatron(p))
        elif kind == "datatrove":
            parts.append(_datatrove(p))
        elif kind == "parquet":
            parts.append(_parquet(p, column))
        else:
            parts.append(_datasets(p, column, split))
    lengths = np.concatenate([q.lengths for q in parts]).astype(np.int64)
    names = tuple((str(p), int(q.lengths.shape[0])) for (p, _), q in zip(srcs, parts, strict=True))
    missing = [str(p) for (p, _), q in zip(srcs, parts, strict=True) if q.loss is None]
    if missing:
        note = next(q.note for q in parts if q.loss is None)
        if len(missing) < len(parts):
            note = f"{missing[0]}: {note} (so none are written for any source)"
        return TokenizedLengths(lengths, None, srcs[0][1], names, note)
    loss = np.concatenate([q.loss for q in parts if q.loss is not None]).astype(np.int64)
    notes = sorted({q.note for q in parts})
    return TokenizedLengths(lengths, loss, srcs[0][1], names, "; ".join(notes))


# --- Arrow columns: datasets folders and parquet files -------------------------------------------------


def _parquet_column(p: Path, column: str | None = None) -> str | None:
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(p).names
    except Exception as exc:  # pyarrow raises many types for damaged files
        raise InputError(f"not a readable parquet file ({_short(exc)})", path=str(p)) from None
    return _pick(names, column)


def _pick(names: Sequence[str], column: str | None) -> str | None:
    if column is not None:
        return column if column in names else None
    return next((c for c in LENGTH_COLUMNS if c in names), None)


def _load(p: Path, split: str | None):  # -> datasets.Dataset
    from padfree.data.records import _load_dataset, _source

    return _load_dataset(_source(p, split))


def _datasets_column(
    p: Path, split: str | None, column: str | None = None, probe: bool = False
) -> str | None:
    if probe and (p / "dataset_dict.json").exists() and split is None:
        try:  # the column names of any split decide the kind; reading needs --split
            info = json.loads((p / "dataset_dict.json").read_text())
            first = Path(p) / str(info["splits"][0])
            return _datasets_column(first, None, column)
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return None
    if probe and (p / "dataset_info.json").exists():
        try:
            feats = json.loads((p / "dataset_info.json").read_text()).get("features") or {}
            return _pick(list(feats), column)
        except (OSError, ValueError, AttributeError):
            return None
    return _pick(_load(p, split).column_names, column)


def _datasets(p: Path, column: str | None, split: str | None) -> _Part:
    ds = _load(p, split)
    name = _pick(ds.column_names, column)
    where = f"{p}[{split}]" if split else str(p)
    if name is None:
        raise InputError(f"no column {column or ' or '.join(LENGTH_COLUMNS)!r} "
                         f"(columns: {', '.join(ds.column_names[:12])})", path=where)  # fmt: skip
    table = ds.data.table
    if getattr(ds, "_indices", None) is not None:  # a selection not yet flattened
        table = table.take(ds._indices.column(0))
    return _arrow(table, name, where)


def _parquet(p: Path, column: str | None) -> _Part:
    import pyarrow.parquet as pq

    name = _parquet_column(p, column)
    if name is None:
        raise InputError(f"no column {column!r}", path=str(p))
    names = pq.read_schema(p).names
    cols = [name, *(c for c in LOSS_COLUMNS if c in names and c != name)]
    try:
        table = pq.read_table(p, columns=cols, use_threads=False, pre_buffer=False)
    except Exception as exc:
        raise InputError(f"not a readable parquet file ({_short(exc)})", path=str(p)) from None
    return _arrow(table, name, str(p))


def _arrow(table, name: str, where: str) -> _Part:
    """Lengths from column ``name`` (integers, or lists of ids), loss counts from a loss column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = table.column(name)
    if col.null_count:
        i = int(np.argmax(pc.is_null(col).to_numpy(zero_copy_only=False)))
        raise InputError(f"column {name!r} has a missing value", path=where, sample=i)
    kind = col.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
    elif pa.types.is_integer(kind):
        lengths = col.to_numpy().astype(np.int64)
    else:
        raise InputError(f"column {name!r} must hold integers or lists of token ids (got type {kind})",
                         path=where)  # fmt: skip
    loss_col = next((c for c in LOSS_COLUMNS if c in table.column_names and c != name), None)
    if loss_col is None:
        held = ", ".join(LOSS_COLUMNS)
        return _Part(lengths, None, f"no loss mask held (no {held} column): no loss-bearing counts")
    mask_col = table.column(loss_col)
    if not (pa.types.is_list(mask_col.type) or pa.types.is_large_list(mask_col.type)):
        raise InputError(f"column {loss_col!r} must hold a list per sample (got type {mask_col.type})",
                         path=where)  # fmt: skip
    sizes = pc.list_value_length(mask_col).to_numpy(zero_copy_only=False)
    sizes = np.where(np.isnan(sizes.astype(np.float64)), -1, sizes).astype(np.int64)
    bad = sizes != lengths
    if bad.any():
        i = int(np.argmax(bad))
        raise InputError(
            f"column {loss_col!r} holds {int(sizes[i])} values for {int(lengths[i])} tokens",
            path=where,
            sample=i,
        )
    flat = pc.list_flatten(mask_col).to_numpy(zero_copy_only=False)
    mask = (flat != IGNORE) if loss_col == "labels" else flat.astype(bool)
    how = "labels != -100" if loss_col == "labels" else "loss_mask"
    return _Part(
        lengths, _loss_counts(mask, lengths), f"loss-bearing counts from column {loss_col!r} ({how})"
    )


def _loss_counts(mask: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Masked tokens after each sample's first one (``mask``: the samples' flags, concatenated)."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    cs = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    a, b = offsets[:-1], offsets[1:]
    if not mask.shape[0]:
        return np.zeros(lengths.shape[0], np.int64)
    first = np.where(b > a, mask[np.minimum(a, mask.shape[0] - 1)], False)
    return cs[b] - cs[a] - first.astype(np.int64)


# --- Megatron indexed datasets ------------------------------------------------------------------------


def _megatron(p: Path) -> _Part:
    """``PREFIX.idx``: magic, version 1, dtype code, sequence count, document count, then the int32 sequence
    lengths (Megatron-LM ``megatron/core/datasets/indexed_dataset.py``)."""
    name = p.name
    idx = p.with_name(name[:-4] + ".idx") if name.endswith((".idx", ".bin")) else p.with_name(name + ".idx")
    if not idx.is_file():
        raise InputError("a Megatron indexed dataset needs its .idx file beside the .bin", path=str(idx))
    try:
        with idx.open("rb") as f:
            head = f.read(9 + 8 + 1 + 8 + 8)
            if len(head) < 34 or head[:9] != MEGATRON_MAGIC:
                raise InputError("not a Megatron .idx file (it does not start with MMIDIDX)", path=str(idx))
            (version,) = struct.unpack("<Q", head[9:17])
            if version != 1:
                raise InputError(f"Megatron .idx version {version} (padfree reads version 1)", path=str(idx))
            code = head[17]
            (count,) = struct.unpack("<Q", head[18:26])
            raw = f.read(4 * count)
    except OSError as exc:
        raise InputError(f"cannot read the file ({exc.strerror or exc})", path=str(idx)) from None
    if code not in _MEGATRON_DTYPES:
        raise InputError(f"unknown Megatron token dtype code {code}", path=str(idx))
    if len(raw) < 4 * count:
        raise InputError(
            f"truncated .idx: {count} sequence lengths promised, {len(raw) // 4} held", path=str(idx)
        )
    lengths = np.frombuffer(raw, dtype="<i4").astype(np.int64)
    bad = lengths < 0
    if bad.any():
        i = int(np.argmax(bad))
        raise InputError(f"negative sequence length {int(lengths[i])}", path=str(idx), sample=i)
    note = "a Megatron indexed dataset holds no loss mask (Megatron builds it at training time)"
    return _Part(lengths, None, note + ": no loss-bearing counts")


# --- datatrove tokenized shards -----------------------------------------------------------------------


def _datatrove(p: Path) -> _Part:
    """``NAME.ds.index``: little-endian uint64 document ends, in tokens; ``NAME.ds.loss``: a byte a token."""
    base = str(p)[: -len(".index")] if str(p).endswith(".ds.index") else str(p)
    index = Path(base + ".index")
    if not index.is_file():
        raise InputError(
            "a datatrove shard needs its .ds.index (written with save_index=True)", path=str(index)
        )
    try:
        ends = np.fromfile(index, dtype="<u8").astype(np.int64)
    except OSError as exc:
        raise InputError(f"cannot read the file ({exc.strerror or exc})", path=str(index)) from None
    if index.stat().st_size % 8:
        raise InputError("not a datatrove index (its size is not a multiple of 8 bytes)", path=str(index))
    lengths = np.diff(np.concatenate([[0], ends]))
    bad = lengths < 0
    if bad.any():
        i = int(np.argmax(bad))
        raise InputError("document ends go backwards", path=str(index), sample=i)
    loss = Path(base + ".loss")
    if not loss.is_file():
        return _Part(lengths, None, "a datatrove shard without a .ds.loss file holds no loss mask: no "
                     "loss-bearing counts")  # fmt: skip
    mask = np.fromfile(loss, dtype=np.uint8).astype(bool)
    total = int(ends[-1]) if ends.shape[0] else 0
    if mask.shape[0] != total:
        raise InputError(f"{mask.shape[0]} loss flags for {total} tokens", path=str(loss))
    return _Part(lengths, _loss_counts(mask, lengths), "loss-bearing counts from the .ds.loss files")


def _short(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
