"""examples/train_drafter.py: a short run of each method trains and logs its samples; killed with SIGKILL
under torchrun at 2 ranks and resumed, every sample trains exactly once per epoch, always with the anchors its
document gets alone from (seed, epoch, sample id)."""

import json
import random
from pathlib import Path

import numpy as np
import pytest

from padfree.testing import killresume, seenlog

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_drafter.py"


def base_args(fixtures_dir, tmp_path, n, method, strategy="packed"):
    return [
        "--method", method, "--data", str(fixtures_dir / "samples/*.jsonl.gz"),
        "--tokenizer", str(fixtures_dir / "tokenizers/llama_sp32k.model"),
        "--strategy", strategy, "--budget", "256", "--limit-samples", str(n), "--vocab-size", "256",
        "--block-size", "4", "--ttt", "2", "--log-every", "1000", "--seen-log", str(tmp_path / "seen.jsonl"),
        "--overlong", "truncate",
    ]  # fmt: skip


@pytest.mark.parametrize(("method", "strategy"), [("dflash", "bucketed"), ("eagle3", "packed")])
def test_a_short_run_trains_and_logs_its_samples(tmp_path, fixtures_dir, method, strategy):
    n = 24
    args = base_args(fixtures_dir, tmp_path, n, method, strategy) + ["--max-steps", "3", "--grad-accum", "2"]
    out = tmp_path / "run.out"
    res = killresume.run(SCRIPT, 1, args, tmp_path / "seen.jsonl", output=out, timeout=300)
    text = out.read_text()
    assert res.returncode == 0 and "finished at step 3" in text, text[-2000:]
    records = seenlog.read(tmp_path / "seen.jsonl")
    assert {r["step"] for r in records} == {0, 1, 2}
    assert len({r["index"] for r in records}) == len(records) > 0  # no sample twice in one epoch


def test_sigkill_and_resume_at_two_ranks_trains_each_sample_once_with_its_anchors(tmp_path, fixtures_dir):
    from padfree.core.anchors import choose_anchors
    from padfree.data.samples import load_samples
    from padfree.drafter import recipes

    n = 48
    seen, anchor_log = tmp_path / "seen.jsonl", tmp_path / "anchors.jsonl"
    args = base_args(fixtures_dir, tmp_path, n, "dflash") + [
        "--epochs", "2", "--seed", "3", "--grad-accum", "2", "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--checkpoint-every", "2", "--resume", "--anchor-log", str(anchor_log),
    ]  # fmt: skip
    out = tmp_path / "train.out"
    first = killresume.run(SCRIPT, 2, args, seen, kill_at_step=random.Random(18).randint(3, 6), output=out)
    second = killresume.run(SCRIPT, 2, args, seen, output=out)
    assert first.killed and not second.killed, out.read_text()[-3000:]

    records = seenlog.read(seen)
    report = seenlog.check_exactly_once(records, n, epochs=2)
    assert report["ok"] and report["runs"] == 2 and report["counted"] == 2 * n, report
    runs = list(dict.fromkeys(r["run"] for r in records))
    assert min(r["step"] for r in records if r["run"] == runs[1]) > 0  # resumed from a checkpoint

    samples = load_samples(
        [str(fixtures_dir / "samples/*.jsonl.gz")], str(fixtures_dir / "tokenizers/llama_sp32k.model"), n,
        "assistant", 256,
    )  # fmt: skip
    policy = recipes.override(recipes.get("specforge", "dflash"), block_size=4).anchor_policy()  # as trained
    logged = [json.loads(line) for line in anchor_log.read_text().splitlines() if line.strip()]
    assert {r["run"] for r in logged} == set(runs)
    trained = {(r["epoch"], r["index"]) for r in logged}
    assert trained == {(e, i) for e in range(2) for i in range(n)}
    for r in logged:  # the killed run's redone steps and the resumed run: one anchor set per (epoch, sample)
        mask = np.asarray(samples[r["index"]]["loss_mask"])
        alone = choose_anchors(mask, policy, seed=3, epoch=r["epoch"], sample_id=r["index"])
        assert list(r["anchors"]) == alone.tolist(), r


