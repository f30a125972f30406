"""Does an anchor width run here? speculators' own ``DFlashDraftModel`` (their 0.9.0 wheel, SDPA, padfree's
tiny target, their recipe's block size) forward and backward on the padfree row with the most anchors, at
``batch_max_length`` B and anchor width W, on the bundled chats: the row's tokens and anchors, the memory it
adds to the process and its seconds (one thread). Needs the peers (``make setup-dev``).

    PYTHONPATH=src python benchmarks/speculators_anchor_width.py 2048 1024
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

import lab  # noqa: F401  (puts tests/ on sys.path, where support is)
from padfree.core.config import PlanConfig
from padfree.drafter import recipes
from padfree.drafter.proc import peak_resident_bytes, reset_peak, resident_bytes
from padfree.drafter.target import build_target
from padfree.integrations import feed
from padfree.integrations import speculators as sp
from padfree.torch import PlannedDataset
from support import drafters
from support.peers import import_peer

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 2048


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("budget", type=int, help="batch_max_length")
    ap.add_argument("width", type=int, help="anchor width W (their --max-anchors)")
    ap.add_argument("--samples", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = build_target(vocab_size=VOCAB)
    samples = drafters.bundled_chats(ROOT / "fixtures", args.samples, VOCAB, max_tokens=args.budget)
    rec = recipes.get("speculators", "dflash")
    model = drafters.speculators_dflash(target, (1, 3), block_size=rec.block_size, mask_token_id=VOCAB - 1)
    transfer = drafters.TargetTransfer(target, samples, feed.target_layers(model))
    with tempfile.TemporaryDirectory() as tmp:
        ds = drafters.speculators_dataset(Path(tmp) / "data", samples, max_len=args.budget, transfer=transfer)
        anchors = sp.count_anchors(ds, rec, max_len=args.budget)
        config = PlanConfig(strategy="packed", anchor_budget=args.width)
        sampler = sp.PadfreeMultipackSampler(
            args.budget, ds.approx_lengths, 1, 0, config=config, anchors=anchors, recipe=rec
        )
        their = import_peer("speculators", "train.data").CollateFn(
            args.budget, 64, len(model.target_layer_ids), torch.float32
        )
        collate = sp.PadfreeCollate(their, method="dflash", recipe=rec, shapes=sampler.shapes)
        batches = list(DataLoader(PlannedDataset(ds), batch_sampler=sampler, collate_fn=collate))
    kwargs = sp.trainer_kwargs(model, rec, loss_implementation="eager", max_anchors=args.width)
    sp.install(model)
    big = max(batches, key=lambda b: int(b["padfree_anchor_valid"].sum()))
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = resident_bytes()
    reset_peak()
    t0 = time.perf_counter()
    _, loss, _ = model(**dict(big), **kwargs)
    loss.backward()
    seconds = time.perf_counter() - t0
    out = {
        "batch_max_length": args.budget,
        "width": args.width,
        "rows": len(batches),
        "row_tokens": int((big["document_ids"] >= 0).sum()),
        "row_anchors": int(big["padfree_anchor_valid"].sum()),
        "anchor_share": round(float(anchors.sum() / np.sum(ds.approx_lengths)), 3),
        "peak_gib": round((peak_resident_bytes() - base) / 2**30, 2),
        "seconds": round(seconds, 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
