"""Counting token lengths on Ray, past one machine, by padfree's one tokenization rule.

* :func:`count_records` counts a batch of records (a Ray Data batch: a ``pyarrow.Table``, a pandas
  ``DataFrame``, a dict of columns, or a list of records) with :func:`padfree.data.tokenization.encode_chunk`,
  the function ``padfree lengths`` and training tokenize with; :class:`CountBatch` is the same as a
  ``map_batches`` stage (its tokenizer loaded once per actor)::

      ds.map_batches(CountBatch, fn_constructor_kwargs={"tokenizer": "tok.json"}, batch_format="pyarrow",
                     concurrency=8)   # -> columns "length", "loss_tokens", in the batch's row order

* :func:`count_on_ray` (``padfree lengths --ray [ADDRESS]``) cuts every source into row ranges, counts each
  range in a Ray Data stage that reads its own rows (jsonl, parquet, ``datasets`` folders: the paths must be
  readable where the workers run), writes one shard per range and a ``manifest.json`` (rule version,
  tokenizer hash, options, sources with their hashes and row counts, every shard's range and sha256);
* :func:`merge_shards` verifies the manifest (the rule version and the tokenizer it is asked for, the
  ranges covering every source once, each shard's bytes) and concatenates the shards in source order. A
  manifest of another tokenizer or rule is refused in one line.

Ray is an optional extra (``pip install 'padfree[ray]'``); without it, or with an address no cluster
answers at, the call is one :class:`~padfree.errors.ConfigError` line.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from padfree.data import formats, records
from padfree.data.reading import Reading, field_map, readings
from padfree.data.tokenization import (
    RULE_VERSION,
    Tokenizer,
    encode_chunk,
    raise_record_error,
    tokenizer_kind,
)
from padfree.errors import ConfigError, InputError

__all__ = ["CountBatch", "RayCount", "count_on_ray", "count_records", "merge_shards"]

MANIFEST = "manifest.json"
SHARDS_FORMAT = "padfree-lengths-shards/1"


# --- one batch of records ------------------------------------------------------------------------------


def count_records(
    batch: Any,
    tokenizer: str | Path | Tokenizer,
    *,
    mode: str = "auto",
    fields: Mapping[str, str] | None = None,
    chat_template: bool = False,
) -> dict[str, np.ndarray]:
    """Token counts of a batch of records by padfree's rule: ``{"length", "loss_tokens"}`` (int64, in the
    batch's order). ``mode``: the record format (``auto``: detected from the batch's columns / first
    record). A record that breaks the format is an :class:`InputError` naming its place in the batch."""
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer, chat_template)
    names = field_map(mode, None, fields)
    rows = _rows_of(batch)
    if not rows:
        z = np.zeros(0, np.int64)
        return {"length": z, "loss_tokens": z.copy()}
    fmt = mode
    if mode == "auto":
        first = rows[0]
        found = formats.detect(list(first) if isinstance(first, dict) else first, names)
        if found is None:
            keys = ", ".join(list(first)[:12]) if isinstance(first, dict) else type(first).__name__
            raise InputError(f"the batch matches no record format (columns: {keys}); pass mode=")
        fmt = found
    res = encode_chunk(tok, rows, False, fmt, names)
    if res.error is not None or res.encoded is None:
        assert res.error is not None
        raise InputError(res.error[1], path="batch", sample=res.error[0])
    return {"length": res.encoded.lengths.astype(np.int64), "loss_tokens": res.encoded.loss_tokens}


class CountBatch:
    """:func:`count_records` as a Ray Data ``map_batches`` stage (a callable class: one tokenizer per
    actor). Returns the batch's ``length`` and ``loss_tokens`` columns."""

    def __init__(
        self,
        tokenizer: str | Path,
        mode: str = "auto",
        fields: Mapping[str, str] | None = None,
        chat_template: bool = False,
    ) -> None:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the actors are the parallelism
        self.tok = Tokenizer(tokenizer, chat_template)
        self.mode, self.fields = mode, dict(fields or {})

    def __call__(self, batch: Any) -> dict[str, np.ndarray]:
        return count_records(batch, self.tok, mode=self.mode, fields=self.fields)


def _rows_of(batch: Any) -> list:
    """A Ray Data batch as a list of plain records (dicts of Python values)."""
    if isinstance(batch, list):
        return batch
    if hasattr(batch, "to_pylist"):  # pyarrow.Table / RecordBatch
        return list(batch.to_pylist())
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas.DataFrame
        return [{k: _plain(v) for k, v in r.items()} for r in batch.to_dict("records")]
    if isinstance(batch, Mapping):
        cols = list(batch)
        n = len(batch[cols[0]]) if cols else 0
        return [{c: _plain(batch[c][i]) for c in cols} for i in range(n)]
    raise ConfigError(
        f"a batch of records must be a pyarrow Table, a DataFrame, a dict or a list (got {batch!r:.60})"
    )


