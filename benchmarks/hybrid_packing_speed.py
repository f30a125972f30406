"""What keeping a hybrid model's token mixers per document costs: real tokens/s of packed vs padded training.

A hybrid model (LFM2-style short convolutions, or Qwen3.5-style gated delta-nets, beside attention) trains
one epoch of the same random subset of real lengths under four setups sharing one token budget:

- ``bucketed``      padded micro-batches of near-equal lengths (``sdpa`` with a mask): padded, never leaks
- ``random``        padded micro-batches of random lengths: what a plain shuffle pays
- ``packed``        one packed row, ``padfree_varlen``, every mixer run per document: exact
- ``packed_leaky``  the same rows with the mixers over the whole row, as transformers runs them without a
                    kernel (wrong: documents leak; shown only to price the per-document path)

Setups run interleaved in rounds so machine drift hits all alike; ratios come from one run.

    PYTHONPATH=src python benchmarks/hybrid_packing_speed.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from packing_speed import packed_batch, padded_batch  # noqa: E402

from padfree.core.config import PlanConfig  # noqa: E402
from padfree.core.planner import make_plan  # noqa: E402
from padfree.models import build_model  # noqa: E402
from padfree.torch.documents.mixers import mixers_of, per_document_mixers  # noqa: E402

BASE = {"vocab_size": 8192, "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4,
        "num_key_value_heads": 4, "max_position_embeddings": 16384, "tie_word_embeddings": False}  # fmt: skip
FAMILIES = {
    "lfm2": {**BASE, "model_type": "lfm2", "num_hidden_layers": 4,
             "layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "qwen3_5": {**BASE, "model_type": "qwen3_5_text", "num_hidden_layers": 4, "head_dim": 64,
                "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
                "linear_value_head_dim": 64},
}  # fmt: skip
SETUPS = {  # name -> (plan strategy, attention, mixers per document)
    "bucketed": ("bucketed", "sdpa", True),
    "random": ("random", "sdpa", True),
    "packed": ("packed", "padfree_varlen", True),
    "packed_leaky": ("packed", "padfree_varlen", False),
}


def run_family(family: str, subset: np.ndarray, budget: int, seed: int) -> dict:
    cfg_dir = Path(tempfile.mkdtemp(prefix=f"padfree-{family}-"))
    (cfg_dir / "config.json").write_text(json.dumps(FAMILIES[family]))
    micro, models, optims = {}, {}, {}
    for name, (strategy, attn, _) in SETUPS.items():
        plan = make_plan(subset, PlanConfig(strategy=strategy, budget=budget, seed=seed, overlong="truncate"))
        micro[name] = [plan.lengths[plan.offsets[k] : plan.offsets[k + 1]] for k in range(plan.n_micro)]
        models[name] = build_model(str(cfg_dir), attn_implementation=attn, seed=seed).train()
        optims[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-4)
    mixers = sorted({type(models["packed"].get_submodule(q)).__name__ for q in mixers_of(models["packed"])})
    gen = torch.Generator().manual_seed(seed)
    vocab = FAMILIES[family]["vocab_size"]
    seconds = dict.fromkeys(SETUPS, 0.0)
    real = dict.fromkeys(SETUPS, 0)
    computed = dict.fromkeys(SETUPS, 0)
    refused: dict[str, str] = {}
    for r in range(max(len(m) for m in micro.values())):
        for name, (strategy, _, apart) in SETUPS.items():
            if r >= len(micro[name]) or name in refused:
                continue
            lengths = micro[name][r]
            batch = (packed_batch if strategy == "packed" else padded_batch)(lengths, gen, vocab)
            t0 = time.perf_counter()
            try:
                with per_document_mixers(apart):
                    models[name](**batch).loss.backward()
            except ValueError as exc:  # transformers' own refusal of packed rows without a kernel
                if apart:
                    raise
                refused[name] = " ".join(str(exc).split())[:160]
                optims[name].zero_grad(set_to_none=True)
                continue
            optims[name].step()
            optims[name].zero_grad(set_to_none=True)
            seconds[name] += time.perf_counter() - t0
            real[name] += int(lengths.sum())
            computed[name] += (
                int(lengths.sum()) if strategy == "packed" else int(lengths.max()) * len(lengths)
            )
    rate = {n: real[n] / seconds[n] if n not in refused else None for n in SETUPS}
    return {
        "mixers": mixers,
        "micro_batches": {n: len(m) for n, m in micro.items()},
        "real_tokens": real,
        "computed_tokens": computed,
        "seconds": seconds,
        "real_tokens_per_s": rate,
        "ratios": {
            "packed/bucketed": rate["packed"] / rate["bucketed"],
            "packed/random": rate["packed"] / rate["random"],
            "packed/packed_leaky": None
            if "packed_leaky" in refused
            else rate["packed"] / rate["packed_leaky"],
        },
        "refused": refused,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--lengths", type=Path, default=None, help="lengths .npy (default ../shared seed_mix)")
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    root = Path(__file__).resolve().parents[1]
    path = args.lengths or root.parent / "shared" / "data" / "lengths" / "seed_mix.mistral_v1.npy"
    lengths = np.load(path).astype(np.int64)
    rng = np.random.default_rng(args.seed)
    subset = np.minimum(lengths[rng.choice(len(lengths), size=args.samples, replace=False)], args.budget)
    t0 = time.perf_counter()
    results = {f: run_family(f, subset, args.budget, args.seed) for f in args.families.split(",")}
    result = {
        "command": "PYTHONPATH=src python benchmarks/hybrid_packing_speed.py "
        + " ".join(argv or sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },  # fmt: skip
        "lengths": str(path),
        "samples": len(subset),
        "budget": args.budget,
        "model": "hidden 256, 4 layers, vocab 8192, float32, AdamW",
        "wall_seconds": time.perf_counter() - t0,
        "families": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hybrid_packing_speed.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# Hybrid models: packed with per-document mixers vs padded (CPU, real tokens/s)",
        "",
        f"`{result['command']}`: {len(subset)} random {path.name} lengths (cut to the budget), budget "
        f"{args.budget}, one epoch per setup, interleaved; {result['model']}.",
        "",
        "| family | mixers per document | packed tok/s | bucketed | random | packed, mixers over the row "
        "(leaks) | packed/bucketed | packed/random | per-document cost (packed/leaky) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for f, r in results.items():
        t, q = r["real_tokens_per_s"], r["ratios"]
        if q["packed/packed_leaky"] is None:  # transformers refuses the whole-row path itself
            t = {**t, "packed_leaky": float("nan")}
            q = {**q, "packed/packed_leaky": float("nan")}
        lines.append(
            f"| {f} | {', '.join(r['mixers'])} | {t['packed']:.0f} | {t['bucketed']:.0f} | "
            f"{t['random']:.0f} | {t['packed_leaky']:.0f} | {q['packed/bucketed']:.2f} | "
            f"{q['packed/random']:.2f} | {q['packed/packed_leaky']:.2f} |"
        )
    refusals = [f"{f}: {r['refused']['packed_leaky']}" for f, r in results.items() if r["refused"]]
    if refusals:
        lines += [
            "",
            "nan: transformers itself refuses packed rows over the whole row here: " + "; ".join(refusals),
        ]
    (args.out / "hybrid_packing_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
