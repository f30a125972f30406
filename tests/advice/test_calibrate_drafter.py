"""calibrate for a drafter setup: DFlash shapes vary the anchors at fixed tokens, and the fit recovers a
machine's per-block and per-reach costs beside its token, attention and per-step ones."""

import numpy as np
import pytest

from padfree.advice.calibrate import DrafterShape, Shape, calibrate, design, drafter_grid


def test_the_fit_recovers_the_drafter_terms_of_a_synthetic_machine():
    clock = [0.0]
    truth = (2e-6, 1e-9, 5e-3, 4e-5, 3e-8)  # seconds per slot, L^2, step, block, unit of reach

    def step(count, length, anchors):
        s = DrafterShape(count, length, anchors)
        clock[0] += float((design([s]) @ np.array(truth))[0])

    cal = calibrate(step, 1024, [64, 128, 256, 512, 1024], repeats=1, warmup=0, clock=lambda: clock[0],
                    anchors_per_token=(1 / 32, 1 / 16, 1 / 8))  # fmt: skip
    a = truth[0]
    assert cal.seconds_per_slot == pytest.approx(a, rel=1e-6)
    assert (cal.cost.b, cal.cost.c, cal.cost.d, cal.cost.e) == pytest.approx(
        (truth[1] / a, truth[2] / a, truth[3] / a, truth[4] / a), rel=1e-5
    )
    assert cal.held_out["rel_rms"] < 1e-9 and all("anchors" in r for r in cal.rows)


def test_drafter_grid_varies_blocks_at_fixed_tokens():
    grid = drafter_grid([Shape(4, 256), Shape(1, 1024)])
    assert {(s.count, s.length) for s in grid} == {(4, 256), (1, 1024)}
    at_256 = sorted(s.blocks for s in grid if s.length == 256)
    assert at_256 == [4 * 8, 4 * 16, 4 * 32]
    assert design(grid).shape == (6, 5) and design([Shape(1, 8)]).shape == (1, 3)
