"""PlanBatchSampler: rank slices, O(1) state round trips, elastic resume, fingerprints, StatefulDataLoader."""

import json

import numpy as np
import pytest

from padfree import PlanConfig, StateError
from padfree.torch import PackCollator, PadCollator, PlanBatchSampler, PlannedDataset

STRATEGIES = ["sorted", "random", "bucketed", "packed"]


def lengths_for(n=300, seed=0):
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(4.0, 0.9, n).astype(np.int64) + 2, 400)


def ranks(lengths, cfg, world, **kw):
    return [PlanBatchSampler(lengths, cfg, rank=r, world_size=world, **kw) for r in range(world)]


def consume(samplers, steps=None):
    """Run all ranks in lock step for `steps` optimizer steps (None: to the end); returns micro-batches."""
    its = [iter(s) for s in samplers]
    g = samplers[0].grad_accum
    out = []
    done = 0
    while steps is None or done < steps:
        step = [[next(it, None) for _ in range(g)] for it in its]
        flat = [mb for r in step for mb in r]
        if all(mb is None for mb in flat):
            break
        assert all(mb is not None for mb in flat), "ranks disagree on the number of micro-batches"
        assert len({mb.info.step for mb in flat}) == 1
        assert [mb.info.last for mb in step[0]] == [False] * (g - 1) + [True]
        out.extend(flat)
        done += 1
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ranks_partition_every_epoch(strategy):
    lengths = lengths_for()
    cfg = PlanConfig(strategy=strategy, budget=1024, grad_accum=2, seed=3)
    samplers = ranks(lengths, cfg, 3)
    seen_orders = []
    for epoch in range(3):
        for s in samplers:
            s.set_epoch(epoch)
        assert len({len(s) for s in samplers}) == 1
        mbs = consume(samplers)
        assert len(mbs) == 3 * len(samplers[0].__class__(lengths, cfg, rank=0, world_size=3, epoch=epoch))
        ids = np.concatenate([np.asarray(mb, dtype=np.int64) for mb in mbs])
        assert np.array_equal(np.sort(ids), np.arange(len(lengths)))
        by_rank = [{i for mb in mbs if mb.info.rank == r for i in mb} for r in range(3)]
        assert sum(len(b) for b in by_rank) == len(lengths)
        seen_orders.append(ids.tolist())
        assert all(len(s) == 0 for s in samplers)  # exhausted until the epoch changes
        with pytest.raises(StateError, match="set_epoch"):  # a second pass needs set_epoch (issue 19)
            list(iter(samplers[0]))
    if strategy != "sorted":
        assert seen_orders[0] != seen_orders[1]


@pytest.mark.parametrize("strategy", ["bucketed", "packed"])
def test_state_round_trip_resumes_at_exact_next_micro_batch(strategy):
    lengths = lengths_for(seed=1)
    cfg = PlanConfig(strategy=strategy, budget=1024, grad_accum=3, seed=5)
    ref = list(PlanBatchSampler(lengths, cfg, rank=1, world_size=2, epoch=2))
    for cut in (0, 1, 4, 7, len(ref) - 1, len(ref)):
        s = PlanBatchSampler(lengths, cfg, rank=1, world_size=2, epoch=2)
        it = iter(s)
        for _ in range(cut):
            next(it)
        state = json.loads(json.dumps(s.state_dict()))
        t = PlanBatchSampler(lengths, cfg, rank=1, world_size=2)  # epoch 0 until the state says otherwise
        t.load_state_dict(state)
        rest = list(t)
        assert [list(m) for m in rest] == [list(m) for m in ref[cut:]]
        assert [m.info for m in rest] == [m.info for m in ref[cut:]]
        assert len(json.dumps(state)) < 600  # a cursor (with its identity and digest), not the plan


