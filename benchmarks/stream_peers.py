"""Streams and mixtures against the peers' real code (issue 43, item 4): padfree's windowed planner beside
grain's first-fit packer, a torchforge-style buffer, TRL's BFD, lhotse's dynamic bucketing and torchtitan's
weighted source interleave, for windows of 1, 2, 4 and 8 steps.

Two streams, capped at the budget (16384), planned as 8 ranks x 4 micro-batches per step:

- ``seed_mix``: the first ``--samples`` of a seeded shuffle of seed_mix (cl100k, 902K samples);
- ``three_sets``: chat = self_instruct_t0 (0.6), code = python_stdlib_code (0.25), math = gsm8k (0.15),
  ``--samples`` documents drawn one by one by torchtitan's own ``InterleavedDataset`` (each source re-looped
  and reshuffled when exhausted): the weighted per-document draw of torchtitan's mix.

Each planner reads the stream in order and holds a window of ``W`` steps' worth of samples (``window``
samples at the stream's mean length, :func:`padfree.core.lookahead.window_for_steps`):

- ``padfree``: :func:`padfree.core.lookahead.window_steps` (packed), ranks balanced inside the window;
- ``grain_first_fit``: ``grain.experimental.FirstFitPackIterDataset`` with ``W x 32`` bins (one step's
  micro-batches per step of window) over token arrays of each sample's length;
- ``torchforge_buffer``: a re-implementation (torchforge 0.0.1 on the registry is an empty placeholder) of
  a lookahead buffer of ``window`` samples: each pack takes, in buffer order, every sample that still fits,
  then the buffer is refilled;
- ``trl_bfd``: ``trl.data_utils.pack_dataset(strategy="bfd")`` with ``datasets`` map batches of ``window``
  samples (the rows in map order: a stream is not shuffled again);
- ``lhotse_bucketing``: ``lhotse`` ``DynamicBucketingSampler`` (``TokenConstraint(max_tokens=budget)``,
  padded, 30 buckets, ``buffer_size=window``), via :mod:`padfree.bench.peers`;
- on ``three_sets`` also ``torchtitan_rows``: torchtitan's mix as its ``InterleavedChatDataLoader`` builds
  it: each source packed greedily on its own (``ChatDataset``'s rule: a row is flushed when the next sample
  does not fit; re-implemented on lengths, W plays no part) and whole rows drawn by ``InterleavedDataset``;
  and ``padfree_sources`` (W = pool): :func:`padfree.core.sources.plan_sources` over the three sets in
  memory, by the deficit rule per step (unit tokens; the windowed planner does not take sources yet).

A peer's micro-batches are dealt to ranks as a ``DistributedSampler`` does (micro ``j`` of a step to rank
``j % 8``); padfree's steps come rank-balanced. Every number uses padfree's one cost model
(:mod:`padfree.core.cost`, the default coefficients): padding efficiency (real tokens over computed slots:
packed rows compute their tokens, padded batches count x longest), fill (real tokens over micro-batches x
budget: a fixed-length packer's padding), rank imbalance (a step's most loaded rank over its mean, mean and
p99 over whole steps), per-step source-share error in documents and in tokens (``max_s |u_s - w_s u|`` over
one document in that unit: 1, or the longest sample) and peak memory (each run in a forked child: the
growth of its resident peak over its resident size at the start, ``VmHWM`` reset through
``/proc/self/clear_refs`` (Linux); each planner warmed up first on 400 samples, so imports and compiles are
not counted).

    make bench-stream-peers   # a venv under build/ with grain, lhotse, trl, torchtitan; then:
    build/bench-venv/bin/python benchmarks/stream_peers.py --lengths ../shared/data/lengths
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import itertools
import json
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from padfree.core import cost
from padfree.core.config import DEFAULT_COST, PlanConfig
from padfree.core.kernels import njit
from padfree.core.lookahead import ArrayLengths, window_for_steps, window_steps
from padfree.core.sources import plan_sources, source_data

BUDGET, WORLD, ACCUM = 16384, 8, 4
K = WORLD * ACCUM
WINDOWS = (1, 2, 4, 8)
MIX = (("chat", "self_instruct_t0", 0.6), ("code", "python_stdlib_code", 0.25), ("math", "gsm8k", 0.15))
PEER_PACKAGES = ("grain", "lhotse", "trl", "datasets", "torchtitan", "torch", "numpy")


@dataclass(frozen=True)
class Stream:
    """Samples in stream order: lengths (capped at the budget), the source of each (``None``: one source)
    and the source weights."""

    name: str
    lengths: np.ndarray
    sources: np.ndarray | None = None
    weights: tuple[float, ...] = ()
    drawn_by: str = ""


@dataclass(frozen=True)
class Batches:
    """A planner's micro-batches: each sample's length and source, micro-batch after micro-batch
    (``offsets``), packed rows or padded batches, dealt rank-major (padfree's steps) or round-robin (a
    peer's stream)."""

    lengths: np.ndarray
    sources: np.ndarray | None
    offsets: np.ndarray
    packed: bool
    rank_major: bool


def _config(stream: Stream) -> PlanConfig:
    return PlanConfig(strategy="packed", budget=BUDGET, world_size=WORLD, grad_accum=ACCUM, seed=0)


def _batches(order: np.ndarray, counts, stream: Stream, packed: bool, rank_major: bool) -> Batches:
    offsets = np.concatenate(([0], np.cumsum(np.asarray(counts, np.int64)))).astype(np.int64)
    src = None if stream.sources is None else stream.sources[order]
    return Batches(stream.lengths[order], src, offsets, packed, rank_major)


# ---- planners: (stream, window samples, window steps) -> Batches ----------------------------------------


def plan_padfree(stream: Stream, window: int, w: int) -> Batches:
    """padfree's windowed stream planner (packed), its steps rank after rank."""
    micro = [
        m for step in window_steps(ArrayLengths(stream.lengths), _config(stream), window) for m in step.micro
    ]
    order = np.concatenate(micro) if micro else np.zeros(0, np.int64)
    return _batches(order, [m.shape[0] for m in micro], stream, True, True)


def plan_grain(stream: Stream, window: int, w: int) -> Batches:
    """grain's ``FirstFitPackIterDataset`` with ``w * 32`` bins over token arrays of stream positions."""
    import grain
    from grain.experimental import FirstFitPackIterDataset

    lens = stream.lengths
    ds = grain.MapDataset.range(lens.shape[0]).map(lambda i: {"tokens": np.full(int(lens[i]), i, np.int32)})
    packed = FirstFitPackIterDataset(
        ds.to_iter_dataset(),
        length_struct={"tokens": BUDGET},
        num_packing_bins=w * K,
        seed=0,
        shuffle_bins=True,
    )
    order, counts = [], []
    for row in packed:
        seg = row["tokens_segment_ids"]
        starts = np.flatnonzero((seg != 0) & (np.diff(seg, prepend=0) != 0))
        order.append(row["tokens"][starts].astype(np.int64))
        counts.append(starts.shape[0])
    return _batches(np.concatenate(order), counts, stream, True, False)


@njit(cache=True)
def _buffer_packs(lens: np.ndarray, size: int, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """A lookahead buffer of ``size`` samples: each pack takes, in buffer order, each sample that fits."""
    n = lens.shape[0]
    buf = np.empty(size, np.int64)
    keep = np.empty(size, np.int64)
    order = np.empty(n, np.int64)
    counts = np.zeros(n, np.int64)
    held, read, done, packs = 0, 0, 0, 0
    while done < n:
        while held < size and read < n:
            buf[held] = read
            held += 1
            read += 1
        room, kept = budget, 0
        for j in range(held):
            i = buf[j]
            if lens[i] <= room:
                room -= lens[i]
                order[done] = i
                done += 1
                counts[packs] += 1
            else:
                keep[kept] = i
                kept += 1
        buf[:kept] = keep[:kept]
        held = kept
        packs += 1
    return order, counts[:packs]


def plan_torchforge(stream: Stream, window: int, w: int) -> Batches:
    """A torchforge-style lookahead buffer of ``window`` samples (re-implemented, see the module doc)."""
    order, counts = _buffer_packs(stream.lengths.astype(np.int64), int(window), BUDGET)
    return _batches(order, counts, stream, True, False)


def plan_trl(stream: Stream, window: int, w: int) -> Batches:
    """TRL's BFD over ``datasets`` map batches of ``window`` samples; each row's sources read back from a
    packed per-token source column (TRL gives lengths per row, not sample ids)."""
    import datasets
    import pyarrow as pa
    from trl.data_utils import pack_dataset

    datasets.disable_progress_bars()
    lens = stream.lengths
    off = np.concatenate(([0], np.cumsum(lens, dtype=np.int64)))
    cols = {"input_ids": pa.LargeListArray.from_arrays(pa.array(off), pa.nulls(int(off[-1])))}
    src = np.zeros(lens.shape[0], np.int8) if stream.sources is None else stream.sources.astype(np.int8)
    cols["source"] = pa.LargeListArray.from_arrays(pa.array(off), pa.array(np.repeat(src, lens)))
    packed = pack_dataset(datasets.Dataset(pa.table(cols)), BUDGET, strategy="bfd",
                          map_kwargs={"batch_size": int(window)})  # fmt: skip
    seq = packed.data.column("seq_lengths").combine_chunks()
    rows = packed.data.column("source").combine_chunks()
    counts = np.diff(seq.offsets.to_numpy()).astype(np.int64)
    out_len = seq.values.to_numpy().astype(np.int64)
    firsts = rows.offsets.to_numpy()[:-1].repeat(counts) + _within_row_starts(out_len, counts)
    out_src = rows.values.to_numpy()[firsts].astype(np.int64)
    offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    if np.sort(out_len).tolist() != np.sort(lens).tolist():
        raise RuntimeError("trl pack_dataset did not return every sample exactly once")
    return Batches(out_len, None if stream.sources is None else out_src, offsets, True, False)


def _within_row_starts(lens: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each sample's first token within its row, rows of ``counts`` samples."""
    ends = np.cumsum(lens)
    row_start = np.repeat(np.concatenate(([0], ends))[np.concatenate(([0], np.cumsum(counts)))[:-1]], counts)
    return ends - lens - row_start


def plan_lhotse(stream: Stream, window: int, w: int) -> Batches:
    """lhotse's ``DynamicBucketingSampler`` with ``buffer_size=window`` (padded batches)."""
    from padfree.bench.peers import plan_with_peer

    b = plan_with_peer("lhotse_dynamic_bucketing", stream.lengths, BUDGET, 0, buffer_size=int(window))
    return _batches(b.order, np.diff(b.offsets), stream, False, False)


def plan_torchtitan_rows(stream: Stream, window: int, w: int) -> Batches:
    """torchtitan's mix of packed rows: each source packed greedily alone, rows drawn by
    ``InterleavedDataset`` until the stream's tokens are planned."""
    from torchtitan.hf_datasets.interleaved import InterleavedDataset

    assert stream.sources is not None
    per = [np.flatnonzero(stream.sources == s) for s in range(len(stream.weights))]
    rows = [_SourceRows(stream.lengths, ids, s) for s, ids in enumerate(per)]
    inter = InterleavedDataset(rows, list(stream.weights), seed=0, stopping_strategy="all_exhausted")
    total, got, order, counts = int(stream.lengths.sum()), 0, [], []
    for row in inter:
        order.append(row)
        counts.append(row.shape[0])
        got += int(stream.lengths[row].sum())
        if got >= total:
            break
    return _batches(np.concatenate(order), counts, stream, True, False)


class _SourceRows:
    """One source's rows, packed as torchtitan's ``ChatDataset`` does (flush when the next does not fit),
    with the ``state_dict``/``reloop`` an ``InterleavedDataset`` source needs."""

    def __init__(self, lengths: np.ndarray, ids: np.ndarray, seed: int) -> None:
        self.lengths, self.ids, self.epoch, self.seed = lengths, ids, 0, seed

    def __iter__(self) -> Iterator[np.ndarray]:
        ids = np.random.default_rng((self.seed, self.epoch)).permutation(self.ids) if self.epoch else self.ids
        row: list[int] = []
        room = BUDGET
        for i in ids.tolist():
            n = int(self.lengths[i])
            if n > room and row:
                yield np.array(row, np.int64)
                row, room = [], BUDGET
            row.append(i)
            room -= n
        if row:
            yield np.array(row, np.int64)

    def reloop(self) -> None:
        self.epoch += 1

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])


PLANNERS: dict[str, tuple[Callable[[Stream, int, int], Batches], tuple[str, ...], str]] = {
    "padfree": (plan_padfree, (), "padfree.core.lookahead.window_steps (packed)"),
    "grain_first_fit": (plan_grain, ("grain",), "grain.experimental.FirstFitPackIterDataset, W x 32 bins"),
    "torchforge_buffer": (plan_torchforge, (), "torchforge-style lookahead buffer (re-implemented)"),
    "trl_bfd": (plan_trl, ("trl", "datasets"), "trl pack_dataset(strategy='bfd'), map batches of W"),
    "lhotse_bucketing": (plan_lhotse, ("lhotse",), "lhotse DynamicBucketingSampler, buffer W"),
    "torchtitan_rows": (
        plan_torchtitan_rows,
        ("torchtitan", "torch"),
        "torchtitan InterleavedDataset over per-source greedy rows",
    ),  # fmt: skip
}


def missing(modules: tuple[str, ...]) -> str | None:
    for mod in modules:
        if importlib.util.find_spec(mod) is None:
            return f"python module {mod!r} is not installed (make bench-stream-peers installs it)"
    return None


# ---- measures -------------------------------------------------------------------------------------------


def measure(b: Batches, weights: tuple[float, ...] = ()) -> dict:
    """Padding efficiency, fill, rank imbalance and per-step source-share error of whole steps."""
    n_steps = (b.offsets.shape[0] - 1) // K
    off = b.offsets[: n_steps * K + 1]
    m = int(off[-1])
    lens, offsets = b.lengths[:m], off
    if not b.rank_major:  # micro j of a step goes to rank j % WORLD: rank-major order for rank_costs
        deal = np.array([a * WORLD + r for r in range(WORLD) for a in range(ACCUM)])
        micro = (np.arange(n_steps)[:, None] * K + deal[None, :]).ravel()
        counts = np.diff(off)[micro]
        order = np.concatenate([np.arange(off[j], off[j + 1]) for j in micro]) if m else np.zeros(0, np.int64)
        lens = b.lengths[order]
        offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    shapes = cost.micro_shapes(lens, offsets, b.packed)
    ranks = cost.rank_costs(cost.micro_costs(shapes, DEFAULT_COST), WORLD, ACCUM)
    ratio = ranks.max(axis=1) / ranks.mean(axis=1)
    out = {
        "steps": n_steps,
        "samples": m,
        "padding_efficiency": round(float(shapes.real.sum() / shapes.slots.sum()), 4),
        "fill": round(float(shapes.real.sum() / (n_steps * K * BUDGET)), 4),
        "imbalance_mean": round(float(ratio.mean()), 4),
        "imbalance_p99": round(float(np.quantile(ratio, 0.99)), 4),
    }
    if b.sources is not None and weights:
        step_of = np.repeat(np.arange(n_steps * K) // K, np.diff(off))
        w = np.asarray(weights) / np.sum(weights)
        for unit, vals, one in (("documents", np.ones(m), 1.0),
                                ("tokens", b.lengths[:m].astype(float), float(b.lengths.max()))):  # fmt: skip
            shares = np.zeros((n_steps, w.shape[0]))
            np.add.at(shares, (step_of, b.sources[:m]), vals)
            err = np.abs(shares - w * shares.sum(axis=1, keepdims=True)).max(axis=1) / one
            out[f"share_error_{unit}_mean"] = round(float(err.mean()), 3)
            out[f"share_error_{unit}_max"] = round(float(err.max()), 3)
    return out


def run_one(planner: str, stream: Stream, w: int) -> dict:
    """One planner at a window of ``w`` steps: its numbers, seconds and peak memory (or why not run)."""
    fn, needs, describe = PLANNERS[planner]
    window = window_for_steps(w, _config(stream), float(stream.lengths.mean()))
    row: dict = {"stream": stream.name, "planner": planner, "window_steps": w, "window": window}
    why = missing(needs)
    if why:
        return {**row, "status": f"not run: {why}"}
    if planner not in _WARM:  # imports and numba compiles happen here, outside the measured run
        fn(Stream(stream.name, stream.lengths[:400], None if stream.sources is None else stream.sources[:400],
                  stream.weights), 64, 1)  # fmt: skip
        _WARM.add(planner)
    return {**row, "status": "ok", **in_child(lambda: fn(stream, window, w), stream.weights)}


_WARM: set[str] = set()


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def _rss_reset() -> int:
    """Collect garbage, reset the resident peak (``VmHWM``) to the resident size, and return that size."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS")


def run_sources(stream: Stream, sets: dict[str, np.ndarray], steps: int, unit: str) -> dict:
    """padfree's per-step deficit rule over the three sets in memory (W = the pool)."""
    cfg = _config(stream).with_(sources=tuple((n, wt) for n, _, wt in MIX), unit=unit, epoch_steps=steps)
    data = source_data(sets, cfg)
    plan_sources(data, cfg.with_(epoch_steps=1), 0)  # warm-up: numba compiles

    def plan() -> Batches:
        p, _ = plan_sources(data, cfg, 0)
        return Batches(p.lengths, data.source_of(p.indices), p.offsets, True, True)

    row = {"stream": stream.name, "planner": f"padfree_sources_{unit}", "window_steps": "pool", "window": "-"}
    return {**row, "status": "ok", **in_child(plan, stream.weights)}


def in_child(plan: Callable[[], Batches], weights: tuple[float, ...]) -> dict:
    """Run ``plan`` in a forked child (so what it allocates never stays in this process) and measure it
    there: its numbers, seconds and the growth of the child's resident peak over its resident size at the
    start (``VmHWM`` reset through ``/proc/self/clear_refs``, Linux)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, write one JSON line, leave without cleanup
        code = 0
        try:
            base = _rss_reset()
            t0 = time.perf_counter()
            b = plan()
            seconds = time.perf_counter() - t0
            peak = _status_kib("VmHWM") - base
            out = {**measure(b, weights), "seconds": round(seconds, 2), "peak_mib": round(peak / 1024, 1)}
        except BaseException as exc:  # reported by the parent
            out, code = {"error": f"{type(exc).__name__}: {exc}"[:300]}, 1
        os.write(write, json.dumps(out).encode())
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    out = json.loads(data or b'{"error": "the child wrote nothing"}')
    if "error" in out:
        raise RuntimeError(out["error"])
    return out


# ---- streams --------------------------------------------------------------------------------------------


def seed_mix_stream(folder: Path, samples: int) -> Stream:
    seed = np.minimum(np.load(folder / "seed_mix.cl100k.npy").astype(np.int64), BUDGET)
    pick = np.random.default_rng(0).permutation(seed.shape[0])[:samples]
    return Stream("seed_mix", seed[pick], drawn_by=f"first {samples:,} of a seeded shuffle")


def mix_sets(folder: Path) -> dict[str, np.ndarray]:
    return {n: np.minimum(np.load(folder / f"{f}.cl100k.npy").astype(np.int64), BUDGET) for n, f, _ in MIX}


def mix_stream(sets: dict[str, np.ndarray], samples: int, name: str = "three_sets") -> Stream:
    """``samples`` documents drawn per document by torchtitan's ``InterleavedDataset`` when it is installed,
    else by the same rule in numpy (``drawn_by`` says which)."""
    weights = tuple(wt for _, _, wt in MIX)
    sizes = [sets[n].shape[0] for n, _, _ in MIX]
    starts = np.concatenate(([0], np.cumsum(sizes)))
    if missing(("torchtitan", "torch")) is None:
        from torchtitan.hf_datasets.interleaved import InterleavedDataset

        docs = [_SourceDocs(int(starts[s]), sizes[s], s) for s in range(len(sizes))]
        inter = InterleavedDataset(docs, list(weights), seed=0, stopping_strategy="all_exhausted")
        ids = np.fromiter(itertools.islice(iter(inter), samples), np.int64)
        how = f"torchtitan {importlib.metadata.version('torchtitan')} InterleavedDataset, per document"
    else:
        rng = np.random.default_rng(0)
        pick = rng.choice(len(sizes), size=samples, p=np.asarray(weights) / sum(weights))
        ids = np.empty(samples, np.int64)
        for s in range(len(sizes)):
            at = np.flatnonzero(pick == s)
            ids[at] = starts[s] + np.resize(rng.permutation(sizes[s]), at.shape[0])
        how = "numpy per-document weighted draws (torchtitan not installed)"
    lengths = np.concatenate([sets[n] for n, _, _ in MIX])
    src = np.searchsorted(starts, ids, side="right") - 1
    return Stream(name, lengths[ids], src.astype(np.int64), weights, how)


class _SourceDocs:
    """One source's global ids, reshuffled on each re-loop (an ``InterleavedDataset`` source)."""

    def __init__(self, start: int, size: int, seed: int) -> None:
        self.start, self.size, self.seed, self.epoch = start, size, seed, 0

    def __iter__(self) -> Iterator[int]:
        perm = np.random.default_rng((self.seed, self.epoch)).permutation(self.size) + self.start
        return iter(perm.tolist())

    def reloop(self) -> None:
        self.epoch += 1

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])


