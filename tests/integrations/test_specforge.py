"""padfree.integrations.specforge in SpecForge's own offline data plane and trainer (their 0.2.0 wheel):
feature files in their format read through their manifest reader, store, normalizer, collator and
FeatureDataLoader; their OnlineDFlashModel through their DFlashTrainStrategy, padded rows unmodified and
packed rows patched, every document's loss equal to it alone; at 2 gloo ranks under their TrainerController,
CheckpointManager and DDP backend, SIGKILLed and resumed through seek(), every sample trains exactly once per
epoch."""

import os
import signal

import numpy as np
import pytest
import torch

from support.peers import peer_missing

REASON = peer_missing("specforge")
pytestmark = pytest.mark.skipif(bool(REASON), reason=REASON)

VOCAB, BLOCK, BUDGET, N, LAYERS = 256, 4, 512, 24, (1, 3)


@pytest.fixture(scope="module")
def samples(fixtures_dir):
    from support.drafters import bundled_chats

    return bundled_chats(fixtures_dir, N, VOCAB)


@pytest.fixture(scope="module")
def target():
    from padfree.drafter.target import build_target

    return build_target(vocab_size=VOCAB)


@pytest.fixture(scope="module")
def features(tmp_path_factory, samples, target):
    from support.drafters import specforge_features

    folder = tmp_path_factory.mktemp("features")
    specforge_features(folder, samples, target, LAYERS)
    return folder


def recipe():
    from padfree.drafter import recipes

    return recipes.override(recipes.get("specforge", "dflash"), block_size=BLOCK)


def refs_of(features):
    from support.peers import import_peer

    data = import_peer("specforge", "algorithms.common.dflash_family_data")
    return data.build_offline_reader("dflash", str(features), run_id="t", ttt_length=1, max_len=BUDGET).read()


def loader(features, layout, rank=0, world=1, seed=2, cache=None, resume_dir=None):
    """Their manifest, store, normalizer and collator; padfree's index and loader: as the guide wires them."""
    from padfree.core.config import PlanConfig
    from padfree.integrations import specforge as sf
    from support.peers import import_peer

    data = import_peer("specforge", "algorithms.common.dflash_family_data")
    store = import_peer("specforge", "runtime.data_plane.feature_store")
    refs = refs_of(features)
    index = sf.build_index(refs, max_len=BUDGET, recipe=recipe(), cache_dir=cache or features)
    strategy = "packed" if layout == "packed" else "bucketed"
    config = PlanConfig(strategy=strategy, budget=BUDGET, anchor_budget=BUDGET, seed=seed)
    return sf.PlanFeatureLoader(
        store.LocalFeatureStore("t"), refs, index=index, config=config, collate_fn=data.build_collator(),
        per_sample_transform=data.build_offline_normalizer(BUDGET), layout=layout, recipe=recipe(), rank=rank,
        world_size=world, resume_dir=resume_dir,
    )  # fmt: skip


def test_index_is_read_once_cached_and_matches_the_tokenized_data(tmp_path, features, samples, monkeypatch):
    from padfree.integrations import specforge as sf

    refs = refs_of(features)
    assert all(r.num_tokens == 0 for r in refs)  # their reader opens no file: no lengths to plan with
    first = sf.build_index(refs, max_len=128, recipe=recipe(), cache_dir=tmp_path)
    assert len(list(tmp_path.glob("padfree-index-*.npz"))) == 1
    masks = [s["loss_mask"] for s in samples]
    direct = sf.index_from_masks(masks, max_len=128, recipe=recipe())
    assert np.array_equal(first.lengths, np.minimum([len(m) for m in masks], 128))
    assert np.array_equal(first.anchors, direct.anchors) and first.anchors.min() > 0

    def no_read(*_a):
        raise AssertionError("a cached index must not read feature files")

    monkeypatch.setattr(sf, "_read", no_read)
    again = sf.build_index(refs, max_len=128, recipe=recipe(), cache_dir=tmp_path)
    assert np.array_equal(again.anchors, first.anchors) and again.key == first.key
    with pytest.raises(AssertionError, match="must not read"):  # another rule is another index
        sf.build_index(refs, max_len=64, recipe=recipe(), cache_dir=tmp_path)


