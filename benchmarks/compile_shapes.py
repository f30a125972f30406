"""Shapes a compiler keeps: what ``PlanConfig(shapes=...)`` costs in padding and saves in recompiles.

Two parts, both on ``seed_mix`` (the bundled 902K-sample lengths, ``padfree/data/seed_mix.npy``):

1. **The whole epoch, planned** (no model): for each shapes setting, the distinct row lengths of a packed and
   a bucketed plan (what ``torch.compile`` with static shapes, or CUDA graphs, records one graph each for)
   and the padding the setting adds (padding efficiency = real tokens / computed slots, from the plan's
   metrics, which count every pad the collators compute).
2. **An epoch slice, compiled on CPU**: a tiny causal LM (2 layers, hidden 64) trained on the first packed
   micro-batches of a plan at budget 2048 (CPU attention over 8K-token rows takes tens of seconds a
   step), collated by ``PackCollator(shapes=...)``, under ``torch.compile`` with static
   shapes (``dynamic=False``, a graph per shape, the CUDA-graph regime) and with automatic dynamic shapes
   (``dynamic=None``), with and without shapes: graphs compiled (a counting backend around ``aot_eager``,
   the same graphs dynamo makes for inductor, or inductor itself with ``--backend inductor``), total wall
   time (compiles included) and the median step that compiled nothing.

    PYTHONPATH=src python benchmarks/compile_shapes.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from padfree import PlanConfig, make_plan
from padfree.core.shard import geometric_shapes
from padfree.data.length_files import bundled_seed_mix

BUDGET = 8192
COMPILED_BUDGET = 2048  # the compiled slice: rows of at most 2048 tokens (CPU attention stays affordable)


def settings() -> dict[str, object]:
    return {
        "off": None,
        "multiple of 128": 128,
        "multiple of 512": 512,
        "multiple of 2048": 2048,
        "ladder x2 from 512": geometric_shapes(512, BUDGET, 2.0),
        "ladder x1.25 from 512": geometric_shapes(512, BUDGET, 1.25),
    }


def plan_part(lengths: np.ndarray) -> list[dict]:
    rows = []
    for name, shapes in settings().items():
        for strategy in ("packed", "bucketed"):
            cfg = PlanConfig(strategy=strategy, budget=BUDGET, world_size=8, grad_accum=4, shapes=shapes,
                             overlong="truncate", seed=0)  # fmt: skip
            plan = make_plan(lengths, cfg, 0)
            sh = plan.shapes()
            full = sh.count > 0
            n_rows = np.ones(int(full.sum()), np.int64) if cfg.packed else sh.count[full].astype(np.int64)
            width = (sh.slots[full] / n_rows).astype(np.int64)  # a padded row's width; a packed row's length
            rows.append({
                "shapes": name, "strategy": strategy, "micro_batches": int(plan.n_micro),
                "distinct_row_lengths": int(np.unique(width).shape[0]),
                "distinct_batch_shapes": int(np.unique(np.stack([n_rows, width]), axis=1).shape[1]),
                "padding_efficiency": round(float(sh.real.sum() / sh.slots.sum()), 4),
            })  # fmt: skip
    return rows


def compile_part(
    lengths: np.ndarray, n_micro: int, shapes: object, dynamic: bool | None, backend: str
) -> dict:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from padfree.torch import PackCollator

    torch.manual_seed(0)
    torch._dynamo.reset()
    torch._dynamo.config.cache_size_limit = 1024  # count every graph instead of falling back to eager
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    vocab, hidden, heads = 256, 64, 4

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
            self.n1, self.n2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, t, 3, heads, hidden // heads).unbind(2)
            a = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            x = x + self.out(a.transpose(1, 2).reshape(b, t, hidden))
            return x + self.mlp(self.n2(x))

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.blocks = nn.Embedding(vocab, hidden), nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(hidden, vocab)

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            x = self.emb(ids)
            for blk in self.blocks:
                x = blk(x)
            logits = self.head(x)[:, :-1]
            return F.cross_entropy(logits.reshape(-1, vocab), labels[:, 1:].reshape(-1), ignore_index=-100)

    graphs = 0

    def counting(gm, example_inputs):  # noqa: ANN001, ANN202
        nonlocal graphs
        graphs += 1
        if backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def boxed(g, _):  # noqa: ANN001, ANN202
            return make_boxed_func(g.forward)

        return aot_autograd(fw_compiler=boxed, bw_compiler=boxed)(gm, example_inputs)

    model = LM()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = torch.compile(model, backend=counting, dynamic=dynamic)
    cfg = PlanConfig(strategy="packed", budget=COMPILED_BUDGET, shapes=shapes, overlong="truncate", seed=0)
    plan = make_plan(lengths, cfg, 0)
    collate = PackCollator(shapes=shapes)
    rng = np.random.default_rng(0)
    times, t0, widths, fresh = [], time.perf_counter(), [], []
    for k in range(n_micro):
        ids = plan.micro(k)
        items = [
            {"input_ids": rng.integers(0, vocab, int(min(lengths[i], cfg.shard.capacity(COMPILED_BUDGET))))}
            for i in ids
        ]
        b = collate(items)
        widths.append(int(b["input_ids"].shape[1]))
        t, before = time.perf_counter(), graphs
        loss = step(b["input_ids"], b["labels"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
        fresh.append(graphs > before)
    warm = [t for t, f in zip(times, fresh, strict=True) if not f] or [float("nan")]
    return {
        "graphs_compiled": graphs,
        "distinct_row_lengths": len(set(widths)),
        "total_s": round(time.perf_counter() - t0, 2),
        "steps_that_compiled": int(sum(fresh)),
        "median_step_s_without_compile": round(statistics.median(warm), 4),
        "padding_efficiency": round(float(plan.shapes().real[:n_micro].sum() / sum(widths)), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--micro", type=int, default=16, help="packed micro-batches of the compiled slice")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--backend",
        default="aot_eager",
        choices=["aot_eager", "inductor"],
        help="aot_eager (dynamo + AOTAutograd: the same graphs and recompiles, seconds to compile) or "
        "inductor (code generation: minutes per graph on a loaded CPU)",
    )
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    lengths = bundled_seed_mix()
    planned = plan_part(lengths)
    compiled = []
    ladder = geometric_shapes(256, COMPILED_BUDGET, 2.0)
    for dynamic in (False, None):
        for name, shapes in (("off", None), ("multiple of 128", 128), ("ladder x2 from 256", ladder)):
            r = compile_part(lengths, args.micro, shapes, dynamic, args.backend)
            compiled.append({"dynamic": dynamic, "shapes": name, **r})
            print(compiled[-1], flush=True)
    result = {
        "machine": platform.platform(), "torch": torch.__version__, "threads": args.threads, "budget": BUDGET,
        "backend": args.backend, "compiled_budget": COMPILED_BUDGET,
        "lengths": "seed_mix (bundled, 902K samples)", "plan": planned, "compile": compiled,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compile_shapes.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# Shapes a compiler keeps: padding vs recompiles (seed_mix)",
        "",
        f"`PYTHONPATH=src python benchmarks/compile_shapes.py --micro {args.micro}` on {platform.machine()}, "
        f"torch {torch.__version__}, {args.threads} threads. Budget {BUDGET}, world 8 x grad_accum 4, the "
        "whole epoch.",
        "",
        "## The epoch, planned: distinct row lengths (one graph each under static shapes / CUDA graphs)",
        "",
        "| shapes | strategy | micro-batches | distinct row lengths | distinct (rows, width) | padding eff."
        " |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in planned:
        cells = [r["shapes"], r["strategy"], f"{r['micro_batches']:,}", f"{r['distinct_row_lengths']:,}",
                 f"{r['distinct_batch_shapes']:,}", f"{r['padding_efficiency']:.4f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"## {args.micro} packed micro-batches of budget {COMPILED_BUDGET} compiled on CPU (tiny LM, "
        f"backend {args.backend})",
        "",
        "| dynamic | shapes | graphs compiled | distinct row lengths | total s (compiles incl.) | "
        "steps that compiled | median step s without a compile | padding eff. |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in compiled:
        keys = ("dynamic", "shapes", "graphs_compiled", "distinct_row_lengths", "total_s")
        keys += ("steps_that_compiled", "median_step_s_without_compile", "padding_efficiency")
        cells = [str(r[k]) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    (args.out / "compile_shapes.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
