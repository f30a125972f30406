"""Seconds to plan one epoch, padfree's strategies beside peer samplers and packers, and the padding each
leaves, measured the same way (:mod:`padfree.bench.measure`).

Every case runs in its own subprocess (``python -m lab.plan_speed --worker``): it prepares the
peer's input (not timed), warms up on the first 20,000 samples (imports, JIT, caches), then times the
planning work alone, up to ``repeats`` times while less than 2 s have been spent (median reported). An
alarm stops a run that exceeds the cap; the case then reads "timed out".
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lab import child_env
from padfree.bench.measure import Batching, batching_stats, covers_each_once, rank_imbalance
from padfree.core.config import DEFAULT_COST

WARMUP_SAMPLES = 20_000


@dataclass(frozen=True)
class Case:
    """One timed planning run: ``method`` is a padfree strategy (kind ``padfree``) or a peer name."""

    dataset: str
    lengths_path: str
    method: str
    kind: str
    settings: dict = field(default_factory=dict)
    budget: int = 16384
    world_size: int = 8
    grad_accum: int = 4
    seed: int = 0
    cap_s: float = 300.0
    repeats: int = 3

    @property
    def variant(self) -> str:
        if self.kind == "padfree":
            return f"make_plan, world {self.world_size} x accum {self.grad_accum}"
        from padfree.bench.peers import PEERS

        layout = {"world_size": self.world_size, "grad_accum": self.grad_accum}
        peer = PEERS[self.method].settings
        merged = peer | {k: v for k, v in layout.items() if k in peer} | self.settings
        return ", ".join(f"{k}={v}" for k, v in merged.items()) or "library defaults"


class _TimedOut(Exception):
    pass


def _alarm(_signum, _frame):
    raise _TimedOut


def _padfree_phases(case: Case):
    from padfree import PlanConfig, make_plan

    cfg = PlanConfig(
        strategy=case.method,
        budget=case.budget,
        world_size=case.world_size,
        grad_accum=case.grad_accum,
        seed=case.seed,
    )

    def prepare(lengths):
        return lengths

    def run(lengths):
        return make_plan(lengths, cfg, epoch=1)

    def finish(_lengths, plan):
        return Batching(plan.indices, plan.offsets, packed=cfg.packed, note="padfree.make_plan, one epoch")

    return prepare, run, finish


def _peer_phases(case: Case):
    from padfree.bench.peers import PEERS

    peer = PEERS[case.method]
    layout = {"world_size": case.world_size, "grad_accum": case.grad_accum}  # peers that plan ranks
    settings = peer.settings | {k: v for k, v in layout.items() if k in peer.settings} | case.settings

    def prepare(lengths):
        return peer.prepare(lengths, case.budget, case.seed, **settings)

    return prepare, peer.run, peer.finish


def run_case(case: Case) -> dict:
    """Run one case in this process and return its result row (see module docstring)."""
    out: dict[str, Any] = {
        "dataset": case.dataset,
        "method": case.method,
        "kind": case.kind,
        "variant": case.variant,
        "cap_s": case.cap_s,
    }
    if case.kind == "peer":
        from padfree.bench.peers import PEERS, missing

        why = missing(PEERS[case.method])
        if why:
            return out | {"status": "unavailable", "reason": why}
        prepare, run, finish = _peer_phases(case)
    else:
        prepare, run, finish = _padfree_phases(case)
    lengths = np.load(case.lengths_path).astype(np.int64)
    warm = lengths[: min(lengths.shape[0], WARMUP_SAMPLES)]
    st = prepare(warm)
    finish(st, run(st))
    t0 = time.perf_counter()
    st = prepare(lengths)
    out["prepare_seconds"] = time.perf_counter() - t0
    times: list[float] = []
    raw = None
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        while len(times) < max(1, case.repeats) and (not times or sum(times) < 2.0):
            if raw is not None and case.kind == "peer":
                st = prepare(lengths)  # samplers hold generator state: each repeat starts fresh
            signal.setitimer(signal.ITIMER_REAL, case.cap_s)
            t = time.perf_counter()
            raw = run(st)
            times.append(time.perf_counter() - t)
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _TimedOut:
        return out | {"status": "timed out", "reason": f"one epoch took longer than {case.cap_s:.0f} s"}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    b = finish(st, raw)
    out |= {
        "status": "ok",
        "seconds": float(np.median(times)),
        "runs": len(times),
        "covers_each_once": covers_each_once(b, lengths.shape[0]),
        "padded": not b.packed,
        "note": b.note,
    }
    out |= batching_stats(lengths, b, case.budget)
    out["over_budget_share"] = out["over_budget_micro"] / max(out["micro_batches"], 1)
    out["imbalance"] = rank_imbalance(lengths, b, case.world_size, case.grad_accum, DEFAULT_COST)
    out["imbalance_slots"] = rank_imbalance(lengths, b, case.world_size, case.grad_accum)
    return out


def run_case_subprocess(case: Case, hard_timeout_s: float | None = None) -> dict:
    """Run a case in a fresh interpreter (so imports, memory and JIT caches do not leak between cases)."""
    env = child_env()
    cmd = [sys.executable, "-m", "lab.plan_speed", "--worker", json.dumps(case.__dict__)]
    limit = hard_timeout_s if hard_timeout_s is not None else 3 * case.cap_s + 600
    base = {"dataset": case.dataset, "method": case.method, "kind": case.kind, "variant": case.variant}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        return base | {
            "status": "timed out",
            "reason": f"the whole case (prepare + runs) exceeded {limit:.0f} s",
        }
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
        if proc.returncode == -signal.SIGKILL:
            tail = "killed by SIGKILL (out of memory: the kernel's OOM killer)"
        elif proc.returncode < 0:
            tail = f"killed by signal {-proc.returncode}"
        return base | {"status": "error", "reason": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def render_markdown(result: dict) -> str:
    """The results as markdown: one table per dataset."""
    c = result["config"]
    lines = [
        "# Planning speed: padfree vs peers",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Budget {c['budget']} tokens per micro-batch, world {c['world_size']} x grad-accum "
        f"{c['grad_accum']}, seed {c['seed']}, cap {c['cap_s']:.0f} s per epoch. Seconds: one epoch's "
        "planning work, after a warm-up, input preparation excluded (median of up to 3 runs). Padding "
        "efficiency: real tokens / computed slots (padded: count x longest; a packed row computes its "
        "tokens). Over budget: micro-batches computing more slots than the budget (share of all); largest: "
        "the most slots one micro-batch computes. Imbalance: mean over steps of the most loaded rank's "
        "modeled cost / the mean rank's, the micro-batches dealt to ranks in their order (world x accum "
        "per step, as padfree's plans and BatchRebalanceSampler lay them out; for the other peers, which "
        "assign no ranks, that order is theirs), under padfree's default cost model (FLOP-shaped, "
        "7B-like) and under slots alone.",
        "",
    ]
    m = result["machine"]
    lines += [
        f"Machine: {m.get('cpu', '?')}, {m['cpu_count']} cores, {m.get('memory_gib', '?')} GiB; load "
        f"average at start {m['load_average_1_5_15'][0]:.1f} (the machine is shared: times are upper "
        f"bounds). Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v),
        "",
    ]
    for name, d in result["datasets"].items():
        lines += [
            f"## {name}: {d['samples']:,} samples, {d['tokens']:,} tokens",
            "",
            "| method | variant | seconds | padding eff. | micro-batches | over budget | largest | "
            "imbalance | imbalance (slots) | note |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in result["results"]:
            if r["dataset"] != name:
                continue
            if r["status"] == "ok":
                share = r.get("over_budget_share")
                cells = [
                    f"{r['seconds']:.3f}",
                    f"{r['padding_efficiency']:.4f}",
                    f"{r['micro_batches']:,}",
                    f"{r['over_budget_micro']:,}" + (f" ({share:.0%})" if share else ""),
                    f"{r['largest_micro_slots']:,}" if "largest_micro_slots" in r else "-",
                    f"{r['imbalance']:.3f}" if "imbalance" in r else "-",
                    f"{r['imbalance_slots']:.3f}" if "imbalance_slots" in r else "-",
                    r.get("note", ""),
                ]
            else:
                cells = [r["status"], "-", "-", "-", "-", "-", "-", r.get("reason", "")]
            if r.get("rerun"):
                cells[-1] += f" (rerun: `{r['rerun']}`)"
            lines.append(f"| {r['method']} | {r['variant']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--worker", required=True)
    args = p.parse_args(argv)
    case = Case(**json.loads(args.worker))
    print(json.dumps(run_case(case)))
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
