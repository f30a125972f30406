"""padfree in a vllm ``speculators`` run: a batch sampler, a collate wrapper and a model hook that drop into
their data plane (``ArrowDataset`` -> ``MultipackDistributedBatchSamplerV2`` -> ``CollateFn`` -> one packed
row per rank per step -> ``model(**batch, **train_call_kwargs)``).

* :class:`PadfreeMultipackSampler` takes ``MultipackDistributedBatchSamplerV2``'s arguments
  (``batch_max_length, lengths, num_replicas, rank, truncate_long_samples, seed, max_batches``) plus a
  :class:`~padfree.PlanConfig` and per-sample DFlash ``anchors`` (:func:`count_anchors`), and plans every
  epoch with padfree: packed rows of at most ``batch_max_length`` tokens and ``anchor_budget`` anchors, steps
  that mix lengths like a shuffle, ranks balanced by the drafter cost model. It offers the hooks their
  trainer's fast resume looks for (``_generate_batches(epoch)``, ``_cached_generated_batches``), so a resumed
  run skips without replaying.
* :class:`PadfreeCollate` wraps their ``CollateFn``: their batch keys unchanged, rows cut to one of a few
  lengths, plus ``padfree_sample_ids``, ``padfree_epoch`` and (DFlash) ``padfree_anchors`` /
  ``padfree_anchor_valid``: each document's anchors chosen from its own loss mask and (seed, epoch, sample
  id), at a fixed anchor width. EAGLE-3 rows lose the loss on each document's first ``ttt - 1`` positions,
  where their row-wide ``align_for_step`` would pair two documents; MTP rows on each document's first ``K +
  1`` (their row-wide ``k + 2`` label shift) and end with ``K + 1`` loss-free positions (the queries their
  ``valid_len`` drops), so every document keeps all of its queries (:func:`padfree.integrations.feed.
  mtp_inputs`). P-EAGLE rows lose it on each document's
  first and last positions and carry ``padfree_chains``: each document's COD chains drawn from its own
  generator (:func:`padfree.drafter.methods.peagle.model.row_chains`, the same draws padfree's own fields
  make).
* :func:`install` hooks their model: it takes the ``padfree_*`` keys out of the call and puts padfree's
  anchors in place of their ``select_anchors`` (today's signature and the one their PR #1071 proposes) while
  that forward runs (and, for P-EAGLE, padfree's chains in place of their ``generate_cod_sample_indices``).

Their dataset must come wrapped in :class:`padfree.torch.PlannedDataset` (it hands the batch's sample ids and
epoch to the collate function). Nothing here imports speculators at module level. Guide: docs/integrations.md
("padfree in a speculators run").
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from padfree.core.anchors import anchor_counts
from padfree.core.config import PlanConfig
from padfree.core.items import validate_lengths
from padfree.core.plan import Plan, validate_anchors
from padfree.core.planner import make_plan
from padfree.drafter import recipes
from padfree.drafter.recipes import Recipe
from padfree.drafter.setup import drafter_setup
from padfree.errors import ConfigError, InputError
from padfree.integrations._common import (
    BatchInfo,
    ElasticEpochs,
    Installed,
    PlannedBatch,
    check_rank,
    forward_hooks,
    recipe_for,
)
from padfree.integrations.feed import (
    SPECULATORS,
    AnchorChoice,
    ChainChoice,
    RowDocs,
    speculators_model,
    trainer_kwargs,
    whole_blocks,
)
from padfree.integrations.shapes import ShapeSet, pad_rows

__all__ = [
    "PadfreeCollate",
    "PadfreeMultipackSampler",
    "ShapeSet",
    "count_anchors",
    "dataset_loss_masks",
    "install",
    "trainer_kwargs",
]

KEYS = ("padfree_sample_ids", "padfree_epoch", "padfree_anchors", "padfree_anchor_valid", "padfree_chains")
"""The keys :class:`PadfreeCollate` adds to their batch (and :func:`install` takes out of the model call)."""


def dataset_loss_masks(dataset: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(flat loss mask, offsets)`` of every sample of their ``ArrowDataset`` (its ``data``, a Hugging Face
    dataset with a ``loss_mask`` column; a plain one works too), read column-wise from Arrow, no Python loop
    over samples."""
    data = getattr(dataset, "data", dataset)
    try:
        column = data.with_format("arrow")[:]["loss_mask"].combine_chunks()
    except (AttributeError, KeyError) as err:
        raise InputError(f"the dataset has no Arrow loss_mask column ({err})") from None
    offsets = np.asarray(column.offsets, dtype=np.int64)
    flat = np.asarray(column.flatten().to_numpy(zero_copy_only=False)).astype(bool)
    return flat, offsets - offsets[0]


