"""examples/train.py killed with SIGKILL at random steps and resumed, the last time at another world size
(one process, then two ranks under torchrun): over both epochs, the steps that count consumed every sample
exactly once (checked from the seen-log)."""

import random
from pathlib import Path

from padfree.testing import killresume, seenlog

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train.py"
TINY = ["--vocab-size", "512", "--model-set", "hidden_size=32", "--model-set", "intermediate_size=64",
        "--model-set", "num_hidden_layers=1", "--model-set", "num_attention_heads=2",
        "--model-set", "num_key_value_heads=2"]  # fmt: skip


def test_sigkill_and_elastic_resume_consume_every_sample_once(tmp_path, fixtures_dir):
    n = 240
    seen = tmp_path / "seen.jsonl"
    args = [
        "--data", str(fixtures_dir / "samples/*.jsonl.gz"),
        "--tokenizer", str(fixtures_dir / "tokenizers/llama_sp32k.model"),
        "--strategy", "packed", "--budget", "256", "--overlong", "truncate", "--grad-accum", "2",
        "--epochs", "2",
        "--limit-samples", str(n), "--seed", "3", "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--checkpoint-every", "3", "--seen-log", str(seen), "--resume", "--log-every", "1000", *TINY,
    ]  # fmt: skip
    rng = random.Random(20261129)
    out = tmp_path / "train.out"
    first = killresume.run(TRAIN, 1, args, seen, kill_at_step=rng.randint(2, 40), output=out)
    later = first.last_step + rng.randint(4, 60)
    second = killresume.run(TRAIN, 1, args, seen, kill_at_step=later, output=out)
    third = killresume.run(TRAIN, 2, args, seen, output=out)  # torchrun, another world size, to the end
    assert first.killed and second.killed and not third.killed, out.read_text()[-3000:]

    records = seenlog.read(seen)
    report = seenlog.check_exactly_once(records, n, epochs=2)
    assert report["ok"], report
    assert report["runs"] == 3 and report["counted"] == 2 * n
    runs = list(dict.fromkeys(r["run"] for r in records))
    ranks_of = {run: {r["rank"] for r in records if r["run"] == run} for run in runs}
    assert ranks_of[runs[0]] == {0} and ranks_of[runs[2]] == {0, 1}
    # the last run resumed from a checkpoint (not from scratch), at the other world size
    assert min(r["step"] for r in records if r["run"] == runs[2]) > 0


def test_sigkill_and_resume_with_dynamic_balancing_consume_every_sample_once(tmp_path, fixtures_dir):
    """Two ranks balancing from measured times (an exchange every 2 steps), SIGKILLed after the balance was
    learned and checkpointed, resumed with it from the checkpoint (resuming at another world size, which
    restarts the speeds, is covered in-process by tests/torch/test_sampler_dynamic.py)."""
    import torch

    n = 120
    seen = tmp_path / "seen.jsonl"
    args = [
        "--data", str(fixtures_dir / "samples/*.jsonl.gz"),
        "--tokenizer", str(fixtures_dir / "tokenizers/llama_sp32k.model"),
        "--strategy", "packed", "--budget", "256", "--overlong", "truncate", "--grad-accum", "2",
        "--epochs", "2",
        "--limit-samples", str(n), "--seed", "5", "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--checkpoint-every", "3", "--seen-log", str(seen), "--resume", "--log-every", "1000",
        "--balance", "dynamic", "--balance-every", "2", *TINY,
    ]  # fmt: skip
    out = tmp_path / "train.out"
    first = killresume.run(TRAIN, 2, args, seen, kill_at_step=random.Random(7).randint(7, 20), output=out)
    ckpt = sorted((tmp_path / "ckpt").glob("step-*.pt"))[-1]
    state = torch.load(ckpt, weights_only=True)["sampler"]
    assert state["mode"] == "dynamic" and state["balance"]["fitted"] and len(state["balance"]["speeds"]) == 2
    second = killresume.run(TRAIN, 2, args, seen, output=out)
    assert first.killed and not second.killed, out.read_text()[-3000:]
    report = seenlog.check_exactly_once(seenlog.read(seen), n, epochs=2)
    assert report["ok"] and report["runs"] == 2 and report["counted"] == 2 * n, report
    assert "cost fitted to measured times" in out.read_text().rsplit("sampler after", 1)[-1]