def _plain(v: Any) -> Any:
    """numpy values (Ray's numpy batches hold nested object arrays) as Python lists and scalars."""
    if isinstance(v, np.ndarray):
        return [_plain(x) for x in v.tolist()] if v.dtype == object else v.tolist()
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, np.generic):
        return v.item()
    return v


# --- row ranges of the sources, counted on Ray ---------------------------------------------------------


@dataclass(frozen=True)
class RayCount:
    """What :func:`count_on_ray` returns: the merged counts and where its shards are.

    Attributes:
        lengths, loss_tokens: per sample (int64), the sources concatenated in order.
        shards: the folder of shards and ``manifest.json``.
        n_shards, workers, seconds: shards counted, Ray workers (actors) used, wall time (Ray start included).
    """

    lengths: np.ndarray
    loss_tokens: np.ndarray
    shards: Path
    n_shards: int
    workers: int
    seconds: float


def _spec(r: Reading) -> dict:
    s = r.source
    return {"path": str(s.path), "kind": s.kind, "split": s.split, "format": r.fmt, "columns": r.columns}


def _source_of(spec: Mapping) -> records.Source:
    return records.Source(Path(spec["path"]), spec["kind"], spec["split"])


def _n_rows(r: Reading) -> int:
    if r.source.kind in ("parquet", "datasets"):
        return records.source_size(r.source)
    return sum(len(c.values) for c in records.iter_chunks(r.source, r.columns, 8192))


class _CountRanges:
    """The Ray Data stage of :func:`count_on_ray`: each row is a range of a source; the actor reads those
    records itself (by the readers ``padfree lengths`` uses) and counts them by the one rule."""

    def __init__(self, tokenizer: str, chat_template: bool, sources: list[dict], names: dict) -> None:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.tok = Tokenizer(tokenizer, chat_template)
        self.sources, self.names = sources, names

    def __call__(self, batch: dict) -> dict:
        out: dict[str, list] = {"shard": [], "lengths": [], "loss": [], "error": []}
        for shard, k, a, b, size in zip(batch["shard"], batch["source"], batch["start"], batch["stop"],
                                        batch["size"], strict=True):  # fmt: skip
            spec = self.sources[int(k)]
            lengths, loss, err = self._count(spec, int(a), int(b), int(size))
            out["shard"].append(int(shard))
            out["lengths"].append(lengths.astype("<i8").tobytes())
            out["loss"].append(loss.astype("<i8").tobytes())
            out["error"].append(err)
        return {
            "shard": np.array(out["shard"], np.int64),
            **{k: np.array(out[k], dtype=object) for k in ("lengths", "loss", "error")},
        }

    def _count(self, spec: dict, a: int, b: int, size: int) -> tuple[np.ndarray, np.ndarray, str]:
        src = _source_of(spec)
        jsonl = src.kind == "jsonl"
        values = _range_values(src, spec["columns"], a, b, size)
        if values is None or len(values) != b - a:
            z = np.zeros(0, np.int64)
            missing = f"rows {a}..{b - 1} not found (the source changed?)"
            return z, z, json.dumps([src.name, jsonl, a, missing])
        res = encode_chunk(self.tok, values, jsonl, spec["format"], self.names)
        if res.error is not None or res.encoded is None:
            assert res.error is not None
            z = np.zeros(0, np.int64)
            return z, z, json.dumps([src.name, jsonl, a + res.error[0], res.error[1]])
        return res.encoded.lengths, res.encoded.loss_tokens, ""


def _range_values(src: records.Source, columns: list[str] | None, a: int, b: int, size: int) -> list | None:
    """Records ``a .. b - 1`` of a source, as :func:`padfree.data.records.iter_chunks` gives them: a parquet
    file's row groups that hold them, a ``datasets`` folder's slice; a ``.jsonl`` file read up to them."""
    cols = columns or []
    if src.kind == "parquet":
        f = records._parquet(src)
        md = f.metadata
        ends = np.cumsum([0] + [md.row_group(i).num_rows for i in range(md.num_row_groups)])
        groups = [i for i in range(md.num_row_groups) if ends[i] < b and ends[i + 1] > a]
        if not groups:
            return None
        table = f.read_row_groups(groups, columns=cols, use_threads=False)
        return list(table.slice(a - int(ends[groups[0]]), b - a).to_pylist())
    if src.kind == "datasets":
        batch = records._load_dataset(src).select_columns(cols)[a:b]
        return [dict(zip(cols, vals, strict=True)) for vals in zip(*(batch[c] for c in cols), strict=True)]
    chunk = next((c for c in records.iter_chunks(src, columns, size) if c.first == a), None)
    return None if chunk is None else chunk.values


