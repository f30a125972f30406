"""``padfree lengths``: count the tokens of every sample of a dataset and write ``lengths.npy``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from padfree.commands.common import check_input, check_output, writing
from padfree.data.length_files import assistant_path
from padfree.errors import ConfigError
from padfree.options import WORKERS, Bounded, add_data_arguments, add_path, record_options

if TYPE_CHECKING:
    import numpy as np

NAME = "lengths"
ROWS = Bounded(int, 1, 2**31 - 1)  # --rows-per-shard
HELP = (
    "tokenize a dataset (.jsonl[.gz], .parquet, datasets folders; several files, globs, folders) and write "
    "per-sample token counts (.npy) plus loss-bearing counts beside them; tokenized data (a seq_len or "
    "input_ids column, Megatron .bin/.idx, datatrove .ds) is read, not tokenized again"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from padfree.data.count_lengths import default_workers

    p.add_argument(
        "data",
        nargs="+",
        help=".jsonl, .jsonl.gz, .parquet, datasets folders, globs or folders of such files (counted in "
        "the order given, as one dataset); or tokenized data: datasets folders / parquet files with a "
        "seq_len or input_ids column, Megatron PREFIX.bin/.idx, datatrove .ds shards or their folders (read)",
    )
    add_path(
        p,
        "--tokenizer",
        "SentencePiece .model, tokenizer.json, or a local transformers tokenizer folder (needed to "
        "count raw records; tokenized data is read without it)",
    )
    p.add_argument(
        "--column",
        default=None,
        help="tokenized data: the lengths column (default seq_len, else input_ids)",
    )
    p.add_argument(
        "--tokenize",
        action="store_true",
        help="tokenize every source by padfree's rule even when it holds token ids",
    )
    add_data_arguments(p)
    add_path(p, "--out", "output .npy; loss-bearing counts go to *.assistant.npy", required=True)
    p.add_argument(
        "--workers", type=WORKERS, default=default_workers(), help="processes (default min(4, cpus))"
    )
    add_path(p, "--cache-dir", "token-count cache (default $PADFREE_CACHE_DIR or ~/.cache/padfree)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    p.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="count on a Ray cluster (HOST:PORT, ray://HOST:PORT, auto; no address: a local one of --workers "
        "CPUs), past one machine: needs pip install 'padfree[ray]' and the data readable by the workers",
    )
    p.add_argument(
        "--rows-per-shard",
        type=ROWS,
        default=None,
        help="--ray: records per shard (default: about 4 shards per worker, 256 to 16384 records each)",
    )
    add_path(
        p,
        "--shards",
        "--ray: where the counted shards and their manifest go (default: OUT without .npy + .shards/)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from padfree.data.count_lengths import count_lengths

    if args.out.suffix != ".npy":
        raise ConfigError(f"--out must name a .npy file (got {args.out})")
    if not args.tokenize:
        from padfree.data.readers import tokenized_sources

        if tokenized_sources(args.data, args.split):
            return _read_tokenized(args)
    if args.tokenizer is None:
        raise ConfigError(
            "--tokenizer is required to count raw records (none of the data holds token ids: a seq_len or "
            "input_ids column, Megatron .bin/.idx, datatrove .ds)"
        )
    check_input(args.tokenizer, "tokenizer")  # the data sources: padfree.data.records checks each file
    _check_outputs(args.out)
    reading = record_options(args)
    if args.ray is not None:
        return _count_on_ray(args, reading)
    res = count_lengths(
        args.data,
        args.tokenizer,
        **reading,
        workers=args.workers,
        cache_dir=args.cache_dir,
        use_cache=not args.no_cache,
        progress=not args.quiet,
    )
    aux = _save(args.out, res.lengths, res.loss_tokens)
    cache = "cache hit" if res.cache_hit else ("cache miss" if res.cache_file else "cache off")
    q = np.percentile(res.lengths, [50, 99])
    fmts = sorted({f for _, f in res.formats})
    src = f"{len(res.formats)} sources, " if len(res.formats) > 1 else ""
    print(
        f"{args.out}: {res.lengths.shape[0]:,} samples, {int(res.lengths.sum()):,} tokens "
        f"(p50 {q[0]:.0f}, p99 {q[1]:.0f}, max {int(res.lengths.max()):,}); loss-bearing "
        f"{int(res.loss_tokens.sum()):,} tokens in {aux}; {src}format {', '.join(fmts)}; {cache}; "
        f"{res.seconds:.2f} s",
        file=sys.stderr,
    )
    if res.replaced[0]:
        print(
            f"padfree: warning: {res.replaced[0]:,} record(s) held lone UTF-16 surrogates (half an emoji), "
            f"each replaced by U+FFFD (first: {res.replaced[1]})",
            file=sys.stderr,
        )
    return 0


def _read_tokenized(args: argparse.Namespace) -> int:
    """Lengths of tokenized data, read (:mod:`padfree.data.readers`), written as ``padfree lengths`` writes
    counts; a format without a loss mask writes no loss-bearing file (and removes a stale one) and says so."""
    import time

    import numpy as np

    from padfree.data.readers import read_tokenized

    t0 = time.perf_counter()
    _check_outputs(args.out)
    res = read_tokenized(args.data, args.column, args.split)
    if res.lengths.shape[0] == 0:
        raise ConfigError(f"no samples in {', '.join(s for s, _ in res.sources[:3])}")
    aux = _save(args.out, res.lengths, res.loss_tokens)
    q = np.percentile(res.lengths, [50, 99])
    src = f"{len(res.sources)} sources, " if len(res.sources) > 1 else ""
    loss = (
        f"loss-bearing {int(res.loss_tokens.sum()):,} tokens in {aux}"
        if res.loss_tokens is not None
        else f"no loss-bearing counts written ({res.note})"
    )
    print(
        f"{args.out}: {res.lengths.shape[0]:,} samples, {int(res.lengths.sum()):,} tokens "
        f"(p50 {q[0]:.0f}, p99 {q[1]:.0f}, max {int(res.lengths.max()):,}) read from {res.fmt} token ids "
        f"(not tokenized again); {loss}; {src}{time.perf_counter() - t0:.2f} s",
        file=sys.stderr,
    )
    return 0


def _count_on_ray(args: argparse.Namespace, reading: dict) -> int:
    """``--ray``: count on a Ray cluster (:mod:`padfree.data.ray_lengths`), write as the local count does."""

    from padfree.data.ray_lengths import count_on_ray

    shards = args.shards or args.out.with_name(args.out.name[: -len(".npy")] + ".shards")
    check_output(shards, "the shards", folder=True)
    address = None if args.ray == "local" else args.ray
    res = count_on_ray(
        args.data,
        args.tokenizer,
        shards,
        address=address,
        **reading,
        workers=args.workers if address is None else None,
        rows_per_shard=args.rows_per_shard,
    )
    aux = _save(args.out, res.lengths, res.loss_tokens)
    n = res.lengths.shape[0]
    print(
        f"{args.out}: {n:,} samples, {int(res.lengths.sum()):,} tokens counted on Ray ({res.workers} "
        "workers, "
        f"{res.n_shards} shards in {shards}, merged by their manifest); loss-bearing "
        f"{int(res.loss_tokens.sum()):,} tokens in {aux}; {res.seconds:.2f} s "
        f"({n / res.seconds:,.0f} samples/s)",
        file=sys.stderr,
    )
    return 0


def _check_outputs(out: Path) -> None:
    """Refuse before any work where the lengths or the loss-bearing counts beside them cannot be written."""
    check_output(out, "the lengths")
    check_output(assistant_path(out), "the loss-bearing lengths")


def _save(out: Path, lengths: np.ndarray, loss_tokens: np.ndarray | None) -> Path:
    """Write ``lengths`` to ``out`` and ``loss_tokens`` beside it (int32 where the lengths fit, else int64);
    return where the loss-bearing counts go. Without ``loss_tokens`` a stale file there is removed: it would
    pair old loss counts with these lengths."""
    import numpy as np

    dtype = np.int32 if int(lengths.max(initial=0)) < 2**31 else np.int64
    aux = assistant_path(out)
    with writing(out, "the lengths"):
        out.parent.mkdir(parents=True, exist_ok=True)
        np.save(out, lengths.astype(dtype))
        if loss_tokens is not None:
            np.save(aux, loss_tokens.astype(dtype))
        else:
            aux.unlink(missing_ok=True)
    return aux