@pytest.mark.parametrize("tear", ["truncated", "empty", "other_arrays"])
def test_a_torn_index_cache_is_rebuilt(tmp_path, features, tear):
    from padfree.integrations import specforge as sf

    refs = refs_of(features)
    first = sf.build_index(refs, max_len=128, recipe=recipe(), cache_dir=tmp_path)
    (cached,) = tmp_path.glob("padfree-index-*.npz")
    whole = cached.read_bytes()
    if tear == "truncated":  # a crash or a full device mid-write
        cached.write_bytes(whole[: len(whole) // 2])
    elif tear == "empty":
        cached.write_bytes(b"")
    else:
        with cached.open("wb") as f:  # another file list's index under this name
            np.savez(f, lengths=np.arange(3), anchors=np.arange(3))
    again = sf.build_index(refs, max_len=128, recipe=recipe(), cache_dir=tmp_path)
    assert np.array_equal(again.lengths, first.lengths) and np.array_equal(again.anchors, first.anchors)
    assert cached.read_bytes() == whole  # rebuilt in place


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_loader_keeps_their_interface_and_deals_every_sample_once(tmp_path, features, layout):
    ranks = [loader(features, layout, rank=r, world=2, resume_dir=tmp_path) for r in range(2)]
    for ld in ranks:
        ld.set_epoch(1)
    assert len(ranks[0]) == len(ranks[1]) > 1
    batches = [list(ld) for ld in ranks]
    ids = sorted(int(i) for bs in batches for b in bs for i in b.tensors["padfree_sample_ids"])
    assert ids == list(range(N))
    for b in batches[0]:
        assert {"input_ids", "loss_mask", "hidden_states"} <= set(b.tensors)  # their DFlash keys
        assert len(b.sample_ids) == len(b.tensors["padfree_sample_ids"]) and b.strategy == "dflash"
        rows = 1 if layout == "packed" else len(b.sample_ids)
        assert (
            b.tensors["input_ids"].shape[0] == rows and b.tensors["input_ids"].shape[1] <= BUDGET + N * BLOCK
        )
    ranks[0].set_epoch(1)
    ranks[0].seek(2)  # what their controller does on resume
    assert [b.sample_ids for b in ranks[0]] == [b.sample_ids for b in batches[0][2:]]
    assert [b.sample_ids for b in ranks[0]] == [b.sample_ids for b in batches[0]]  # seek is one-shot
    from padfree.errors import StateError

    ranks[0].seek(len(ranks[0]) + 1)
    with pytest.raises(StateError, match="more than the epoch has"):
        next(iter(ranks[0]))


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_without_a_config_the_loader_plans_with_the_drafter_setup(features, layout):
    """No ``config``: the plan is the drafter setup's for the recipe (its cost model) on the index's lengths,
    at the index's ``max_len`` tokens (and the gap behind each packed document); every sample dealt once."""
    from padfree.core.config import PlanConfig
    from padfree.drafter.setup import drafter_setup
    from padfree.integrations import specforge as sf
    from support.peers import import_peer

    data = import_peer("specforge", "algorithms.common.dflash_family_data")
    store = import_peer("specforge", "runtime.data_plane.feature_store")
    refs = refs_of(features)
    index = sf.build_index(refs, max_len=BUDGET, recipe=recipe(), cache_dir=features)
    ld = sf.PlanFeatureLoader(
        store.LocalFeatureStore("t"), refs, index=index, collate_fn=data.build_collator(),
        per_sample_transform=data.build_offline_normalizer(BUDGET), layout=layout, recipe=recipe(),
        rank=0, world_size=1,
    )  # fmt: skip
    gap = recipe().block_size - 1 if layout == "packed" else 0
    wanted = PlanConfig(strategy="packed" if layout == "packed" else "bucketed", budget=BUDGET + gap)
    setup = drafter_setup(recipe(), wanted, lengths=index.lengths)
    assert ld.config.cost == setup.config.cost != PlanConfig().cost
    assert ld.config.budget == BUDGET + gap and ld.config.packed == (layout == "packed")
    ids = sorted(int(i) for b in ld for i in b.tensors["padfree_sample_ids"])
    assert ids == list(range(N))
    ld.close()


def grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_their_model_trains_each_document_as_alone(features, target, layout):
    from padfree.integrations import specforge as sf
    from support import drafters
    from support.peers import import_peer

    base = import_peer("specforge", "training.strategies.base")
    ld = loader(features, layout)
    model = drafters.specforge_dflash(target, LAYERS, block_size=BLOCK, mask_token_id=VOCAB - 1)
    handle = sf.install(model, ld)
    step = base.DFlashTrainStrategy(model)  # their strategy: model(input_ids=, hidden_states=, loss_mask=)
    ld.set_epoch(1)
    batch = max(ld, key=lambda b: len(b.sample_ids))
    ids = batch.tensors["padfree_sample_ids"].tolist()
    assert len(ids) >= 3

    def run(b, keep=None):
        one = type(b)(b.sample_ids, b.strategy, dict(b.tensors), b.metadata)
        if keep is not None:
            one.tensors["loss_mask"] = b.tensors["loss_mask"] * keep
        ld.current = one
        return step.forward_loss(one)

    def only(d):
        if layout == "packed":
            return batch.tensors["document_ids"] == d
        keep = torch.zeros_like(batch.tensors["loss_mask"], dtype=torch.bool)
        keep[d] = True
        return keep

    model.zero_grad()
    run(batch).loss.backward()
    g_packed = grads(model)
    expected, total = torch.zeros_like(g_packed), 0.0
    for d, sid in enumerate(ids):
        with torch.no_grad():
            in_batch = float(run(batch, only(d)).loss)
        model.zero_grad()
        out = run(ld.batch_of([sid], epoch=1))
        out.loss.backward()
        assert abs(in_batch - float(out.loss.detach())) < 1e-5 * max(1.0, abs(float(out.loss.detach())))
        den = float(out.loss_terms[1])  # their weighted denominator: sum of slot weights
        expected += den * grads(model)
        total += den
    assert torch.allclose(
        g_packed, expected / total, atol=1e-6, rtol=1e-4
    )  # their weighted mean of the batch
    if layout == "packed":  # without the document term a block of a packed row sees the previous documents
        handle._handles[2].remove()
        last = len(ids) - 1
        with torch.no_grad():
            leaky = float(run(batch, only(last)).loss)
            alone = float(run(ld.batch_of([ids[last]], epoch=1)).loss)
        assert abs(leaky - alone) > 1e-4
    handle.remove()


# --- 2 gloo ranks under their TrainerController, SIGKILLed and resumed
# ----------------------------------------


def rank_main(rank, world, store, features, target, out, seen, run):  # noqa: PLR0913
    """One rank assembled as their domain Trainer assembles it (training/trainer.py): draft weights restored
    before the wrap, their NO_SHARD backend (DDP on gloo here), BF16Optimizer, TrainerCore, TrainerController
    with their CheckpointManager and resume counters; padfree's loader in place of their FeatureDataLoader."""
    import torch.distributed as dist

    from padfree.integrations import specforge as sf
    from padfree.testing import seenlog
    from support import drafters
    from support.peers import import_peer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    backend_mod = import_peer("specforge", "training.backend")
    controller_mod = import_peer("specforge", "training.controller")
    checkpoint = import_peer("specforge", "training.checkpoint")
    optimizer = import_peer("specforge", "optimizer")
    base = import_peer("specforge", "training.strategies.base")

    model = drafters.specforge_dflash(target, LAYERS, block_size=BLOCK, mask_token_id=VOCAB - 1)
    ld = loader(features, "packed", rank, world, seed=4, cache=out, resume_dir=out)
    resume = None
    if checkpoint.CheckpointManager(str(out), "sf").latest_dir() is not None:
        # at another world size their per-rank optimizer/RNG shards do not apply: weights and counters only
        resume = checkpoint.CheckpointManager.read_resume_state(str(out), require_full_state=False)
        model.draft_model.load_state_dict(resume["draft_state_dict"])
    parallel = backend_mod.ParallelConfig(
        world_size=world, sharding_strategy="NO_SHARD", param_dtype=torch.float32,
        fsdp_process_group=dist.group.WORLD,
    )  # fmt: skip
    backend = backend_mod.FSDPTrainingBackend(
        parallel, optimizer_factory=lambda m: optimizer.BF16Optimizer(m, lr=1e-3, total_steps=100)
    )
    wrapped = backend.prepare_model(model, optimizer_target=model.draft_model)
    if resume is not None and resume["backend"]:
        backend.load_state_dict(resume["backend"])
    core = controller_mod.TrainerCore(base.DFlashTrainStrategy(wrapped), backend, accumulation_steps=1)
    controller = controller_mod.TrainerController(
        core, run_id="sf", output_dir=str(out), num_epochs=2, save_interval=1, log_interval=1000,
        start_step=resume["global_step"] if resume else 0, start_epoch=resume["epoch"] if resume else 0,
        start_batch=resume["epoch_batch"] if resume else 0, start_samples=resume["epoch_samples"] if resume
        else 0,
    )  # fmt: skip
    fd = os.open(seen, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    sf.install(
        model,
        ld,
        on_batch=lambda ids, e: seenlog.append(fd, run, e, controller.global_step, rank, ids.tolist()),
    )
    controller.fit(ld)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("worlds", [(2, 2), (2, 1), (1, 2)])
def test_killed_and_resumed_at_any_world_size_train_every_sample_once(tmp_path, features, target, worlds):
    """SIGKILLed mid-epoch under their TrainerController and resumed through seek() at the same or another
    world size: every sample trains exactly once per epoch (their ``epoch_batch`` counts micro-batches per
    rank; padfree's record in their output_dir re-plans the rest over the new ranks)."""
    from padfree.testing import forkranks, seenlog

    seen, out = tmp_path / "seen.jsonl", tmp_path / "out"
    out.mkdir()
    ld = loader(features, "packed", cache=out)  # the index is built once, before the ranks read it
    per_epoch = {w: len(loader(features, "packed", 0, w, seed=4, cache=out)) for w in set(worlds)}
    assert min(per_epoch.values()) >= 3, per_epoch
    ld.close()

    def main(run):
        return lambda rank, world, store: rank_main(rank, world, store, features, target, out, seen, run)

    before, after = worlds
    kill = per_epoch[before] + 2  # a few steps into epoch 1
    assert forkranks.launch(main("a"), before, seen, run="a", kill_at=kill) == [-signal.SIGKILL] * before
    assert forkranks.launch(main("b"), after, seen, run="b") == [0] * after
    records = seenlog.read(seen)
    report = seenlog.check_exactly_once(records, N, epochs=2)
    assert report["ok"] and report["runs"] == 2, report
    first = min((r for r in records if r["run"] == "b"), key=lambda r: (r["epoch"], r["step"]))
    kept = seenlog.counted(records)  # resumed through seek() inside an epoch both runs trained part of
    assert {r["run"] for r in kept if r["epoch"] == first["epoch"]} == {"a", "b"}


def test_a_seek_without_the_record_is_refused_in_one_line(features):
    from padfree.errors import StateError

    ld = loader(features, "packed")
    ld.set_epoch(1)
    ld.seek(2)  # what their TrainerController does on resume
    with pytest.raises(StateError, match=r"resume_dir= their TrainerController's output_dir") as err:
        next(iter(ld))
    assert "\n" not in str(err.value)
    ld.close()


def test_packed_document_term_is_the_same_for_their_dense_and_flex_masks():
    from padfree.integrations.specforge import _same_document
    from support.peers import import_peer

    family = import_peer("specforge", "algorithms.common.dflash_family_model")
    doc = torch.tensor([[0, 0, 0, 0, -1, -1, 1, 1, 1, -1, -1, 2, 2, 2, 2, 2]])
    pos = torch.tensor([[0, 1, 2, 3, 0, 0, 0, 1, 2, 0, 0, 0, 1, 2, 3, 4]])
    anchors, keep = torch.tensor([[1, 7, 12, 0]]), torch.tensor([[True, True, True, False]])
    s, block = doc.shape[1], 3
    args = {
        "anchor_positions": anchors,
        "block_keep_mask": keep,
        "S": s,
        "block_size": block,
        "device": "cpu",
    }
    fields = {"document_ids": doc, "position_ids": pos, "padfree_anchors": anchors}
    kwargs = {"position_ids": torch.zeros(1, s + 4 * block, dtype=torch.long)}
    dense = _same_document(
        {**kwargs, "attention_mask": family.create_dflash_sdpa_mask(**args)}, fields, block
    )
    flex = _same_document(
        {**kwargs, "attention_mask": family.create_dflash_block_mask(**args)}, fields, block
    )
    q, kv = torch.meshgrid(torch.arange(4 * block), torch.arange(s + 4 * block), indexing="ij")
    zero = torch.zeros_like(q)
    grid = flex["attention_mask"].mask_mod(zero, zero, q, kv)
    assert torch.equal(grid, dense["attention_mask"][0, 0])
    # a block sees context of its own document only: anchor 7 (document 1) sees 6, not 0..3
    assert dense["attention_mask"][0, 0, block, :s].nonzero().reshape(-1).tolist() == [6]
    assert dense["position_ids"][0, s:].tolist() == [1, 2, 3, 1, 2, 3, 1, 2, 3, 0, 1, 2]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_an_index_of_another_tokenization_is_refused_naming_the_sample(features, samples, layout):
    """An index whose lengths are not the feature files' (another tokenizer: here every sample 4/5 as long)
    would put anchors outside their documents; the first batch is refused in one line naming a sample and
    its file."""
    from padfree.core.config import PlanConfig
    from padfree.errors import InputError
    from padfree.integrations import specforge as sf
    from support.peers import import_peer

    data = import_peer("specforge", "algorithms.common.dflash_family_data")
    store = import_peer("specforge", "runtime.data_plane.feature_store")
    masks = [np.asarray(s["loss_mask"])[: len(s["loss_mask"]) * 4 // 5] for s in samples]
    index = sf.index_from_masks(masks, max_len=BUDGET, recipe=recipe())
    config = PlanConfig(
        strategy="packed" if layout == "packed" else "bucketed", budget=BUDGET, anchor_budget=BUDGET
    )
    ld = sf.PlanFeatureLoader(
        store.LocalFeatureStore("t"), refs_of(features), index=index, config=config,
        collate_fn=data.build_collator(), per_sample_transform=data.build_offline_normalizer(BUDGET),
        layout=layout, recipe=recipe(),
    )  # fmt: skip
    with pytest.raises(
        InputError, match=r"data_\d+\.ckpt: sample \d+: \d+ tokens after their normalizer"
    ) as e:
        next(iter(ld))
    sid = e.value.sample
    assert f"{len(samples[sid]['input_ids'])} tokens after" in str(e.value)
    assert f"says {len(masks[sid])}" in str(e.value) and "\n" not in str(e.value)
    ld.close()


def test_strategy_is_the_old_name_of_method():
    import warnings

    from padfree.core.config import PlanConfig
    from padfree.errors import ConfigError
    from padfree.integrations import specforge as sf

    index = sf.LengthIndex(np.array([4, 5]), np.array([1, 1]), 8, "key")
    cfg = PlanConfig(strategy="bucketed", budget=16)
    with pytest.warns(DeprecationWarning, match="method="), pytest.raises(ConfigError, match="differ"):
        sf.PlanFeatureLoader(None, [], index=index, config=cfg, method="dflash", strategy="eagle3")
    with pytest.warns(DeprecationWarning, match="method="), pytest.raises(ConfigError, match="manifest 0"):
        sf.PlanFeatureLoader(None, [], index=index, config=cfg, strategy="eagle3")
    with warnings.catch_warnings(), pytest.raises(ConfigError, match="manifest 0"):
        warnings.simplefilter("error")  # method= alone warns of nothing
        sf.PlanFeatureLoader(None, [], index=index, config=cfg, method="eagle3")