# ---- report ---------------------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in PEER_PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


COLS = ["window_steps", "window", "steps", "padding_efficiency", "fill", "imbalance_mean", "imbalance_p99",
        "share_error_documents_mean", "share_error_documents_max", "share_error_tokens_mean",
        "share_error_tokens_max", "peak_mib", "seconds"]  # fmt: skip


def markdown(result: dict) -> str:
    lines = [
        "# Streams and mixtures against the peers' real code (issue 43, item 4)",
        "",
        f"`{result['command']}`",
        "",
        "Budget 16384, 8 ranks x 4 micro-batches, padfree's default cost model for everyone. Streams: "
        + "; ".join(f"{s['name']}: {s['samples']:,} samples, {s['drawn_by']}" for s in result["streams"])
        + ". Versions: "
        + ", ".join(f"{k} {v}" for k, v in result["versions"].items())
        + ".",
        "",
        "Padding efficiency: real tokens over computed slots (packed rows compute their tokens, lhotse's "
        "padded batches count x longest). Fill: real tokens over micro-batches x budget (a fixed-length "
        "packer's padding). Imbalance: a step's most loaded rank over its mean. Share error: a step's "
        "`max_s |u_s - w_s u|` over one document in that unit (1, or the longest sample in tokens). Peak: "
        "growth of the resident peak over the resident size before the run (after a warm-up; grain packs "
        "token arrays, TRL a per-token source column); seconds on a loaded 2-core machine.",
        "",
        "| stream | planner | " + " | ".join(COLS) + " |",
        "|---|---|" + "---:|" * len(COLS),
    ]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['stream']} | {r['planner']} | {r['window_steps']} | {r['status']} |")
            continue
        lines.append(
            f"| {r['stream']} | {r['planner']} | " + " | ".join(str(r.get(c, "-")) for c in COLS) + " |"
        )
    lines += ["", "Notes:"] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


