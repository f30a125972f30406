"""padfree.integrations.speculators in speculators' own data plane (their 0.9.0 wheel): their ArrowDataset and
CollateFn, padfree's sampler, collate wrapper and model hook, their DFlash, EAGLE-3 and MTP models forward
and backward; documents train as alone; at 2 gloo ranks under their Trainer's own epoch loop, SIGKILLed and
resumed through their fast-resume hooks, every sample trains exactly once per epoch."""

import json
import os
import pickle
import signal

import numpy as np
import pytest
import torch

from support.peers import peer_missing

REASON = peer_missing("speculators")
pytestmark = pytest.mark.skipif(bool(REASON), reason=REASON)

VOCAB, BLOCK, BUDGET, WIDTH, N = 256, 4, 512, 256, 24
ANCHORED = ("dflash", "dflash2", "dspark")


@pytest.fixture(scope="module")
def samples(fixtures_dir):
    from support.drafters import bundled_chats

    return bundled_chats(fixtures_dir, N, VOCAB)


@pytest.fixture(scope="module")
def target():
    from padfree.drafter.target import build_target

    return build_target(vocab_size=VOCAB)


def recipe(method):
    from padfree.drafter import recipes

    r = recipes.get("speculators", method)
    return recipes.override(r, block_size=BLOCK) if method in ANCHORED else r


def setup(tmp_path, samples, target, method, rank=0, world=1, seed=1, resume_dir=None):
    """Their dataset and collate function, padfree's sampler and wrapper, their model: as the guide wires
    them."""
    from torch.utils.data import DataLoader

    from padfree.core.config import PlanConfig
    from padfree.drafter.methods.eagle3.spec import low_mid_high
    from padfree.integrations import feed
    from padfree.integrations import speculators as sp
    from padfree.torch import PlannedDataset
    from support import drafters
    from support.peers import import_peer

    rec = recipe(method)
    if method == "dflash":
        model = drafters.speculators_dflash(target, (1, 3), block_size=BLOCK, mask_token_id=VOCAB - 1)
    elif method == "dspark":
        model = drafters.speculators_dspark(
            target, (1, 3), block_size=rec.block_size, mask_token_id=VOCAB - 1, markov_rank=8
        )
    elif method == "dflash2":
        model = drafters.speculators_dflash2(target, (1, 3), block_size=BLOCK, mask_token_id=VOCAB - 1)
    elif method == "mtp":
        model = drafters.speculators_mtp(target, steps=rec.ttt)
    elif method == "peagle":
        model = drafters.speculators_peagle(target, low_mid_high(6), depths=rec.ttt, mask_token_id=VOCAB - 1)
    else:
        model = drafters.speculators_eagle3(target, low_mid_high(6), ttt=rec.ttt)
    transfer = drafters.TargetTransfer(target, samples, feed.target_layers(model))
    ds = drafters.speculators_dataset(tmp_path / f"data-{method}", samples, max_len=BUDGET, transfer=transfer)
    anchors = sp.count_anchors(ds, rec, max_len=BUDGET) if method in ANCHORED else None
    config = PlanConfig(strategy="packed", anchor_budget=WIDTH if method in ANCHORED else None)
    sampler = sp.PadfreeMultipackSampler(
        BUDGET, ds.approx_lengths, world, rank, seed=seed, config=config, anchors=anchors, recipe=rec,
        resume_dir=resume_dir,
    )  # fmt: skip
    data = import_peer("speculators", "train.data")
    shift = {
        "eagle3": lambda: import_peer("speculators", "models.eagle3.data").shift_batch,
        "peagle": lambda: import_peer("speculators", "models.eagle3.data").shift_batch,
        "mtp": lambda: import_peer("speculators", "models.mtp.data").shift_batch_mtp,
    }.get(method, lambda: None)()
    their = data.CollateFn(BUDGET, 64, len(model.target_layer_ids), torch.float32, preprocess=shift)
    collate = sp.PadfreeCollate(their, method=method, recipe=rec, seed=seed, shapes=sampler.shapes)
    loader = DataLoader(PlannedDataset(ds), batch_sampler=sampler, collate_fn=collate)
    kwargs = sp.trainer_kwargs(model, rec, loss_implementation="eager", max_anchors=WIDTH)
    return model, ds, sampler, collate, loader, kwargs, transfer