def unsupervised_heavy_data(path: Path, n: int = 12) -> Path:
    """Chats whose long prompts leave nothing supervised once truncated to 256 tokens (every other sample),
    mixed with short ones: packed micro-batches then hold no anchor and no supervised position."""
    rng = random.Random(5)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    rows = []
    for i in range(n):
        prompt = " ".join(rng.choice(words) for _ in range(400 if i % 2 == 0 else 12))
        rows.append(
            {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": "ok fine"}]}
        )
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize(("method", "balance"), [("dflash", "static"), ("eagle3", "dynamic")])
def test_two_ranks_train_through_micro_batches_without_anchors_or_supervision(
    tmp_path, fixtures_dir, method, balance
):
    """Issue 28 item 1: under torchrun at 2 ranks, micro-batches with no anchor and no supervised position
    (long prompts truncated away) train on with a zero loss that keeps every rank's all-reduces in step (gloo
    raised "collective mismatch" before); every sample exactly once; the samples that lost every supervised
    token are counted and said."""
    data = unsupervised_heavy_data(tmp_path / "long_prompts.jsonl")
    args = [
        "--method", method, "--data", str(data),
        "--tokenizer", str(fixtures_dir / "tokenizers/llama_sp32k.model"), "--strategy", "packed",
        "--budget", "256", "--vocab-size", "256", "--block-size", "4", "--ttt", "2",
        "--log-every", "1000", "--seen-log", str(tmp_path / "seen.jsonl"), "--overlong", "truncate",
        "--balance", balance, "--balance-every", "1", "--epochs", "2",
    ]  # fmt: skip
    out = tmp_path / "run.out"
    res = killresume.run(SCRIPT, 2, args, tmp_path / "seen.jsonl", output=out, timeout=300)
    text = out.read_text()
    assert res.returncode == 0 and "finished at step" in text, text[-3000:]
    assert "6 of 12 samples keep no supervised token after --overlong truncate" in text
    report = seenlog.check_exactly_once(seenlog.read(tmp_path / "seen.jsonl"), 12, epochs=2)
    assert report["ok"] and report["counted"] == 24, report


def test_resume_under_another_drafter_configuration_names_the_field(tmp_path, fixtures_dir):
    """Issue 28 item 2: a changed --draft-layers (or recipe field) is one line naming it, not a RuntimeError
    from load_state_dict."""
    import subprocess
    import sys

    ckpt = tmp_path / "ckpt"
    args = base_args(fixtures_dir, tmp_path, 8, "dflash") + [
        "--max-steps",
        "1",
        "--checkpoint-dir",
        str(ckpt),
    ]
    first = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    for extra, said in ((["--draft-layers", "2"], "draft_layers 1 in the checkpoint, 2 now"),
                        (["--gamma", "3"], "gamma 7.0 in the checkpoint, 3.0 now")):  # fmt: skip
        again = subprocess.run(
            [sys.executable, str(SCRIPT), *args, "--resume", *extra],
            capture_output=True,
            text=True,
            timeout=300,
        )
        err = again.stderr.strip().splitlines()
        assert again.returncode == 2 and len(err) == 1 and said in err[0], again.stderr[-2000:]
        assert "Traceback" not in again.stderr


@pytest.mark.parametrize(
    ("option", "value"),
    [("--vocab-size", "1"), ("--draft-layers", "0"), ("--checkpoint-every", "-1"), ("--ttt", "0"),
     ("--ttt", "-2"), ("--block-size", "nan")],
)  # fmt: skip
def test_example_options_are_bounded_and_named(option, value, capsys):
    """Issue 28 item 3: an out-of-range option is one line naming it, exit 2 (not an IndexError, a 0-layer
    drafter, an accepted -1 or 24 lines of usage)."""
    import sys

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import train_drafter
    finally:
        sys.path.remove(str(SCRIPT.parent))
    with pytest.raises(SystemExit) as exc:
        train_drafter.parse_args([option, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and f"argument {option}" in err[0], err


def test_a_recipe_under_which_nothing_drafts_is_refused_in_one_line(tmp_path, fixtures_dir):
    """Issue 33 item 7: an anchor margin longer than every document leaves no anchor anywhere; the run used to
    train zeros and exit 0. One line naming the margin and the longest document, exit 2, before any step."""
    import subprocess
    import sys

    args = base_args(fixtures_dir, tmp_path, 8, "dflash") + ["--max-steps", "2", "--anchor-margin", "1000"]
    res = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(err) == 1, res.stderr[-2000:]
    assert "nothing drafts" in err[0] and "anchor margin 1000" in err[0] and "longest document" in err[0]
    assert "finished at step" not in res.stdout and not (tmp_path / "seen.jsonl").exists()


def test_a_memory_bound_that_cuts_documents_says_so_and_counts_the_tokens(tmp_path, fixtures_dir):
    """Issue 33 item 6: --memory-gb on EAGLE-3 used to cut rows far below --budget and say nothing (and the
    default --overlong truncate said nothing of what it cut either). At a memory that holds one document of
    100 tokens at most (its attention), the run says where it cuts, why, and how many tokens go untrained;
    rows still fill the budget with shorter documents."""
    import re
    import subprocess
    import sys

    from padfree.drafter import recipes
    from padfree.drafter.train import build_models, memory_model

    rec = recipes.override(recipes.get("specforge", "eagle3"), ttt=2)
    mm = memory_model(build_models("eagle3", vocab=256, seed=0, recipe=rec))
    gb = (mm.fixed + mm.per_token * 256 + mm.per_attention * 100 * 101.5) / 2**30  # 100 x (100 + 1) scores
    args = base_args(fixtures_dir, tmp_path, 24, "eagle3") + ["--max-steps", "1", "--memory-gb", repr(gb)]
    res = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("--overlong truncate"))
    assert "longer than 100 tokens, the longest document whose attention fits --memory-gb" in line
    assert "--budget 256" in line
    lost, total, pct = re.search(r"(\d+) of (\d+) tokens not trained \((\d+\.\d)%\)", line).groups()
    assert 0 < int(lost) < int(total) and float(pct) == round(100 * int(lost) / int(total), 1)
    assert f"{total} tokens" in res.stdout  # the run line's token count: every token of the data counted


def _dflash_memory_for(blocks: int, budget: int = 256) -> float:
    """The --memory-gb at which the example's tiny DFlash drafter (base_args) leaves room for ``blocks``
    draft blocks in a micro-batch of ``budget`` tokens (:func:`padfree.drafter.memory.anchor_budget`)."""
    from padfree.drafter import recipes
    from padfree.drafter.train import build_models, memory_model

    rec = recipes.override(recipes.get("specforge", "dflash"), block_size=4)
    m = memory_model(build_models("dflash", vocab=256, seed=0, recipe=rec))
    return (
        m.fixed + m.per_token * budget + (blocks + 0.5) * (m.per_block + m.per_reach * budget / 2)
    ) / 2**30


@pytest.mark.parametrize("case", ["export-format", "memory-anchors", "memory-overlong"])
def test_lines_name_this_commands_own_options(tmp_path, fixtures_dir, case):
    """Issue 33 item 12: train_drafter's lines named another command's option (--format for its
    --export-format), the library's (anchor_budget after --memory-gb) or told to raise --budget where the cut
    came from --memory-gb."""
    import subprocess
    import sys

    method = "eagle3" if case != "memory-anchors" else "dflash"
    args = base_args(fixtures_dir, tmp_path, 24, method) + ["--max-steps", "1"]
    if case == "export-format":
        args += ["--export-dir", str(tmp_path / "out"), "--export-format", "dflash"]
        said, unsaid = "(export it with --export-format speculators)", "--format "
    elif case == "memory-anchors":
        args += ["--memory-gb", repr(_dflash_memory_for(12))]
        said, unsaid = "more than a micro-batch may hold: the 12 --memory-gb", "anchor_budget"
    else:
        from padfree.drafter import recipes
        from padfree.drafter.train import build_models, memory_model

        mm = memory_model(build_models("eagle3", vocab=256, seed=0, recipe=recipes.override(
            recipes.get("specforge", "eagle3"), ttt=2)))  # fmt: skip
        gb = (mm.fixed + mm.per_token * 256 + mm.per_attention * 100 * 101.5) / 2**30
        args += ["--memory-gb", repr(gb), "--overlong", "error"]
        said, unsaid = (
            "longer than 100 tokens, the longest document whose attention fits --memory-gb",
            "raise the",
        )
    res = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(err) == 1, res.stderr[-2000:]
    assert said in err[0] and unsaid not in err[0], err[0]


def test_a_resume_under_another_memory_bound_names_the_option(tmp_path, fixtures_dir):
    """Issue 33 item 12: --memory-gb added on resume was refused with two hashes (the sampler identity's
    optional attn_budget was in one run only); now the line names --memory-gb."""
    import subprocess
    import sys

    args = base_args(fixtures_dir, tmp_path, 8, "eagle3") + ["--checkpoint-dir", str(tmp_path / "ckpt")]
    run = [sys.executable, str(SCRIPT), *args]
    first = subprocess.run([*run, "--max-steps", "1"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    more = ["--max-steps", "2", "--resume", "--memory-gb", "4"]
    again = subprocess.run([*run, *more], capture_output=True, text=True, timeout=300)
    err = again.stderr.strip().splitlines()
    assert again.returncode == 2 and len(err) == 1, again.stderr[-2000:]
    assert "--memory-gb none in the checkpoint, 4.0 now" in err[0] and "sampler state" not in err[0], err[0]
