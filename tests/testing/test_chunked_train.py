"""examples/train.py --strategy chunked: killed mid-epoch on one process and resumed on two DDP ranks, every
sample is trained exactly once (a chunked document once, not once per chunk)."""

from __future__ import annotations

from pathlib import Path

from padfree.testing import killresume, seenlog

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train.py"
TINY = ["--vocab-size", "512", "--model-set", "hidden_size=32", "--model-set", "intermediate_size=64",
        "--model-set", "num_hidden_layers=1", "--model-set", "num_attention_heads=2",
        "--model-set", "num_key_value_heads=2"]  # fmt: skip


def test_a_chunked_run_killed_and_resumed_at_another_world_size_is_exactly_once(tmp_path, fixtures_dir):
    n, seen, out = 160, tmp_path / "seen.jsonl", tmp_path / "train.out"
    args = [
        "--data", str(fixtures_dir / "samples/*.jsonl.gz"),
        "--tokenizer", str(fixtures_dir / "tokenizers/llama_sp32k.model"),
        "--strategy", "chunked", "--budget", "128", "--overlong", "truncate", "--grad-accum", "6",
        "--limit-samples", str(n), "--seed", "5", "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--checkpoint-every", "2", "--seen-log", str(seen), "--resume", "--log-every", "1000", *TINY,
    ]  # fmt: skip
    first = killresume.run(TRAIN, 1, args, seen, kill_at_step=3, output=out)
    second = killresume.run(TRAIN, 2, args, seen, output=out)
    assert first.killed and not second.killed and second.returncode == 0, out.read_text()[-3000:]
    text = out.read_text()
    assert "chunked budget 128, world 2 x grad_accum 6" in text and "resumed from" in text
    report = seenlog.check_exactly_once(seenlog.read(seen), n, epochs=1)
    assert report["ok"], report
