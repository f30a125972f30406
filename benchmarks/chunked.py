"""Chunked training of long documents, measured on CPU: exact gradients, peak memory, throughput and balance.

    PYTHONPATH=src python benchmarks/chunked.py --out benchmarks/results

1. gradients: a document of 1..8 chunks trained with ``padfree.torch.execution.chunked.chunked_backward`` vs
whole, in
   float32, tiny Llama, tiny Qwen3 and tiny LFM2 (short convolutions + attention; random weights): the
   largest difference over the parameters, relative to each parameter's largest gradient;
2. peak memory: one forward+backward of a document of 1x..8x the chunk size, whole vs chunked, each in a
   fresh process (peak RSS over the RSS after the model was built);
   split into the state kept of the earlier chunks (their keys/values and the gradient of them, linear in
   the document) and the rest (one chunk's activations and the parameters' gradients: flat);
3. throughput and balance on a long-tail set: one epoch of a tiny Llama, ``chunked`` (documents up to
   ``grad_accum`` chunks, nothing cut) vs ``packed`` and padded ``bucketed`` at the same budget with
   ``--overlong truncate`` and with ``split``, and ``packed`` at ``grad_accum`` times the budget (whole
   documents, that much more memory): trained tokens per second (one process), tokens not trained, and the
   modeled rank imbalance at 8 ranks;
4. the same on seed_mix (the bundled 902K lengths) and on a long tail with a few 32K-64K documents (99.9%
   under 1K): modeled at full scale on 8 ranks (imbalance, modeled throughput, tokens not trained), real
   tokens/s on a subsample (one process).

Writes ``chunked.json`` and ``chunked.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

CHUNK = 512
MEM_MODEL = {"vocab_size": 8192, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 4,
             "max_position_embeddings": 16384}  # fmt: skip
GRAD_MODEL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 4096}  # fmt: skip
TRAIN_MODEL = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 4096}  # fmt: skip
KV_BYTES = 2 * MEM_MODEL["num_hidden_layers"] * MEM_MODEL["hidden_size"] * 4
"""Keys and values of one token, all layers, float32 (the state a chunk keeps of its earlier chunks)."""
LONG_BUDGET, LONG_ACCUM = 4096, 16
"""The 32K-64K long tail's budget and grad_accum: chunked trains documents up to 64K tokens whole."""
SEED_BUDGET, SEED_ACCUM = 2048, 4
"""seed_mix's (its longest samples are 8,192 tokens)."""


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def peak_worker(mode: str, length: int) -> dict:
    """One forward+backward of a ``length``-token document in this fresh process: peak RSS over the RSS
    after building the model."""
    import torch

    from padfree.models import build_model
    from padfree.torch import token_loss_sum
    from padfree.torch.execution.chunked import chunked_backward

    torch.set_num_threads(1)
    model = build_model("tiny-llama", attn_implementation="sdpa", **MEM_MODEL)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MEM_MODEL["vocab_size"], (length,), generator=gen)
    base = _rss_mib()
    t = time.perf_counter()
    if mode == "whole":
        token_loss_sum(model(input_ids=ids[None]).logits, ids[None]).backward()
    else:
        chunked_backward(model, ids, ids, CHUNK)
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    past = length - (length - 1) % CHUNK - 1  # the earlier chunks' tokens: all but the last chunk's
    kept = 2 * past * KV_BYTES / 2**20 if mode == "chunked" else 0.0  # their keys/values and gradient
    return {
        "mode": mode, "length": length, "peak_over_model_mib": peak - base, "seconds": seconds,
        "kept_state_mib": kept, "rest_mib": peak - base - kept,
        "model_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
    }  # fmt: skip


def peak_memory(lengths: list[int]) -> list[dict]:
    rows = []
    for length in lengths:
        for mode in ("whole", "chunked"):
            # a fixed mmap threshold: glibc's moving one keeps freed blocks on the heap, and the peak RSS
            # then counts memory no tensor holds
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            out = subprocess.run(
                [sys.executable, __file__, "--peak", mode, str(length)],
                capture_output=True, text=True, check=True, env=env,
            )  # fmt: skip
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rows[-1], file=sys.stderr)
    return rows


