"""Issue 19, item 7: `padfree bench` survives any arm. An arm whose step fails or runs out of memory is
recorded as such, with its peak, and the other arms' figures are kept; the preflight child process really
runs out of memory under its cap (and is not killed: it reports it)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY_MODEL

from padfree.bench import isolation
from padfree.bench import train_speed as ts
from padfree.bench.samples import random_samples
from padfree.bench.trainer import Trainer


def _samples() -> object:
    lengths = np.random.default_rng(3).integers(2, 60, 120)
    return random_samples(lengths, 128, 0, "test")


def _cfg(**kw) -> ts.BenchConfig:
    return ts.BenchConfig(budget=64, steps=2, warmup=1, model_overrides=TINY_MODEL, threads=1,
                          strategies=("sorted", "random", "packed"), **kw)  # fmt: skip


def test_an_arm_that_runs_out_of_memory_in_the_rounds_is_recorded_and_the_others_kept(monkeypatch) -> None:
    real = Trainer.step
    calls = {"packed": 0}

    def step(self, batch, step_tokens):  # the packed arm's allocator refuses its third step
        if self.collate.__class__.__name__ == "PackCollator":
            calls["packed"] += 1
            if calls["packed"] == 3:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 GB")
        return real(self, batch, step_tokens)

    monkeypatch.setattr(Trainer, "step", step)
    result = ts.run_bench(_samples(), _cfg(isolate=False))
    s = result["strategies"]
    assert s["packed"]["out_of_memory"] is True and "can't allocate memory" in s["packed"]["error"]
    assert "during the interleaved rounds" in s["packed"]["error"] and s["packed"]["peak_rss_mb"] > 0
    for name in ("sorted", "random"):
        assert s[name]["real_tok_per_s"] > 0 and s[name]["steps"] == 2
    assert calls["packed"] == 3  # it ran no further


def test_an_arm_the_preflight_refuses_is_left_out_with_its_peak(monkeypatch) -> None:
    real = isolation.preflight
    seen = []

    def preflight(items, cfg, packed, limit, timeout=600.0):
        seen.append((packed, limit))
        if not packed:
            return real(items, cfg, packed, limit, timeout)
        return {"ok": False, "out_of_memory": True, "error": "MemoryError: ", "peak_rss_mb": 4321.0}

    monkeypatch.setattr(isolation, "preflight", preflight)
    result = ts.run_bench(_samples(), _cfg(memory_limit=8 * 2**30))
    s = result["strategies"]
    assert s["packed"] == {
        "error": "out of memory (its heaviest micro-batch alone in a child process capped at 8.0 GiB): "
        "MemoryError: ",
        "out_of_memory": True,
        "peak_rss_mb": 4321.0,
    }
    assert s["sorted"]["real_tok_per_s"] > 0 and s["random"]["real_tok_per_s"] > 0
    assert len(seen) == 3 and all(limit == 8 * 2**30 for _, limit in seen)


@pytest.mark.parametrize("rows", [2, 24])
def test_the_preflight_child_runs_out_of_memory_under_its_cap_and_says_so(rows: int) -> None:
    """A real allocation failure: 24 rows x 4096 tokens of a 32K-vocabulary model need ~12 GB of logits,
    far over a 4 GiB cap; 2 rows of 64 tokens fit under it."""
    cfg = ts.BenchConfig(budget=4096 * 24, threads=1, model_overrides={"num_hidden_layers": 1})
    n = 4096 if rows > 2 else 64
    items = [{"input_ids": list(np.random.default_rng(r).integers(1, 30000, n))} for r in range(rows)]
    out = isolation.preflight(items, cfg, False, 4 * 2**30)
    assert out["peak_rss_mb"] > 100
    if rows > 2:
        assert out["ok"] is False and out["out_of_memory"] is True, out
        assert out["peak_rss_mb"] < 4 * 1024
    else:
        assert out["ok"] is True, out