def alone(ds, collate, sid, epoch):
    from padfree.integrations._common import BatchInfo, PlannedBatch
    from padfree.torch import PlannedDataset

    return collate(PlannedDataset(ds).__getitems__(PlannedBatch([sid], BatchInfo(epoch, 0, np.array([sid])))))


@pytest.mark.parametrize("method", ["dflash", "eagle3", "mtp", "peagle", "dspark", "dflash2"])
def test_their_pipeline_trains_each_document_as_alone(tmp_path, samples, target, method):
    from padfree.core.anchors import choose_anchors
    from padfree.integrations import speculators as sp

    model, ds, sampler, collate, loader, kwargs, _ = setup(tmp_path, samples, target, method)
    handle = sp.install(model)
    sampler.set_epoch(1)
    batches = list(loader)
    assert sorted(int(i) for b in batches for i in b["padfree_sample_ids"]) == list(range(N))
    assert {b["input_ids"].shape[1] for b in batches} <= set(sampler.shapes.lengths)  # a few shapes only
    if method in ANCHORED:
        assert {b["padfree_anchors"].shape[0] for b in batches} == {WIDTH}  # one anchor width
    batch = max(batches, key=lambda b: len(b["padfree_sample_ids"]))
    ids = batch["padfree_sample_ids"].tolist()
    assert len(ids) >= 2 and int(batch["padfree_epoch"]) == 1
    if method in ANCHORED:  # each document's anchors: its own, from (seed, epoch, sample id)
        doc = batch["document_ids"][0]
        got = batch["padfree_anchors"][batch["padfree_anchor_valid"]]
        policy = recipe(method).anchor_policy(partial=False)
        for d, sid in enumerate(ids):
            start = int((doc == d).nonzero()[0])
            mine = (got[doc[got] == d] - start).tolist()
            mask = np.asarray(samples[sid]["loss_mask"], bool)
            if mask.sum() < recipe(method).min_loss_tokens:  # DSpark: such a document trains nothing
                mask[:] = False
            assert mine == choose_anchors(mask, policy, seed=1, epoch=1, sample_id=sid).tolist()
    model.zero_grad()
    _, loss, _ = model(**dict(batch), **kwargs)
    loss.backward()
    assert torch.isfinite(loss) and any(
        p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters()
    )
    for d, sid in enumerate(ids[:3]):
        with torch.no_grad():
            one = dict(batch)
            one["loss_mask"] = batch["loss_mask"] * (batch["document_ids"] == d)
            in_row = float(model(**one, **kwargs)[1])
            by_itself = float(model(**alone(ds, collate, sid, 1), **kwargs)[1])
        assert abs(in_row - by_itself) < 1e-5 * max(1.0, abs(by_itself)), (method, d, in_row, by_itself)
    if method in ("eagle3", "mtp"):  # EAGLE-3: the first ttt - 1 positions of every document carry no loss
        head = {"eagle3": recipe("eagle3").ttt - 1, "mtp": recipe("mtp").ttt + 1}[method]  # MTP: K + 1
        doc, mask = batch["document_ids"][0], batch["loss_mask"][0]
        for d in range(len(ids)):
            assert not mask[doc == d][:head].any()
    if method == "mtp":  # and K + 1 loss-free positions after the last document, the queries valid_len drops
        n = int((batch["document_ids"][0] >= 0).sum())
        assert batch["input_ids"].shape[1] >= n + recipe("mtp").ttt + 1
    if method == "peagle":  # each document's chains: its own, as padfree's fields draw them alone
        chains, doc, mask = batch["padfree_chains"], batch["document_ids"][0], batch["loss_mask"][0]
        assert chains.shape[1] > 0 and not bool((doc[chains[0]] != doc[chains[0] + chains[1]]).any())
        for d in range(len(ids)):
            assert not mask[doc == d][[0, -1]].any()  # first and last positions: no loss
        one = alone(ds, collate, ids[1], 1)
        start = int((doc == 1).nonzero()[0])
        mine = chains[:, doc[chains[0]] == 1]
        assert torch.equal(one["padfree_chains"], torch.stack([mine[0] - start, mine[1]]))
        from padfree.drafter.collate import DrafterCollator

        ours = DrafterCollator("peagle", recipe=recipe("peagle"), seed=1, mask_token_id=VOCAB - 1)
        ours.set_epoch(1)
        item = {**samples[ids[1]], "sample_id": ids[1]}
        depth, anchor = torch.nonzero(ours([item]).fields.present[1:], as_tuple=True)
        assert torch.equal(one["padfree_chains"], torch.stack([anchor, depth + 1]))  # padfree's own draws
    handle.remove()


