"""The compiled kernels against plain reference implementations."""

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from padfree.core import _ranks, batching, kernels
from padfree.core.buckets import bucket_of, growth_edges, optimal_edges, padding_of_edges
from padfree.core.steps import quantile_steps, spread_tail, stratified_order


def ref_best_fit(lens, budget):
    rooms, out = [], []
    for length in lens:
        fits = [(r, i) for i, r in enumerate(rooms) if r >= length]
        if fits:
            r, i = min(fits)  # least room; ties: any bin with that room
            rooms[i] -= length
            out.append((i, r))
        else:
            rooms.append(budget - length)
            out.append((len(rooms) - 1, None))
    return rooms, out


@given(st.lists(st.integers(1, 50), min_size=1, max_size=200), st.integers(50, 120))
def test_best_fit_matches_reference_room_choices(lens, budget):
    arr = np.array(lens, dtype=np.int64)
    bin_of, n_bins = kernels.best_fit(arr, budget)
    rooms, ref = ref_best_fit(lens, budget)
    assert n_bins == len(rooms)
    # bins never overflow, and every item went to a bin with the least sufficient room
    load = np.bincount(bin_of, weights=arr, minlength=n_bins)
    assert (load <= budget).all()
    assert np.array_equal(np.sort(budget - load), np.sort(np.array(rooms)))


@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(1, 4))
def test_optimal_edges_is_optimal(lens, k):
    arr = np.array(lens, dtype=np.int64)
    edges = optimal_edges(arr, k)
    values = np.unique(arr)
    assert edges[-1] == values[-1] and len(edges) <= k
    best = min(
        padding_of_edges(arr, np.array([*c, values[-1]]))
        for r in range(0, min(k, len(values)))
        for c in itertools.combinations(values[:-1], r)
    )
    assert padding_of_edges(arr, edges) == best


def test_growth_edges_cover_and_grow():
    lengths = np.array([3, 10, 100, 1000, 8192])
    e = growth_edges(lengths, 1.25)
    assert e[0] >= 3 and e[-1] >= 8192 and e[-2] < 8192
    ratios = e[1:] / e[:-1]
    assert (ratios[e[:-1] > 20] < 1.26).all()


@given(st.lists(st.integers(0, 9), min_size=0, max_size=100))
def test_counting_argsort_is_stable_argsort(keys):
    arr = np.array(keys, dtype=np.int64)
    assert np.array_equal(kernels.counting_argsort(arr, 10), np.argsort(arr, kind="stable"))


@given(
    st.lists(st.floats(0.1, 100.0), min_size=12, max_size=12),
    st.sampled_from([(2, 6), (3, 4), (4, 3), (6, 2)]),
)
def test_balance_ranks_is_a_valid_assignment_no_worse_than_lpt_bound(costs, shape):
    world, accum = shape
    c = np.array(costs)
    perm = _ranks.balance_ranks(c, world, accum, 64, np.ones(world), True)
    assert np.array_equal(np.sort(perm), np.arange(12))
    loads = c[perm].reshape(world, accum).sum(1)
    # the optimum is at least the mean load; and for t = 1..accum, some rank holds t of the (t-1)*world+1
    # largest items (pigeonhole), so at least the t smallest of those plus the accum-t smallest of all
    cs = np.sort(c)
    top = cs[::-1]
    lower = max(
        c.sum() / world,
        *(
            top[(t - 1) * world + 1 - t : (t - 1) * world + 1].sum() + cs[: accum - t].sum()
            for t in range(1, accum + 1)
        ),
    )
    assert loads.max() <= 4 / 3 * lower + 1e-9


def test_balance_ranks_beats_round_robin_on_skewed_costs():
    rng = np.random.default_rng(0)
    c = rng.lognormal(0, 1, size=32 * 50)
    perm = _ranks.balance_ranks(c, 8, 4, 64, np.ones(8), True)
    bal = c[perm].reshape(50, 8, 4).sum(2)
    naive = c.reshape(50, 8, 4).sum(2)
    assert (bal.max(1) / bal.mean(1)).mean() < (naive.max(1) / naive.mean(1)).mean()
    # within 1% of the lower bound max(mean load, largest item + the 3 smallest) on average
    cs = np.sort(c.reshape(50, 32), axis=1)
    lower = np.maximum(bal.mean(1), cs[:, -1] + cs[:, :3].sum(1))
    assert (bal.max(1) / lower).mean() < 1.01


def test_spread_tail_keeps_samples():
    off = np.array([0, 5, 9, 10, 14])
    out = spread_tail(off, 3)
    assert (len(out) - 1) % 3 == 0 and out[0] == 0 and out[-1] == 14
    assert set(off.tolist()) <= set(out.tolist())


def test_stratified_order_spreads_each_stratum_evenly():
    rng = np.random.default_rng(1)
    strata = np.repeat([0, 1, 2], [100, 50, 10])
    tokens = np.ones(160)
    order = stratified_order(strata, tokens, rng)
    assert np.array_equal(np.sort(order), np.arange(160))
    # in every window of 16 micro-batches, stratum 0 has about 10
    s = strata[order].reshape(10, 16)
    assert ((s == 0).sum(1) >= 8).all() and ((s == 0).sum(1) <= 12).all()
    assert ((s == 2).sum(1) <= 2).all()


