"""What a long run says: a progress bar on a terminal only (never into a log, a pipe or CI, never under
``--quiet``), tokens/s, and a one-line sampler summary at its end instead of the raw state dict."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

import pytest

from padfree import progress
from padfree.torch.feed.balance import balance_summary

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--max-steps", "2", "--budget", "256", "--limit-samples", "12", "--model-set", "hidden_size=32",
        "--model-set", "intermediate_size=64", "--model-set", "num_hidden_layers=1", "--vocab-size", "256",
        "--overlong", "truncate"]  # fmt: skip


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_run_output", ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bars_only_on_a_terminal_off_under_ci_and_quiet(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(sys, "stderr", _Tty())
    monkeypatch.setattr(sys, "stdout", _Tty())
    assert progress.bars_wanted() and not progress.bars_wanted(quiet=True)
    monkeypatch.setenv("CI", "true")
    assert not progress.bars_wanted()
    monkeypatch.delenv("CI")
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # the run's lines to a file: they must stay there
    assert not progress.bars_wanted()
    monkeypatch.setattr(sys, "stdout", _Tty())
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file or a pipe
    assert not progress.bars_wanted()


def test_a_run_ends_with_one_summary_line_and_tokens_per_second(capsys, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    assert _example("train").main(TINY) == 0
    captured = capsys.readouterr()
    end = captured.out.rsplit("finished at step 2", 1)[-1]
    assert "tokens/s" in end.splitlines()[0], end
    summary = [line for line in end.splitlines() if line.startswith("sampler after")]
    assert len(summary) == 1 and "static balance (configured cost model, 1 rank)" in summary[0], end
    assert "{" not in summary[0] and "Coefficients(" not in summary[0]
    assert "\r" not in captured.err and "━" not in captured.err  # stderr is no terminal here: no bar
    assert "epoch 0 step 1 (" in captured.out  # the first step is said at once (--log-every is 10)


def test_the_bar_shows_on_a_terminal_and_not_under_quiet(capsys, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    shown = []

    def spy(description, total, *, enabled):
        shown.append((total, enabled))
        return real(description, total, enabled=False)

    from padfree.recipes import loop

    real = progress.progress_bar
    monkeypatch.setattr(loop, "progress_bar", spy)
    monkeypatch.setattr(loop, "bars_wanted", lambda quiet=False: not quiet)  # as on a terminal
    train = _example("train")
    assert train.main(TINY) == 0 and train.main([*TINY, "--quiet"]) == 0
    assert shown == [(2, True), (2, False)]


def test_a_fitted_balance_reads_as_one_line():
    stats = {"mode": "dynamic", "fitted": True, "speeds": (0.9, 1.1), "heldout_rel_error": 0.042,
             "exchanges": 3, "records": 24, "dropped_times": 1, "sync_seconds": 0.05, "plan_budget": 512,
             "sampler_seconds": 1.5, "sampler_first_step_seconds": 0.2}  # fmt: skip
    line = balance_summary(stats)
    assert line.startswith("dynamic balance (cost fitted to measured times, held-out error 4.2%, 2 ranks")
    assert (
        "rank speeds 0.90-1.10" in line
        and "3 timing exchanges of 24 micro-batch times (1 screened out)" in line
    )
    assert "\n" not in line


@pytest.mark.parametrize("quiet", [False, True])
def test_hf_trainer_keeps_the_trainers_bar_on_a_terminal(tmp_path, monkeypatch, quiet):
    import transformers

    monkeypatch.setattr(sys, "stderr", _Tty())
    monkeypatch.setattr(sys, "stdout", _Tty())
    monkeypatch.delenv("CI", raising=False)
    seen = {}

    class Stop(Exception):
        pass

    def grab(self, *a, **k):
        seen["disable_tqdm"] = self.args.disable_tqdm
        raise Stop

    monkeypatch.setattr(transformers.Trainer, "train", grab)
    args = [*TINY, "--output-dir", str(tmp_path / "run"), *(["--quiet"] if quiet else [])]
    with pytest.raises(Stop):
        _example("hf_trainer").main(args)
    assert seen["disable_tqdm"] is quiet


def test_the_trainer_reports_tokens_per_second(tmp_path, capsys):
    trainer = _example("hf_trainer").main([*TINY, "--output-dir", str(tmp_path / "run"), "--quiet"])
    final = trainer.state.log_history[-1]
    assert final["train_tokens_per_second"] > 10 * final["train_samples_per_second"] > 0
    # the plan's tokens fetched (no padding) over the run's time
    fetched = final["train_tokens_per_second"] * final["train_runtime"]
    assert trainer._padfree_tokens > 0 and abs(fetched - trainer._padfree_tokens) <= 1e-3 * fetched + 1
    assert "tokens/s" in capsys.readouterr().out


def test_a_chunked_run_names_its_reach_not_the_budget(capsys):
    args = [*TINY[4:], "--max-steps", "1", "--budget", "64", "--strategy", "chunked", "--grad-accum", "2"]
    assert TINY[:4] == ["--max-steps", "2", "--budget", "256"] and _example("train").main(args) == 0
    out = capsys.readouterr().out
    assert "samples are longer than the chunked reach of 128 tokens (--grad-accum 2 x --budget 64)" in out, (
        out
    )
