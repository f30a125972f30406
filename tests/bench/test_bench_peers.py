import json

import numpy as np
import pytest

from lab.plan_speed import Case, render_markdown, run_case
from padfree.bench.measure import Batching, batching_stats, covers_each_once
from padfree.bench.peers import PEER_NAMES, PEERS, missing, plan_with_peer


@pytest.fixture(scope="module")
def small(seed_mix):
    return seed_mix[:6000]


@pytest.mark.parametrize("name", PEER_NAMES)
def test_peer_covers_every_sample_once(name, small):
    assert missing(PEERS[name]) is None, "the bench extra is part of the dev install"
    b = plan_with_peer(name, small, budget=16384, seed=1)
    assert covers_each_once(b, small.size)
    st = batching_stats(small, b, 16384)
    assert st["samples_covered"] == small.size and 0 < st["padding_efficiency"] <= 1.0
    if name in ("hf_group_by_length", "trl_bfd"):  # cut under the padded budget / bins of the budget
        assert st["over_budget_micro"] == 0
    assert b.note


def test_measure_padded_and_packed_by_hand():
    lengths = np.array([4, 2, 6, 10])
    padded = Batching(np.array([0, 1, 2, 3]), np.array([0, 2, 4]), packed=False)
    # micro 0: 2 x 4 = 8 slots, micro 1: 2 x 10 = 20 slots
    assert batching_stats(lengths, padded, 20)["padding_efficiency"] == pytest.approx(22 / 28)
    packed = Batching(np.array([3, 0, 1, 2]), np.array([0, 1, 4]), packed=True)
    st = batching_stats(lengths, packed, 8)  # bin 0 overflows (10 > 8) and counts its own size
    assert st["padding_efficiency"] == pytest.approx(22 / (10 + 12)) and st["over_budget_micro"] == 2
    assert not covers_each_once(Batching(np.array([0, 0, 1, 2]), np.array([0, 4]), True), 4)


def test_run_case_padfree_and_peer(tmp_path, small):
    path = tmp_path / "l.npy"
    np.save(path, small)
    rows = [
        run_case(Case("s", str(path), "bucketed", "padfree", {}, cap_s=60)),
        run_case(Case("s", str(path), "hf_group_by_length", "peer", {}, cap_s=60)),
    ]
    for r in rows:
        assert r["status"] == "ok" and r["covers_each_once"] and r["seconds"] > 0
    assert rows[1]["variant"] == "grad_accum=4"
    result = {
        "command": "x",
        "config": {"budget": 16384, "world_size": 8, "grad_accum": 4, "seed": 0, "cap_s": 60},
        "machine": {"cpu_count": 2, "load_average_1_5_15": [1.0, 1.0, 1.0], "versions": {"numpy": "2"}},
        "datasets": {"s": {"samples": small.size, "tokens": int(small.sum())}},
        "results": rows
        + [{"dataset": "s", "method": "trl_bfd", "variant": "v", "status": "timed out", "reason": "r"}],
    }
    md = render_markdown(result)
    assert "| bucketed |" in md and "| trl_bfd | v | timed out |" in md
    json.dumps(result)


def test_run_case_times_out(tmp_path, seed_mix):
    path = tmp_path / "l.npy"
    np.save(path, seed_mix[:60_000])
    r = run_case(Case("s", str(path), "lhotse_dynamic_bucketing", "peer", {}, cap_s=0.05))
    assert r["status"] == "timed out" and "0 s" in r["reason"]


def test_batch_rebalance_peer_is_every_ranks_own_sampler(small):
    """The adapter's micro-batch (step s, rank r, slot a) is what BatchRebalanceSampler(rank=r) yields as its
    s*accum+a-th micro-batch; its imbalance and over-budget count are measured like padfree's."""
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    from padfree.bench.measure import rank_imbalance
    from padfree.bench.peers import per_device_batch

    lengths = small[:2000]
    world, accum, budget = 4, 2, 4096
    b = plan_with_peer("hf_batch_rebalance", lengths, budget, seed=3, world_size=world, grad_accum=accum)
    assert covers_each_once(b, lengths.size) and not b.packed
    ebs = per_device_batch(lengths, budget) * accum * world
    micro = [b.order[b.offsets[k] : b.offsets[k + 1]].tolist() for k in range(b.n_micro)]
    assert len(micro) % (world * accum) == 0
    for r in range(world):
        own = BatchRebalanceSampler(lengths.tolist(), ebs, world, accum, seed=3, rank=r, drop_last=False)
        mine = [m for k, m in enumerate(micro) if (k // accum) % world == r]
        assert [list(x) for x in own] == mine
    assert rank_imbalance(lengths, b, world, accum) >= 1.0
    st = batching_stats(lengths, b, budget)
    slots = [len(m) * int(lengths[m].max()) for m in micro]
    assert st["over_budget_micro"] == sum(s > budget for s in slots)
    assert st["largest_micro_slots"] == max(slots)


def test_rank_imbalance_by_hand():
    from padfree.bench.measure import rank_imbalance
    from padfree.core.config import CostModel

    lengths = np.array([4, 4, 2, 8, 3])
    # padded micro-batches {0,1} {2} {3} {4}: slots 8, 2, 8, 3; world 2 x accum 1: steps (8,2) and (8,3)
    b = Batching(np.arange(5), np.array([0, 2, 3, 4, 5]), packed=False)
    assert rank_imbalance(lengths, b, 2, 1) == pytest.approx(np.mean([8 / 5, 8 / 5.5]))
    # with attention: costs 8+0.5*32=24, 2+0.5*4=4, 8+0.5*64=40, 3+0.5*9=7.5
    want = np.mean([24 / 14, 40 / 23.75])
    assert rank_imbalance(lengths, b, 2, 1, CostModel(1.0, 0.5, 0.0)) == pytest.approx(want)
    # world 2 x accum 2: one step, ranks (8+2, 8+3); a trailing partial step is left out
    assert rank_imbalance(lengths, b, 2, 2) == pytest.approx(11 / 10.5)
    assert rank_imbalance(lengths, b, 4, 2) == 1.0
