"""Why a padded micro-batch costs more attention than a packed one of the same tokens, even unpadded.

A padded batch reaches ``torch.nn.functional.scaled_dot_product_attention`` with an explicit mask (causal
and padding, built by transformers from the attention mask); a packed row split per document reaches it
with ``is_causal=True``. The fused kernel skips the upper triangle only in the second case. This script
times forward + backward of both for the same shapes, and records which form transformers' ``sdpa`` path
gives a padded batch without a single pad.

    PYTHONPATH=src python benchmarks/sdpa_mask_cost.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def timed(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def attention_cost(rows: int, length: int, heads: int, dim: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, heads, length, dim, generator=g, requires_grad=True) for _ in range(3))
    mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None].expand(rows, 1, length, length)

    def causal() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def masked() -> None:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()

    a, b = timed(causal, repeats), timed(masked, repeats)
    return {"rows": rows, "length": length, "is_causal_s": a, "explicit_mask_s": b, "ratio": b / a}


def transformers_padded_mask() -> str:
    """What the sdpa attention of a tiny Llama receives for an unpadded 2-row batch with attention_mask."""
    from padfree.models import build_model

    seen: dict = {}
    model = build_model("tiny-llama", attn_implementation="sdpa", num_hidden_layers=1)
    attn = model.model.layers[0].self_attn
    orig = attn.forward

    def spy(*args, **kwargs):
        m = kwargs.get("attention_mask")
        seen["mask"] = None if m is None else f"{tuple(m.shape)} {m.dtype}"
        return orig(*args, **kwargs)

    attn.forward = spy
    ids = torch.randint(1, 100, (2, 64))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
        no_pad = seen["mask"]
        mask = torch.ones_like(ids)
        mask[1, -5:] = 0
        model(input_ids=ids, attention_mask=mask)
    return f"no pad: {no_pad}; with pads: {seen['mask']}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [(8, 512), (4, 1024), (2, 2048), (1, 4096)]  # one micro-batch of 4,096 tokens each way
    rows = [attention_cost(r, n, heads=4, dim=64, repeats=args.repeats) for r, n in shapes]
    result = {
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": args.threads},
        "attention": rows,
        "transformers_sdpa_mask": transformers_padded_mask(),
    }
    lines = [
        "# SDPA: explicit causal mask vs is_causal (forward + backward, 4 heads x 64)",
        "",
        f"torch {torch.__version__}, {args.threads} thread(s), best of {args.repeats}.",
        "",
        "| rows x length | is_causal s | explicit mask s | mask / causal |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r['rows']} x {r['length']} | {r['is_causal_s']:.4f} | {r['explicit_mask_s']:.4f} | "
        f"{r['ratio']:.2f}x |"
        for r in rows
    ]
    lines += ["", f"transformers sdpa, mask given to attention: {result['transformers_sdpa_mask']}", ""]
    md = "\n".join(lines)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sdpa_mask_cost.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "sdpa_mask_cost.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