def count_anchors(loss_masks: Any, recipe: Recipe | None = None, *, max_len: int | None = None) -> np.ndarray:
    """DFlash anchors per sample (DFlash2's or DSpark's, given its ``recipe``) as :class:`PadfreeCollate`
    will choose them (the recipe's rule, blocks inside their document), for the sampler's ``anchors``.
    ``loss_masks``: their dataset (see :func:`dataset_loss_masks`), ``(flat, offsets)``, or one mask per
    sample. ``max_len``: count on each sample's first ``max_len`` tokens (their ``CollateFn`` truncates
    there)."""
    rec = recipe_for("speculators", "dflash" if recipe is None else recipe.method, recipe)
    if not speculators_model(rec.method).anchors:
        raise ConfigError(f"count_anchors: {rec.method} opens no blocks at anchors (recipe {rec.name})")
    if isinstance(loss_masks, tuple) and len(loss_masks) == 2:
        flat, offsets = (np.asarray(x) for x in loss_masks)
    elif hasattr(loss_masks, "with_format") or hasattr(getattr(loss_masks, "data", None), "with_format"):
        flat, offsets = dataset_loss_masks(loss_masks)
    else:
        parts = [np.asarray(m).reshape(-1).astype(bool) for m in loss_masks]
        offsets = np.concatenate([[0], np.cumsum([p.shape[0] for p in parts])]).astype(np.int64)
        flat = np.concatenate(parts) if parts else np.zeros(0, bool)
    offsets = offsets.astype(np.int64)
    if max_len is not None:
        n = np.minimum(np.diff(offsets), int(max_len))
        flat = flat[np.repeat(offsets[:-1], n) + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)]
        offsets = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
    return anchor_counts(flat.astype(bool), offsets, whole_blocks(rec))


