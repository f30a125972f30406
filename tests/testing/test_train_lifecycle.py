"""examples/train.py ends cleanly: SIGTERM checkpoints at the next step boundary and the resume redoes and
loses nothing; killing only torchrun's launcher (what an OOM killer or a scheduler signalling one pid does)
stops its workers at once, and the resume is exactly once (checked from the seen-log)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from padfree.testing import killresume, seenlog
from padfree.torch.run.lifecycle import EXIT_STOPPED

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train.py"
TINY = ["--vocab-size", "512", "--model-set", "hidden_size=32", "--model-set", "intermediate_size=64",
        "--model-set", "num_hidden_layers=1", "--model-set", "num_attention_heads=2",
        "--model-set", "num_key_value_heads=2"]  # fmt: skip


def _args(
    tmp_path: Path, fixtures_dir: Path, n: int, epochs: int = 1, overlong: str = "truncate"
) -> list[str]:
    return [
        "--data", str(fixtures_dir / "samples/*.jsonl.gz"),
        "--tokenizer", str(fixtures_dir / "tokenizers/llama_sp32k.model"),
        "--strategy", "packed", "--budget", "256", "--overlong", overlong, "--grad-accum", "2",
        "--epochs", str(epochs),
        "--limit-samples", str(n), "--seed", "5", "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--checkpoint-every", "4", "--seen-log", str(tmp_path / "seen.jsonl"), "--resume",
        "--log-every", "1000", *TINY,
    ]  # fmt: skip


def test_sigterm_checkpoints_at_the_next_step_and_the_resume_loses_nothing(tmp_path, fixtures_dir):
    n, seen, out = 160, tmp_path / "seen.jsonl", tmp_path / "train.out"
    args = _args(tmp_path, fixtures_dir, n)
    first = killresume.run(TRAIN, 1, args, seen, term_at_step=5, output=out)
    assert first.stopped and first.returncode == EXIT_STOPPED, out.read_text()[-2000:]
    stopped_at = int(sorted((tmp_path / "ckpt").glob("step-*.pt"))[-1].stem.split("-")[1])
    assert stopped_at == first.last_step + 1  # the checkpoint holds every step the run did
    second = killresume.run(TRAIN, 1, args, seen, output=out)
    assert not second.killed and second.returncode == 0
    records = seenlog.read(seen)
    report = seenlog.check_exactly_once(records, n, epochs=1)
    assert report["ok"] and report["records"] == report["counted"] == n, report  # nothing redone
    runs = list(dict.fromkeys(r["run"] for r in records))
    assert min(r["step"] for r in records if r["run"] == runs[1]) == stopped_at


def test_a_run_that_drops_overlong_samples_is_exactly_once_over_the_kept_ones(tmp_path, fixtures_dir):
    # issue 28: the seen-log reported the samples --overlong drop leaves out as lost
    n, seen, out = 160, tmp_path / "seen.jsonl", tmp_path / "train.out"
    args = _args(tmp_path, fixtures_dir, n, overlong="drop")
    first = killresume.run(TRAIN, 1, args, seen, kill_at_step=3, output=out)
    second = killresume.run(TRAIN, 2, args, seen, output=out)
    assert first.killed and not second.killed, out.read_text()[-3000:]
    dropped = seenlog.read_dropped(seen)
    assert len(dropped) > 0 and f"--overlong drop: {len(dropped)} of {n} samples" in out.read_text()
    report = seenlog.check_exactly_once(seenlog.read(seen), n, epochs=1, dropped=dropped)
    assert report["ok"] and report["dropped"] == len(dropped), report
    assert report["counted"] == n - len(dropped), report  # nothing redone, nothing dropped trained


def test_killing_only_the_launcher_stops_the_workers_and_the_resume_is_exactly_once(tmp_path, fixtures_dir):
    n, seen, out = 200, tmp_path / "seen.jsonl", tmp_path / "train.out"
    args = _args(tmp_path, fixtures_dir, n)
    first = killresume.run(TRAIN, 2, args, seen, kill_at_step=6, kill="launcher", output=out)
    assert first.killed and first.orphans == 0, out.read_text()[-3000:]
    # the killed launch's workers do not go on training after their launcher died: nothing more is logged
    # (steps logged between the killer's last read and the kill are the live launch's, so no step bound)
    logged = seen.stat().st_size
    time.sleep(1.0)
    assert seen.stat().st_size == logged
    second = killresume.run(TRAIN, 1, args, seen, output=out)  # refused if a worker still held the lock
    assert not second.killed and second.returncode == 0, out.read_text()[-3000:]
    records = seenlog.read(seen)
    report = seenlog.check_exactly_once(records, n, epochs=1)
    assert report["ok"] and report["runs"] == 2 and report["counted"] == n, report
    runs = list(dict.fromkeys(r["run"] for r in records))
    assert {r["rank"] for r in records if r["run"] == runs[0]} == {0, 1}
    assert min(r["step"] for r in records if r["run"] == runs[1]) > 0  # resumed from a checkpoint


def test_main_in_process_leaves_no_signal_handler_and_refuses_an_owned_directory(
    tmp_path, fixtures_dir, capsys
):
    import importlib.util
    import signal

    from padfree.torch.run.checkpoint import CheckpointDir

    spec = importlib.util.spec_from_file_location("train_example", TRAIN)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    before = signal.getsignal(signal.SIGTERM)
    args = [*_args(tmp_path, fixtures_dir, 60), "--max-steps", "1"]
    assert train.main(args) == 0 and signal.getsignal(signal.SIGTERM) == before
    owner = CheckpointDir(tmp_path / "ckpt")
    owner.acquire("the-owner")
    with pytest.raises(SystemExit) as info:  # as `python examples/train.py` runs it
        train.run_example(lambda: train.main(args))
    err = capsys.readouterr().err.splitlines()
    assert info.value.code == 2 and len(err) == 1 and "in use by run the-owner" in err[0], err
    assert signal.getsignal(signal.SIGTERM) == before
    owner.release()


def test_a_checkpoint_of_another_model_is_one_line_exit_2(tmp_path, fixtures_dir, capsys):
    """The model options are not part of the sampler's identity: a resume with another model shape reaches
    ``load_state_dict``, whose RuntimeError (a size mismatch) is one line naming the checkpoint."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_example", TRAIN)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    args = [*_args(tmp_path, fixtures_dir, 30), "--max-steps", "1"]
    assert train.main(args) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        train.run_example(lambda: train.main([*args, "--model-set", "hidden_size=48"]))
    err = capsys.readouterr().err.splitlines()
    assert info.value.code == 2 and len(err) == 1, err
    assert "step-000000001.pt: the checkpoint's model or optimizer does not fit this run" in err[0], err