def count_on_ray(
    data: str | Path | Sequence[str | Path],
    tokenizer: str | Path,
    out_dir: str | Path,
    *,
    address: str | None = None,
    mode: str = "auto",
    fields: Mapping[str, str] | None = None,
    split: str | None = None,
    chat_template: bool = False,
    workers: int | None = None,
    rows_per_shard: int | None = None,
) -> RayCount:
    """Count ``data`` (as :func:`padfree.data.count_lengths.count_lengths` does) on a Ray cluster
    (``address``; ``None``: a local one of ``workers`` CPUs), writing the shards and their manifest to
    ``out_dir``, then merging them (:func:`merge_shards`). Equal to the single-machine count."""
    t0 = time.perf_counter()
    ray = _import_ray()
    names = field_map(mode, None, fields)
    tokenizer_kind(tokenizer)
    Tokenizer(tokenizer, chat_template)  # a tokenizer that cannot load (or lacks a template) fails here, once
    reads = readings(data, mode, names, split)
    sizes = [_n_rows(r) for r in reads]
    if not sum(sizes):
        raise InputError("no records", path=", ".join(r.source.name for r in reads[:3]))
    _start(ray, address, workers)
    try:
        n_workers = max(1, int(ray.available_resources().get("CPU", 1))) if workers is None else workers
        per = rows_per_shard or max(256, min(16384, math.ceil(sum(sizes) / (4 * n_workers))))
        items: list[dict[str, int]] = []
        for k, n in enumerate(sizes):
            for a in range(0, n, per):
                items.append(
                    {"shard": len(items), "source": k, "start": a, "stop": min(n, a + per), "size": per}
                )
        specs = [_spec(r) for r in reads]
        ds = ray.data.from_items(items, override_num_blocks=len(items))
        counted = ds.map_batches(
            _CountRanges,
            fn_constructor_kwargs={
                "tokenizer": str(tokenizer),
                "chat_template": chat_template,
                "sources": specs,
                "names": names,
            },  # fmt: skip
            batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=n_workers),
            num_cpus=1,
        ).take_all()
    finally:
        if address is None:
            ray.shutdown()
    results = sorted(counted, key=lambda r: int(r["shard"]))
    for r in results:
        if r["error"]:
            name, jsonl, index, rule = json.loads(r["error"])
            raise_record_error(name, jsonl, index, rule)
    folder = Path(out_dir)
    _write_shards(folder, items, results, reads, sizes, tokenizer, names, chat_template)
    lengths, loss = merge_shards(folder, tokenizer, chat_template=chat_template, fields=fields, mode=mode)
    return RayCount(lengths, loss, folder, len(items), n_workers, time.perf_counter() - t0)


def _import_ray():  # -> the ray module
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise ConfigError("counting on Ray needs the ray extra: pip install 'padfree[ray]'") from None
    return ray


def _probe(address: str) -> None:
    """A ``HOST:PORT`` (or ``ray://HOST:PORT``) nobody listens at is one line now, not minutes of Ray's
    retries."""
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        if address == "auto":
            return
        raise ConfigError(
            f"--ray takes a cluster address HOST:PORT, ray://HOST:PORT or auto (got {address!r})"
        )
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise ConfigError(
            f"no Ray cluster answers at {address} ({exc.strerror or exc}); start one (ray start --head) or "
            "give --ray without an address for a local one"
        ) from None


def _start(ray, address: str | None, workers: int | None) -> None:
    kw: dict[str, Any] = {"ignore_reinit_error": True, "log_to_driver": False, "include_dashboard": False,
                          "logging_level": logging.WARNING}  # fmt: skip
    if address is not None:
        _probe(address)
    try:
        if address is None:
            ray.init(num_cpus=workers, **kw)
        else:
            ray.init(address=address, **kw)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as exc:
        first = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        where = f"at {address}" if address else "locally"
        raise ConfigError(f"cannot start or reach a Ray cluster {where} ({first})") from None
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False


