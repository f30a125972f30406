"""Peak memory of ``padfree lengths`` on one huge record: one .jsonl line holding a ~50 MB document, counted
in a fresh process per tokenizer kind (SentencePiece .model, tokenizer.json); prints and writes JSON with the
peak RSS of the counting process (``VmHWM``: reset at exec, so the parent's memory is not counted), its
time and the count.

    PYTHONPATH=src python benchmarks/record_memory.py --mb 50 --out /tmp/record_memory.json
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import sys, time
import numpy as np
from padfree.data.count_lengths import count_lengths
t = time.perf_counter()
res = count_lengths([sys.argv[1]], sys.argv[2], mode="text", workers=1, use_cache=False)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(int(res.lengths[0]), time.perf_counter() - t, hwm)
"""


def document(mb: float, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dogs", "über", "12", "3.14", "naïve"]
    seps = [" "] * 12 + ["\n", ", ", ". ", "\n\n"]
    out, size = [], 0
    while size < mb * 1e6:
        w = rng.choice(words) + rng.choice(seps)
        out.append(w)
        size += len(w)
    return "".join(out)


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--mb", type=float, default=50.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp())
    data = tmp / "one.jsonl"
    data.write_text(json.dumps({"text": document(args.mb)}) + "\n")
    hf = tmp / "tokenizer.json"
    hf.write_bytes(lzma.decompress((ROOT / "fixtures/tokenizers/deepseek_v3_tokenizer.json.xz").read_bytes()))
    (tmp / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<｜end▁of▁sentence｜>"}))
    results = {"record_bytes": data.stat().st_size, "kinds": {}}
    for kind, tok in (
        ("sentencepiece", ROOT / "fixtures/tokenizers/llama_sp32k.model"),
        ("tokenizer.json", hf),
    ):
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(data), str(tok)], capture_output=True, text=True, check=False
        )
        if out.returncode:
            results["kinds"][kind] = {"error": out.stderr.strip().splitlines()[-1]}
            continue
        count, seconds, rss_kb = out.stdout.split()
        results["kinds"][kind] = {
            "tokens": int(count),
            "peak_rss_mb": round(int(rss_kb) / 1024, 1),
            "seconds": round(float(seconds), 2),
            "wall_seconds": round(time.perf_counter() - t0, 2),
        }
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