def test_sampler_keeps_their_constructor_and_fast_resume_hooks(tmp_path, samples, target):
    from padfree.integrations._common import PlannedBatch
    from support.peers import import_peer

    _, ds, sampler, _, _, _, _ = setup(tmp_path, samples, target, "dflash", resume_dir=tmp_path / "ckpt")
    theirs = import_peer("speculators", "train.distributed_batch_sampler").MultipackDistributedBatchSamplerV2
    ref = theirs(BUDGET, ds.approx_lengths, 1, 0, seed=1)
    assert sampler._cached_generated_batches == ref._cached_generated_batches == (-1, [])
    batches = sampler._generate_batches(0)
    assert sampler._cached_generated_batches[0] == 0 and len(sampler) == len(batches)
    assert list(iter(sampler)) == batches  # the run that will be resumed: its record in resume_dir
    sampler._cached_generated_batches = (0, batches[2:])  # what their trainer's fast resume does
    assert list(iter(sampler)) == list(batches)[2:]  # at the same world size: the same plan, from 2 on
    b = pickle.loads(pickle.dumps(batches[0]))  # through spawn workers' index queue
    assert isinstance(b, PlannedBatch) and b == batches[0] and b.info.epoch == 0


# --- 2 gloo ranks under their Trainer, SIGKILLed and resumed
# --------------------------------------------------


def cpu_trainer(trainer_mod):
    """Their ``Trainer`` with what a CPU lacks replaced: it puts the model and each batch on
    ``cuda:<local_rank>``, loads checkpoints onto ``cuda:0`` (``get_current_device``) and its step timer calls
    ``torch.accelerator.synchronize()`` (a no-op here), so device placement and the weight/optimizer files are
    ours; resume bookkeeping (``setup_trainer``, ``training_state.json``),
    the fast-resume skip (``_prepare_resume_skip``), the epoch loop (``train_epoch``: their
    ``model(**batch, **train_call_kwargs)``, backward, clipping, optimizer step) and ``run_training`` are
    theirs."""
    import shutil

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from support.peers import import_peer

    checkpointer = import_peer("speculators", "train.checkpointer")
    build_optimizers = import_peer("speculators", "train.optimizers").build_optimizers

    class CPUTrainer(trainer_mod.Trainer):
        def __init__(self, model, config, train_loader):
            self.model, self.config, self.train_loader, self.val_loader = model, config, train_loader, None
            self.local_rank, self.device_type = "cpu", "cpu"
            self.rank, self.is_distributed = dist.get_rank(), True
            self.resume_from_checkpoint = config.resume_from_checkpoint
            self.checkpointer = checkpointer.SingleGPUCheckpointer(config.save_path)
            self.setup_trainer()
            self.setup_model()
            self.setup_optimizer()

        def _state(self):
            prev = self.checkpointer.prev_path
            return torch.load(prev / "padfree.pt") if self.resume_from_checkpoint and prev else None

        def setup_model(self):
            state = self._state()
            if state is not None:
                self.model.load_state_dict(state["model"])
            self.model = DistributedDataParallel(self.model)

        def setup_optimizer(self):
            self.optimizers, self.schedulers = build_optimizers(self.model, self.config), []
            state = self._state()
            if state is not None:
                self.optimizers[0].load_state_dict(state["optimizer"])

        def maybe_save_checkpoint(self, epoch, local_step=0):
            if dist.get_rank() == 0:
                root = self.checkpointer.path
                tmp, old, final = root / f"tmp-{epoch}", root / f"old-{epoch}", root / str(epoch)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
                weights = self.model.module.state_dict()
                torch.save(
                    {"model": weights, "optimizer": self.optimizers[0].state_dict()}, tmp / "padfree.pt"
                )
                state = {"epoch": epoch, "local_step": local_step, "global_step": self.global_step}
                (tmp / "training_state.json").write_text(json.dumps(state))
                if final.exists():
                    final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            dist.barrier()

    return CPUTrainer