def gradients(max_chunks: int = 8, chunk: int = 32) -> list[dict]:
    import torch
    import transformers

    from padfree.models import build_model
    from padfree.torch import token_loss_sum
    from padfree.torch.execution.chunked import chunked_backward

    rows = []
    for family in ("tiny-llama", "tiny-qwen3", "tiny-lfm2"):
        if family == "tiny-qwen3":
            cfg = transformers.Qwen3Config(**GRAD_MODEL, head_dim=16, use_cache=False)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        elif family == "tiny-lfm2":  # the hybrid: short convolutions carry their conv state across chunks
            types = ["conv", "full_attention"] * 2
            cfg = transformers.Lfm2Config(**GRAD_MODEL | {"num_hidden_layers": 4}, layer_types=types)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        else:
            model = build_model(family, attn_implementation="sdpa", **GRAD_MODEL)
        for n in range(1, max_chunks + 1):
            gen = torch.Generator().manual_seed(n)
            ids = torch.randint(0, GRAD_MODEL["vocab_size"], (n * chunk - n % 3,), generator=gen)
            labels = ids.clone()
            labels[0] = -100
            model.zero_grad()
            token_loss_sum(model(input_ids=ids[None]).logits, labels[None]).backward()
            want = {k: p.grad.clone() for k, p in model.named_parameters()}
            model.zero_grad()
            chunked_backward(model, ids, labels, chunk)
            worst = max(
                float((p.grad - want[k]).abs().max() / want[k].abs().max())
                for k, p in model.named_parameters()
            )
            rows.append({"model": family, "chunks": n, "tokens": int(ids.shape[0]), "max_rel_diff": worst})
    return rows


def long_tail(n: int, budget: int, reach: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(np.log(budget / 2), 1.0, n).astype(np.int64) + 2, reach)


def long_tail_with_long_documents(n_short: int, n_long: int, seed: int = 0) -> np.ndarray:
    """``n_short`` documents under 1K tokens (lognormal, median about 200) and ``n_long`` of 32K-64K tokens,
    shuffled: ChunkFlow's long-tail fine-tuning sets in small."""
    rng = np.random.default_rng(seed)
    short = np.minimum(rng.lognormal(np.log(200), 0.9, n_short).astype(np.int64) + 2, 1023)
    long = rng.integers(32 * 1024, 64 * 1024 + 1, n_long)
    return rng.permutation(np.concatenate([short, long]))


def subsample(lengths: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).choice(lengths, n, replace=False)


SETTINGS = [("chunked", "truncate"), ("packed", "truncate"), ("packed", "split"), ("bucketed", "truncate")]
"""What chunked is compared with at one budget: packed with truncation and with splitting, padded buckets."""


