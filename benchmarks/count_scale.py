"""Counting lengths past one machine: ``padfree lengths`` vs its Ray path (1 and 2 workers), and reading token
ids others wrote vs tokenizing again.

On the shared samples (``../shared/data/samples``, real chats and documents) with the bundled Llama
SentencePiece tokenizer:

* single machine: :func:`padfree.data.count_lengths.count_lengths` with 1 and 2 processes, cache off;
* Ray: :func:`padfree.data.ray_lengths.count_on_ray` on a local cluster of 1 and 2 workers (wall time with
  the cluster's start, and samples/s per worker); every array equal to the single-machine count;
* readers: the same records' token ids and loss masks written as a parquet ``input_ids`` column, a
  ``datasets`` folder, a Megatron ``.bin/.idx`` (by megatron-core) and datatrove shards (by datatrove), read
  by :func:`padfree.data.readers.read_tokenized`, vs tokenizing the records again; equal arrays.

    PYTHONPATH=src python benchmarks/count_scale.py --out benchmarks/results   # needs the ray, dev extras
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from padfree.data.count_lengths import count_lengths
from padfree.data.ray_lengths import count_on_ray
from padfree.data.readers import read_tokenized
from padfree.data.tokenization import Tokenizer, encode_samples

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "fixtures" / "tokenizers" / "llama_sp32k.model"
FILES = ["hh_rlhf_harmless_test.jsonl.gz", "gsm8k.jsonl.gz", "self_instruct_t0.jsonl.gz"]


def _timed(fn):  # noqa: ANN001, ANN202
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def counting(data: list[Path], ref: np.ndarray, ref_loss: np.ndarray, tmp: Path) -> list[dict]:
    rows = []
    for w in (1, 2):
        res, s = _timed(lambda w=w: count_lengths(data, TOKENIZER, workers=w, use_cache=False))
        assert np.array_equal(res.lengths, ref)
        rate = ref.shape[0] / s
        rows.append({"path": "padfree lengths", "workers": w, "seconds": round(s, 2),
                     "samples_per_s": round(rate), "per_worker": round(rate / w)})  # fmt: skip
    for w in (1, 2):
        out = tmp / f"shards{w}"
        res, s = _timed(lambda w=w, out=out: count_on_ray(data, TOKENIZER, out, workers=w))
        assert np.array_equal(res.lengths, ref) and np.array_equal(res.loss_tokens, ref_loss)
        rows.append({"path": "padfree lengths --ray (local)", "workers": w, "seconds": round(s, 2),
                     "samples_per_s": round(ref.shape[0] / s), "per_worker": round(ref.shape[0] / s / w),
                     "shards": res.n_shards, "equal": True})  # fmt: skip
    return rows


def readers(data: list[Path], ref: np.ndarray, ref_loss: np.ndarray, tmp: Path) -> list[dict]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from datatrove.io import get_datafolder
    from datatrove.pipeline.tokens.tokenizer import TokenizedFile
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from padfree.data import records
    from padfree.data.formats import to_sample
    from padfree.data.reading import field_map, readings

    tok = Tokenizer(TOKENIZER)
    names = field_map("auto", None, None)
    ids, masks = [], []
    for r in readings(data):
        lines = [v for c in records.iter_chunks(r.source, None, 4096) for v in c.values]
        samples = [to_sample(records.parse_line(v)[0], r.fmt, names) for v in lines]
        enc = encode_samples(tok, samples)
        ids += [enc.sample(i)[0] for i in range(len(enc))]
        masks += [enc.sample(i)[1] for i in range(len(enc))]
    table = pa.table({"input_ids": [x.tolist() for x in ids], "loss_mask": [m.tolist() for m in masks]})
    pq.write_table(table, tmp / "ids.parquet")
    datasets.Dataset.from_parquet(str(tmp / "ids.parquet")).save_to_disk(str(tmp / "ds"))
    builder = IndexedDatasetBuilder(str(tmp / "mega.bin"), dtype=np.int32)
    for x in ids:
        builder.add_item(torch.from_numpy(x.astype(np.int32)))
        builder.end_document()
    builder.finalize(str(tmp / "mega.idx"))
    (tmp / "dt").mkdir()
    f = TokenizedFile(get_datafolder(str(tmp / "dt")), "00000_x.ds", save_loss_metadata=True, token_size=4)
    for x, m in zip(ids, masks, strict=True):
        f.write(x.tolist(), m.astype(bool))
    f.close()
    rows = []
    _, s = _timed(lambda: count_lengths(data, TOKENIZER, workers=1, use_cache=False))
    rows.append({"path": "tokenize again (1 process)", "seconds": round(s, 3), "loss_counts": True})
    for name, spec in (("parquet input_ids", tmp / "ids.parquet"), ("datasets folder", tmp / "ds"),
                       ("Megatron .bin/.idx", tmp / "mega.idx"), ("datatrove .ds", tmp / "dt")):  # fmt: skip
        res, s = _timed(lambda spec=spec: read_tokenized([spec]))
        assert np.array_equal(res.lengths, ref)
        if res.loss_tokens is not None:
            assert np.array_equal(res.loss_tokens, ref_loss)
        rows.append({"path": name, "seconds": round(s, 4), "loss_counts": res.loss_tokens is not None,
                     "note": res.note})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--samples", type=Path, default=ROOT.parent / "shared" / "data" / "samples")
    args = ap.parse_args()
    data = [args.samples / f for f in FILES]
    tmp = Path(tempfile.mkdtemp(prefix="padfree-count-"))
    try:
        ref_res = count_lengths(data, TOKENIZER, workers=1, use_cache=False)
        ref, ref_loss = ref_res.lengths, ref_res.loss_tokens
        count_rows = counting(data, ref, ref_loss, tmp)
        reader_rows = readers(data, ref, ref_loss, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {"machine": platform.platform(), "files": FILES, "samples": int(ref.shape[0]),
              "tokens": int(ref.sum()), "counting": count_rows, "readers": reader_rows}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "count_scale.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# Counting lengths: one machine vs Ray, and reading token ids vs tokenizing again",
        "",
        f"`PYTHONPATH=src python benchmarks/count_scale.py` on {platform.machine()} ({platform.platform()}); "
        f"{', '.join(FILES)}: {ref.shape[0]:,} samples, {int(ref.sum()):,} tokens, llama_sp32k. A shared "
        "2-core machine: figures are indicative. Every array equals the single-machine count.",
        "",
        "| path | workers | seconds | samples/s | samples/s per worker |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in count_rows:
        lines.append(f"| {r['path']} | {r['workers']} | {r['seconds']} | {r['samples_per_s']:,} | "
                     f"{r['per_worker']:,} |")  # fmt: skip
    lines += ["", "| lengths from | seconds | loss-bearing counts |", "|---|---:|---|"]
    for r in reader_rows:
        lines.append(f"| {r['path']} | {r['seconds']} | {'yes' if r['loss_counts'] else 'none held'} |")
    (args.out / "count_scale.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
