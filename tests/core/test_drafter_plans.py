"""Drafter plans: every micro-batch within the token budget and the anchor budget (and, for eager EAGLE-3,
the attention-memory bound), checked against brute force; the drafter cost terms; resume with anchors."""

from collections import Counter

import numpy as np
import pytest

from padfree import ConfigError, CostModel, PlanConfig, make_plan
from padfree.core import capacity, cost
from padfree.core.balance import Balance, step_layout
from padfree.drafter.methods import cost_model

STRATEGIES = ["sorted", "random", "bucketed", "packed"]


def data(seed, n=400, top=900):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, top, n)
    # anchors loosely tied to length, some anchor-rich short samples and anchor-poor long ones
    anchors = np.minimum(lengths, rng.integers(0, 60, n) + (lengths // 40) * rng.integers(0, 2, n))
    return lengths, anchors


def blocks_brute(lens, anchors, packed):
    """Draft blocks a micro-batch computes, counted one by one."""
    if packed:
        return sum(int(a) for a in anchors)
    return len(lens) * max(int(a) for a in anchors)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_micro_batch_within_both_budgets(strategy, seed):
    lengths, anchors = data(seed)
    cfg = PlanConfig(strategy=strategy, budget=2048, world_size=2, grad_accum=2, seed=seed, anchor_budget=90)
    plan = make_plan(lengths, cfg, epoch=seed, anchors=anchors)
    assert sorted(plan.indices.tolist()) == list(range(lengths.shape[0]))
    assert plan.n_micro % 4 == 0
    packed = cfg.packed
    for j in range(plan.n_micro):
        ids = plan.micro(j)
        if ids.size == 0:
            continue
        lens, anc = lengths[ids], anchors[ids]
        tokens = lens.sum() if packed else len(lens) * lens.max()
        assert tokens <= 2048
        assert blocks_brute(lens, anc, packed) <= 90
        assert np.array_equal(plan.anchors[plan.offsets[j] : plan.offsets[j + 1]], anc)
    # the anchor budget binds here: without it, fewer micro-batches
    assert make_plan(lengths, cfg.with_(anchor_budget=None), epoch=seed).n_micro < plan.n_micro


def greedy_brute(lens, anchors, budget, anchor_budget):
    """The greedy padded cut, checking both bounds directly."""
    offsets, start = [0], 0
    for i in range(1, len(lens) + 1):
        if i == len(lens):
            break
        run = slice(start, i + 1)
        if (i + 1 - start) * lens[run].max() > budget or (i + 1 - start) * anchors[run].max() > anchor_budget:
            offsets.append(i)
            start = i
    offsets.append(len(lens))
    return offsets


@pytest.mark.parametrize("seed", range(6))
def test_padded_sizes_are_exact_against_brute_force(seed):
    """Folding the anchor budget into one size per item neither breaks nor tightens a padded cut: the greedy
    cut on the sizes is the greedy cut that checks tokens and anchors one by one."""
    from padfree.core.batching import cut

    lengths, anchors = data(seed, n=300, top=300)
    cfg = PlanConfig(strategy="sorted", budget=1200, anchor_budget=120)  # budget / anchor_budget = 10
    size = capacity.sizes(lengths, anchors, cfg)
    assert cut(size, 1200).tolist() == greedy_brute(lengths, anchors, 1200, 120)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_eager_attention_bound(strategy):
    lengths, anchors = data(3)
    cfg = PlanConfig(strategy=strategy, budget=4096, world_size=2, attn_budget=900_000, attn_extra=6)
    plan = make_plan(lengths, cfg, epoch=0)
    assert sorted(plan.indices.tolist()) == list(range(lengths.shape[0]))
    for ids in plan.micro_batches():
        if ids.size == 0:
            continue
        lens = lengths[ids]
        if cfg.packed:
            t = int(lens.sum())
            assert t * (t + 6) <= 900_000
        else:
            assert len(lens) * int(lens.max()) * (int(lens.max()) + 6) <= 900_000


def test_token_cap_is_the_largest_row():
    for m, k in [(1000, 6), (10**6, 0), (7, 6), (123457, 3)]:
        cfg = PlanConfig(strategy="packed", budget=10**5, attn_budget=m, attn_extra=k)
        t = capacity.token_cap(cfg)
        assert t * (t + k) <= m < (t + 1) * (t + 1 + k)


def test_one_clear_error_for_an_item_over_the_anchor_budget():
    lengths = np.array([100, 50, 60, 70])
    with pytest.raises(ConfigError, match="item 2 has 40 anchors, more than the anchor budget of 30"):
        make_plan(lengths, PlanConfig(strategy="packed", budget=256, anchor_budget=30), anchors=[1, 2, 40, 3])
    with pytest.raises(ConfigError, match="sample 1: 51 anchors for 50 tokens"):
        make_plan(lengths, PlanConfig(strategy="packed", budget=256), anchors=[1, 51, 4, 3])
    with pytest.raises(ConfigError, match="one integer count per sample"):
        make_plan(lengths, PlanConfig(strategy="packed", budget=256), anchors=[1, 2])


def test_split_pieces_keep_their_sample_anchors():
    lengths = np.array([10, 25, 7])
    cfg = PlanConfig(strategy="packed", budget=10, overlong="split", anchor_budget=8)
    plan = make_plan(lengths, cfg, anchors=np.array([2, 5, 1]))
    got = Counter(zip(plan.indices.tolist(), plan.anchors.tolist(), strict=True))
    assert got == Counter({(0, 2): 1, (1, 5): 3, (2, 1): 1})


def shapes_brute(lens, anchors, offsets, packed):
    out = {"blocks": [], "reach": []}
    for j in range(len(offsets) - 1):
        lj, aj = lens[offsets[j] : offsets[j + 1]], anchors[offsets[j] : offsets[j + 1]]
        if packed:
            out["blocks"].append(float(sum(aj)))
            out["reach"].append(sum(float(a) * float(x) / 2 for a, x in zip(aj, lj, strict=True)))
        else:
            out["blocks"].append(float(len(aj) * max(aj)))
            out["reach"].append(len(aj) * max(aj) * max(lj) / 2.0)
    return out


@pytest.mark.parametrize("packed", [True, False])
def test_drafter_cost_terms_against_brute_force(packed):
    lens = np.array([5, 3, 9, 1, 4, 4])
    anchors = np.array([1, 0, 3, 1, 2, 0])
    offsets = np.array([0, 2, 5, 6])
    sh = cost.micro_shapes(lens, offsets, packed, anchors)
    want = shapes_brute(lens, anchors, offsets, packed)
    assert sh.blocks.tolist() == want["blocks"] and sh.reach.tolist() == want["reach"]
    model = CostModel(a=2.0, b=0.5, c=3.0, d=7.0, e=0.25)
    expect = 2 * sh.slots + 0.5 * sh.attn + 3 + 7 * sh.blocks + 0.25 * sh.reach
    np.testing.assert_allclose(cost.micro_costs(sh, model), expect)
    # the balancer's costs (one linear work feature priced by a) are the same numbers
    bal = Balance.of(model)
    np.testing.assert_allclose(cost.micro_costs(sh, bal.cost, bal.drafter), expect)


def test_drafter_cost_model_defaults_and_file(tmp_path):
    d = cost_model("dflash", hidden=256, layers=4, vocab=32000, block_size=16)
    assert d.a == 1.0 and d.d > 0 and d.e > 0
    e3 = cost_model("eagle3", hidden=256, layers=4, vocab=32000)
    assert e3.d == e3.e == 0 and e3.b > 0  # EAGLE-3 steps scale with tokens and attention: a and b
    d.save(tmp_path / "c.json")
    back = CostModel.load(tmp_path / "c.json")
    assert (back.a, back.b, back.c, back.d, back.e) == (d.a, d.b, d.c, d.d, d.e)
    with pytest.raises(ConfigError, match="need a > 0"):
        CostModel(a=0.0, b=1.0, d=1.0)
    with pytest.raises(ConfigError, match="unknown drafter method"):
        cost_model("medusa")


def test_rank_balance_uses_the_drafter_terms():
    """Two micro-batches of equal tokens, one rich in anchors: a drafter cost model gives them to ranks so
    that the anchor-rich one is not stacked with another heavy one."""
    lens = np.array([100, 100, 100, 100])
    anchors = np.array([50, 0, 50, 0])
    offsets = np.array([0, 1, 2, 3, 4])
    cfg = PlanConfig(strategy="packed", budget=128, world_size=2, grad_accum=2)
    tokens_only = Balance((1.0, 0.0, 0.0))
    drafting = Balance.of(CostModel(a=1.0, d=4.0))
    order, off = step_layout(lens, offsets, cfg, drafting, anchors=anchors)
    per_rank = [anchors[order[off[2 * r] : off[2 * r + 2]]].sum() for r in range(2)]
    assert per_rank == [50, 50]
    # tokens alone cannot tell them apart (every assignment ties)
    costs = cost.micro_costs(
        cost.micro_shapes(lens, offsets, True, anchors), tokens_only.cost, tokens_only.drafter
    )
    assert len(set(costs.tolist())) == 1


def test_fingerprint_covers_anchors_and_capacities():
    from padfree.core.fingerprint import fingerprint

    lengths = np.array([3, 4, 5])
    cfg = PlanConfig(strategy="packed")
    base = fingerprint(lengths, cfg)
    assert fingerprint(lengths, cfg, None) == base  # unchanged without drafter fields
    assert fingerprint(lengths, cfg, np.array([1, 1, 1])) != base
    assert fingerprint(lengths, cfg, np.array([1, 1, 1])) != fingerprint(lengths, cfg, np.array([1, 2, 1]))
    assert fingerprint(lengths, cfg.with_(anchor_budget=10)) != base


def test_seed_mix_like_packing_stays_near_the_lower_bound():
    """When anchors follow supervised tokens (the default anchor policy's quota), the folded sizes pack
    within 1% of max(tokens / budget, anchors / anchor budget) bins."""
    rng = np.random.default_rng(5)
    lengths = np.minimum(rng.lognormal(5.0, 1.2, 20000).astype(np.int64) + 2, 8192)
    anchors = np.minimum(np.ceil((lengths - 1) / 16).astype(np.int64), 512)
    for ab in (None, 1024, 768):
        cfg = PlanConfig(strategy="packed", budget=16384, anchor_budget=ab)
        plan = make_plan(lengths, cfg, anchors=anchors)
        bound = max(lengths.sum() / 16384, anchors.sum() / (ab or np.inf))
        assert plan.n_micro <= 1.01 * bound + 1