def rank_main(rank, world, store, tmp_path, samples, target, seen, run):  # noqa: PLR0913
    """One rank: gloo, their Trainer on padfree's sampler and collate, a seen-log line per trained sample."""
    import torch.distributed as dist

    from padfree.integrations import speculators as sp
    from padfree.testing import seenlog
    from support.peers import import_peer

    torch.set_num_threads(1)
    if not torch.accelerator.is_available():  # their step timer synchronizes an accelerator (this is a fork)
        torch.accelerator.synchronize = lambda *a: None
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    spd = import_peer("speculators", "train.distributed")
    spd._is_distributed, spd._rank, spd._local_rank, spd._world_size = True, rank, 0, world
    trainer_mod = import_peer("speculators", "train.trainer")
    ckpt = tmp_path / "ckpt"
    model, _, _, _, loader, kwargs, transfer = setup(
        tmp_path, samples, target, "dflash", rank, world, seed=3, resume_dir=ckpt
    )
    config = trainer_mod.TrainerConfig(
        lr=1e-3, num_epochs=2, save_path=str(ckpt), resume_from_checkpoint=True,
        train_call_kwargs=kwargs, scheduler_type="none", checkpoint_freq=0.25,
        hidden_states_dtype=torch.float32, log_freq=1000,
    )  # fmt: skip
    fetched = []
    inner = transfer.get_cached
    transfer.get_cached = lambda i: fetched.append(int(i)) or inner(i)
    fd = os.open(seen, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    trainer = None

    def log(ids, epoch):
        seenlog.append(fd, run, epoch, trainer.global_step, rank, ids.tolist())

    sp.install(model, on_batch=log)
    trainer = cpu_trainer(trainer_mod)(model, config, loader)
    trainer.run_training()
    with open(tmp_path / f"fetched-{run}-{rank}.json", "w") as f:
        json.dump(fetched, f)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("worlds", [(2, 2), (2, 1), (1, 2)])
def test_killed_and_resumed_at_any_world_size_train_every_sample_once(tmp_path, samples, target, worlds):
    """SIGKILLed mid-epoch under their Trainer and resumed through their fast-resume hooks at the same or
    another world size: every sample trains exactly once per epoch (at another world size their ``local_step``
    means other samples; padfree's record in their save_path re-plans the rest over the new ranks)."""
    from padfree.testing import forkranks, seenlog

    seen = tmp_path / "seen.jsonl"
    setup(tmp_path, samples, target, "dflash")  # writes their dataset once, before the ranks read it

    def main(run):
        return lambda rank, world, store: rank_main(rank, world, store, tmp_path, samples, target, seen, run)

    before, after = worlds  # 5 steps an epoch at 2 ranks, 9 at 1: killed a few steps into an epoch
    assert forkranks.launch(main("a"), before, seen, run="a", kill_at=7) == [-signal.SIGKILL] * before
    assert forkranks.launch(main("b"), after, seen, run="b") == [0] * after
    records = seenlog.read(seen)
    report = seenlog.check_exactly_once(records, N, epochs=2)
    assert report["ok"] and report["runs"] == 2, report
    resumed = [r for r in records if r["run"] == "b"]
    first = min(resumed, key=lambda r: (r["epoch"], r["step"]))
    kept = seenlog.counted(records)  # resumed inside an epoch both runs trained part of
    assert {r["run"] for r in kept if r["epoch"] == first["epoch"]} == {"a", "b"}
    # their fast resume sliced padfree's batch list: the resumed run fetched only the samples it trained
    fetched = sum((json.loads((tmp_path / f"fetched-b-{r}.json").read_text()) for r in range(after)), [])
    assert sorted(fetched) == sorted(r["index"] for r in resumed)


def test_a_resume_without_the_record_is_refused_in_one_line(tmp_path, samples, target):
    from padfree.errors import StateError

    _, _, sampler, _, _, _, _ = setup(tmp_path, samples, target, "dflash")
    batches = sampler._generate_batches(0)
    with pytest.raises(StateError, match=r"resume_dir= their TrainerConfig's save_path") as err:
        batches[2:]  # what their trainer's fast resume does
    assert "\n" not in str(err.value)


def test_their_select_anchors_is_answered_in_both_signatures_and_restored():
    from padfree.integrations import speculators as sp
    from padfree.integrations.feed import AnchorChoice
    from support.peers import import_peer

    core = import_peer("speculators", "models.dflash.core")
    theirs = core.select_anchors
    handle = sp.install(torch.nn.Linear(1, 1))
    assert core.select_anchors is not theirs
    mask = torch.ones(1, 20, dtype=torch.long)
    torch.manual_seed(0)
    a, v = core.select_anchors(mask, 5, 4)  # no padfree batch in flight: theirs
    torch.manual_seed(0)
    assert [t.tolist() for t in (a, v)] == [t.tolist() for t in theirs(mask, 5, 4)]
    sp._local.choice = AnchorChoice(torch.tensor([3, 9]), 4, 8)
    try:
        a, v = core.select_anchors(mask, 5, 4)  # today's: num_anchors slots
        assert a.tolist() == [3, 9, 0, 0, 0] and v.tolist() == [True, True, False, False, False]
        a, v = core.select_anchors(mask, 512, 4, torch.zeros(1, 20, dtype=torch.long))  # PR #1071's
        assert a.shape == (8,) and a[v].tolist() == [3, 9]
    finally:
        sp._local.choice = None
    handle.remove()
    assert core.select_anchors is theirs


@pytest.mark.parametrize("shrink", [2, 1])
def test_lengths_below_the_data_are_refused_naming_the_sample(tmp_path, samples, target, shrink):
    """Lengths below what their dataset materialises: their CollateFn would cut or drop the row's last
    documents while padfree_sample_ids reports them trained; refused in one line naming the sample (shrink 1:
    the honest lengths still train every document whole)."""
    from torch.utils.data import DataLoader

    from padfree.core.config import PlanConfig
    from padfree.errors import InputError
    from padfree.integrations import speculators as sp
    from padfree.torch import PlannedDataset

    _, ds, _, collate, _, _, _ = setup(tmp_path, samples, target, "eagle3")
    lengths = np.asarray(ds.approx_lengths) // shrink
    sampler = sp.PadfreeMultipackSampler(BUDGET, lengths, 1, 0, seed=1, config=PlanConfig(strategy="packed"))
    loader = DataLoader(PlannedDataset(ds), batch_sampler=sampler, collate_fn=collate)
    if shrink == 1:
        for b in loader:
            doc, ids = b["document_ids"][0], b["padfree_sample_ids"].tolist()
            whole = [len(samples[i]["input_ids"]) - 1 for i in ids]  # their EAGLE-3 shift_batch: one fewer
            assert [int((doc == d).sum()) for d in range(len(ids))] == whole
        return
    with pytest.raises(
        InputError, match=r"^sample \d+: \d+ tokens, but the sampler planned it at \d+"
    ) as err:
        list(loader)
    sid = err.value.sample
    assert f"{len(samples[sid]['input_ids'])} tokens" in str(err.value) and "\n" not in str(err.value)


def test_a_recipe_under_which_nothing_drafts_is_refused(samples):
    """Issue 33 item 7: anchors counted under an anchor margin longer than every document are all zero; the
    sampler refuses them in one line instead of planning an epoch that trains zeros."""
    from padfree.core.config import PlanConfig
    from padfree.drafter import recipes
    from padfree.errors import ConfigError
    from padfree.integrations import speculators as sp

    rec = recipes.override(recipe("dflash"), anchor_margin=4096)
    anchors = sp.count_anchors([s["loss_mask"] for s in samples], rec)
    lengths = [len(s["input_ids"]) for s in samples]
    config = PlanConfig(strategy="packed", anchor_budget=WIDTH)
    with pytest.raises(
        ConfigError, match=r"nothing drafts .* anchor margin 4096, longest document \d+"
    ) as err:
        sp.PadfreeMultipackSampler(BUDGET, lengths, 1, 0, config=config, anchors=anchors, recipe=rec)
    assert "\n" not in str(err.value)
    ok = sp.count_anchors([s["loss_mask"] for s in samples], recipe("dflash"))
    assert (
        len(
            sp.PadfreeMultipackSampler(
                BUDGET, lengths, 1, 0, config=config, anchors=ok, recipe=recipe("dflash")
            )
        )
        > 0
    )


def test_a_nan_length_is_named_as_nan():
    """Issue 33 item 12: a NaN among the sampler's lengths was cast to int64 first and shown as
    -9223372036854775808."""
    from padfree.errors import InputError
    from padfree.integrations import speculators as sp

    with pytest.raises(InputError, match=r"^sample 1: length must be a positive integer \(got nan\)$"):
        sp.PadfreeMultipackSampler(BUDGET, np.array([30.0, np.nan, 50.0]), 1, 0)


def test_mtp_rows_keep_documents_apart_where_every_token_carries_loss(tmp_path, samples, target):
    """MTP on documents whose first tokens carry loss, in a row their CollateFn fills to ``max_len``: without
    padfree's gate their ``k + 2`` shift labels one document's queries with the next one's first tokens, and
    without the tail their ``valid_len`` drops the last document's final queries; with both every document of
    the row trains as alone."""
    from padfree.integrations import feed
    from padfree.integrations import speculators as sp
    from padfree.integrations._common import BatchInfo, PlannedBatch
    from padfree.torch import PlannedDataset
    from support import drafters
    from support.peers import import_peer

    rec = recipe("mtp")
    docs = [{**s, "loss_mask": np.ones(len(s["input_ids"]), np.int64)} for s in samples[:3]]
    full = sum(len(s["input_ids"]) for s in docs)
    model = drafters.speculators_mtp(target, steps=rec.ttt)
    transfer = drafters.TargetTransfer(target, docs, feed.target_layers(model))
    ds = drafters.speculators_dataset(tmp_path / "data", docs, max_len=full, transfer=transfer)
    data = import_peer("speculators", "train.data")
    shift = import_peer("speculators", "models.mtp.data").shift_batch_mtp
    their = data.CollateFn(full, 64, 1, torch.float32, preprocess=shift)
    collate = sp.PadfreeCollate(their, method="mtp", recipe=rec)
    kwargs = sp.trainer_kwargs(model, rec)

    def rows(sids):
        return collate(PlannedDataset(ds).__getitems__(PlannedBatch(sids, BatchInfo(0, 0, np.array(sids)))))

    row = rows([0, 1, 2])
    assert row["input_ids"].shape[1] == full + rec.ttt + 1  # their row was full: the tail extends it
    with torch.no_grad():
        for d in range(3):
            in_row = float(
                model(**{**row, "loss_mask": row["loss_mask"] * (row["document_ids"] == d)}, **kwargs)[1]
            )
            alone = float(model(**rows([d]), **kwargs)[1])
            assert abs(in_row - alone) < 1e-5 * max(1.0, alone), (d, in_row, alone)
