"""Real tokens per second of a tiny-Llama training step: packed rows vs padded batches, on real lengths.

One training step = forward, backward and AdamW on one micro-batch of the padfree plan, for four setups that
share one token budget:

- ``sorted``        padded batch (length-sorted micro-batches), ``sdpa`` with an attention mask
- ``random``        padded batch (random micro-batches), ``sdpa`` with an attention mask
- ``packed``        one packed row, ``padfree_varlen`` (per-document attention, no dense mask)
- ``packed_sdpa``   the same packed rows through ``sdpa`` (transformers' dense block-diagonal mask)

Setups run interleaved in rounds (A B C D A B C D ...) so that machine drift hits all of them alike; the first
``--warmup`` rounds are discarded. By default every setup trains on one whole epoch of the same random
subset of documents, so the aggregate real tokens/s (padding not counted) compares like with like; medians of
per-step rates are reported too.
Token ids are random (throughput does not depend on them).

    PYTHONPATH=src python benchmarks/packing_speed.py --budget 4096 --samples 64 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from padfree.core.config import PlanConfig
from padfree.core.planner import make_plan
from padfree.models import build_model
from padfree.torch.documents.attention import attn_for

SETUPS = {  # name -> (plan strategy, attn implementation)
    "sorted": ("sorted", "sdpa"),
    "random": ("random", "sdpa"),
    "packed": ("packed", attn_for("packed")),
    "packed_sdpa": ("packed", "sdpa"),
}


def padded_batch(lengths: np.ndarray, gen: torch.Generator, vocab: int) -> dict:
    n, width = len(lengths), int(lengths.max())
    ids = torch.randint(0, vocab, (n, width), generator=gen)
    mask = torch.arange(width)[None, :] < torch.as_tensor(lengths)[:, None]
    labels = ids.masked_fill(~mask, -100)
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": labels}


def packed_batch(lengths: np.ndarray, gen: torch.Generator, vocab: int) -> dict:
    """The PackCollator layout: one row, position ids restarting per document, -100 at each document start,
    flash-attention style boundaries."""
    total = int(lengths.sum())
    ids = torch.randint(0, vocab, (1, total), generator=gen)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.as_tensor(np.cumsum(lengths), dtype=torch.int32)
    starts = cu[:-1].long()
    pos = torch.arange(total) - torch.repeat_interleave(starts, torch.as_tensor(lengths))
    labels = ids.clone()
    labels[0, starts] = -100
    m = int(lengths.max())
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": pos[None],
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": m,
        "max_length_k": m,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--lengths", type=Path, default=None, help="lengths .npy (default ../shared seed_mix)")
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=4000, help="random subset of the lengths to plan")
    ap.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="measured rounds; 0 (default): one whole epoch of the subset per setup, so that every setup "
        "trains on exactly the same documents",
    )
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    root = Path(__file__).resolve().parents[1]
    path = args.lengths or root.parent / "shared" / "data" / "lengths" / "seed_mix.mistral_v1.npy"
    all_lengths = np.load(path).astype(np.int64)
    rng = np.random.default_rng(args.seed)
    subset = all_lengths[
        rng.choice(len(all_lengths), size=min(args.samples, len(all_lengths)), replace=False)
    ]
    names = args.setups.split(",")

    micro: dict[str, list[np.ndarray]] = {}
    for name in names:
        strategy = SETUPS[name][0]
        plan = make_plan(
            subset,
            PlanConfig(
                strategy=strategy,
                budget=args.budget,
                world_size=1,
                grad_accum=1,
                seed=args.seed,
                overlong="truncate",
            ),
        )
        micro[name] = [plan.lengths[plan.offsets[k] : plan.offsets[k + 1]] for k in range(plan.n_micro)]

    models, optims = {}, {}
    for name in names:
        models[name] = build_model("tiny-llama", attn_implementation=SETUPS[name][1], seed=args.seed)
        models[name].train()
        optims[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-4)
    vocab = models[names[0]].config.vocab_size

    gen = torch.Generator().manual_seed(args.seed)
    rates: dict[str, list[float]] = {n: [] for n in names}
    cpu_rates: dict[str, list[float]] = {n: [] for n in names}
    detail: dict[str, list[dict]] = {n: [] for n in names}
    t_start = time.perf_counter()
    epoch = args.rounds == 0
    rounds = max(len(m) for m in micro.values()) if epoch else args.rounds
    for r in range(rounds + args.warmup):
        for name in names:
            if epoch and r - args.warmup >= len(micro[name]):
                continue  # this setup has finished its epoch
            k = r if r < args.warmup else r - args.warmup
            lengths = micro[name][k % len(micro[name])]
            make = packed_batch if SETUPS[name][0] == "packed" else padded_batch
            batch = make(lengths, gen, vocab)
            model, opt = models[name], optims[name]
            t0, c0 = time.perf_counter(), time.process_time()
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            real = int(lengths.sum())
            if r >= args.warmup:
                rates[name].append(real / dt)
                cpu_rates[name].append(real / cpu)
                detail[name].append(
                    {
                        "docs": len(lengths),
                        "real": real,
                        "padded": int(lengths.max()) * len(lengths) if SETUPS[name][0] != "packed" else real,
                        "seconds": dt,
                        "cpu_seconds": cpu,
                    }
                )
        print(
            f"round {r}: " + " ".join(f"{n}={real_rate(detail[n]):.0f}" for n in names if detail[n]),
            file=sys.stderr,
            flush=True,
        )
    wall = time.perf_counter() - t_start

    med = {n: statistics.median(rates[n]) for n in names}
    cpu_med = {n: statistics.median(cpu_rates[n]) for n in names}
    ratios, cpu_ratios, paired = {}, {}, {}
    if "packed" in med:
        for other in names:
            if other != "packed":
                ratios[f"packed/{other}"] = med["packed"] / med[other]
                cpu_ratios[f"packed/{other}"] = cpu_med["packed"] / cpu_med[other]
                paired[f"packed/{other}"] = statistics.median(
                    a / b for a, b in zip(rates["packed"], rates[other], strict=False)
                )
    result = {
        "command": "PYTHONPATH=src python benchmarks/packing_speed.py " + " ".join(argv or sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "model": "tiny-llama (hidden 256, 4 layers, vocab 32000), float32, AdamW",
        "lengths": str(path),
        "samples": len(subset),
        "budget": args.budget,
        "rounds": rounds,
        "whole_epoch": epoch,
        "warmup_rounds": args.warmup,
        "wall_seconds": wall,
        "load_average_after": os.getloadavg(),
        "median_real_tokens_per_s": med,
        "median_real_tokens_per_cpu_s": cpu_med,
        "mean_docs_per_step": {n: statistics.mean(d["docs"] for d in detail[n]) for n in names},
        "mean_real_tokens_per_step": {n: statistics.mean(d["real"] for d in detail[n]) for n in names},
        "aggregate_real_tokens_per_s": {n: real_rate(detail[n]) for n in names},
        "padding_fraction": {
            n: 1 - sum(d["real"] for d in detail[n]) / sum(d["padded"] for d in detail[n]) for n in names
        },
        "ratios_of_medians": ratios,
        "ratios_of_cpu_time_medians": cpu_ratios,
        "median_of_per_round_ratios": paired,
        "steps": detail,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "packing_speed_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "packing_speed_cpu.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def real_rate(steps: list[dict]) -> float:
    return sum(s["real"] for s in steps) / max(sum(s["seconds"] for s in steps), 1e-9)


def markdown(res: dict) -> str:
    lines = [
        "# Packed vs padded training throughput (CPU)",
        "",
        f"Command: `{res['command']}`",
        "",
        f"Machine: {res['machine']['platform']}, {res['machine']['cpus']} CPUs, "
        f"torch {res['machine']['torch']} with {res['machine']['torch_threads']} threads.",
        f"Model: {res['model']}. Lengths: `{res['lengths']}` ({res['samples']} random samples), "
        f"token budget {res['budget']}, "
        + ("one whole epoch per setup (every setup sees the same documents), " if res["whole_epoch"] else "")
        + f"{res['rounds']} measured rounds after {res['warmup_rounds']} warm-up "
        f"rounds, setups interleaved; wall {res['wall_seconds']:.0f} s.",
        "",
        f"Load average after the run (other jobs shared the 2 cores): "
        f"{', '.join(f'{x:.1f}' for x in res['load_average_after'])}.",
        "",
        "| setup | median real tok/s (wall) | median real tok/CPU-s | aggregate real tok/s | docs/step "
        "| real tokens/step | padding |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n, v in res["median_real_tokens_per_s"].items():
        lines.append(
            f"| {n} | {v:.0f} | {res['median_real_tokens_per_cpu_s'][n]:.0f} | "
            f"{res['aggregate_real_tokens_per_s'][n]:.0f} | {res['mean_docs_per_step'][n]:.1f} | "
            f"{res['mean_real_tokens_per_step'][n]:.0f} | {res['padding_fraction'][n]:.1%} |"
        )
    agg = res["aggregate_real_tokens_per_s"]
    lines += [
        "",
        "| ratio | of aggregates (whole run) | of wall medians | of CPU-time medians "
        "| median of per-round wall ratios |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {k} | {agg['packed'] / agg[k.split('/')[1]]:.2f}x | {v:.2f}x | "
        f"{res['ratios_of_cpu_time_medians'][k]:.2f}x | {res['median_of_per_round_ratios'][k]:.2f}x |"
        for k, v in res["ratios_of_medians"].items()
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
