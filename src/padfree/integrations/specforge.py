"""padfree in a SpecForge offline run: a cached length and anchor index of the feature files, and a loader
with ``FeatureDataLoader``'s interface that yields padfree's plan for this rank in their batch keys.

Their offline data plane: ``OfflineManifestReader(...).read()`` lists the feature files as ``SampleRef``s (it
opens none: ``num_tokens`` stays 0), ``_shard_offline_refs`` deals them to ranks like ``DistributedSampler``,
``FeatureDataLoader(store, refs=..., batch_size=B, collate_fn=...)`` cuts fixed batches padded to the
longest, and their ``TrainerController.fit`` calls ``set_epoch(e)``, ``seek(n)`` on resume, then iterates
``TrainBatch``es.

* :func:`build_index` reads every feature file's ``input_ids`` and ``loss_mask`` once (their ``.ckpt`` loads
  memory-mapped, so only those pages are read; ``.ckpt.gz`` must be inflated), in threads, and caches the
  per-sample token count and DFlash anchor count (the recipe's rule) beside the data, keyed by the files'
  names, sizes and times and by the rule: a later run, any rank, loads it in seconds instead of deserialising
  every file before step 1 (SpecForge#733). :func:`index_from_masks` builds it from the tokenized dataset
  instead.
* :class:`PlanFeatureLoader` replaces ``_shard_offline_refs`` + ``FeatureDataLoader``: same ``__iter__``,
  ``__len__``, ``seek``, ``set_epoch`` (and ``close``), every rank's micro-batches from one padfree plan of
  the whole manifest, materialised by their own ``FeatureDataLoader`` (store, per-sample transform, collate,
  validation, prefetch threads). ``layout="padded"`` keeps their models unmodified (one sample per row);
  ``layout="packed"`` lays a micro-batch's samples in one row, each followed by ``block_size - 1`` empty
  positions so a block that runs past its document's end reads no other document, and needs :func:`install`.
* :func:`install` patches one ``OnlineDFlashModel``: its anchors become padfree's per-document choice (from
  seed, epoch and sample id, the same on any rank and after any resume), and on packed rows the draft model's
  attention gets a same-document term and positions restarting per document.

Every batch carries ``padfree_sample_ids`` (manifest indices) and ``padfree_epoch``; DFlash batches carry
``padfree_anchors`` / ``padfree_anchor_valid`` (``[rows, width]``), packed ones ``document_ids`` and
``position_ids``. Nothing here imports SpecForge at module level. Guide: docs/integrations.md ("padfree in a
SpecForge offline run").
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from padfree.core.anchors import AnchorPolicy, anchor_counts
from padfree.core.config import PlanConfig
from padfree.core.plan import Plan
from padfree.core.planner import make_plan
from padfree.drafter import methods
from padfree.drafter.recipes import Recipe
from padfree.drafter.setup import drafter_setup
from padfree.errors import ConfigError, InputError
from padfree.integrations._common import (
    ElasticEpochs,
    Installed,
    doc_anchors,
    forward_hooks,
    recipe_for,
    this_rank,
)
from padfree.integrations.shapes import ShapeSet, anchor_slots, pad_rows, slot_width

__all__ = ["LengthIndex", "PlanFeatureLoader", "build_index", "index_from_masks", "install"]

_FORMAT = 1

PACKED_MODELS = ("dflash",)
"""The drafter methods SpecForge has a patched model of that trains on packed rows (:func:`install`), by
name; the others train on their padded rows."""


@dataclass(frozen=True)
class LengthIndex:
    """Per sample of a manifest (in its order): tokens as their normalizer keeps them (``min(n, max_len)``)
    and DFlash anchors under ``policy`` on those tokens (0: no valid anchor; their DFlash normalizer refuses
    such a sample). ``key`` names the files and rule it was built from."""

    lengths: np.ndarray
    anchors: np.ndarray
    max_len: int
    key: str

    def __len__(self) -> int:
        return int(self.lengths.shape[0])


def _policy(recipe: Recipe) -> AnchorPolicy:
    return recipe.anchor_policy()


def feature_paths(refs: Sequence[Any]) -> list[str]:
    """The files behind their ``SampleRef``s (``file://`` URIs, as ``OfflineManifestReader`` writes them), or
    paths given directly."""
    out = []
    for r in refs:
        uri = getattr(r, "feature_store_uri", r)
        uri = str(uri)
        if "://" in uri and not uri.startswith("file://"):
            raise ConfigError(
                f"{uri}: the index reads feature files (file:// refs), not {uri.split('://')[0]}"
            )
        out.append(uri[len("file://") :] if uri.startswith("file://") else uri)
    return out


def _key(paths: Sequence[str], max_len: int, policy: AnchorPolicy) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([_FORMAT, int(max_len), repr(policy)]).encode())
    for p in paths:
        st = os.stat(p)
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def _read(path: str, max_len: int, policy: AnchorPolicy) -> tuple[int, int]:
    store: Any = importlib.import_module("specforge.runtime.data_plane.feature_store")
    raw = store.load_feature_file(path)
    if "input_ids" not in raw or "loss_mask" not in raw:
        raise InputError("a feature file without input_ids and loss_mask", path=path)
    n = min(int(raw["input_ids"].numel()), int(max_len))
    mask = np.asarray(raw["loss_mask"].reshape(-1)[:n].numpy()).astype(bool)
    return n, int(anchor_counts(mask, np.array([0, n]), policy)[0])


def build_index(
    refs: Sequence[Any],
    *,
    max_len: int,
    recipe: Recipe | None = None,
    cache_dir: str | Path | None = None,
    workers: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> LengthIndex:
    """The :class:`LengthIndex` of ``refs`` (their ``SampleRef``s or file paths, manifest order), loaded from
    ``cache_dir`` (default: the first file's folder) when an index of the same files and rule is there, else
    read from the files with ``workers`` threads and saved there (atomically, so concurrent ranks are
    safe)."""
    policy = _policy(recipe_for("specforge", "dflash", recipe))
    paths = feature_paths(refs)
    if not paths:
        raise ConfigError("no feature files to index")
    key = _key(paths, max_len, policy)
    folder = Path(cache_dir) if cache_dir is not None else Path(paths[0]).parent
    cached = folder / f"padfree-index-{key}.npz"
    found = _load_index(cached, len(paths))
    if found is not None:
        return LengthIndex(*found, int(max_len), key)
    lengths = np.zeros(len(paths), np.int64)
    anchors = np.zeros(len(paths), np.int64)
    done = 0
    with ThreadPoolExecutor(max_workers=max(1, int(workers))) as pool:
        for i, (n, a) in enumerate(pool.map(lambda p: _read(p, max_len, policy), paths, chunksize=64)):
            lengths[i], anchors[i] = n, a
            done += 1
            if progress is not None and (done % 4096 == 0 or done == len(paths)):
                progress(done, len(paths))
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".padfree-index-{key}.{os.getpid()}.{threading.get_ident()}.npz"
    with open(tmp, "wb") as f:  # durable before the rename: a crash leaves the old cache or this one
        np.savez(f, lengths=lengths, anchors=anchors)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, cached)
    return LengthIndex(lengths, anchors, int(max_len), key)


def _load_index(cached: Path, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``(lengths, anchors)`` of the index cache ``cached`` when it is whole (``n`` non-negative integers
    each); None when it is absent or torn (a crash, a full device, another tool's file), so it is rebuilt."""
    if not cached.is_file():
        return None
    try:
        with np.load(cached, allow_pickle=False) as z:
            lengths, anchors = np.asarray(z["lengths"]), np.asarray(z["anchors"])
    except Exception:  # zipfile, numpy and the OS raise many types for a torn archive
        return None
    for a in (lengths, anchors):
        if a.shape != (n,) or a.dtype.kind not in "iu" or (n and int(a.min()) < 0):
            return None
    return lengths.astype(np.int64), anchors.astype(np.int64)


def index_from_masks(loss_masks: Sequence[Any], *, max_len: int, recipe: Recipe | None = None) -> LengthIndex:
    """The index from the tokenized dataset that produced the feature files (one loss mask per sample, in the
    manifest's order), without opening a feature file."""
    rec = recipe_for("specforge", "dflash", recipe)
    parts = [np.asarray(m).reshape(-1)[: int(max_len)].astype(bool) for m in loss_masks]
    lengths = np.array([p.shape[0] for p in parts], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = np.concatenate(parts) if parts else np.zeros(0, bool)
    anchors = anchor_counts(flat, offsets, _policy(rec))
    digest = hashlib.sha256(np.packbits(flat).tobytes() + lengths.tobytes()).hexdigest()[:24]
    return LengthIndex(lengths, anchors, int(max_len), digest)


class _PackedCollate:
    """One packed row of a micro-batch's normalized samples (``input_ids``, ``loss_mask``, ``hidden_states``),
    each followed by ``gap`` empty positions, plus ``document_ids`` (-1 on gaps) and restarting
    ``position_ids``."""

    def __init__(self, gap: int) -> None:
        self.gap = int(gap)

    def __call__(self, features: list[dict]) -> dict:
        parts: dict[str, list[torch.Tensor]] = {"input_ids": [], "loss_mask": [], "hidden_states": []}
        docs, pos = [], []
        for d, f in enumerate(features):
            n = int(f["input_ids"].shape[-1])
            for k in parts:
                t = f[k][0]
                gap = torch.zeros((self.gap, *t.shape[1:]), dtype=t.dtype)
                parts[k].append(torch.cat([t, gap]))
            docs.append(torch.cat([torch.full((n,), d), torch.full((self.gap,), -1)]))
            pos.append(torch.cat([torch.arange(n), torch.zeros(self.gap, dtype=torch.long)]))
        out = {k: torch.cat(v)[None] for k, v in parts.items()}
        out["document_ids"] = torch.cat(docs)[None].long()
        out["position_ids"] = torch.cat(pos)[None].long()
        return out


class _Measured:
    """Their (or padfree's packed) collate function, plus each sample's token count as it was materialised
    (``padfree_lengths``), for the loader to check against the index."""

    def __init__(self, collate_fn: Callable[[list], dict]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, features: list[dict]) -> dict:
        out = self.collate_fn(features)
        out["padfree_lengths"] = torch.tensor([int(f["input_ids"].shape[-1]) for f in features])
        return out


class PlanFeatureLoader:
    """A drop-in for SpecForge's offline ``FeatureDataLoader`` (refs mode) that yields this rank's
    micro-batches of one padfree plan of the whole manifest.

    Args:
        store: their ``LocalFeatureStore`` (``file://`` refs are read in place).
        refs: every ``SampleRef`` of the manifest, in order (not sharded: the plan deals them to ranks).
        index: their :class:`LengthIndex` (:func:`build_index`).
        config: the :class:`~padfree.PlanConfig` (``budget``: tokens per micro-batch, ``count x longest``
            padded, the row's tokens packed; ``anchor_budget``: DFlash blocks per micro-batch; ``grad_accum``:
            their accumulation steps). Its world size comes from ``world_size``. Default: the drafter
            setup's (:func:`padfree.drafter.setup.drafter_setup`) for the recipe on the index's lengths, a
            ``packed`` or ``bucketed`` plan as ``layout`` asks, ``index.max_len`` tokens per micro-batch (and
            the gap behind each document of a packed row).
        collate_fn, per_sample_transform: their algorithm's offline collator and normalizer
            (``build_collator()``, ``build_offline_normalizer(max_len)``); ``layout="packed"`` uses padfree's
            packed collate instead of ``collate_fn``.
        layout: ``padded`` (their models unmodified) or ``packed`` (needs :func:`install` on the model).
        recipe: the anchors' rule (default: SpecForge's preset for ``method``).
        rank, world_size: default: torch.distributed's (their draft-DP group is the world without USP).
        shapes: row lengths and anchor widths batches are padded to (default: none, each batch's own).
        method: the drafter method, their strategy name (``dflash``, the default, or ``eagle3``);
            ``strategy=`` is its old name, accepted with a DeprecationWarning until the next release.
        device, num_workers: theirs.
        resume_dir: their ``TrainerController``'s ``output_dir``: rank 0 records there
            (``padfree-resume.json``) at which world size and grad_accum each run began each epoch, so that
            ``seek(epoch_batch)`` (micro-batches per rank, other samples at another world size) continues
            exactly at any world size, as :class:`padfree.torch.PlanBatchSampler` does. Without it a seek
            mid-epoch is refused in one line.
    """

    def __init__(
        self,
        store: Any,
        refs: Sequence[Any],
        *,
        index: LengthIndex,
        config: PlanConfig | None = None,
        collate_fn: Callable[[list], dict] | None = None,
        per_sample_transform: Callable[[dict], dict] | None = None,
        layout: str = "padded",
        recipe: Recipe | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        shapes: ShapeSet | None = None,
        method: str | None = None,
        device: Any = "cpu",
        num_workers: int = 0,
        resume_dir: str | os.PathLike | None = None,
        strategy: str | None = None,
    ) -> None:
        if strategy is not None:
            warnings.warn(
                "PlanFeatureLoader(strategy=...) is now method=...; strategy= goes in the next release",
                DeprecationWarning,
                stacklevel=2,
            )
            if method not in (None, strategy):
                raise ConfigError(f"method {method!r} and strategy {strategy!r} differ: give method= alone")
            method = strategy
        method = method or "dflash"
        spec = methods.get(method)
        if layout not in ("padded", "packed"):
            raise ConfigError(f"layout must be padded or packed (got {layout!r})")
        if layout == "packed" and method not in PACKED_MODELS:
            packed = " and ".join(methods.get(m).title for m in PACKED_MODELS)
            raise ConfigError(
                f"packed rows need a patched model: only SpecForge's {packed} has one (install)"
            )
        self.recipe = recipe_for("specforge", method, recipe)
        self.gap = self.recipe.block_size - 1 if layout == "packed" else 0  # behind each packed document
        if config is None:  # the drafter's own plan: its cost model, on the index's lengths
            strategy = "packed" if layout == "packed" else "bucketed"
            plan = PlanConfig(strategy=strategy, budget=index.max_len + self.gap)
            config = drafter_setup(self.recipe, plan, lengths=index.lengths).config
        if config.packed != (layout == "packed"):
            raise ConfigError(
                f"layout {layout} needs a {'packed' if layout == 'packed' else 'padded'} strategy"
            )
        if len(index) != len(refs):
            raise ConfigError(f"the index has {len(index)} samples, the manifest {len(refs)}")
        if layout == "padded" and collate_fn is None:
            raise ConfigError("padded rows use their algorithm's collator: pass collate_fn=build_collator()")
        self.rank, self.world_size = this_rank(rank, world_size)
        self.config = config.with_(world_size=self.world_size)
        self.layout, self.shapes, self.index = layout, shapes, index
        self._plan_lengths = index.lengths + self.gap
        self._anchors = index.anchors if spec.anchors is not None else None
        self._epochs = ElasticEpochs(
            self._plan_lengths,
            self.config,
            self.rank,
            anchors=self._anchors,
            record_dir=resume_dir,
            who="PlanFeatureLoader",
            hint="give it resume_dir= their TrainerController's output_dir",
        )
        fdl: Any = importlib.import_module("specforge.runtime.data_plane.feature_dataloader")
        self._inner = fdl.FeatureDataLoader(
            store,
            refs=list(refs),
            batch_size=1,
            collate_fn=_Measured(
                _PackedCollate(self.gap) if collate_fn is None or layout == "packed" else collate_fn
            ),
            per_sample_transform=per_sample_transform,
            device=device,
            drop_last=False,
            strategy=method,
            num_workers=num_workers,
        )
        self._refs = list(refs)
        self.epoch, self._skip = 0, 0
        self._cached: tuple[int, Plan | None] = (-1, None)
        self.current: Any = None

    # -- FeatureDataLoader's interface -------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Plan ``epoch`` (its first iteration starts at its first micro-batch)."""
        self.epoch, self._skip = int(epoch), 0

    def seek(self, num_batches: int) -> None:
        """Skip the first ``num_batches`` of this rank's micro-batches on the next iteration (one-shot): their
        ``epoch_batch``, counted at the world size the checkpoint was written at; the rest of the epoch
        continues exactly at this one (see ``resume_dir``)."""
        self._skip = max(0, int(num_batches))

    def __len__(self) -> int:
        return len(self.micro_ids())

    def close(self) -> None:
        self._inner.close()

    def plan(self, epoch: int | None = None) -> Plan:
        """The padfree plan of ``epoch`` (default: the current one), cached."""
        e = self.epoch if epoch is None else int(epoch)
        if self._cached[0] != e:
            self._cached = (e, make_plan(self._plan_lengths, self.config, e, anchors=self._anchors))
        plan = self._cached[1]
        assert plan is not None
        return plan

    def micro_ids(self) -> np.ndarray:
        """This rank's micro-batch numbers in the current epoch's plan."""
        return self.plan().micro_ids(self.rank)

    def __iter__(self) -> Iterator[Any]:
        epoch, skip = self.epoch, self._skip
        self._skip = 0
        groups = [np.asarray(ids, dtype=np.int64) for ids, _ in self._epochs.batches(epoch, skip)]
        self._epochs.commit(epoch, skip)
        for g in groups:
            if g.shape[0] == 0:
                raise ConfigError(f"epoch {epoch}: an empty micro-batch in the plan (nothing to train)")
        chunks = [[self._refs[int(i)] for i in g] for g in groups]
        inner = self._inner
        batches = (
            inner._iter_refs_prefetch(chunks) if inner.num_workers > 0 else map(inner._make_batch, chunks)
        )
        for g, batch in zip(groups, batches, strict=True):
            self._complete(batch, g, epoch)
            self.current = batch
            yield batch
        self.current = None

    def batch_of(self, ids: Sequence[int], epoch: int | None = None) -> Any:
        """The batch of samples ``ids`` laid out as this loader lays out a micro-batch (e.g. one document
        alone, to compare with its packed row); it becomes :attr:`current`."""
        g = np.asarray(ids, dtype=np.int64)
        batch = self._inner._make_batch([self._refs[int(i)] for i in g])
        self._complete(batch, g, self.epoch if epoch is None else int(epoch))
        self.current = batch
        return batch

    # -- what padfree adds -------------------------------------------------------------------------
    def _check(self, got: np.ndarray, ids: np.ndarray) -> None:
        """Each sample's materialised token count (after their normalizer) is the index's: an index of
        another tokenization or other files would place anchors outside their document and pack rows past
        the budget. Else one line naming the sample and its file."""
        want = self.index.lengths[ids]
        bad = np.flatnonzero(np.asarray(got) != want)
        if bad.shape[0]:
            j = int(bad[0])
            sid = int(ids[j])
            raise InputError(
                f"{int(got[j])} tokens after their normalizer, but the length index says {int(want[j])} "
                f"({bad.shape[0]} of this batch's {len(ids)} samples differ): the index was built from other "
                "data (another tokenizer or other feature files); build it from these files (build_index)",
                path=feature_paths([self._refs[sid]])[0],
                sample=sid,
            )

    def _complete(self, batch: Any, ids: np.ndarray, epoch: int) -> None:
        t = batch.tensors
        self._check(t.pop("padfree_lengths").numpy(), ids)
        if self.shapes is not None:
            width = int(t["input_ids"].shape[1])
            t.update(pad_rows(t, width, self.shapes.width(width)))
        t["padfree_sample_ids"] = torch.as_tensor(ids, dtype=torch.long)
        t["padfree_epoch"] = torch.tensor(epoch, dtype=torch.long)
        if self._anchors is None:
            return
        policy = _policy(self.recipe)
        mask = t["loss_mask"].numpy().astype(bool)
        lens = self.index.lengths[ids]
        seed = self.config.seed
        if self.layout == "packed":
            starts = np.concatenate([[0], np.cumsum(lens + self.gap)[:-1]]).astype(np.int64)
            rows = [doc_anchors(mask[0], starts, lens, ids, policy=policy, seed=seed, epoch=epoch)]
        else:
            rows = [
                doc_anchors(mask[r], [0], [lens[r]], [ids[r]], policy=policy, seed=seed, epoch=epoch)
                for r in range(len(ids))
            ]
        width = slot_width(self.shapes, max(len(a) for a in rows))
        t["padfree_anchors"], t["padfree_anchor_valid"] = anchor_slots(rows, width)


_local = threading.local()


def _same_document(kwargs: dict, fields: dict, block: int) -> dict:
    """The draft model's keywords with positions restarting per document and the attention mask limited to
    each block's own document (packed rows)."""
    doc = fields["document_ids"].to(kwargs["position_ids"].device)
    pos = fields["position_ids"].to(doc.device)
    anchors = fields["padfree_anchors"].to(doc.device)
    offsets = torch.arange(block, device=doc.device)
    draft = (torch.gather(pos, 1, anchors)[..., None] + offsets).reshape(pos.shape[0], -1)
    out = dict(kwargs)
    out["position_ids"] = torch.cat([pos, draft], dim=1)
    q_doc = torch.gather(doc, 1, anchors).repeat_interleave(block, dim=1)  # [B, Q]
    s = doc.shape[1]

    def limit(mask: Any) -> Any:
        if isinstance(mask, dict):
            return {k: limit(v) for k, v in mask.items()}
        if isinstance(mask, torch.Tensor):
            kv = torch.cat([doc, torch.full_like(q_doc, -2)], dim=1)  # draft keys: their own block rule
            ok = (kv[:, None, :] == q_doc[:, :, None]) | (kv[:, None, :] == -2)
            return mask & ok[:, None]
        mod = getattr(mask, "mask_mod", None)
        if mod is None:
            raise ConfigError(f"packed rows: cannot add a document term to a {type(mask).__name__} mask")
        flex: Any = importlib.import_module("torch.nn.attention.flex_attention")

        def doc_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
            qd = q_doc[b, q.clamp(max=q_doc.shape[1] - 1)]
            kd = doc[b, kv.clamp(max=s - 1)]
            return mod(b, h, q, kv) & ((kv >= s) | (kd == qd))

        n_q, n_kv = mask.shape[-2], mask.shape[-1]
        return flex.create_block_mask(
            doc_mod, B=q_doc.shape[0], H=None, Q_LEN=n_q, KV_LEN=n_kv, device=doc.device
        )

    out["attention_mask"] = limit(kwargs["attention_mask"])
    return out


def install(
    model: Any, loader: PlanFeatureLoader, *, on_batch: Callable[[np.ndarray, int], None] | None = None
) -> Installed:
    """Patch SpecForge's ``OnlineDFlashModel`` ``model`` for batches of ``loader``: each forward (their
    strategy calls ``model(input_ids=..., hidden_states=..., loss_mask=...)``) must be of the batch
    ``loader`` yielded last (checked); its anchors are that batch's ``padfree_anchors``, and on packed rows
    the draft model sees only each block's own document at restarting positions. ``on_batch(sample_ids,
    epoch)`` is called before each forward."""
    block = int(model.block_size)

    def anchors(seq_len: int, loss_mask: torch.Tensor, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
        f = getattr(_local, "fields", None)
        if f is None:
            raise ConfigError("padfree anchors asked for outside a forward of an installed model")
        return f["padfree_anchors"].to(device), f["padfree_anchor_valid"].to(device)

    def before(_module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        cur = loader.current
        if cur is None or ids is None or not torch.equal(cur.tensors["input_ids"].to(ids.device), ids):
            raise ConfigError("the model got a batch that is not the one the padfree loader yielded last")
        _local.fields = cur.tensors
        if on_batch is not None:
            on_batch(cur.tensors["padfree_sample_ids"].numpy(), int(cur.tensors["padfree_epoch"]))

    def draft_before(_module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        f = getattr(_local, "fields", None)
        if f is None or "document_ids" not in f:
            return None
        return args, _same_document(kwargs, f, block)

    model._sample_anchor_positions = anchors
    handles = forward_hooks(model, before, _local, "fields")
    handles.append(model.draft_model.register_forward_pre_hook(draft_before, with_kwargs=True))
    return Installed(handles, lambda: model.__dict__.pop("_sample_anchor_positions", None))