class PadfreeMultipackSampler(torch.utils.data.Sampler):
    """A drop-in for speculators' ``MultipackDistributedBatchSamplerV2`` that plans with padfree.

    Args:
        batch_max_length, lengths, num_replicas, rank, truncate_long_samples, seed, max_batches: theirs
            (``lengths``: their dataset's ``approx_lengths``; long samples are truncated to the budget or
            dropped, as theirs are).
        config: a packed :class:`~padfree.PlanConfig` for everything else (``anchor_budget``: the fixed anchor
            width; ``cost``: the rank balancing model). Its budget, world size, seed and overlong policy are
            set from the arguments above; one micro-batch per rank per step (their trainer has no gradient
            accumulation). Default: packed, balanced by the recipe's drafter cost model.
        anchors: DFlash anchors per sample (:func:`count_anchors`); ``None`` for EAGLE-3.
        recipe: the recipe the anchors and the default cost model follow (default: speculators' DFlash, or
            EAGLE-3 without anchors).
        resume_dir: their ``TrainerConfig.save_path``: rank 0 records there (``padfree-resume.json``) at
            which world size each run began each epoch, so that their mid-epoch resume (``local_step``:
            micro-batches per rank, other samples at another world size) continues exactly at any world size,
            as :class:`padfree.torch.PlanBatchSampler` does (:class:`~padfree.integrations._common.
            ElasticEpochs`). Without it a mid-epoch resume is refused in one line.

    Every rank gets the same number of micro-batches per epoch (some may be empty near an epoch's end; their
    ``CollateFn`` turns an empty one into a row of padding that trains nothing).
    """

    def __init__(
        self,
        batch_max_length: int,
        lengths: Any,
        num_replicas: int,
        rank: int,
        truncate_long_samples: bool = True,
        seed: int = 0,
        max_batches: int | None = None,
        *,
        config: PlanConfig | None = None,
        anchors: Any = None,
        recipe: Recipe | None = None,
        resume_dir: str | os.PathLike | None = None,
    ) -> None:
        check_rank(rank, num_replicas)
        self.num_replicas, self.rank, self.seed, self.epoch = int(num_replicas), int(rank), int(seed), 0
        self.batch_max_length = int(batch_max_length)
        self.max_batches = max_batches
        self.lengths = validate_lengths(np.asarray(lengths).reshape(-1))  # one line for NaN, 0, 2.5...
        anchored = [name for name, m in SPECULATORS.items() if m.anchors == (anchors is not None)]
        method = recipe.method if recipe is not None and recipe.method in anchored else anchored[0]
        self.recipe = recipe_for("speculators", method, recipe)
        base = (
            config or drafter_setup(self.recipe, PlanConfig(strategy="packed"), lengths=self.lengths).config
        )
        if not base.packed:
            raise ConfigError(
                f"speculators trains one packed row per rank: use strategy packed (got {base.strategy})"
            )
        self.config = base.with_(
            budget=self.batch_max_length,
            world_size=self.num_replicas,
            grad_accum=1,
            seed=self.seed,
            overlong="truncate" if truncate_long_samples else "drop",
        )
        self.anchors = None
        if anchors is not None:
            self.anchors = validate_anchors(np.asarray(anchors).reshape(-1), self.lengths)
            recipes.check_drafts(self.recipe, self.anchors, self.lengths)
            if self.config.anchor_budget is None:
                raise ConfigError(
                    "DFlash rows need a fixed anchor width: give config=PlanConfig(strategy='packed', "
                    "anchor_budget=W) and pass max_anchors=W to the model (trainer_kwargs)"
                )
        self._cached_generated_batches: tuple[int, list] = (-1, [])
        self.epochs = ElasticEpochs(
            self.lengths,
            self.config,
            self.rank,
            anchors=self.anchors,
            record_dir=resume_dir,
            who="PadfreeMultipackSampler",
            hint="give it resume_dir= their TrainerConfig's save_path",
        )

    @property
    def shapes(self) -> ShapeSet:
        """The row lengths and the anchor width :class:`PadfreeCollate` should pad to: eight lengths up to the
        budget (a packed row is cut to the smallest that holds it; MTP rows hold their loss-free tail
        besides), the plan's anchor budget."""
        tail = speculators_model(self.recipe.method).tail(self.recipe)
        return ShapeSet.spread(self.batch_max_length + tail, 8, anchors=self.config.anchor_budget)

    @property
    def last_plan(self) -> Plan | None:
        """The plan of the epoch last generated, every rank's micro-batches (``None`` before the first)."""
        epoch = self._cached_generated_batches[0]
        return None if epoch < 0 else make_plan(self.lengths, self.config, epoch, anchors=self.anchors)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self):
        batches = self._generate_batches(self.epoch)
        self.epochs.commit(self.epoch, getattr(batches, "skip", 0))
        return iter(batches)

    def __len__(self) -> int:
        return len(self._generate_batches(self.epoch))

    def _generate_batches(self, epoch: int) -> list:
        """This rank's micro-batches of ``epoch``, each a :class:`PlannedBatch` of sample ids (cached per
        epoch). Their trainer's fast resume slices this list (``batches[local_step:]``): the slice is the rest
        of the epoch as :class:`~padfree.integrations._common.ElasticEpochs` continues it, at this world size
        whatever the one the checkpoint was written at."""
        if self._cached_generated_batches[0] == epoch:
            return self._cached_generated_batches[1]
        batches = _EpochBatches(self, epoch, 0)
        self._cached_generated_batches = (epoch, batches)
        return batches


