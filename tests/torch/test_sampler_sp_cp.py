"""PlanBatchSampler with SP/CP groups: the plan's ranks are data-parallel ranks, every GPU of a group of
sp x cp gets the same micro-batches, the data-parallel ranks together see every sample exactly once, also
across a resume and an elastic resume at another data-parallel size; PackCollator lays a sharded row out
in the THD layout."""

from __future__ import annotations

import datetime
import json
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from padfree import ConfigError, CostModel, PlanConfig, make_plan
from padfree.torch import PackCollator, PlanBatchSampler
from padfree.torch.feed.collate import packed_layout

SP, CP = 2, 2  # groups of 4 GPUs
GLOBAL = 12  # GPUs: 3 data-parallel ranks


def lengths_long_tail(n=1500, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(4.5, 1.0, n).astype(np.int64) + 2, 400)
    lengths[rng.choice(n, 5, replace=False)] = rng.integers(600, 2000, 5)  # over the per-GPU budget
    return lengths


def config(strategy="packed"):
    return PlanConfig(strategy=strategy, budget=512, grad_accum=2, sp=SP, cp=CP, seed=2)


def gpu_samplers(lengths, cfg, n_gpus, **kw):
    """One sampler per GPU, groups of sp x cp consecutive GPUs: dp rank = gpu // (sp x cp)."""
    group = cfg.sp * cfg.cp
    dp = n_gpus // group
    return [PlanBatchSampler(lengths, cfg, dp_rank=g // group, dp_size=dp, **kw) for g in range(n_gpus)]


def ids(mbs):
    return [tuple(mb.info.indices) for mb in mbs]


def expected(lengths, cfg):
    return Counter(make_plan(lengths, cfg.with_(world_size=1, grad_accum=1), 0).indices.tolist())


def covered(per_gpu, group):
    """Samples run by the data-parallel ranks (one GPU of each group)."""
    return Counter(i for mbs in per_gpu[::group] for mb in mbs for i in mb.info.indices)


@pytest.mark.parametrize("strategy", ["packed", "bucketed"])
def test_group_peers_get_the_same_micro_batches_and_dp_ranks_cover_every_sample_once(strategy):
    lengths = lengths_long_tail()
    cfg = config(strategy)
    per_gpu = [list(s) for s in gpu_samplers(lengths, cfg, GLOBAL)]
    group = SP * CP
    for g in range(GLOBAL):
        assert ids(per_gpu[g]) == ids(per_gpu[g - g % group])  # the group's first GPU
        assert {mb.info.world_size for mb in per_gpu[g]} == {GLOBAL // group}
    assert ids(per_gpu[0]) != ids(per_gpu[group])
    assert covered(per_gpu, group) == expected(lengths, cfg)


@pytest.mark.parametrize("strategy", ["sorted", "random", "bucketed", "packed"])
def test_the_sampler_runs_the_sharded_plan_of_make_plan(strategy):
    """The sampler gives each step to ranks one at a time (padded widths, padded costs) exactly as
    make_plan does for the whole epoch."""
    lengths = lengths_long_tail(seed=7)
    cfg = config(strategy).with_(world_size=3, cost=CostModel(1, 1e-3, 50))
    plan = make_plan(lengths, cfg, 5)
    for r in range(3):
        s = PlanBatchSampler(lengths, cfg, dp_rank=r, dp_size=3, epoch=5)
        assert [list(m) for m in s] == [plan.micro(k).tolist() for k in plan.micro_ids(r)]


@pytest.mark.parametrize("dp_after", [3, 2, 5])
def test_resume_and_elastic_resume_with_sp_groups_is_exactly_once(dp_after):
    """Two steps (and one micro-batch at the same size) on 3 data-parallel ranks (12 GPUs), saved, loaded on
    ``dp_after`` ranks (4 * dp_after GPUs) and drained: every sample exactly once over the data-parallel
    ranks, the peers of a group still alike; at the same size the rest is the uninterrupted run's."""
    lengths = lengths_long_tail(seed=4)
    cfg = config()
    group = SP * CP
    first = gpu_samplers(lengths, cfg, GLOBAL)
    its = [iter(s) for s in first]
    head = [[] for _ in range(GLOBAL)]
    mid_step = dp_after == 3  # a state mid-step resumes at its own shape only; elastic at a step boundary
    for _ in range(2 * cfg.grad_accum + mid_step):
        for g, it in enumerate(its):
            head[g].append(next(it))
    state = json.loads(json.dumps(first[0].state_dict()))
    assert all(s.state_dict() == state for s in first)
    second = gpu_samplers(lengths, cfg, dp_after * group)
    for s in second:
        s.load_state_dict(state)
    tail = [list(s) for s in second]
    for g in range(dp_after * group):
        assert ids(tail[g]) == ids(tail[g - g % group])
    got = covered(head, group) + covered(tail, group)
    assert got == expected(lengths, cfg)
    if dp_after == 3:
        ref = [list(s) for s in gpu_samplers(lengths, cfg, GLOBAL)]
        assert [ids(h) + ids(t) for h, t in zip(head, tail, strict=True)] == [ids(r) for r in ref]


def test_data_parallel_place_is_said_once_and_consistently():
    lengths = lengths_long_tail()
    cfg = config()
    with pytest.raises(ConfigError, match="differ"):
        PlanBatchSampler(lengths, cfg, rank=1, dp_rank=0, dp_size=2)
    with pytest.raises(ConfigError, match="not both"):
        PlanBatchSampler(lengths, cfg, dp_rank=0, dp_size=2, dp_group=SimpleNamespace())
    with pytest.raises(ConfigError, match="re-cut SP/CP"):
        PlanBatchSampler(lengths, cfg, dp_rank=0, dp_size=2, balance="dynamic")
    with pytest.raises(ConfigError, match="outside world size"):
        PlanBatchSampler(lengths, cfg, dp_rank=2, dp_size=2)
    legacy = PlanBatchSampler(lengths, cfg, rank=1, world_size=2)  # rank/world_size: data-parallel
    assert ids(legacy) == ids(PlanBatchSampler(lengths, cfg, dp_rank=1, dp_size=2))


class _Mesh:
    """What the sampler reads of a torch DeviceMesh."""

    def __init__(self, names, sizes, local):
        self.mesh_dim_names, self._sizes, self._local, self.ndim = names, sizes, local, len(names)

    def get_local_rank(self, dim=None):
        return self._local[0 if dim is None else self.mesh_dim_names.index(dim)]

    def size(self, dim=None):
        return self._sizes[0 if dim is None else dim]


def test_a_device_mesh_says_the_data_parallel_rank():
    lengths = lengths_long_tail()
    cfg = config()
    mesh = _Mesh(("dp", "cp", "sp"), (3, CP, SP), (2, 1, 0))
    s = PlanBatchSampler(lengths, cfg, dp_group=mesh)
    assert (s.rank, s.world_size) == (2, 3)
    assert ids(s) == ids(PlanBatchSampler(lengths, cfg, dp_rank=2, dp_size=3))
    with pytest.raises(ConfigError, match="without a 'dp' dimension"):
        PlanBatchSampler(lengths, cfg, dp_group=_Mesh(("x", "y"), (2, 2), (0, 0)))
    one_d = PlanBatchSampler(lengths, cfg, dp_group=_Mesh(("dp",), (2,), (1,)))
    assert (one_d.rank, one_d.world_size) == (1, 2)


def test_under_torch_distributed_sp_groups_need_their_dp_place(tmp_path):
    lengths = lengths_long_tail()
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    try:
        with pytest.raises(ConfigError, match="say this rank's data-parallel place"):
            PlanBatchSampler(lengths, config())
        s = PlanBatchSampler(lengths, config(), dp_group=dist.group.WORLD)
        assert (s.rank, s.world_size) == (0, 1)
        plain = PlanBatchSampler(lengths, PlanConfig(strategy="packed", budget=2048, seed=2))
        assert (plain.rank, plain.world_size) == (0, 1)  # no SP/CP: the global rank, as before
    finally:
        dist.destroy_process_group()


def test_pack_collator_lays_a_sharded_row_out_in_thd():
    items = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}, {"input_ids": [4]}]
    b = PackCollator(pad_token_id=0, sp=2, cp=2)(items)
    # documents padded to 2 x cp = 4, the row to cp x lcm(2, sp) = 4: spans 4, 4, 4
    assert b["input_ids"].tolist() == [[5, 6, 7, 0, 8, 9, 0, 0, 4, 0, 0, 0]]
    assert b["labels"].tolist() == [[-100, 6, 7, -100, -100, 9, -100, -100, -100, -100, -100, -100]]
    assert b["cu_seq_lens_q"].tolist() == [0, 3, 5, 6]
    assert b["cu_seq_lens_q_padded"].tolist() == [0, 4, 8, 12]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]]
    assert b.tokens == 6 and b.loss_tokens == 3
    sp_only = PackCollator(sp=4)([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    assert sp_only["input_ids"].shape[1] == 8 and sp_only["cu_seq_lens_q_padded"].tolist() == [0, 3, 8]
    assert sp_only["cu_seq_lens_q"].tolist() == [0, 3, 5]
    plain = PackCollator()(items)
    assert "cu_seq_lens_q_padded" not in plain and plain["input_ids"].shape[1] == 6
    with pytest.raises(ConfigError, match="sp and cp must be integers"):
        PackCollator(cp=0)


@pytest.mark.parametrize(("sp", "cp"), [(2, 1), (4, 1), (1, 2), (1, 4), (2, 2), (3, 2), (8, 4)])
def test_packed_layout_spans_shard_evenly(sp, cp):
    rng = np.random.default_rng(sp * 10 + cp)
    lens = rng.integers(1, 300, 7)
    lay = packed_layout(lens, sp=sp, cp=cp)
    cu_pad = lay["cu_seq_lens_q_padded"].numpy()
    spans = np.diff(cu_pad)
    total = int(cu_pad[-1])
    assert total % sp == 0 and (total // cp) % sp == 0
    assert np.all(spans % (2 * cp if cp > 1 else 1) == 0) and np.all(spans >= lens)
    assert lay["position_ids"].shape == (1, total) and lay["seq_idx"].shape == (1, total)
    assert np.array_equal(np.diff(lay["cu_seq_lens_k"].numpy()), lens)
    assert packed_layout(lens)["cu_seq_lens_q"].tolist() == np.concatenate([[0], np.cumsum(lens)]).tolist()
    assert torch.equal(packed_layout(lens, sp=1, cp=1)["position_ids"], packed_layout(lens)["position_ids"])
