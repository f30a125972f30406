import json

import numpy as np
import pytest
from conftest import TINY_MODEL

from padfree.advice.calibrate import (
    Shape,
    calibrate,
    default_lengths,
    design,
    fit_seconds,
    held_out_grid,
    measure,
    nnls,
    shape_grid,
    torch_train_step,
)
from padfree.cli import main
from padfree.core.config import CostModel
from padfree.errors import ConfigError

TINY = {**TINY_MODEL, "max_position_embeddings": 256}


class FakeMachine:
    """A clock that advances by a known cost function whenever a step runs (with seeded noise)."""

    def __init__(self, a, b, c, noise=0.0, seed=0):
        self.t, self.coef, self.noise = 0.0, (a, b, c), noise
        self.rng = np.random.default_rng(seed)
        self.calls = []

    def clock(self):
        return self.t

    def step(self, count, length):
        a, b, c = self.coef
        base = a * count * length + b * count * length**2 + c
        self.t += base * (1.0 + self.noise * self.rng.standard_normal())
        self.calls.append((count, length))


def test_grid_varies_slots_and_attention():
    shapes = shape_grid(4096, default_lengths(4096))
    assert [s.length for s in shapes][0] == 64 and max(s.length for s in shapes) == 4096
    assert all(s.slots <= 4096 for s in shapes)
    slots = {s.slots for s in shapes}
    assert len(slots) >= 3  # several slot counts, so a and c are separable
    # same slots at different lengths, so b is separable from a
    by_slots = {}
    for s in shapes:
        by_slots.setdefault(s.slots, set()).add(s.length)
    assert any(len(v) > 1 for v in by_slots.values())
    held = held_out_grid(4096, default_lengths(4096))
    assert held and not {(s.count, s.length) for s in held} & {(s.count, s.length) for s in shapes}


def test_grid_rejects_length_over_budget():
    with pytest.raises(ConfigError, match="between 1 and the budget"):
        shape_grid(128, [64, 256])


@pytest.mark.parametrize(
    "coef", [(2e-6, 1e-9, 5e-3), (1e-5, 0.0, 2e-2), (3e-7, 4e-10, 0.0)], ids=["all", "no-attn", "no-overhead"]
)
def test_synthetic_coefficients_recovered(coef):
    m = FakeMachine(*coef, noise=0.01, seed=3)
    cal = calibrate(m.step, 4096, default_lengths(4096), repeats=3, warmup=1, clock=m.clock)
    a, b, c = coef
    assert cal.seconds_per_slot == pytest.approx(a, rel=0.03)
    assert cal.cost.a == 1.0
    assert cal.cost.b == pytest.approx(b / a, rel=0.1, abs=2e-6)
    assert cal.cost.c == pytest.approx(c / a, rel=0.1, abs=0.02 * 4096)
    assert cal.fit["rel_rms"] < 0.03 and cal.held_out["n"] > 0 and cal.held_out["max_rel"] < 0.06
    # warm-up calls are made but not timed: each shape is stepped warmup + repeats times
    assert len(m.calls) == 4 * len(cal.rows)


def test_exact_fit_without_noise():
    m = FakeMachine(1e-6, 2e-10, 1e-3)
    cal = calibrate(m.step, 1024, [64, 128, 256, 512, 1024], repeats=1, warmup=0, clock=m.clock)
    assert cal.fit["max_rel"] < 1e-9 and cal.held_out["max_rel"] < 1e-9
    assert cal.coef_seconds == pytest.approx((1e-6, 2e-10, 1e-3), rel=1e-6)