class _EpochBatches(list):
    """A rank's micro-batches of an epoch from micro-batch ``skip`` on; slicing it from ``k`` (their fast
    resume) resumes after ``k`` micro-batches."""

    def __init__(self, sampler: PadfreeMultipackSampler, epoch: int, skip: int) -> None:
        got = sampler.epochs.batches(epoch, skip)
        if sampler.max_batches is not None:
            got = got[: max(0, int(sampler.max_batches) - skip)]
        lengths = sampler.lengths
        super().__init__(
            PlannedBatch(ids, BatchInfo(int(epoch), j, np.asarray(ids, np.int64), lengths[ids]))
            for ids, j in got
        )
        self.sampler, self.epoch, self.skip = sampler, int(epoch), int(skip)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice) and key.step is None and key.stop is None and (key.start or 0) > 0:
            return _EpochBatches(self.sampler, self.epoch, self.skip + int(key.start))
        return super().__getitem__(key)


class PadfreeCollate:
    """Their ``CollateFn`` plus what padfree needs (picklable, for their spawn workers).

    Args:
        collate_fn: their ``CollateFn`` (its ``max_len`` the sampler's ``batch_max_length``).
        method: ``dflash`` or ``dflash2`` (anchors), ``eagle3`` or ``mtp`` (per-document gate; MTP also a
            loss-free tail), or ``peagle`` (per-document gate and chains, ``padfree_chains``).
        recipe: the anchors' rule / EAGLE-3's ttt (default: speculators' preset for ``method``).
        seed: the anchors' seed (use the sampler's).
        shapes: row lengths and the anchor width (``sampler.shapes``); ``None``: rows stay ``max_len`` long
            and the anchor slots are the row's count.
    """

    def __init__(
        self,
        collate_fn: Callable[[list], dict],
        *,
        method: str = "dflash",
        recipe: Recipe | None = None,
        seed: int = 0,
        shapes: ShapeSet | None = None,
    ) -> None:
        self.collate_fn = collate_fn
        self.method = method
        self.recipe = recipe_for("speculators", method, recipe)
        self.seed = int(seed)
        self.shapes = shapes

    def __call__(self, items: list) -> dict:
        info = getattr(items, "info", None)
        if not isinstance(info, BatchInfo):
            raise ConfigError(
                "PadfreeCollate needs the batch's sample ids: DataLoader(PlannedDataset(dataset), "
                "batch_sampler=PadfreeMultipackSampler(...), collate_fn=PadfreeCollate(...))"
            )
        kept = [int(i) for i, it in zip(info.indices, items, strict=True) if isinstance(it, Mapping)]
        out = self.collate_fn(list(items))
        doc = out["document_ids"][0]
        lens = torch.bincount(doc[doc >= 0], minlength=len(kept)).tolist() if len(kept) else []
        check_materialised(items, info, lens, int(doc.shape[0]), getattr(self.collate_fn, "preprocess", None))
        full = int(doc.shape[0])
        model = speculators_model(self.method)
        need = int(sum(lens)) + model.tail(self.recipe)  # MTP: loss-free positions after the row
        width = max(full, need) if self.shapes is None else self.shapes.width(need)
        if width < full:
            for k, v in out.items():
                if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == full:
                    out[k] = v[:, :width]
        elif width > full:
            out = pad_rows(out, full, width)
        starts = (
            np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64) if lens else np.zeros(0, np.int64)
        )
        gated = model.head(self.recipe)
        if gated > 0:  # no loss where a shifted pair could join two documents
            pos = (
                torch.arange(width)
                - torch.as_tensor(starts, dtype=torch.long)[out["document_ids"][0].clamp(min=0)]
            )
            head = (pos < gated) & (out["document_ids"][0] >= 0)
            out["loss_mask"] = out["loss_mask"] * ~head[None].to(out["loss_mask"].device)
        if (
            self.recipe.min_loss_tokens > 0
        ):  # DSpark: a document under the recipe's loss tokens trains nothing
            out["loss_mask"] = _drop_short(
                out["loss_mask"], out["document_ids"][0], self.recipe.min_loss_tokens
            )
        if model.columns is not None:  # DFlash's anchors, P-EAGLE's chains: each document's own
            row = RowDocs(starts, lens, kept, self.recipe, self.seed, info.epoch, self.shapes)
            out = model.columns(out, row)
        out["padfree_sample_ids"] = torch.tensor(kept, dtype=torch.long)
        out["padfree_epoch"] = torch.tensor(info.epoch, dtype=torch.long)
        return out