def modeled(lengths: np.ndarray, budget: int, accum: int) -> list[dict]:
    """Full-scale plans on 8 ranks (nothing trained): imbalance, modeled throughput, tokens not trained
    (truncation's; chunked's beyond ``grad_accum`` chunks), documents cut."""
    from padfree import PlanConfig
    from padfree.advice.analyze import measure

    rows = []
    for strategy, overlong in SETTINGS:
        cfg = PlanConfig(strategy, budget, 8, accum, overlong=overlong, seed=0)
        m = measure(lengths, cfg)
        keep = budget * accum if strategy == "chunked" else budget if overlong == "truncate" else None
        lost = 0 if keep is None else int(np.maximum(lengths - keep, 0).sum())
        rows.append({
            "strategy": strategy, "overlong": overlong, "budget": budget, "grad_accum": accum,
            "imbalance_8_ranks": m["imbalance"], "modeled_throughput": m["modeled_throughput"],
            "not_trained": lost, "not_trained_share": lost / float(lengths.sum()),
            "documents_cut": int(m["truncated"] + m["split"]),
            "documents_without_beginning": int(((lengths[lengths > budget] + budget - 1) // budget - 1).sum())
            if overlong == "split" and strategy != "chunked" else 0,
        })  # fmt: skip
        print(rows[-1], file=sys.stderr)
    return rows


def throughput(
    budget: int,
    accum: int,
    n: int = 0,
    rounds: int = 3,
    lengths: np.ndarray | None = None,
    settings: list[tuple[str, int, str]] | None = None,
) -> tuple[list[dict], dict]:
    """One epoch per setting on one process (tiny Llama, float32), the settings in turn ``rounds`` times (the
    fastest round kept: the CPUs are shared), and the modeled balance at 8 ranks. ``lengths``: the set
    (default: :func:`long_tail` of ``n``)."""
    import torch

    from padfree import PlanConfig, make_plan, plan_metrics
    from padfree.errors import ConfigError
    from padfree.models import build_model
    from padfree.torch import PackCollator, PadCollator, PlanBatchSampler, PlannedDataset, token_loss_sum
    from padfree.torch.documents.attention import attention_implementation
    from padfree.torch.execution.chunked import run_step
    from padfree.torch.run.loop import steps_of

    torch.set_num_threads(1)
    if lengths is None:
        lengths = long_tail(n, budget, budget * accum)
    n = int(lengths.size)
    rng = np.random.default_rng(1)
    data = [{"input_ids": rng.integers(1, TRAIN_MODEL["vocab_size"], int(x))} for x in lengths]
    settings = settings or [
        ("chunked", budget, "error"),
        ("packed", budget, "truncate"),
        ("packed", budget, "split"),
        ("bucketed", budget, "truncate"),
        ("packed", budget * accum, "error"),
    ]
    rows: dict[tuple, dict] = {}
    for strategy, b, overlong in [s for _ in range(rounds) for s in settings]:
        cfg = PlanConfig(strategy=strategy, budget=b, grad_accum=accum, overlong=overlong, seed=0)
        try:  # a subsample may be too small for 8 ranks' steps: its full set is modeled elsewhere
            planned = make_plan(lengths, cfg.with_(world_size=8), 0)
            metrics: dict = plan_metrics(planned)
            n_micro: int | None = int(planned.n_micro)
        except ConfigError:
            metrics, n_micro = {"imbalance": None, "truncated": 0, "split": 0}, None
        model = build_model(
            "tiny-llama", attn_implementation=attention_implementation(strategy), **TRAIN_MODEL
        )
        sampler = PlanBatchSampler(lengths, cfg, world_size=1, rank=0)
        collate = PackCollator(chunked=cfg.chunked) if cfg.packed else PadCollator(pad_to_multiple_of=8)
        loader = torch.utils.data.DataLoader(PlannedDataset(data), batch_sampler=sampler, collate_fn=collate)
        trained = 0
        t = time.perf_counter()
        for step in steps_of(loader):
            scale = 1.0 / max(step[-1].info.step_tokens or 1, 1)
            if cfg.chunked:
                _, tokens = run_step(model, step, scale)
            else:
                tokens = 0
                for mb in step:
                    inputs = dict(mb)
                    labels = inputs.pop("labels")
                    (token_loss_sum(model(**inputs).logits, labels) * scale).backward()
                    tokens += mb.tokens
            trained += tokens
            model.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t
        key = (strategy, b, overlong)
        if key in rows and rows[key]["seconds"] <= seconds:
            continue
        rows[key] = {
            "strategy": strategy, "budget": b, "overlong": overlong, "trained_tokens": trained,
            "not_trained": int(lengths.sum()) - trained, "seconds": seconds,
            "tokens_per_s": trained / seconds,
            "imbalance_8_ranks": metrics["imbalance"], "micro_batches": n_micro,
            "documents_cut": int(metrics["truncated"] + metrics["split"]),
        }  # fmt: skip
        print(rows[key], file=sys.stderr)
    data_summary = {"samples": int(n), "tokens": int(lengths.sum()),
                    "over_budget": int((lengths > budget).sum()), "longest": int(lengths.max()),
                    "budget": budget, "grad_accum": accum}  # fmt: skip
    return list(rows.values()), data_summary


def render(result: dict) -> str:
    lines = ["# Chunked training of long documents (CPU)", "", f"Command: `{result['command']}`", ""]
    lines += ["## Gradients: chunked vs whole document (float32)", "",
              "| model | chunks | tokens | max relative difference |", "|---|---:|---:|---:|"]  # fmt: skip
    for r in result["gradients"]:
        lines.append(f"| {r['model']} | {r['chunks']} | {r['tokens']} | {r['max_rel_diff']:.2e} |")
    lines += ["", f"## Peak memory of one forward+backward (chunk {CHUNK} tokens, MiB over the model)", "",
              "Chunked's peak split in two: the state kept of the earlier chunks (their keys/values and the "
              f"gradient sent to them: {2 * KV_BYTES / 1024:.0f} KiB a token of the past here, "
              "`2 x 2 x layers x kv_heads x head_dim x 4` bytes in float32) and the rest (one chunk's "
              "activations, the parameters' gradients).", "",
              "| tokens | whole | chunked | chunked: kept state | chunked: the rest | whole s | chunked s |",
              "|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    by = {(r["mode"], r["length"]): r for r in result["peak_memory"]}
    for length in sorted({r["length"] for r in result["peak_memory"]}):
        w, c = by[("whole", length)], by[("chunked", length)]
        lines.append(
            f"| {length} | {w['peak_over_model_mib']:.0f} | {c['peak_over_model_mib']:.0f} | "
            f"{c['kept_state_mib']:.0f} | {c['rest_mib']:.0f} | {w['seconds']:.2f} | {c['seconds']:.2f} |"
        )
    d = result["dataset"]
    lines += ["", "## One epoch on a long-tail set, one process", "",
              f"{d['samples']} samples, {d['tokens']:,} tokens, {d['over_budget']} over the budget of "
              f"{d['budget']} (longest {d['longest']}); grad_accum {d['grad_accum']}. Tokens/s: the fastest "
              "of 3 rounds on a shared 2-core machine (noisy). Imbalance: modeled, 8 ranks.", "",
              "| strategy | budget | overlong | tokens trained | not trained | tokens/s "
              "| imbalance (8 ranks) |",
              "|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in result["throughput"]:
        lines.append(
            f"| {r['strategy']} | {r['budget']} | {r['overlong']} | {r['trained_tokens']:,} | "
            f"{r['not_trained']:,} | {r['tokens_per_s']:,.0f} | {r['imbalance_8_ranks'] or 0:.4f} |"
        )
    for key, title in (("seed_mix", "seed_mix"), ("long_tail_32k", "a long tail with 32K-64K documents")):
        part = result.get(key)
        if not part:
            continue
        d = part["full"]
        lines += ["", f"## {title}: modeled at full scale (8 ranks)", "",
                  f"{d['samples']:,} samples, {d['tokens']:,} tokens, {d['over_budget']:,} over the budget "
                  f"of {d['budget']:,} (longest {d['longest']:,}); grad_accum {d['grad_accum']} (chunked "
                  f"trains up to {d['budget'] * d['grad_accum']:,} tokens a document whole).", "",
                  "| strategy | overlong | imbalance (8 ranks) | modeled throughput | tokens not trained "
                  "| pieces cut from their beginning |",
                  "|---|---|---:|---:|---:|---:|"]  # fmt: skip
        for r in part["modeled"]:
            lines.append(
                f"| {r['strategy']} | {r['overlong']} | {r['imbalance_8_ranks']:.4f} | "
                f"{r['modeled_throughput']:.3f} | {r['not_trained']:,} ({r['not_trained_share']:.1%}) | "
                f"{r['documents_without_beginning']:,} |"
            )
        d = part["sample"]
        lines += ["", f"Real, one process, a subsample: {d['samples']} samples, {d['tokens']:,} tokens, "
                  f"{d['over_budget']} over the budget (longest {d['longest']:,}); one round.", "",
                  "| strategy | budget | overlong | tokens trained | not trained | tokens/s |",
                  "|---|---:|---|---:|---:|---:|"]  # fmt: skip
        for r in part["real"]:
            lines.append(
                f"| {r['strategy']} | {r['budget']} | {r['overlong']} | {r['trained_tokens']:,} | "
                f"{r['not_trained']:,} | {r['tokens_per_s']:,.0f} |"
            )
    lines += ["", *result["notes"], ""]
    return "\n".join(lines)


def notes(result: dict) -> list[str]:
    """What the numbers say, in three lines."""
    peaks, grads = result["peak_memory"], result["gradients"]
    whole = {r["length"]: r["peak_over_model_mib"] for r in peaks if r["mode"] == "whole"}
    chunk = {r["length"]: r["peak_over_model_mib"] for r in peaks if r["mode"] == "chunked"}
    lo, hi = 2 * CHUNK, 8 * CHUNK

    def per_token(d: dict) -> float:
        return (d[hi] - d[lo]) * 2**20 / (hi - lo) / 1024

    kept = {r["length"]: r["kept_state_mib"] for r in peaks if r["mode"] == "chunked"}
    rest = {r["length"]: r["rest_mib"] for r in peaks if r["mode"] == "chunked"}
    model = next(r["model_mib"] for r in peaks if "model_mib" in r)
    lines = [
        f"- largest gradient difference: {max(r['max_rel_diff'] for r in grads):.1e} (float32 rounding).",
        f"- peak memory from {lo} to {hi} tokens (4x): whole {whole[lo]:.0f} -> {whole[hi]:.0f} MiB "
        f"({whole[hi] / whole[lo]:.1f}x, {per_token(whole):.0f} KiB a token: activations); chunked "
        f"{chunk[lo]:.0f} -> {chunk[hi]:.0f} MiB ({chunk[hi] / chunk[lo]:.2f}x), of which the kept state of "
        f"the earlier chunks {kept[lo]:.0f} -> {kept[hi]:.0f} MiB ({2 * KV_BYTES / 1024:.0f} KiB a token "
        f"of the past: keys/values and their gradient, which exact attention to the whole past needs) and "
        f"the rest {rest[lo]:.0f} -> {rest[hi]:.0f} MiB ({rest[hi] / rest[lo]:.2f}x: flat; with the "
        f"{model:.0f} MiB of weights, {(rest[hi] + model) / (rest[lo] + model):.2f}x). The past is read "
        "block by block (`padfree.torch.documents.past_attention`): no chunk x past mask, no copy of the "
        "past's "
        "keys/values.",
        "- chunked recomputes every chunk's forward but the last one (one extra forward per long document); "
        "its rows are at most one chunk, and a long document's last chunk runs alone (no packing partner).",
    ]
    for key in ("seed_mix", "long_tail_32k"):
        part = result.get(key)
        if not part:
            continue
        by = {(r["strategy"], r["overlong"]): r for r in part["modeled"]}
        c, t = by[("chunked", "truncate")], by[("packed", "truncate")]
        cut = by[("packed", "split")]["documents_without_beginning"]
        real = {(r["strategy"], r["overlong"]): r for r in part["real"]}
        rc, rt = real[("chunked", "truncate")], real[("packed", "truncate")]
        rw = real.get(("packed", "error"))
        whole = (
            ""
            if rw is None
            else f"; whole documents in micro-batches of {rw['budget']:,} tokens (the same attention to the "
            f"whole past, more memory) {rw['tokens_per_s']:,.0f} "
            f"({rc['tokens_per_s'] / rw['tokens_per_s']:.2f}x)"
        )
        lines.append(
            f"- {key}: chunked trains {1 - c['not_trained_share']:.1%} of the tokens (packed with truncation "
            f"{1 - t['not_trained_share']:.1%}; splitting trains them all but cuts {cut:,} pieces off "
            f"from their beginning), imbalance {c['imbalance_8_ranks']:.4f} at 8 ranks (packed "
            f"{t['imbalance_8_ranks']:.4f}); real tokens/s on the subsample {rc['tokens_per_s']:,.0f} vs "
            f"{rt['tokens_per_s']:,.0f} ({rc['tokens_per_s'] / rt['tokens_per_s']:.2f}x, counting the tokens "
            f"each trains: truncation and splitting skip the attention to the past, which dominates a tiny "
            f"model's cost at this length){whole}."
        )
    return lines


def extra_sets() -> dict:
    """seed_mix and the 32K-64K long tail: modeled at full scale, real tokens/s on a subsample."""
    from padfree.data.length_files import bundled_seed_mix

    out = {}
    sets = {
        "seed_mix": (np.asarray(bundled_seed_mix()), SEED_BUDGET, SEED_ACCUM, 300),
        "long_tail_32k": (long_tail_with_long_documents(20_000, 20), LONG_BUDGET, LONG_ACCUM, 0),
    }
    for key, (lengths, budget, accum, n_sample) in sets.items():
        full = {"samples": int(lengths.size), "tokens": int(lengths.sum()), "budget": budget,
                "over_budget": int((lengths > budget).sum()), "longest": int(lengths.max()),
                "grad_accum": accum}  # fmt: skip
        rows = modeled(lengths, budget, accum)
        if n_sample:
            sample = subsample(lengths, n_sample)
        else:  # 300 short documents and two long ones
            sample = np.concatenate([subsample(lengths[lengths < 1024], 300), [36 * 1024, 60 * 1024]])
        # and whole documents in one micro-batch of the reach (the attention chunked does, more memory)
        settings = [(s, budget, o) for s, o in SETTINGS] + [("packed", budget * accum, "error")]
        real, summary = throughput(budget, accum, rounds=1, lengths=sample, settings=settings)
        out[key] = {"full": full, "modeled": rows, "real": real, "sample": summary}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--peak", nargs=2, metavar=("MODE", "LENGTH"), help=argparse.SUPPRESS)
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--render", action="store_true", help="only write chunked.md again from chunked.json")
    p.add_argument(
        "--only", choices=["gradients", "sets"], help="run one part again, the rest from chunked.json"
    )
    args = p.parse_args(argv)
    if args.peak:
        print(json.dumps(peak_worker(args.peak[0], int(args.peak[1]))))
        return 0
    if args.render or args.only:
        result = json.loads((args.out / "chunked.json").read_text())
        if args.only == "sets":
            result |= extra_sets()
        elif args.only == "gradients":
            result["gradients"] = gradients()
    else:
        result = {
            "command": "PYTHONPATH=src python benchmarks/chunked.py --out benchmarks/results",
            "gradients": gradients(),
            "peak_memory": peak_memory([CHUNK, 2 * CHUNK, 4 * CHUNK, 8 * CHUNK]),
        }
        result["throughput"], result["dataset"] = throughput(budget=256, accum=4, n=args.samples)
        result |= extra_sets()
    result["notes"] = notes(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chunked.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "chunked.md").write_text(render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