def test_elastic_resume_keeps_exactly_once_over_world_sizes():
    lengths = lengths_for(400, seed=2)
    for strategy in STRATEGIES:
        cfg = PlanConfig(strategy=strategy, budget=900, grad_accum=2, seed=11)
        rng = np.random.default_rng(7)
        shapes = [(2, 2), (4, 1), (1, 3), (3, 2), (2, 2)]
        state = None
        taken = []
        step_numbers = []
        for j, (w, g) in enumerate(shapes):
            samplers = ranks(lengths, cfg.with_(grad_accum=g), w, epoch=4)
            if state is not None:
                for s in samplers:
                    s.load_state_dict(state)
            left = len(samplers[0]) // g
            steps = None if j == len(shapes) - 1 else int(rng.integers(0, max(left // 2, 1) + 1))
            mbs = consume(samplers, steps)
            taken.extend(mbs)
            step_numbers.extend(sorted({mb.info.step for mb in mbs}))
            state = samplers[0].state_dict()
            assert all(s.state_dict() == state for s in samplers)
        ids = np.concatenate([np.asarray(mb, dtype=np.int64) for mb in taken])
        assert np.array_equal(np.sort(ids), np.arange(len(lengths))), strategy
        assert step_numbers == list(range(len(step_numbers)))  # steps keep counting across resumes
        assert len(state["history"]) <= len(shapes)


def test_tiny_tail_at_larger_world_gives_empty_micro_batches_not_a_hang():
    lengths = np.full(40, 10)
    cfg = PlanConfig(strategy="packed", budget=50, seed=0)
    a = ranks(lengths, cfg, 1)
    consume(a, a[0].steps_in_epoch - 1)
    state = a[0].state_dict()
    big = ranks(lengths, cfg, 8)
    for s in big:
        s.load_state_dict(state)
    mbs = consume(big)
    assert len(mbs) == 8 and sum(len(m) for m in mbs) == 5
    assert sum(len(m) == 0 for m in mbs) >= 1
    batch = PackCollator()(PlannedDataset([[1] * 10] * 40).__getitems__(next(m for m in mbs if not m)))
    assert batch.loss_tokens == 0 and batch["input_ids"].shape == (1, 1)


def test_foreign_or_mid_step_state_is_refused():
    lengths = lengths_for()
    cfg = PlanConfig(strategy="packed", budget=1024, grad_accum=2, seed=1)
    s = PlanBatchSampler(lengths, cfg)
    next(iter(s))
    state = s.state_dict()
    for other, why in (
        (PlanBatchSampler(lengths, cfg.with_(seed=2)), "seed 1 in the state, 2 now"),
        (PlanBatchSampler(lengths + 1, cfg), "the token counts differ"),
        (
            PlanBatchSampler(lengths, cfg.with_(strategy="bucketed")),
            "strategy packed in the state, bucketed now",
        ),
        (PlanBatchSampler(lengths, cfg.with_(budget=2048)), "budget 1024 in the state, 2048 now"),
    ):
        with pytest.raises(StateError, match="belongs to another configuration") as exc:
            other.load_state_dict(state)
        assert why in str(exc.value) and "\n" not in str(exc.value)
    old = {k: v for k, v in state.items() if k not in ("identity", "digest")}  # no identity: the hash only
    with pytest.raises(StateError, match="fingerprint"):
        PlanBatchSampler(lengths, cfg.with_(seed=2)).load_state_dict(old)
    with pytest.raises(StateError, match="into a step"):
        PlanBatchSampler(lengths, cfg, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(StateError):
        PlanBatchSampler(lengths, cfg).load_state_dict({"format": "nope"})
    # same fingerprint, other world size and grad_accum: accepted (elastic)
    PlanBatchSampler(lengths, cfg.with_(grad_accum=1), rank=0, world_size=4).load_state_dict(
        PlanBatchSampler(lengths, cfg).state_dict()
    )


def _collate_step_tokens(lengths, cfg, world, data, collator, **kw):
    samplers = ranks(lengths, cfg, world, **kw)
    ds = PlannedDataset(data)
    mbs = consume(samplers)
    per_step = {}
    for mb in mbs:
        b = collator(ds.__getitems__(mb))
        assert b.loss_tokens == int((b["labels"] != -100).sum())
        per_step.setdefault(mb.info.step, []).append((b.loss_tokens, mb.info.step_tokens))
    return per_step


@pytest.mark.parametrize(
    ("strategy", "overlong", "masked"),
    [
        ("packed", "error", False),
        ("bucketed", "truncate", False),
        ("packed", "split", False),
        ("random", "error", True),
        ("packed", "error", True),
    ],
)
def test_plan_step_tokens_equal_collated_labels_on_all_ranks(strategy, overlong, masked):
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 300, 200)
    data, loss = [], []
    for n in lengths:
        ids = rng.integers(1, 1000, n)
        mask = rng.random(n) < 0.6 if masked else np.ones(n, bool)
        data.append({"input_ids": ids, "loss_mask": mask.astype(np.int8)} if masked else {"input_ids": ids})
        loss.append(int(mask[1:].sum()))
    cfg = PlanConfig(
        strategy=strategy, budget=250 if overlong != "error" else 600, grad_accum=2, overlong=overlong, seed=9
    )
    collator = PackCollator() if strategy == "packed" else PadCollator(pad_to_multiple_of=8)
    per_step = _collate_step_tokens(lengths, cfg, 2, data, collator, loss_tokens=loss if masked else None)
    assert len(per_step) > 5
    for step, rows in per_step.items():
        assert len({t for _, t in rows}) == 1
        assert rows[0][1] == sum(c for c, _ in rows), step


def test_custom_loss_counts_on_cut_pieces_fall_back_to_none():
    lengths = np.array([50, 500, 60, 70, 80, 90, 40, 30])
    cfg = PlanConfig(strategy="packed", budget=200, overlong="truncate")
    tokens = {mb.info.step_tokens for mb in PlanBatchSampler(lengths, cfg, loss_tokens=lengths // 2)}
    assert None in tokens  # the step holding the truncated sample cannot be known from per-sample counts
    assert any(t is not None for t in tokens)


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resume(workers):
    from torchdata.stateful_dataloader import StatefulDataLoader

    lengths = lengths_for(120, seed=3)
    data = [{"input_ids": np.arange(n) % 97 + 1} for n in lengths]
    cfg = PlanConfig(strategy="packed", budget=700, grad_accum=2, seed=2)

    def loader():
        s = PlanBatchSampler(lengths, cfg, rank=0, world_size=2, epoch=1)
        kw = {"num_workers": workers, "snapshot_every_n_steps": 1} if workers else {}
        return StatefulDataLoader(PlannedDataset(data), batch_sampler=s, collate_fn=PackCollator(), **kw)

    full = [b["input_ids"].tolist() for b in loader()]
    first = loader()
    it = iter(first)
    head = [next(it)["input_ids"].tolist() for _ in range(5)]
    state = first.state_dict()
    del it
    second = loader()
    second.load_state_dict(state)
    batches = list(second)
    assert head + [b["input_ids"].tolist() for b in batches] == full
    assert batches[0].info.step == 2 and batches[0].info.micro == 1


def test_a_second_pass_without_set_epoch_is_one_line_error():
    """Issue 19: a pass over an epoch already yielded to its end, with no set_epoch since, raises (it used to
    yield nothing, len() 0); set_epoch(next) plans the next epoch; set_epoch(same) keeps the position."""
    lengths = lengths_for(200)
    s = PlanBatchSampler(
        lengths, PlanConfig(strategy="bucketed", budget=512, grad_accum=2), rank=0, world_size=1
    )
    first = [list(mb) for mb in s]
    assert sorted(i for mb in first for i in mb) == list(range(200))
    with pytest.raises(
        StateError, match=r"epoch 0 was already iterated to its end; call sampler.set_epoch\(1\)"
    ):
        next(iter(s))
    s.set_epoch(0)  # the same epoch: its position (the end) is kept
    assert list(s) == [] and len(s) == 0
    s.set_epoch(1)
    again = [list(mb) for mb in s]
    assert sorted(i for mb in again for i in mb) == list(range(200)) and again != first
    state = s.state_dict()
    with pytest.raises(StateError):
        list(s)
    s.load_state_dict(state)  # restored at the end of epoch 1: nothing left, no error
    assert list(s) == []


def test_a_plain_dataset_under_the_sampler_warns_once(monkeypatch):
    from torch.utils.data import DataLoader

    from padfree.torch.feed import dataset as _dataset

    monkeypatch.setattr(_dataset, "_warned", False)
    lengths = lengths_for(60)
    data = [{"input_ids": list(range(1, int(n) + 1))} for n in lengths]
    s = PlanBatchSampler(lengths, PlanConfig(strategy="packed", budget=512), rank=0, world_size=1)
    with pytest.warns(
        UserWarning, match=r"without its plan info \(batch.info is None\): wrap the dataset"
    ) as rec:
        batches = list(DataLoader(data, batch_sampler=s, collate_fn=PackCollator()))
    assert len(batches) > 1 and len([w for w in rec if "plan info" in str(w.message)]) == 1
    s.set_epoch(1)
    monkeypatch.setattr(_dataset, "_warned", False)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        planned = list(DataLoader(PlannedDataset(data), batch_sampler=s, collate_fn=PackCollator()))
    assert planned[0].info is not None