def _drop_short(loss_mask: torch.Tensor, doc: torch.Tensor, least: int) -> torch.Tensor:
    """``loss_mask`` ``(1, T)`` without the loss of documents (``doc``: their ids, -1 on padding) holding
    fewer than ``least`` loss tokens, as padfree's DSpark fields drop them (DeepSpec's
    ``min_loss_tokens``)."""
    real = doc >= 0
    n = int(doc.max()) + 1 if bool(real.any()) else 0
    counts = torch.zeros(n).index_add(0, doc[real].cpu(), loss_mask[0][real].float().cpu())
    short = real & (counts < least)[doc.clamp(min=0).cpu()].to(doc.device)
    return loss_mask * ~short[None].to(loss_mask.device)


def check_materialised(
    items: list, info: BatchInfo, lens: list[int], max_len: int, preprocess: Callable | None = None
) -> None:
    """Every planned sample of a micro-batch is in their collated row whole (or cut to the budget, as the
    plan cut it): its materialised token count agrees with the length the sampler planned with, and their
    collate kept all of its tokens (``lens``: each document's positions in their row; ``preprocess``: their
    ``CollateFn``'s, e.g. EAGLE-3's ``shift_batch``, one token fewer). Else one :class:`InputError` naming the
    sample (their ``CollateFn`` would cut or drop it while ``padfree_sample_ids`` reports it trained)."""
    planned = info.lengths
    kept = [j for j, it in enumerate(items) if isinstance(it, Mapping)]
    if len(lens) != len(kept):
        raise ConfigError(
            f"their collate kept {len(lens)} of {len(kept)} planned samples: give CollateFn max_len "
            "= the sampler's batch_max_length"
        )
    for d, j in enumerate(kept):
        sid = int(info.indices[j])
        n = int(items[j]["input_ids"].shape[0])
        if planned is not None and min(n, max_len) != min(int(planned[j]), max_len):
            raise InputError(
                f"{n} tokens, but the sampler planned it at {int(planned[j])}: the lengths "
                "given to PadfreeMultipackSampler must be this dataset's token counts (its approx_lengths)",
                sample=sid,
            )
        want = min(n, max_len)
        if preprocess is not None and "lengths" in items[j]:
            want = min(int(preprocess(items[j])["lengths"].reshape(-1)[0]), max_len)
        if lens[d] != want:
            raise InputError(
                f"their collate kept {lens[d]} of its {want} tokens (the row "
                f"overflows max_len {max_len}): give CollateFn max_len = the sampler's batch_max_length",
                sample=sid,
            )


_local = threading.local()
_installed: dict[str, Any] = {"count": 0, "theirs": None}
_lock = threading.Lock()


