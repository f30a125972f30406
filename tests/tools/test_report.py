"""`padfree report`: the numbers behind the decision, and the page rendered in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from padfree.cli import main
from padfree.core.config import PlanConfig
from padfree.core.metrics import modeled_throughput
from padfree.core.planner import make_plan
from padfree.tools.report import (
    MAX_ADJACENT_CORR,
    MAX_COBATCH_REPEAT,
    build_report,
)


@pytest.fixture(scope="module")
def subset(seed_mix: np.ndarray) -> np.ndarray:
    return seed_mix[np.random.default_rng(5).choice(seed_mix.shape[0], 30_000, replace=False)]


@pytest.fixture(scope="module")
def page(subset: np.ndarray, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report")
    np.save(out / "subset.npy", subset)
    rc = main(
        [
            "report",
            str(out / "subset.npy"),
            "--out",
            str(out / "site"),
            "--world-size",
            "4",
            "--grad-accum",
            "2",
            "--growths",
            "1.25,2",
            "--bucket-counts",
            "4,16",
        ]
    )
    assert rc == 0
    return out / "site"


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if exe is None:
        pytest.fail(
            "chromium is not installed: the report test renders the page in headless Chromium. "
            "Install it (Debian: apt-get install -y chromium; .ci/run does this when CI=true)."
        )
    return exe


def test_page_renders_every_image_in_headless_chromium(page: Path, tmp_path: Path) -> None:
    html = (page / "index.html").read_text()
    n_img = len(re.findall(r"<img\b", html))
    assert n_img >= 4
    # self-contained: every image is a data URI, nothing is fetched from anywhere
    assert re.findall(r"<img[^>]+src='([^']*)'", html) and all(
        s.startswith("data:image/png;base64,") for s in re.findall(r"<img[^>]+src='([^']*)'", html)
    )
    assert not re.search(r"(src|href)=['\"]?(https?:)?//", html)
    cmd = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=5000",
        "--dump-dom",
        (page / "index.html").resolve().as_uri(),
    ]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=90).stdout
    body = re.search(r"<body[^>]*>", dom)
    assert body is not None, dom[:500]
    assert f'data-images-loaded="{n_img}"' in body.group(0), body.group(0)
    assert f'data-images-total="{n_img}"' in body.group(0)
    for heading in ("Recommendation", "Length histogram", "Efficiency-diversity frontier", "Rank load"):
        assert heading in dom


def test_report_json_holds_the_numbers_behind_the_page(page: Path, subset: np.ndarray) -> None:
    numbers = json.loads((page / "report.json").read_text())
    assert numbers["dataset"]["samples"] == subset.shape[0]
    labels = [p["label"] for p in numbers["frontier"]]
    assert len(labels) == len(set(labels))
    # strategies, 2 growth factors (1.25 is the base bucketed config) and 2 bucket counts, then retries
    # with a doubled mix of a faster bucketed plan that only missed the co-batch repeat rule
    swept = {
        "sorted",
        "random",
        "packed",
        "bucketed (growth 1.25)",
        "bucketed (growth 2)",
        "bucketed (4 optimal buckets)",
        "bucketed (16 optimal buckets)",
    }
    by = {p["label"]: p for p in numbers["frontier"]}
    assert swept <= set(labels)
    retried = [by[lab] for lab in labels if lab not in swept]
    assert all(p["family"] == "mix" and p["params"]["mix"] in (256, 512, 1024) for p in retried)
    if retried:  # 30K samples: 128 micro-batches' worth of noise is too little for <= 1% repeats
        assert min(p["cobatch_repeat"] for p in retried) < min(
            by[lab]["cobatch_repeat"] for lab in swept if lab.startswith("bucketed")
        )
    assert by["sorted"]["relative_throughput"] == pytest.approx(1.0)
    assert by["random"]["padding_efficiency"] < 0.6 < by["bucketed (growth 1.25)"]["padding_efficiency"]
    rec = numbers["recommendation"]
    chosen = by[rec["label"]]
    assert chosen["cobatch_repeat"] <= MAX_COBATCH_REPEAT
    assert chosen["adjacent_corr"] <= MAX_ADJACENT_CORR
    assert chosen["step_divergence"] <= by["random"]["step_divergence"]
    assert rec["label"] == "packed"
    alt = by[rec["alternative"]["label"]]
    assert alt["params"]["strategy"] != "packed" and alt["label"] in rec["eligible"]
    faster_rejected = [
        p
        for p in numbers["frontier"]
        if p["label"] in rec["rejected"]
        and p["params"]["strategy"] == "bucketed"
        and p["modeled_throughput"] > alt["modeled_throughput"]
    ]
    if faster_rejected:  # named, with the rule it breaks
        best = max(faster_rejected, key=lambda p: p["modeled_throughput"])
        assert (
            rec["near_miss"].startswith(best["label"])
            and rec["rejected"][best["label"]][0] in rec["near_miss"]
        )
    else:
        assert rec["near_miss"] is None
    assert f"{chosen['padding_efficiency']:.4f}" in rec["text"]
    html = (page / "index.html").read_text()
    assert rec["label"] in html and rec["reasons"][0] in html
    rl = np.asarray(numbers["rank_load"]["cost"])
    assert rl.shape[1] == 4 and 0 < rl.shape[0] <= 200
    np.testing.assert_array_less(numbers["bucket_edges"][:-1], numbers["bucket_edges"][1:])
    assert numbers["bucket_edges"][-1] >= subset.max()


def test_without_packing_the_fastest_eligible_padded_plan_wins(subset: np.ndarray) -> None:
    base = PlanConfig(strategy="bucketed", budget=16384, world_size=4, grad_accum=2)
    numbers, plans = build_report(subset, base, growths=(1.5,), bucket_counts=(8,), packing=False)
    rec = numbers["recommendation"]
    front = {p["label"]: p for p in numbers["frontier"]}
    assert rec["label"] != "packed"
    eligible = [front[lab] for lab in rec["eligible"] if lab != "packed"]
    assert rec["label"] == max(eligible, key=lambda p: p["modeled_throughput"])["label"]
    for lab, why in rec["rejected"].items():  # every rejection names the broken rule
        assert why and lab in front
    plan = plans["recommended"]
    assert numbers["rank_load"]["label"] == rec["label"] and plan.config.strategy != "packed"


def test_modeled_throughput_is_real_tokens_over_slowest_rank_cost(subset: np.ndarray) -> None:
    cfg = PlanConfig(strategy="random", budget=8192, world_size=4, grad_accum=2)
    plan = make_plan(subset, cfg, 0)
    rc = plan.rank_costs()
    expect = subset.sum() / rc.max(axis=1).sum()  # no overlong samples: every token is planned
    assert modeled_throughput(plan) == pytest.approx(expect)
    assert modeled_throughput(plan) < subset.sum() / rc.mean(axis=1).sum()
