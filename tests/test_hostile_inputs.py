"""Hostile inputs by class, through the real CLI (in-process, and in a subprocess where only a real process
shows the failure: an abort at exit, a full stdout, a FIFO, a home folder that is not writable). Every one
ends with exit code 2 and exactly one line on stderr: no traceback, no crash, no hang. And every numeric
option of every command has a stated range, enforced and listed in docs/errors.md."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import HANG_S

from padfree.cli import build_parser, main
from padfree.options import Bounded

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--world-size=1", "--grad-accum=1"]


def _commands() -> dict:
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return dict(sub.choices)


def _numeric_options() -> list[tuple[str, str, Bounded]]:
    out = []
    for name, parser in _commands().items():
        for action in parser._actions:
            if isinstance(action.type, Bounded):
                out.append((name, max(action.option_strings, key=len), action.type))
    return out


# the positionals and required options a command needs to get as far as parsing every option
REQUIRED = {"plan": ["l.txt"], "lengths": ["d.jsonl", "--tokenizer", "t.model", "--out", "o.npy"]}


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, list[str]]:
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err.splitlines()


def _one_line(code: int, lines: list[str], *patterns: str) -> str:
    assert code == 2 and len(lines) == 1, (code, lines)
    for p in patterns:
        assert re.search(p, lines[0]), lines[0]
    return lines[0]


def _proc(argv: list[str], timeout: float = HANG_S, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "padfree", *map(str, argv)]
    return subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, env=env, timeout=timeout)


@pytest.fixture()
def lengths_txt(tmp_path: Path) -> Path:
    p = tmp_path / "l.txt"
    rng = np.random.default_rng(0)
    p.write_text("\n".join(map(str, rng.integers(5, 900, 600))) + "\n")
    return p


# ----- every numeric option: a type with a range, the range documented, everything outside it refused -------
def test_every_numeric_option_has_a_stated_range_that_the_docs_list():
    doc = (ROOT / "docs" / "errors.md").read_text()
    raw = [
        (name, a.option_strings)
        for name, parser in _commands().items()
        for a in parser._actions
        if a.type in (int, float)
    ]
    assert not raw, f"numeric options without a range (use padfree.options.Bounded): {raw}"
    by_option: dict[str, set] = {}
    for name, opt, kind in _numeric_options():
        by_option.setdefault(opt, set()).add(kind.range)
        row = re.search(rf"^\| `{re.escape(opt)}` \|([^|]*)\|([^|]*)\|", doc, re.M)
        assert row, f"docs/errors.md has no range row for {opt}"
        assert re.search(rf"\b{re.escape(name)}\b", row.group(1)), f"{opt}: row does not list `{name}`"
        assert row.group(2).strip() == kind.range, (opt, row.group(2), kind.range)
    assert all(len(r) == 1 for r in by_option.values()), by_option  # one range per option name
    for name, parser in _commands().items():  # every default is itself in range
        for a in parser._actions:
            if isinstance(a.type, Bounded) and a.default is not None:
                assert a.type(str(a.default)) == a.default, (name, a.option_strings)


def _outside(kind: Bounded) -> list[str]:
    big = ["9223372036854775808", "-9223372036854775809", "1" + "0" * 400, "nan", "inf", "-inf", "", "x"]
    if kind.kind is int:
        return [str(kind.lo - 1), str(kind.hi + 1), "1.5", "1e3", *big]
    return [repr(kind.lo) if kind.above else repr(kind.lo - 1.0), repr(kind.hi * 2), "1e400", *big]


@pytest.mark.parametrize(("command", "option", "kind"), _numeric_options(), ids=lambda x: str(x))
def test_every_value_outside_a_range_is_one_usage_line(command, option, kind, capsys):
    for value in _outside(kind):
        code, lines = _run([command, *REQUIRED.get(command, []), f"{option}={value}"], capsys)
        _one_line(code, lines, rf"argument {option}: must be {re.escape(kind.range)}")


# ----- values inside the ranges that would still blow up memory or time ----------------------------------
@pytest.mark.parametrize(
    ("args", "rule"),
    [
        (["--growth=1.0000000001"], r"would cut 1 \.\. 16384 tokens into ~97,040,597,254 buckets"),
        (["--growth=1.00000001", "--budget=2048"], r"into ~762,461,907 buckets \(at most 1024\)"),
        (["--growth=1.001", "--budget=16777216"], r"use a growth >= 1\.016379 at this budget"),
    ],
)
def test_a_growth_implying_too_many_buckets_is_refused_at_once(args, rule, lengths_txt, capsys):
    code, lines = _run(["plan", lengths_txt, *SMALL, *args, "--out=-"], capsys)
    _one_line(code, lines, rule)


def test_optimal_buckets_whose_table_would_not_fit_are_refused(tmp_path, capsys):
    p = tmp_path / "wide.npy"
    np.save(p, np.arange(1, 60_001, dtype=np.int32))  # 60,000 distinct lengths
    code, lines = _run(["plan", p, *SMALL, "--budget=60000", "--buckets=1024", "--out=-"], capsys)
    _one_line(code, lines, r"1024 padding-optimal buckets over 60,000 distinct lengths need a 469 MiB table",
              r"use at most 558 buckets")  # fmt: skip


def test_the_largest_accepted_values_plan_quickly(lengths_txt, capsys, tmp_path):
    out = tmp_path / "plan.jsonl"
    for extreme in (
        ["--mix=2147483647"],
        ["--growth=1e9"],
        ["--seed=9223372036854775807", "--epoch=9223372036854775807"],
    ):
        code, lines = _run(["plan", lengths_txt, *SMALL, "--budget=4096", *extreme, f"--out={out}"], capsys)
        assert code == 0 and out.stat().st_size > 0, (extreme, lines)


# ----- cost files -------------------------------------------------------------------------------------------
COSTS = {
    "zero": ('{"a": 0, "b": 0, "c": 0}', r"are all 0"),
    "nan": (
        '{"a": NaN, "b": 0, "c": 0}',
        r"cost coefficient a must be a number from 0 to 1e\+30 \(got nan\)",
    ),
    "inf": ('{"a": 1, "b": Infinity, "c": 0}', r"coefficient b must be .* \(got inf\)"),
    "negative": ('{"a": 1, "b": 0, "c": -5}', r"coefficient c must be .* \(got -5\.0\)"),
    "huge": ('{"a": 1e300, "b": 0, "c": 0}', r"coefficient a must be .* \(got 1e\+300\)"),
    "bool": (
        '{"a": true, "b": 0, "c": 0}',
        r"not a cost model \(a JSON object with numbers a, b, c; got \[True",
    ),
    "string": ('{"a": "1", "b": 0, "c": 0}', r"not a cost model"),
    "array": ("[1, 0, 0]", r"not a cost model \(a JSON object"),
    "not-json": ("a=1 b=0", r"not a cost model \(malformed JSON"),
    "empty": ("", r"not a cost model \(malformed JSON"),
    "deep": ("[" * 100_000, r"not a cost model \(malformed JSON"),
    "seconds": ('{"a": 1, "b": 0, "c": 0, "seconds_per_unit": -1}', r"seconds_per_unit must be a number > 0"),
}


@pytest.mark.parametrize(
    ("case", "command"),
    [
        (case, command)
        for case in sorted(COSTS)
        for command in ("plan", "analyze", "simulate")
        if case != "seconds" or command == "simulate"  # only simulate reads seconds_per_unit
    ],
)
def test_a_bad_cost_file_is_one_line_naming_it(case, command, lengths_txt, tmp_path, capsys):
    text, rule = COSTS[case]
    cost = tmp_path / "cost.json"
    cost.write_text(text)
    extra = ["--out=-"] if command == "plan" else ["--json"]
    code, lines = _run([command, lengths_txt, *SMALL, f"--cost={cost}", *extra], capsys)
    _one_line(code, lines, re.escape(str(cost)), rule)


def test_a_cost_file_that_is_not_a_regular_file_or_too_large(lengths_txt, tmp_path, capsys):
    big = tmp_path / "big.json"
    big.write_text('{"a": 1, "b": 0, "c": 0, "pad": "' + "x" * 2**20 + '"}')
    fifo = tmp_path / "cost.fifo"
    os.mkfifo(fifo)
    for path, rule in ((big, r"too large for a cost file"), (fifo, r"not a regular file"),
                       (tmp_path, r"not a regular file")):  # fmt: skip
        code, lines = _run(["simulate", lengths_txt, *SMALL, f"--cost={path}", "--json"], capsys)
        _one_line(code, lines, re.escape(str(path)), rule)


# ----- outputs ----------------------------------------------------------------------------------------------
def test_outputs_that_cannot_be_written_are_refused_before_any_work(
    lengths_txt, tmp_path, capsys, monkeypatch
):
    afile = tmp_path / "afile"
    afile.write_text("x")
    ro = tmp_path / "ro"
    ro.mkdir()
    cases = [
        (["plan", lengths_txt, *SMALL, f"--out={afile}/p.jsonl"], r"afile is a file, not a folder"),
        (["plan", lengths_txt, *SMALL, f"--out={tmp_path}"], r"cannot write the plan: it is a folder"),
        (["report", lengths_txt, *SMALL, f"--out={afile}/r"], r"cannot write the report: .*afile is a file"),
        (["report", lengths_txt, *SMALL, f"--out={afile}"], r"cannot write the report: .*afile is a file"),
        (
            ["report", lengths_txt, *SMALL, "--out=/dev/full"],
            r"the report: /dev/full is a file, not a folder",
        ),
        (
            ["calibrate", "--quick", f"--out={afile}/c.json"],
            r"cannot write the cost model: .*afile is a file",
        ),
        (["lengths", lengths_txt, "--tokenizer", lengths_txt, f"--out={afile}/l.npy"], r"afile is a file"),
        (["bench", "--out", f"{afile}/b"], r"cannot write the results: .*afile is a file"),
        (["plan", lengths_txt, *SMALL, f"--out={ro}/p.jsonl"], r"ro is read-only or not writable"),
        (["report", lengths_txt, *SMALL, f"--out={ro}/deeper/r"], r"ro is read-only or not writable"),
    ]
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if Path(p) == ro else real_access(p, m))
    for argv, rule in cases:  # tests run as root: a read-only folder is what os.access says (EROFS, EACCES)
        code, lines = _run(argv, capsys)
        _one_line(code, lines, r"cannot write", rule)
    assert not (ro / "p.jsonl").exists()


def test_a_full_device_as_output_file_or_as_stdout(lengths_txt, tmp_path, capsys):
    code, lines = _run(["plan", lengths_txt, *SMALL, "--out=/dev/full"], capsys)
    _one_line(code, lines, r"^padfree: error: /dev/full: cannot write the plan \(No space left on device\)$")
    with open("/dev/full", "w") as full:
        for argv in (["plan", lengths_txt, *SMALL], ["analyze", lengths_txt, *SMALL, "--json"]):
            res = _proc(argv, stdout=full)
            assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
            assert res.stderr.splitlines() == [
                "padfree: error: <stdout>: cannot write the output (No space left on device)"
            ]
    # a reader that stops early is not an error
    res = subprocess.run(
        f"{sys.executable} -m padfree plan {lengths_txt} {' '.join(SMALL)} | head -1",
        shell=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )  # fmt: skip
    assert res.stderr == "" and res.stdout.startswith("{")


# ----- inputs that are not regular files (a FIFO would block forever) ---------------------------------------
def test_a_fifo_or_device_as_any_input_is_refused_without_blocking(lengths_txt, tmp_path, sp_model):
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    cases = [
        (["plan", fifo, *SMALL], r"not a regular file"),
        (["lengths", fifo, "--tokenizer", sp_model, "--out", tmp_path / "o.npy"], r"not a regular file"),
        (
            ["lengths", lengths_txt, "--tokenizer", "/dev/zero", "--out", tmp_path / "o.npy"],
            r"tokenizer is not",
        ),
        (["check-drafter", "--data", fifo, "--tokenizer", sp_model], r"not a regular file"),
    ]
    # check-drafter checks its tokenizer as `padfree lengths` does (issue 28: a FIFO named like one hung it)
    for name in ("tok.model", "tokenizer.json"):
        os.mkfifo(tmp_path / name)
        argv = ["check-drafter", "--data", lengths_txt, "--tokenizer", tmp_path / name]
        cases.append((argv, r"tokenizer is not a regular file"))
    for argv, rule in cases:  # a real process each: a bug would block, and the timeout would say so
        res = _proc(argv, timeout=HANG_S)
        assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, res.stderr
        assert re.search(rule, res.stderr) and "Traceback" not in res.stderr, res.stderr


def test_a_fifo_as_model_config_is_refused_without_opening_it(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / "config.json")
    code, lines = _run(["check-packing", "--model", model], capsys)
    _one_line(code, lines, r"nor a directory with config\.json")


# ----- parquet length columns of any type: never an abort ---------------------------------------------------
PARQUET = {
    "list": (pa.array([[1, 2], [3]]), r"must hold integers \(got type list"),
    "decimal": (pa.array([1, 2], pa.decimal128(10, 2)), r"must hold integers \(got type decimal128"),
    "struct": (pa.array([{"a": 1}, {"a": 2}]), r"must hold integers \(got type struct"),
    "timestamp": (pa.array([1, 2], pa.timestamp("s")), r"must hold integers \(got type timestamp"),
    "binary": (pa.array([b"1", b"2"]), r"must hold integers \(got type binary"),
    "dict-string": (pa.array(["1", "2"]).dictionary_encode(), r"must hold integers \(got type dictionary"),
    "null": (pa.array([None, None], pa.null()), r"must hold integers \(got type null"),
    "uint64-huge": (
        pa.array([2**64 - 1, 5], pa.uint64()),
        r"sample 0: length 18446744073709551615 is absurdly",
    ),
    "float-huge": (pa.array([1.5e300, 5.0]), r"sample 0: length 1\.5e\+300 is absurdly large"),
    "float16-fraction": (pa.array([np.float16(2.5), np.float16(3)], pa.float16()), r"got 2\.5"),
}


@pytest.mark.parametrize("case", sorted(PARQUET))
def test_any_parquet_column_type_is_one_line(case, tmp_path, capsys):
    arr, rule = PARQUET[case]
    p = tmp_path / "l.parquet"
    pq.write_table(pa.table({"length": arr}), p)
    code, lines = _run(["analyze", p, *SMALL, "--json", "--strategies=packed"], capsys)
    _one_line(code, lines, re.escape(str(p)), rule)


def test_parquet_is_read_without_arrow_thread_pools(tmp_path, monkeypatch):
    """Arrow's pools, torn down at exit while a worker runs, abort the process (apache/arrow#34314)."""
    from padfree.data.length_files import read_lengths

    seen = {}
    real = pq.read_table
    monkeypatch.setattr(pq, "read_table", lambda *a, **k: seen.update(k) or real(*a, **k))
    p = tmp_path / "l.parquet"
    pq.write_table(pa.table({"length": pa.array([3, 4], pa.int32())}), p)
    assert read_lengths(p).tolist() == [3, 4]
    assert seen.get("use_threads") is False and seen.get("pre_buffer") is False