def _select_anchors(loss_mask: torch.Tensor, num_anchors: int, block_size: int, *args: Any, **kwargs: Any):
    """In place of their ``select_anchors`` while :func:`install` holds: padfree's anchors of the row being
    forwarded (set by the model hook), else theirs (a model that was not installed)."""
    choice = getattr(_local, "choice", None)
    if choice is None:
        return _installed["theirs"](loss_mask, num_anchors, block_size, *args, **kwargs)
    if args:  # PR #1071 passes document_ids positionally
        kwargs.setdefault("document_ids", args[0])
    return choice(loss_mask, num_anchors, block_size, **kwargs)


def _cod_indices(seq_length: int, loss_mask: torch.Tensor, *args: Any, **kwargs: Any):
    """In place of their P-EAGLE ``generate_cod_sample_indices`` while :func:`install` holds: the chains
    :class:`PadfreeCollate` drew for the row being forwarded, else theirs (a model that was not installed)."""
    choice = getattr(_local, "choice", None)
    if not isinstance(choice, ChainChoice):
        return _installed["cod"](seq_length, loss_mask, *args, **kwargs)
    return choice(seq_length, loss_mask)


def _peagle_core() -> Any:
    """Their P-EAGLE module, where their release has one (None: older releases)."""
    try:
        return importlib.import_module("speculators.models.peagle.core")
    except ImportError:
        return None


def _restore_theirs() -> None:
    """Their ``select_anchors`` (and P-EAGLE sampler) back once no installed model remains."""
    with _lock:
        _installed["count"] -= 1
        if _installed["count"] == 0:
            core: Any = importlib.import_module("speculators.models.dflash.core")
            core.select_anchors = _installed["theirs"]
            if _installed.get("cod") is not None:
                _peagle_core().generate_cod_sample_indices = _installed["cod"]


def install(
    model: torch.nn.Module, *, on_batch: Callable[[np.ndarray, int], None] | None = None
) -> Installed:
    """Hook speculators' ``model`` (``DFlashDraftModel``, ``Eagle3DraftModel`` or ``PEagleDraftModel``, before
    DDP/FSDP wraps it) for batches from :class:`PadfreeCollate`: each forward takes the ``padfree_*`` keys out
    of its keywords and, for DFlash, draws padfree's anchors instead of their ``select_anchors`` (P-EAGLE:
    padfree's chains instead of their ``generate_cod_sample_indices``). ``on_batch(sample_ids,
    epoch)`` is called before each forward (for a log of what trained)."""
    core: Any = importlib.import_module("speculators.models.dflash.core")
    block = getattr(model, "block_size", None)

    def before(_module, args, kwargs):
        taken = {k: kwargs.pop(k) for k in KEYS if k in kwargs}
        if "padfree_sample_ids" in taken and on_batch is not None:
            on_batch(taken["padfree_sample_ids"].cpu().numpy(), int(taken["padfree_epoch"]))
        if "padfree_anchors" in taken:
            if block is None:
                raise ConfigError(
                    "the batch carries DFlash anchors but the model has no block_size (not DFlash)"
                )
            valid = taken["padfree_anchor_valid"]
            width = int(valid.shape[0])
            _local.choice = AnchorChoice(taken["padfree_anchors"][valid], int(block), width)
        if "padfree_chains" in taken:
            chains = taken["padfree_chains"]
            width = int(kwargs["input_ids"].shape[1])
            _local.choice = ChainChoice(
                torch.cat([torch.arange(width), chains[0].cpu()]),
                torch.cat([torch.zeros(width, dtype=torch.long), chains[1].cpu()]),
                width,
            )
        return args, kwargs

    with _lock:
        if _installed["count"] == 0:
            _installed["theirs"] = core.select_anchors
            core.select_anchors = _select_anchors
            peagle = _peagle_core()
            _installed["cod"] = None if peagle is None else peagle.generate_cod_sample_indices
            if peagle is not None:
                peagle.generate_cod_sample_indices = _cod_indices
        _installed["count"] += 1
    return Installed(forward_hooks(model, before, _local, "choice"), _restore_theirs)
