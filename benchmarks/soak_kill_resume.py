"""Soak: SIGKILL examples/train.py under torchrun at many random moments, resume each time (at a random world
size among --worlds), and verify from the seen-log that every sample of every epoch was consumed exactly once
in the steps that count. Not part of CI's default run (minutes).

Each kill is, at random, of the whole process tree or of the launcher alone (what an OOM killer or a
scheduler that signals one pid does: the workers must stop by themselves, none may be left running); and
every third launch meets a second job started on the same checkpoint directory while it trains (it must be
refused, naming the owner, and write nothing).

Run it from the repository root (it trains on the vendored fixtures/):

    python benchmarks/soak_kill_resume.py --kills 20 --worlds 1 2 4
    python benchmarks/soak_kill_resume.py --kills 10 --worlds 2 3 --balance dynamic \
        --out benchmarks/results/soak_kill_resume_dynamic.json

It writes benchmarks/results/soak_kill_resume.json (the per-launch log, the exactly-once report per epoch, the
world sizes seen) and exits 1 if any sample was lost or duplicated. Each kill happens a random 0-0.5 s after
the launch has logged a random step beyond where it resumed, so it lands anywhere: mid-step, mid-log-write,
mid-checkpoint. The model is a 1-layer toy and the data the first --samples samples, so it stays small.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from padfree.testing import killresume, seenlog

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"
TINY = ["--vocab-size", "512", "--model-set", "hidden_size=32", "--model-set", "intermediate_size=64",
        "--model-set", "num_hidden_layers=1", "--model-set", "num_attention_heads=2",
        "--model-set", "num_key_value_heads=2"]  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--strategy", default="packed")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--checkpoint-every", type=int, default=3)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--balance", default="static", choices=["static", "dynamic"],
        help="dynamic: the ranks balance from measured times (exchange every 2 steps); resumes restore it",
    )  # fmt: skip
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/soak_kill_resume.json"))
    args = p.parse_args()

    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="padfree-soak-"))
    seen = work / "seen.jsonl"
    train_args = [
        "--data", str(FIXTURES / "samples/*.jsonl.gz"),
        "--tokenizer", str(FIXTURES / "tokenizers/llama_sp32k.model"),
        "--strategy", args.strategy, "--budget", str(args.budget), "--overlong", "truncate",
        "--grad-accum", str(args.grad_accum),
        "--epochs", str(args.epochs), "--limit-samples", str(args.samples), "--seed", str(args.seed),
        "--checkpoint-dir", str(work / "ckpt"), "--checkpoint-every", str(args.checkpoint_every),
        "--seen-log", str(seen), "--resume", "--log-every", "1000", "--balance", args.balance,
        "--balance-every", "2", *TINY,
    ]  # fmt: skip
    launches = []
    t0 = time.perf_counter()
    resume_step = 0
    kills = 0
    finished = False
    while not finished:
        world = rng.choice(args.worlds)
        kill = kills < args.kills
        target = resume_step + rng.randint(0, 3 * args.checkpoint_every) if kill else None
        delay = rng.uniform(0.0, 0.5) if kill else 0.0
        how = rng.choice(["tree", "launcher"])
        # every third launch meets a second job, started at a random step before its kill
        span = (target if kill else resume_step + 2 * args.checkpoint_every) - resume_step
        intrude = resume_step + rng.randint(0, span) if len(launches) % 3 == 0 else None
        outcome = killresume.run(
            ROOT / "examples/train.py", world, train_args, seen, kill_at_step=target, kill_delay=delay,
            output=work / "train.out", torchrun=True, kill=how, intruder_at_step=intrude,
        )  # fmt: skip
        ckpts = sorted((work / "ckpt").glob("step-*.pt"))
        resumed_at = resume_step
        resume_step = int(ckpts[-1].stem.split("-")[1]) if ckpts else 0
        kills += outcome.killed
        finished = not outcome.killed
        launches.append({
            "world_size": world, "resumed_at_step": resumed_at, "kill_at_step": target,
            "kill_delay_s": round(delay, 3), "killed": outcome.killed, "last_logged_step": outcome.last_step,
            "kill": how if outcome.killed else None, "orphans": outcome.orphans,
            "second_job_at_step": intrude if outcome.intruder else None,
            "second_job": outcome.intruder, "seconds": round(outcome.seconds, 1),
        })  # fmt: skip
        print(json.dumps(launches[-1]), flush=True)

    records = seenlog.read(seen)
    report = seenlog.check_exactly_once(records, args.samples, args.epochs, seenlog.read_dropped(seen))
    worlds = [x["world_size"] for x in launches]
    second = [x["second_job"] for x in launches if x["second_job"]]
    refused = sum(1 for x in second if x["returncode"] != 0 and "in use by" in x["line"])
    orphans = sum(x["orphans"] for x in launches)
    result = {
        "ok": report["ok"] and orphans == 0 and refused == len(second),
        "exactly_once": report["ok"],
        "kills": kills,
        "kills_of_the_launcher_only": sum(1 for x in launches if x["kill"] == "launcher"),
        "workers_left_running_after_their_launcher_died": orphans,
        "second_jobs": len(second),
        "second_jobs_refused": refused,
        "launches": len(launches),
        "world_sizes_used": sorted(set(worlds)),
        "world_size_changes_on_resume": sum(a != b for a, b in zip(worlds[:-1], worlds[1:], strict=True)),
        "samples": args.samples,
        "epochs": args.epochs,
        "strategy": args.strategy,
        "balance": args.balance,
        "budget": args.budget,
        "grad_accum": args.grad_accum,
        "checkpoint_every": args.checkpoint_every,
        "seed": args.seed,
        "seen_log_records": report["records"],
        "records_that_count": report["counted"],
        "records_redone_after_kills": report["records"] - report["counted"],
        "per_epoch": report["epochs"],
        "seconds": round(time.perf_counter() - t0, 1),
        "launch_log": launches,
        "command": "python benchmarks/soak_kill_resume.py " + " ".join(sys.argv[1:]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "launch_log"}, indent=2))
    if kills < args.kills:
        print(f"only {kills} kills before training ended: raise --epochs", file=sys.stderr)
    return 0 if result["ok"] and kills == args.kills else 1


if __name__ == "__main__":
    raise SystemExit(main())