@pytest.mark.parametrize("m", [64, 70, 5])
def test_quantile_steps_give_every_step_one_micro_batch_per_quantile(m):
    """Each step of the body holds one micro-batch from every 1/k of the length order; the tail steps span
    the length range; every step is whole and no sample is lost or repeated."""
    rng = np.random.default_rng(3)
    k, per = 8, 4
    length = np.repeat(np.arange(1, m + 1) * 10, per)  # micro-batch j: 4 samples of length 10 (j + 1)
    out = quantile_steps(np.arange(m * per), np.arange(0, m * per + 1, per), length, k, 10 * m * per, rng)
    assert out is not None
    order, offs = out
    assert np.array_equal(np.sort(order), np.arange(m * per)) and (offs.shape[0] - 1) % k == 0
    body = m // k if m % k == 0 else max(m // k - 1, 0)
    ids = length[order[offs[: body * k]]] // 10 - 1  # the body's micro-batches, step by step
    chunk = np.searchsorted(np.sort(ids), ids) // max(body, 1)
    for s in range(body):
        assert sorted(chunk[s * k : (s + 1) * k].tolist()) == list(range(k))
    if m % k:
        tail = length[order[offs[body * k] :]]
        assert tail.max() - tail.min() >= 10 * (m - m // 4)


@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 6)), min_size=0, max_size=300),
    st.sampled_from(["grouped", "scattered", "not finite"]),
)
def test_argsort_in_groups_is_the_stable_argsort(pairs, case):
    """Keys that follow their groups (the bucketed sort key: bucket * span + position), with many ties, or
    keys that do not (then the whole array is merge-sorted): the order is ``np.argsort(kind="stable")``."""
    group = np.array([g for g, _ in pairs], dtype=np.int64)
    inner = np.array([v for _, v in pairs], dtype=np.float64) / 3.0
    key = group * 10.0 + inner
    if case == "scattered":
        key = inner - group
    elif case == "not finite" and key.size:
        key[key.size // 2] = np.inf
    got = batching.argsort_in_groups(key, group, 6)
    assert np.array_equal(got, np.argsort(key, kind="stable"))


def test_argsort_in_groups_on_a_crowded_group_and_bucket_of_through_its_table():
    rng = np.random.default_rng(4)
    group = np.sort(rng.integers(0, 3, 20_000))
    key = group * 1e6 + np.where(group == 1, rng.integers(0, 3, group.size), rng.random(group.size) * 1e5)
    assert np.array_equal(batching.argsort_in_groups(key, group, 3), np.argsort(key, kind="stable"))
    lengths = rng.integers(1, 5000, 30_000)
    edges = growth_edges(lengths, 1.25, 0.3)
    assert np.array_equal(bucket_of(lengths, edges), np.searchsorted(edges, lengths, side="left"))
    few = np.array([7, 90_000])  # a table as long as the longest would outgrow the lengths: searchsorted
    assert bucket_of(few, np.array([10, 100_000])).tolist() == [0, 1]


def test_even_padded_steps_is_recut_padded_at_equal_speeds_kept_when_faster():
    """Each step re-cut as ``recut_padded`` re-cuts it for equal speeds, and kept only where the slowest rank
    gets cheaper (its shortcut, no room for the slowest rank's shortest movable row, gives the same)."""
    rng = np.random.default_rng(0)
    cost = np.array([1.0, 2e-5, 3.0])
    recut = 0
    for _ in range(400):
        w, g = int(rng.integers(2, 5)), int(rng.integers(1, 4))
        k, budget = w * g, int(rng.choice([64, 256, 1024]))
        counts = rng.integers(0, 6, k)
        tops = [int(rng.integers(1, budget // max(1, c) + 1)) for c in counts]
        lens = np.concatenate(
            [rng.integers(max(1, t // 2), t + 1, c) for t, c in zip(tops, counts, strict=True)]
        )
        offs = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        perm, new = _ranks.even_padded_steps(lens, offs, w, g, budget, cost, 0.0)

        def rank_loads(bin_of, lens=lens, g=g, k=k):
            longest = np.zeros(k, np.int64)
            np.maximum.at(longest, bin_of, lens)
            per = np.bincount(bin_of, minlength=k) * (cost[0] * longest + cost[1] * longest**2) + cost[2]
            return per.reshape(-1, g).sum(axis=1)

        bins = np.repeat(np.arange(k), counts)
        moved = _ranks.recut_padded(lens, offs, np.ones(w), g, budget, cost)
        before = rank_loads(bins)
        if lens.size >= 2 and before.max() > before.mean() and rank_loads(moved).max() < before.max():
            recut += 1
            assert np.array_equal(perm, np.argsort(moved, kind="stable"))
            assert np.array_equal(new, np.concatenate(([0], np.cumsum(np.bincount(moved, minlength=k)))))
        else:
            assert np.array_equal(perm, np.arange(lens.size)) and np.array_equal(new, offs)
    assert recut > 50
