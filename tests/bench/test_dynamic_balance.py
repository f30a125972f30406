"""The dynamic-balance benchmark's worker, in one process (a gloo group of one rank): the slow rank's
reported compute is its measured compute times the factor, the step's wall time holds it, every step
trains the plan's samples, and the summary is the loss tokens over the wall time."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY_MODEL

from lab.dynamic_balance import Run, has_dynamic, run_one, summarize


@pytest.mark.parametrize("strategy", ["packed", "bucketed"])
def test_worker_times_steps_and_inflates_the_slow_rank(tmp_path, gloo, strategy):
    lengths = np.random.default_rng(0).integers(2, 60, 400)
    np.save(tmp_path / "l.npy", lengths)
    run = Run("slow_rank", strategy, str(tmp_path / "l.npy"), budget=128, grad_accum=2, steps=2, warmup=1,
              slow_rank=0, slow_factor=1.5, model_overrides=TINY_MODEL)  # fmt: skip
    modes = ("static", "dynamic") if has_dynamic() else ("static",)
    res = run_one(run, rank=0, world=1, modes=modes)
    from padfree import PlanConfig, make_plan

    plan = make_plan(lengths, PlanConfig(strategy=strategy, budget=128, world_size=1, grad_accum=2))
    want = [int((plan.lengths[plan.offsets[2 * s] : plan.offsets[2 * s + 2]] - 1).sum()) for s in range(3)]
    for m in modes:
        steps = res["steps"][m]
        assert len(steps) == 3 and [x["tokens"] for x in steps] == want
        for x in steps:
            assert x["busy"][0] == pytest.approx(1.5 * x["compute"][0]) and x["compute"][0] > 0
            assert x["wall"] >= x["busy"][0] and x["micro"] == [2]
        summary = summarize(steps, warmup=1)
        assert summary["steps"] == 2 and summary["busy_imbalance"] == 1.0
        assert summary["real_tok_per_s"] == pytest.approx(sum(want[1:]) / sum(x["wall"] for x in steps[1:]))