def _write_shards(folder, items, results, reads, sizes, tokenizer, names, chat_template) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    shards = []
    for it, r in zip(items, results, strict=True):
        lengths = np.frombuffer(r["lengths"], "<i8")
        loss = np.frombuffer(r["loss"], "<i8")
        if lengths.shape[0] != it["stop"] - it["start"]:
            raise InputError(
                f"shard {it['shard']}: {lengths.shape[0]} counts for rows {it['start']}..{it['stop'] - 1}"
            )
        buf = io.BytesIO()
        np.savez(buf, lengths=lengths, loss_tokens=loss)
        name = f"shard-{it['shard']:06d}.npz"
        (folder / name).write_bytes(buf.getvalue())
        shards.append({"file": name, "source": it["source"], "start": it["start"], "stop": it["stop"],
                       "sha256": hashlib.sha256(buf.getvalue()).hexdigest()})  # fmt: skip
    manifest = {
        "format": SHARDS_FORMAT,
        "rule": RULE_VERSION,
        "tokenizer": records.content_hash(tokenizer, skip_weights=True),
        "tokenizer_path": str(tokenizer),
        "chat_template": bool(chat_template),
        "fields": names,
        "sources": [
            {**_spec(r), "rows": n, "sha256": records.source_hash(r.source)}
            for r, n in zip(reads, sizes, strict=True)
        ],  # fmt: skip
        "shards": shards,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def merge_shards(
    folder: str | Path,
    tokenizer: str | Path,
    *,
    chat_template: bool = False,
    fields: Mapping[str, str] | None = None,
    mode: str = "auto",
) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, loss_tokens)`` of the shards in ``folder``, concatenated in source order, after checking
    that its manifest was counted by this rule version, with ``tokenizer`` (its content hash) and the same
    options, that the shards cover every source's rows once and that each shard's bytes are the ones
    counted. Any mismatch is one :class:`InputError` naming the manifest."""
    where = str(Path(folder) / MANIFEST)
    try:
        m = json.loads((Path(folder) / MANIFEST).read_text())
    except FileNotFoundError:
        raise InputError("no shard manifest (count with padfree lengths --ray first)", path=where) from None
    except (OSError, ValueError) as exc:
        raise InputError(f"unreadable shard manifest ({str(exc)[:100]})", path=where) from None
    if not isinstance(m, dict) or m.get("format") != SHARDS_FORMAT:
        raise InputError(f"not a padfree shard manifest (format {SHARDS_FORMAT} expected)", path=where)
    if m.get("rule") != RULE_VERSION:
        raise InputError(
            f"counted under tokenization rule version {m.get('rule')}, this padfree counts under "
            f"{RULE_VERSION}: count again",
            path=where,
        )
    want = records.content_hash(tokenizer, skip_weights=True)
    if m.get("tokenizer") != want:
        raise InputError(
            f"counted with another tokenizer ({m.get('tokenizer_path')}, sha256 "
            f"{str(m.get('tokenizer'))[:12]}), not {tokenizer} (sha256 {want[:12]}): count again",
            path=where,
        )
    names = field_map(mode, None, fields)
    if bool(m.get("chat_template")) != bool(chat_template) or m.get("fields") != names:
        raise InputError(
            f"counted with other options (chat_template {m.get('chat_template')}, fields {m.get('fields')}), "
            f"not chat_template {bool(chat_template)}, fields {names}",
            path=where,
        )
    lengths, loss = [], []
    shards = sorted(m["shards"], key=lambda s: (int(s["source"]), int(s["start"])))
    at = dict.fromkeys(range(len(m["sources"])), 0)
    for s in shards:
        k = int(s["source"])
        if int(s["start"]) != at[k]:
            raise InputError(
                f"source {k} rows {at[k]}..{int(s['start']) - 1} are in no shard (or in two)", path=where
            )
        data = (Path(folder) / s["file"]).read_bytes()
        if hashlib.sha256(data).hexdigest() != s["sha256"]:
            raise InputError(f"shard {s['file']} is not the one counted (its sha256 differs)", path=where)
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            part, part_loss = z["lengths"], z["loss_tokens"]
        if part.shape[0] != int(s["stop"]) - int(s["start"]):
            raise InputError(f"shard {s['file']} holds {part.shape[0]} counts for its range", path=where)
        lengths.append(part)
        loss.append(part_loss)
        at[k] = int(s["stop"])
    for k, src in enumerate(m["sources"]):
        if at[k] != int(src["rows"]):
            raise InputError(
                f"source {src['path']}: shards cover {at[k]} of its {src['rows']} rows", path=where
            )
    return np.concatenate(lengths).astype(np.int64), np.concatenate(loss).astype(np.int64)