NOTES = [
    "torchforge 0.0.1 on the registry is an empty placeholder package, so `torchforge_buffer` is a "
    "re-implementation of a lookahead buffer (each pack takes every buffered sample that fits, in order).",
    "grain, TRL, lhotse and torchtitan's `InterleavedDataset` are the installed packages' own code; "
    "`torchtitan_rows` re-implements only ChatDataset's greedy per-source packing on lengths (its sources "
    "need a tokenizer and HF datasets) and draws the rows with torchtitan's own interleave.",
    "padfree's windowed planner does not take sources yet (issue 43 item 3 leaves mixtures over streams "
    "open): on three_sets it plans the drawn stream as it comes, and `padfree_sources_*` is the in-memory "
    "per-step deficit rule over the three sets (its memory is the pool's, not O(W)).",
    "Only whole steps are measured. A peer's last, part-filled step is left out (`samples` counts what the "
    "whole steps hold); padfree's windowed planner gives out every sample, its last steps part-empty, which "
    "its fill at W = 1, 2 pays for.",
    "Peak memory is rough (a few MiB of allocator noise): it includes each planner's output ids for the "
    "whole stream, kept for measuring (the same for all), and grain's bins hold token arrays, TRL's table a "
    "per-token source column; the peers' inputs (lhotse's items, TRL's dataset) are built inside the run.",
]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--lengths", type=Path, default=Path("../shared/data/lengths"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--planners", default=",".join(PLANNERS))
    ap.add_argument("--windows", default=",".join(map(str, WINDOWS)))
    ap.add_argument("--streams", default="seed_mix,three_sets")
    ap.add_argument("--name", default="stream_peers")
    args = ap.parse_args(argv)
    planners = [p for p in args.planners.split(",") if p]
    windows = [int(w) for w in args.windows.split(",") if w]
    sets = mix_sets(args.lengths)
    wanted = args.streams.split(",")
    streams = [seed_mix_stream(args.lengths, args.samples)] if "seed_mix" in wanted else []
    streams += [mix_stream(sets, args.samples)] if "three_sets" in wanted else []
    rows = []
    for stream in streams:
        if stream.sources is not None and "padfree" in planners:
            steps = int(stream.lengths.sum() // (K * BUDGET))
            for unit in ("documents", "tokens"):
                rows.append(run_sources(stream, sets, max(steps, 1), unit))
                print(json.dumps(rows[-1]), flush=True)
        for planner in planners:
            if planner == "torchtitan_rows" and stream.sources is None:
                continue
            for w in windows if planner != "torchtitan_rows" else windows[:1]:
                rows.append(run_one(planner, stream, w))
                print(json.dumps(rows[-1]), flush=True)
    result = {
        "command": "python benchmarks/stream_peers.py " + " ".join(argv if argv is not None else _argv()),
        "versions": versions(),
        "streams": [
            {
                "name": s.name,
                "samples": int(s.lengths.shape[0]),
                "drawn_by": s.drawn_by,
                "weights": list(s.weights),
            }
            for s in streams
        ],  # fmt: skip
        "notes": NOTES,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(result))
    return result


def _argv() -> list[str]:
    import sys

    return sys.argv[1:]


if __name__ == "__main__":
    main()