def test_parquet_columns_that_used_to_abort_exit_2_in_a_real_process(tmp_path):
    for case in ("list", "uint64-huge", "struct"):
        p = tmp_path / f"{case}.parquet"
        pq.write_table(pa.table({"length": PARQUET[case][0]}), p)
        res = _proc(["analyze", p, *SMALL, "--json", "--strategies=packed"])
        assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, (case, res.returncode, res.stderr)


# ----- model configs (check-packing --model DIR) ------------------------------------------------------------
CONFIGS = {
    "not-json": ("{model_type: llama}", r"not a model config \(malformed JSON"),
    "array": ("[1, 2]", r"not a model config \(a JSON object with a string model_type\)"),
    "no-type": ('{"hidden_size": 64}', r"a JSON object with a string model_type"),
    "negative": ('{"model_type": "llama", "hidden_size": -4}', r"hidden_size must be an integer from 1"),
    "zero-heads": ('{"model_type": "llama", "num_attention_heads": 0}', r"num_attention_heads must be"),
    "string": ('{"model_type": "llama", "num_hidden_layers": "4"}', r"num_hidden_layers must be"),
    "bool": ('{"model_type": "llama", "vocab_size": true}', r"vocab_size must be an integer"),
    "float": ('{"model_type": "llama", "hidden_size": 64.5}', r"hidden_size must be an integer"),
    "huge-int": ('{"model_type": "llama", "hidden_size": 1e999}', r"hidden_size must be an integer"),
    "unknown-type": ('{"model_type": "no-such-model"}', r"transformers cannot build a config from it"),
    "heads": ('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 5}',
              r"cannot build a config from it .*not a multiple of the number of attention heads"),
    "too-big": ('{"model_type": "llama", "hidden_size": 16384, "num_hidden_layers": 200, '
                '"num_attention_heads": 128, "intermediate_size": 53248}', r"about 739\.\d+B parameters"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_a_bad_model_config_is_one_line_naming_it(case, tmp_path, capsys):
    text, rule = CONFIGS[case]
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(text)
    code, lines = _run(["check-packing", "--model", d, "--json"], capsys)
    _one_line(code, lines, re.escape(str(d)), rule)


# ----- the environment: a home folder that is not writable --------------------------------------------------
def test_an_unwritable_home_folder_changes_nothing_but_the_cache_places(lengths_txt, tmp_path):
    drop = ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "MPLCONFIGDIR", "NUMBA_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(HOME="/dev/null", PYTHONPATH=str(ROOT / "src"))  # ~/.cache, ~/.config: under a file
    report = ["report", lengths_txt, *SMALL, f"--out={tmp_path / 'r'}", "--growths=1.5", "--bucket-counts=4"]
    for argv in (["plan", lengths_txt, *SMALL, f"--out={tmp_path / 'p.jsonl'}"], report):
        res = subprocess.run(
            [sys.executable, "-m", "padfree", *map(str, argv)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert res.returncode == 0, res.stderr
        noise = [
            ln for ln in res.stderr.splitlines() if "warning" in ln.lower() or "matplotlib" in ln.lower()
        ]
        assert not noise and "Traceback" not in res.stderr, res.stderr


def test_numba_caches_in_the_temporary_folder_when_neither_usual_place_is_writable(tmp_path):
    code = (
        "import numba, tempfile, padfree.core.kernels as k\n"
        "numba.config.CACHE_DIR = ''\n"
        "k.__file__ = '/dev/null/kernels.py'\n"  # beside the module: under a file, not writable
        "k._numba_cache_fallback()\n"
        "print(numba.config.CACHE_DIR)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HOME": "/dev/null"}
    env.pop("XDG_CACHE_HOME", None)
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=HANG_S
    )
    assert res.returncode == 0, res.stderr
    import tempfile

    assert res.stdout.strip().startswith(str(Path(tempfile.gettempdir()) / "padfree-numba-")), res.stdout


# ----- the last line of defence -----------------------------------------------------------------------------
def test_an_unexpected_exception_is_one_line_unless_debugging(lengths_txt, capsys, monkeypatch):
    import padfree.commands.plan as plan_cmd

    def boom(args):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(plan_cmd, "run", boom)
    code, lines = _run(["plan", lengths_txt], capsys)
    _one_line(code, lines, r"unexpected ZeroDivisionError: float division by zero \(please report it")
    monkeypatch.setenv("PADFREE_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        main(["plan", str(lengths_txt)])


def test_os_errors_name_their_file(lengths_txt, capsys, monkeypatch):
    import padfree.commands.plan as plan_cmd

    def vanish(args):
        raise FileNotFoundError(2, "No such file or directory", "/gone/shard.txt")

    monkeypatch.setattr(plan_cmd, "run", vanish)
    code, lines = _run(["plan", lengths_txt], capsys)
    _one_line(code, lines, r"^padfree: error: /gone/shard\.txt: No such file or directory$")


def test_growths_and_bucket_count_lists_are_bounded(lengths_txt, tmp_path, capsys):
    out = f"--out={tmp_path / 'r'}"
    for extra, rule in (
        (
            ["--growths=" + ",".join(["1.5"] * 17)],
            r"--growths takes 1 to 16 comma-separated values \(got 17\)",
        ),
        (["--bucket-counts=4,5000"], r"--bucket-counts: each value must be an integer from 1 to 1024"),
        (["--growths=1.5,nan"], r"--growths: each value must be a number > 1"),
    ):
        code, lines = _run(["report", lengths_txt, *SMALL, out, *extra], capsys)
        _one_line(code, lines, rule)


@pytest.mark.parametrize(
    ("speeds", "rule"),
    [
        ("1e300,1", r"every factor must be a number from 0.001 to 1000"),
        ("1e-300,1", r"every factor must be a number from 0.001 to 1000"),
        ("inf,1", r"every factor must be a number from 0.001 to 1000"),
        ("1,500", r"the slowest rank is 500x the fastest; at most 400x"),
    ],
)
def test_simulate_speeds_are_bounded(speeds, rule, lengths_txt, capsys):
    code, lines = _run(["simulate", lengths_txt, "--budget=64", f"--speeds={speeds}"], capsys)
    _one_line(code, lines, r"^padfree: error: --speeds: ", rule)


def test_a_path_with_a_newline_is_printed_escaped_on_one_line(tmp_path, capsys):
    odd = tmp_path / "two\nlines" / "l.txt"
    code, lines = _run(["plan", odd, *SMALL], capsys)
    _one_line(code, lines, r"two\\nlines/l\.txt: file not found$")
    odd.parent.mkdir()
    good = tmp_path / "ok.txt"
    good.write_text("1\n2\n3\n")
    code, lines = _run(["plan", good, *SMALL, f"--out={odd.parent}/out\rx/p.jsonl"], capsys)
    _one_line(code, lines, r"two\\nlines/out\\rx")
