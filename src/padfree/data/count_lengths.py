"""From datasets and a tokenizer to per-sample lengths: parallel, with a progress bar and a content cache.

The counts are ``len(input_ids)`` of :func:`padfree.data.tokenization.encode_samples`, the function training
tokenizes with, so a lengths file from here always matches the data it was counted on.

The cache key is the sha256 of every source's bytes (in order), of the tokenizer's bytes and of every option
that changes a count (formats, field names, chat template, rule version), so a second run on the same inputs
only hashes the files and reads the stored counts, and any change to the data or the tokenizer misses.

Example (library)::

    res = count_lengths(["a.jsonl.gz", "b/*.parquet"], "tokenizer.json", workers=4)
    res.lengths, res.loss_tokens, res.cache_hit
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from padfree.data import records
from padfree.data.reading import MODES, Reading, field_map, readings
from padfree.data.tokenization import (
    RULE_VERSION,
    Tokenizer,
    encode_chunk,
    raise_record_error,
    tokenizer_kind,
)
from padfree.errors import ConfigError, InputError, one_line

__all__ = ["MODES", "LengthsResult", "count_lengths", "default_cache_dir", "default_workers"]


@dataclass(frozen=True)
class LengthsResult:
    """Token counts of one dataset (its sources concatenated in order).

    Attributes:
        lengths: tokens per sample (int64).
        loss_tokens: loss-bearing label positions per sample (assistant turns of a chat, a document's every
            token after its first), as the collators count them.
        cache_hit: whether the counts came from the cache.
        cache_file: where they are (or were) stored; ``None`` when caching is off.
        seconds: wall time of the call.
        formats: ``(source, format)`` of every source.
        replaced: records whose lone UTF-16 surrogates became U+FFFD, and where the first one is.
    """

    lengths: np.ndarray
    loss_tokens: np.ndarray
    cache_hit: bool
    cache_file: Path | None
    seconds: float
    formats: tuple[tuple[str, str], ...] = ()
    replaced: tuple[int, str] = (0, "")


def default_cache_dir() -> Path:
    """``$PADFREE_CACHE_DIR``, else ``~/.cache/padfree``."""
    env = os.environ.get("PADFREE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "padfree"


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def count_lengths(
    data: str | Path | Sequence[str | Path],
    tokenizer: str | Path,
    *,
    mode: str = "auto",
    field: str | None = None,
    fields: Mapping[str, str] | None = None,
    split: str | None = None,
    chat_template: bool = False,
    workers: int | None = None,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
    progress: bool = False,
    chunk_size: int = 512,
) -> LengthsResult:
    """Count every record's tokens (see :mod:`padfree.data.tokenization` for the rule).

    ``data``: files, globs and folders (counted in the order given, as one concatenated dataset). ``mode``:
    the record format (:data:`MODES`; ``auto`` detects it per file, see :mod:`padfree.data.formats`);
    ``field`` renames the format's main field, ``fields`` any field (``{"from": "speaker"}``); ``split``:
    the split of a DatasetDict folder. A malformed record raises :class:`InputError` naming the file, the
    record and (for .jsonl) the line.
    """
    t0 = time.perf_counter()
    names = field_map(mode, field, fields)
    tokenizer_kind(tokenizer)  # a clear error before any work
    workers = default_workers() if workers is None else workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be an integer >= 1 (got {workers!r})")
    reads = readings(data, mode, names, split)
    found = tuple((r.source.name, r.fmt) for r in reads)
    cache_file = None
    if use_cache:
        key = _cache_key(reads, tokenizer, names, chat_template)
        cache_file = Path(cache_dir or default_cache_dir()) / "lengths" / f"{key}.npz"
        hit = _read_cache(cache_file)
        if hit is not None:
            return LengthsResult(hit[0], hit[1], True, cache_file, time.perf_counter() - t0, found, hit[2])
    totals, loss, replaced = _count(reads, tokenizer, names, chat_template, workers, progress, chunk_size)
    if cache_file is not None:
        _write_cache(cache_file, totals, loss, replaced)
    return LengthsResult(totals, loss, False, cache_file, time.perf_counter() - t0, found, replaced)


def _cache_key(reads: list[Reading], tokenizer: str | Path, names: dict, chat_template: bool) -> str:
    opts = {
        "rule": RULE_VERSION,
        "formats": [r.fmt for r in reads],
        "fields": names,
        "chat_template": bool(chat_template),
    }
    h = hashlib.sha256()
    for r in reads:
        h.update(records.source_hash(r.source).encode())
    h.update(records.content_hash(tokenizer, skip_weights=True).encode())
    h.update(json.dumps(opts, sort_keys=True).encode())
    return h.hexdigest()


def _read_cache(path: Path) -> tuple[np.ndarray, np.ndarray, tuple[int, str]] | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            replaced = (int(z["replaced"]), str(z["replaced_at"]))
            return z["lengths"].astype(np.int64), z["loss_tokens"].astype(np.int64), replaced
    except (OSError, KeyError, ValueError, EOFError):  # absent or damaged: count again
        return None


def _write_cache(path: Path, totals: np.ndarray, loss: np.ndarray, replaced: tuple[int, str]) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(tmp, lengths=totals, loss_tokens=loss, replaced=replaced[0], replaced_at=replaced[1])
        os.replace(tmp, path)
    except OSError as exc:  # a read-only or full cache must not fail the command (nor leave half a file)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        where = one_line(f"{path} ({exc.strerror or exc})")  # a newline in the folder name stays one line
        print(f"padfree: warning: cannot write the cache {where}", file=sys.stderr)


# --- counting: one tokenizer per worker process --------------------------------------------------------

_TOKENIZER: Tokenizer | None = None
_LOAD_ERROR: str | None = None


def _init_worker(tokenizer: str, chat_template: bool) -> None:
    global _TOKENIZER, _LOAD_ERROR
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism
    try:
        _TOKENIZER = Tokenizer(tokenizer, chat_template)
    except ConfigError as exc:  # raising in an initializer would make the pool respawn workers forever
        _LOAD_ERROR = str(exc)


def _work(task: tuple) -> tuple:
    values, first, done, source, fmt, names, jsonl = task
    head = (source, first, done, jsonl)
    if _TOKENIZER is None:
        return (*head, None, None, (None, _LOAD_ERROR or "tokenizer not loaded"), ())
    try:
        res = encode_chunk(_TOKENIZER, values, jsonl, fmt, names)
    except ConfigError as exc:  # the tokenizer has no EOS, ...
        return (*head, None, None, (None, str(exc)), ())
    if res.error is not None or res.encoded is None:
        return (*head, None, None, res.error, res.replaced)
    return (*head, res.encoded.lengths, res.encoded.loss_tokens, None, res.replaced)


def _tasks(reads: list[Reading], names: dict, chunk_size: int):
    for k, r in enumerate(reads):
        size = max(records.source_size(r.source), 1)
        for c in records.iter_chunks(r.source, r.columns, chunk_size):
            yield c.values, c.first, k + min(c.progress / size, 1.0), k, r.fmt, names, r.jsonl


def _count(
    reads: list[Reading],
    tokenizer: str | Path,
    names: dict,
    chat_template: bool,
    workers: int,
    progress: bool,
    chunk_size: int,
) -> tuple[np.ndarray, np.ndarray, tuple[int, str]]:
    tasks = _tasks(reads, names, chunk_size)
    out = _Collected(reads)
    label = f"tokenizing {reads[0].source.path.name}" + (f" (+{len(reads) - 1})" if len(reads) > 1 else "")
    bar = _Bar(len(reads), label) if progress else None
    try:
        if workers == 1:
            global _TOKENIZER
            _TOKENIZER = Tokenizer(tokenizer, chat_template)  # raises ConfigError here
            out.collect(map(_work, tasks), bar)
        else:
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            init = (str(tokenizer), chat_template)
            # the pool's feeder thread would read the whole source ahead; a semaphore keeps it a few
            # chunks ahead of the results, so memory stays flat on big datasets
            ahead = threading.Semaphore(4 * workers)
            stop = threading.Event()

            def bounded():  # noqa: ANN202
                for t in tasks:
                    while not ahead.acquire(timeout=0.1):
                        if stop.is_set():
                            return
                    yield t

            with ctx.Pool(workers, initializer=_init_worker, initargs=init) as pool:
                try:
                    out.collect(pool.imap(_work, bounded()), bar, ahead.release)
                finally:
                    stop.set()
    finally:
        if bar is not None:
            bar.close()
    if not out.totals:
        raise InputError("no records", path=", ".join(r.source.name for r in reads[:3]))
    return np.concatenate(out.totals), np.concatenate(out.loss), (out.n_replaced, out.first_replaced)


class _Collected:
    """Results in order; the first error stops the run."""

    def __init__(self, reads: list[Reading]) -> None:
        self.reads = reads
        self.totals: list[np.ndarray] = []
        self.loss: list[np.ndarray] = []
        self.n_replaced = 0
        self.first_replaced = ""

    def collect(self, results, bar: _Bar | None, done=None) -> None:
        for source, first, at, jsonl, totals, loss, err, replaced in results:
            if done is not None:
                done()
            name = self.reads[source].source.name
            if replaced:
                if not self.n_replaced:
                    where = f"line {first + replaced[0] + 1}" if jsonl else f"sample {first + replaced[0]}"
                    self.first_replaced = f"{name} {where}"
                self.n_replaced += len(replaced)
            if err is not None and err[0] is None:
                raise ConfigError(err[1])
            if err is not None:
                raise_record_error(name, jsonl, first + err[0], err[1])
            self.totals.append(totals)
            self.loss.append(loss)
            if bar is not None:
                bar.update(at)


class _Bar:
    """A rich progress bar on stderr (units: sources; each advances by its bytes or rows)."""

    def __init__(self, total: float, label: str) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

        console = Console(stderr=True)
        self._p = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,  # a log file gets the summary line only
        )
        self._p.start()
        self._task = self._p.add_task(label, total=total)

    def update(self, completed: float) -> None:
        self._p.update(self._task, completed=completed)

    def close(self) -> None:
        self._p.stop()