def test_nnls_matches_constrained_optimum():
    rng = np.random.default_rng(0)
    x = rng.random((30, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + 0.01 * rng.standard_normal(30)
    sol = nnls(x, y)
    assert np.all(sol >= 0) and sol[1] == 0.0
    # no non-negative point on a fine grid around the solution does better
    best = np.sum((x @ sol - y) ** 2)
    for d in rng.normal(scale=0.05, size=(500, 3)):
        cand = np.maximum(sol + d, 0)
        assert np.sum((x @ cand - y) ** 2) >= best - 1e-12


def test_fit_rejects_bad_timings():
    shapes = [Shape(1, 64), Shape(2, 64), Shape(1, 128)]
    with pytest.raises(ConfigError, match="positive"):
        fit_seconds(shapes, np.array([1.0, 0.0, 2.0]))
    with pytest.raises(ConfigError, match="at least 3"):
        fit_seconds(shapes[:2], np.array([1.0, 2.0]))
    assert design(shapes)[2].tolist() == [128.0, 16384.0, 1.0]


def test_real_step_end_to_end_and_cost_file_round_trip(tmp_path, capsys):
    step = torch_train_step("tiny-llama", **TINY)
    cal = calibrate(step, 64, [8, 16, 32, 64], fractions=(1.0, 0.5), repeats=1, warmup=1, source="t")
    assert cal.seconds_per_slot > 0 and all(r["seconds"] > 0 for r in cal.rows)
    out = tmp_path / "cost.json"
    cal.save(out)
    data = json.loads(out.read_text())
    assert data["seconds_per_slot"] == cal.seconds_per_slot and data["a"] == 1.0
    loaded = CostModel.load(out)
    assert (loaded.a, loaded.b, loaded.c) == (cal.cost.a, cal.cost.b, cal.cost.c)
    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(str(x) for x in np.random.default_rng(0).integers(1, 60, 64)) + "\n")
    capsys.readouterr()
    assert main(["analyze", str(lengths), "--budget", "64", "--world-size", "2", "--grad-accum", "1",
                 "--cost", str(out), "--json"]) == 0  # fmt: skip
    res = json.loads(capsys.readouterr().out)
    assert res["config"]["cost"]["c"] == pytest.approx(cal.cost.c)
    assert res["config"]["cost"]["source"] == str(out)


def test_cli_quick_writes_cost_file(tmp_path, monkeypatch, capsys):
    import padfree.advice.calibrate as cal_mod

    real = cal_mod.torch_train_step
    monkeypatch.setattr(cal_mod, "torch_train_step", lambda *a, **k: real(*a, **(k | TINY)))
    out = tmp_path / "c.json"
    assert main(["calibrate", "--quick", "--device", "cpu", "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["meta"]["budget"] == 256 and printed["meta"]["repeats"] == 1
    assert printed["meta"]["warmup"] == 0  # one priming step instead of a warm-up round
    assert CostModel.load(out).a == 1.0
    saved = json.loads(out.read_text())
    assert saved["held_out_rel_rms"] == saved["held_out"]["rel_rms"] > 0  # the cost file says how good it is


def test_prime_is_one_untimed_step_of_the_largest_shape():
    calls = []
    clock = [0.0]

    def step(count, length):
        calls.append((count, length))
        clock[0] += 1e-6 * count * length

    shapes = shape_grid(64, [8, 16, 32], (1.0, 0.5))
    measure(shapes, step, repeats=1, warmup=0, clock=lambda: clock[0], prime=True)
    assert len(calls) == len(shapes) + 1 and calls[0] == (2, 32)


def test_cli_bad_options_exit_2(tmp_path, capsys):
    assert main(["calibrate", "--lengths", "8,x", "--device", "cpu", "--out", str(tmp_path / "c.json")]) == 2
    assert "--lengths" in capsys.readouterr().err
    assert main(["calibrate", "--repeats", "0", "--out", str(tmp_path / "c.json")]) == 2


def test_fit_keeps_a_per_token_cost_on_pure_overhead():
    # timings that are all overhead (flat): the fit keeps A > 0 and reports how poorly it fits
    shapes = shape_grid(1024, [64, 128, 256, 512, 1024])
    y = np.full(len(shapes), 0.5)
    a, b, c = fit_seconds(shapes, y)
    assert a > 0 and b >= 0 and c >= 0
    cal_pred = design(shapes) @ np.array([a, b, c])
    assert np.all(cal_pred > 0)
    assert a * 1024 > 1e-6 * 0.5  # the slots term is not a rounding-error zero


def test_cli_lengths_are_checked_and_used_with_quick_too(tmp_path, monkeypatch, capsys):
    # issue 28: --quick dropped --lengths unread: 70 values (the bound is 64) or one above the budget passed
    import padfree.advice.calibrate as cal_mod

    out = str(tmp_path / "c.json")
    many = ",".join(str(v) for v in range(1, 71))
    cases = [
        (["--quick", "--lengths", many], "--lengths takes 1 to 64 comma-separated values (got 70)"),
        (["--quick", "--lengths", "32,512"], "--lengths: 512 is above the budget 256"),
        (["--lengths", "64,2048", "--budget", "1024"], "--lengths: 2048 is above the budget 1024"),
    ]
    monkeypatch.setattr(cal_mod, "torch_train_step", lambda *a, **k: pytest.fail("built a model"))
    for args, message in cases:
        assert main(["calibrate", *args, "--device", "cpu", "--out", out]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and message in err[0], err
    seen: dict = {}

    def fake_calibrate(step, budget, lengths, **kw):  # what would be timed, then stop
        seen.update(budget=budget, lengths=list(lengths))
        raise ConfigError("stopped before timing")

    monkeypatch.setattr(cal_mod, "torch_train_step", lambda *a, **k: None)
    monkeypatch.setattr(cal_mod, "calibrate", fake_calibrate)
    assert main(["calibrate", "--quick", "--lengths", "32,128", "--device", "cpu", "--out", out]) == 2
    assert "stopped before timing" in capsys.readouterr().err
    assert seen == {"budget": 256, "lengths": [32, 128]}


def test_cli_shows_a_bar_of_timed_steps_on_a_terminal(tmp_path, monkeypatch, capsys):
    import padfree.advice.calibrate as cal_mod
    import padfree.commands.calibrate as cmd
    from padfree import progress

    real = cal_mod.torch_train_step
    calls = []

    def step(*a, **k):
        inner = real(*a, **(k | TINY))

        def counted(*call):
            calls.append(call)
            return inner(*call)

        return counted

    ticks = []

    def bar(description, total, *, enabled):
        ctx = progress.progress_bar(description, total, enabled=False)
        ticks.append(enabled)
        real_enter = ctx.__enter__

        class Wrap:
            def __enter__(self):
                real_enter()
                return lambda n=1, description=None: ticks.append(n)

            def __exit__(self, *exc):
                return ctx.__exit__(*exc)

        return Wrap()

    monkeypatch.setattr(cal_mod, "torch_train_step", step)
    monkeypatch.setattr(cmd, "progress_bar", bar)
    monkeypatch.setattr(cmd, "bars_wanted", lambda quiet=False: not quiet)  # as on a terminal
    out = tmp_path / "c.json"
    assert main(["calibrate", "--quick", "--device", "cpu", "--out", str(out), "--json"]) == 0
    assert ticks[0] is True and ticks[1:] == [1] * len(calls) and len(calls) > 1  # one tick a timed step
    ticks.clear()
    assert main(["calibrate", "--quick", "--device", "cpu", "--out", str(out), "--json", "--quiet"]) == 0
    assert ticks[0] is False
