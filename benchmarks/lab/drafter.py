"""Drafter training speed by batching (``benchmarks/drafter_speed.py``): supervised draft positions per second
of a frozen target plus a DFlash or EAGLE-3 drafter trained under a recipe (:mod:`padfree.drafter.recipes`:
its anchors, objective, weights and normalisation), anchor coverage and anchor-slot efficiency per epoch, and
modeled rank imbalance.

Arms (each one a way to batch the same samples; the models, kernels and loss are the same in every arm):

- ``padfree_packed``: padfree's packed plan; one row of documents, per-document attention, anchors chosen
  per document by the recipe's rule (:mod:`padfree.core.anchors`).
- ``padfree_bucketed``: padfree's bucketed plan; padded rows, anchors per document.
- ``specforge_random``: SpecForge's batching: a fixed count of samples per micro-batch
  (``budget // mean length``) in random order, padded to the longest; anchors per sample (= per row).
- ``sorted_fixed``: the field's length-sorted padded batching (HF ``group_by_length``, the "globally
  length-sorted" batches of the team this project was born from): samples sorted by length over the whole
  epoch, cut into micro-batches of a **fixed sample count**, the same count as ``specforge_random``
  (``budget // mean length``, so the mean real tokens per micro-batch is the budget, rounded down), in
  random order, each padded to its longest. (HF's ``LengthGroupedSampler`` sorts within random mega-batches
  of 50 batches, which leaves more padding than a global sort: this arm is the tighter of the two.)
- ``sorted_budget``: padfree's ``sorted`` strategy: length-sorted micro-batches cut by the token budget
  (``count x longest <= budget``, so the count varies) in random order, padded.
- ``speculators_rows``: vllm speculators' batching and anchors, rebuilt here: rows packed by best fit over
  lengths sorted longest first in shuffled windows (their multipack), ranks given rows by tokens; DFlash
  anchors chosen per *row* by their ``select_anchors`` (``mask[a]``, the row's last block excluded, one quota
  of ``min(valid, max_anchors)`` for the row: the collator's ``leaky`` fields under
  :func:`row_policy`), their anchor tensor always ``max_anchors`` wide (``anchor_valid`` masks the rest);
  for EAGLE-3 the test-time-training shift across the row. Only draft positions whose label is in the
  query's own document count as supervised positions here (and carry loss).

In every padded arm (``padfree_bucketed`` too) the DFlash block tensor is padded as SpecForge's is
(``[rows, width, block_size]``, ``width`` the most anchors of a row of the batch: the extra blocks computed
and not supervised, :func:`padfree.drafter.methods.dflash.model.pad_anchor_slots`), which is what the
planner's cost model counts for padded rows (``count x most``);
``speculators_rows`` pads its row to ``max_anchors`` blocks. The
LM head runs on supervised positions only, in every arm.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from padfree.baselines import fixed_count, multipack, sorted_fixed_count
from padfree.bench.measure import Batching
from padfree.bench.sampling import epoch_seconds, stratified
from padfree.core import kernels
from padfree.core.anchors import AnchorPolicy, anchor_counts, anchor_quota
from padfree.core.config import CostModel, PlanConfig
from padfree.core.cost import Shapes, imbalance, micro_costs, micro_shapes, rank_costs
from padfree.core.planner import make_plan
from padfree.core.steps import assign_ranks
from padfree.drafter.methods import METHODS

if TYPE_CHECKING:
    from padfree.drafter.collate import DrafterBatch
    from padfree.drafter.recipes import Recipe
    from padfree.drafter.train import DrafterModels

ARMS = (
    "padfree_packed",
    "padfree_bucketed",
    "specforge_random",
    "sorted_fixed",
    "sorted_budget",
    "speculators_rows",
)


PUBLIC_TARGETS: dict[str, dict[str, int]] = {
    "qwen3-0.6b": {"hidden": 1024, "layers": 28, "heads": 16, "kv_heads": 8, "head_dim": 128,
                   "intermediate": 3072, "vocab": 151936},
    "llama-3.2-1b": {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "head_dim": 64,
                     "intermediate": 8192, "vocab": 128256},
    "qwen3-8b": {"hidden": 4096, "layers": 36, "heads": 32, "kv_heads": 8, "head_dim": 128,
                 "intermediate": 12288, "vocab": 151936},
}  # fmt: skip
"""Sizes of public targets (their ``config.json``: Qwen/Qwen3-0.6B, meta-llama/Llama-3.2-1B, Qwen/Qwen3-8B),
for runs at a real size with random weights (nothing is downloaded)."""


@dataclass(frozen=True)
class Arm:
    """One batching of the samples: micro-batches, the row layout, and whether speculators' row-level (leaky)
    fields are used (``leaky``: anchors per row, shift across the row, a fixed anchor tensor)."""

    name: str
    batching: Batching
    layout: str
    leaky: bool = False


def sample_anchors(samples: list[dict], policy: AnchorPolicy) -> np.ndarray:
    """DFlash anchors per sample from the loss masks (what the planner is given)."""
    mask = np.concatenate([np.asarray(s["loss_mask"], bool) for s in samples])
    lens = np.array([len(s["input_ids"]) for s in samples], np.int64)
    return anchor_counts(mask, np.concatenate(([0], np.cumsum(lens))), policy)


def supervised_after_first(lengths: np.ndarray, policy: AnchorPolicy) -> np.ndarray:
    """DFlash anchors per sample of ``lengths`` when every token but the first is supervised (length files
    such as the seed_mix carry no loss mask): the policy's quota of its valid positions.

    >>> supervised_after_first(np.array([1, 2, 3, 40, 2000]), AnchorPolicy(density=1.0)).tolist()
    [0, 0, 1, 38, 512]
    """
    n = np.asarray(lengths, np.int64)
    last = n - 1 if policy.eligibility == "pair" else n  # a + 1 < n, as the rule in padfree.core.anchors
    last = np.minimum(last, n - policy.margin)
    if not policy.partial:
        last = np.minimum(last, n - policy.block_size + 1)
    return anchor_quota(np.maximum(last - 1, 0), policy)  # position 0 carries no loss


def row_policy(recipe: Recipe) -> AnchorPolicy:
    """speculators' ``select_anchors`` (``models/dflash/utils.py``) as an anchor policy for the collator's
    row-level fields: ``mask[a]`` alone, every valid position up to ``max_anchors`` for the whole row (the
    row's last block is excluded by the row-level fields themselves)."""
    return AnchorPolicy(
        block_size=recipe.block_size, max_anchors=recipe.max_anchors, density=1.0, eligibility="self"
    )


def make_arms(
    lengths: np.ndarray,
    anchors: np.ndarray,
    budget: int,
    seed: int,
    cost: CostModel,
    world_size: int = 1,
    anchor_budget: int | None = None,
) -> dict[str, Arm]:
    """The six arms over ``lengths`` (see the module docstring); padfree's plans are given the ``anchors``
    per sample, hold at most ``anchor_budget`` of them a micro-batch (when given) and balance ``world_size``
    ranks by ``cost``; the baselines deal micro-batches to ranks in their order."""
    rng = np.random.default_rng(seed)
    cfg = PlanConfig(budget=budget, world_size=world_size, seed=seed, cost=cost, anchor_budget=anchor_budget)
    out = {}
    for name, strategy in (("padfree_packed", "packed"), ("padfree_bucketed", "bucketed")):
        plan = make_plan(lengths, cfg.with_(strategy=strategy), 0, anchors=anchors)
        out[name] = Arm(name, Batching(plan.indices, plan.offsets, cfg.with_(strategy=strategy).packed), "")
    out["specforge_random"] = Arm(
        "specforge_random", Batching(*fixed_count(lengths, budget, rng), False), "padded"
    )
    srt_fixed = sorted_fixed_count(lengths, budget, np.random.default_rng([seed, 1]))
    out["sorted_fixed"] = Arm("sorted_fixed", Batching(*srt_fixed, False), "padded")
    srt = make_plan(lengths, cfg.with_(strategy="sorted", world_size=1), 0, anchors=anchors)
    out["sorted_budget"] = Arm("sorted_budget", Batching(srt.indices, srt.offsets, False), "padded")
    mp = Batching(*multipack(lengths, budget, rng), True)
    if world_size > 1:  # ranks given rows by tokens, as speculators' distributed multipack does
        m = (mp.n_micro // world_size) * world_size
        lens = lengths[mp.order]
        tokens = micro_shapes(lens, mp.offsets[: m + 1], True).real
        perm = assign_ranks(tokens, world_size, 1)
        order, offsets = kernels.gather_segments(mp.order, mp.offsets[: m + 1], perm)
        mp = Batching(order, offsets, True)
    out["speculators_rows"] = Arm("speculators_rows", mp, "packed", leaky=True)
    return {
        k: Arm(a.name, a.batching, a.layout or ("packed" if a.batching.packed else "padded"), a.leaky)
        for k, a in out.items()
    }


def arm_shapes(arm: Arm, lengths: np.ndarray, anchors: np.ndarray | None, max_anchors: int = 512) -> Shapes:
    """What each of the arm's micro-batches computes (:func:`padfree.core.cost.micro_shapes`), with
    ``anchors`` per sample for DFlash. A row-level arm computes ``max_anchors`` blocks a row whatever its
    documents hold (speculators' fixed anchor tensor), each reading on average half of the document its anchor
    falls in (``sum l^2 / 2 T`` a block for a row of ``T`` tokens).

    >>> b = Batching(np.array([0, 1, 2]), np.array([0, 2, 3]), True)
    >>> sh = arm_shapes(Arm("r", b, "packed", leaky=True), np.array([4, 2, 6]), np.array([3, 1, 5]), 8)
    >>> sh.anchors.tolist(), sh.blocks.tolist(), [round(x, 3) for x in sh.reach.tolist()]
    ([4.0, 5.0], [8.0, 8.0], [13.333, 24.0])
    """
    b = arm.batching
    sh = micro_shapes(lengths[b.order], b.offsets, b.packed, None if anchors is None else anchors[b.order])
    if not arm.leaky or sh.blocks is None:
        return sh
    blocks = np.where(sh.count > 0, float(max_anchors), 0.0)
    reach = blocks * sh.real_attn / np.maximum(2.0 * sh.real, 1.0)
    return replace(sh, blocks=blocks, reach=reach)


def modeled_imbalance(
    arm: Arm,
    lengths: np.ndarray,
    anchors: np.ndarray | None,
    world_size: int,
    cost: CostModel,
    max_anchors: int = 512,
) -> float:
    """Mean over steps of (most loaded rank / mean rank) under the drafter cost model, micro-batches dealt to
    ranks in the arm's order (a trailing partial step left out)."""
    b = arm.batching
    m = (b.n_micro // world_size) * world_size
    if m == 0:
        return 1.0
    offs = b.offsets[: m + 1]
    cut = Arm(arm.name, Batching(b.order[: int(offs[-1])], offs, b.packed), arm.layout, arm.leaky)
    costs = micro_costs(arm_shapes(cut, lengths, anchors, max_anchors), cost)
    return imbalance(rank_costs(costs, world_size, 1))


SHARE_GRID = tuple(round(0.05 * k, 2) for k in range(1, 21))
"""The anchor shares ``--anchor-share auto`` chooses from: 0.05 to 1.0 in steps of 0.05."""


def auto_share(
    lengths: np.ndarray,
    anchors: np.ndarray,
    budget: int,
    world_size: int,
    cost: CostModel,
    seed: int = 0,
    max_anchors: int = 512,
) -> tuple[float, dict[float, float]]:
    """``--anchor-share auto``: the share of :data:`SHARE_GRID` whose anchor budget (``max(max_anchors,
    round(budget x share))``) gives padfree's packed plan of ``lengths`` (``anchors`` per sample, the
    method's recipe rule) the lowest modeled imbalance at ``world_size`` ranks under the method's ``cost``
    (the smaller share on a tie), and the imbalance of every share tried. The data's anchors per token alone
    do not fix it: the bound that evens rows depends on what a block costs beside a token (a DFlash block of
    16 costs about 5 target tokens, DSpark's of 7 about 2.3), which the cost model holds.

    >>> rng = np.random.default_rng(0)
    >>> n = rng.integers(2, 600, 400)
    >>> share, tried = auto_share(n, n // 3, 1024, 2, CostModel(a=1.0, b=0.0, c=0.0, d=3.0))
    >>> share in SHARE_GRID and tried[share] == min(tried.values())
    True
    """
    tried: dict[float, float] = {}
    for share in SHARE_GRID:
        bound = max(max_anchors, round(budget * share))
        cfg = PlanConfig(strategy="packed", budget=budget, world_size=world_size, seed=seed, cost=cost,
                         anchor_budget=bound)  # fmt: skip
        plan = make_plan(lengths, cfg, 0, anchors=anchors)
        arm = Arm("auto", Batching(plan.indices, plan.offsets, True), "packed")
        tried[share] = modeled_imbalance(arm, lengths, anchors, world_size, cost, max_anchors)
    best = min(tried.values())
    return next(s for s in SHARE_GRID if tried[s] == best), tried


def cost_folded_imbalance(
    lengths: np.ndarray, anchors: np.ndarray, budget: int, world_size: int, cost: CostModel, seed: int = 0
) -> tuple[float, int]:
    """What-if, not a padfree feature: ``(modeled imbalance, micro-batches)`` of a packed plan whose items are
    sized by their modeled cost in target-token units (``a l + b l^2 + d anchors + e anchors l / 2``, at least
    ``l``) instead of by ``max(tokens, anchors x budget / anchor_budget)``, so every packed micro-batch holds
    about the same modeled work: what a cost-folded capacity in :mod:`padfree.core.capacity` would give."""
    lf, af = lengths.astype(np.float64), anchors.astype(np.float64)
    work = cost.a * lf + cost.b * lf * lf + cost.d * af + cost.e * af * lf / 2.0
    sizes = np.maximum(lengths, np.ceil(work / max(cost.a, 1e-12))).astype(np.int64)
    if sizes.max() > budget:
        return float("nan"), 0
    plan = make_plan(sizes, PlanConfig(strategy="packed", budget=budget, world_size=world_size, seed=seed), 0)
    arm = Arm("cost_folded", Batching(plan.indices, plan.offsets, True), "packed")
    return modeled_imbalance(arm, lengths, anchors, world_size, cost), int(plan.offsets.shape[0] - 1)


# ----- running the models ----------------------------------------------------------------------------------


def bench_models(method: str, *, vocab: int, hidden: int, layers: int, intermediate: int,
                 recipe: Recipe | None = None, seed: int = 0, counts: np.ndarray | None = None,
                 heads: int | None = None, kv_heads: int | None = None, head_dim: int | None = None,
                 device: str = "cpu", **changes: object) -> DrafterModels:  # fmt: skip
    """The benchmarks' target (random weights; default ``hidden // 32`` heads, half as many key-value heads)
    and a one-layer drafter of its width under ``recipe`` (default: the ``specforge`` preset; ``changes``:
    its fields overridden, e.g. ``block_size=4``), with AdamW (:func:`padfree.drafter.train.build_models`;
    ``counts``: the data's token counts, for a draft vocabulary smaller than ``vocab``), on ``device``."""
    import torch

    from padfree.drafter import recipes
    from padfree.drafter.train import build_models

    recipe = recipes.override(recipe or recipes.get(recipes.DEFAULT, method), **changes)
    heads = heads or max(1, hidden // 32)
    extra: dict[str, Any] = {} if head_dim is None else {"head_dim": head_dim}
    models = build_models(method, vocab=vocab, seed=seed, recipe=recipe, counts=counts,
                          hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                          num_attention_heads=heads, num_key_value_heads=kv_heads or max(1, heads // 2),
                          **extra)  # fmt: skip
    models.target.to(device)
    models.drafter.to(device)
    models.optimizer = torch.optim.AdamW(models.trainable(), lr=1e-4, weight_decay=0.0)
    return models


def collator(method: str, arm: Arm, recipe: Recipe, seed: int):
    """The arm's collator under ``recipe``: per-document anchors (the recipe's rule), or speculators'
    row-level ones (:func:`row_policy`) for a ``leaky`` arm."""
    from padfree.drafter.collate import DrafterCollator

    policy = row_policy(recipe) if arm.leaky and METHODS[method].uses_anchors else None
    return DrafterCollator(method, policy, recipe=recipe, seed=seed, layout=arm.layout, leaky=arm.leaky,
                           mask_token_id=1)  # fmt: skip


def as_trained(batch: DrafterBatch, arm: Arm) -> DrafterBatch:
    """The batch as the arm's trainer computes it: a row-level arm keeps only the positions whose label lies
    in the query's own document and pads its blocks to ``max_anchors`` (speculators' anchor tensor); a padded
    arm pads every row's blocks to the batch's most (SpecForge's). EAGLE-3 batches get no block padding."""
    from padfree.drafter.methods.dflash import model as dflash

    if batch.empty:
        return batch
    if arm.leaky:
        batch = batch.keep_own_document()
    if not isinstance(batch.fields, dflash.Fields):
        return batch
    assert batch.recipe is not None
    if arm.leaky:
        return dflash.pad_anchor_slots(batch, width=batch.recipe.max_anchors)
    return dflash.pad_anchor_slots(batch) if arm.layout == "padded" else batch


def items_of(samples: list[dict], ids: np.ndarray) -> list[dict]:
    return [{**samples[int(i)], "sample_id": int(i)} for i in ids]


def speed(
    method: str,
    arms: dict[str, Arm],
    samples: list[dict],
    models: DrafterModels,
    *,
    micro: int,
    seed: int,
    rounds_warmup: int = 1,
    cost: CostModel | None = None,
    anchors: np.ndarray | None = None,
    attention: str = "dense",
    dtype: str = "float32",
) -> dict[str, dict]:
    """Supervised draft positions per second of each arm over ``micro`` micro-batches of its epoch, trained
    under ``models.recipe``, timed in rounds (every arm one micro-batch per round, so a slow spell of a
    shared machine spreads over the arms). Seconds are this process's CPU seconds (``time.process_time``; run
    torch on one thread, then they are the compute time, whatever else the shared machine runs); wall seconds
    are kept too. On a GPU (the models on it) seconds are wall seconds with the device synchronized before
    and after each micro-batch, the drafter's ``attention`` is usually ``flex``, and ``dtype="bfloat16"``
    trains under bf16 autocast.

    With ``cost`` (the drafter cost model; ``anchors`` per sample for DFlash) the micro-batches are those
    ``padfree bench`` takes (:func:`padfree.bench.sampling.stratified`: one from each of ``micro`` equal
    strata of the epoch ordered by modeled cost per real token), and ``epoch_cpu_seconds`` is the epoch's
    seconds estimated from them (:func:`padfree.bench.sampling.epoch_seconds`): a length-sorted arm's
    micro-batches differ many-fold in cost per position, so a few picks alone misstate its epoch. With
    ``micro`` at least an arm's micro-batch count every one is timed, each its own stratum (the epoch's
    seconds measured, not estimated); an arm of fewer picks than the most repeats them, each pick's seconds
    averaged over its repeats. Without ``cost``, micro-batches evenly spaced over the epoch and no
    estimate."""
    import contextlib

    import torch

    from padfree.drafter.train import train_micro

    recipe = models.recipe
    dev = next(models.drafter.parameters()).device
    gpu = dev.type == "cuda"

    def clock() -> float:
        if gpu:
            torch.cuda.synchronize(dev)
            return time.perf_counter()
        return time.process_time()

    def autocast():
        if dtype == "bfloat16":
            return torch.autocast(dev.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    lengths = np.array([len(s["input_ids"]) for s in samples], np.int64)
    picks: dict[str, np.ndarray] = {}
    strata: dict[str, tuple[np.ndarray, np.ndarray, float]] = {}
    for name, arm in arms.items():
        b = arm.batching
        if cost is None:
            n = b.n_micro
            picks[name] = np.unique(np.linspace(0, n - 1, min(micro, n)).round().astype(int))
        else:
            sh = arm_shapes(arm, lengths, anchors, recipe.max_anchors)
            costs = micro_costs(sh, cost)
            picks[name], stratum = stratified(costs / np.maximum(sh.real, 1.0), micro)
            strata[name] = (stratum, costs, float(sh.real.sum() / max(sh.slots.sum(), 1.0)))
    cols = {name: collator(method, arm, recipe, seed) for name, arm in arms.items()}
    seconds = dict.fromkeys(arms, 0.0)
    wall = dict.fromkeys(arms, 0.0)
    positions = dict.fromkeys(arms, 0)
    slots = dict.fromkeys(arms, 0)
    real = dict.fromkeys(arms, 0)
    per_pick = {name: np.zeros(len(p)) for name, p in picks.items()}
    timed = {name: np.zeros(len(p)) for name, p in picks.items()}  # an arm of fewer picks repeats them
    torch.manual_seed(seed)
    for r in range(-rounds_warmup, max(len(p) for p in picks.values())):
        for name, arm in arms.items():
            i = max(r, 0) % len(picks[name])
            j = int(picks[name][i])
            b = arm.batching
            batch = as_trained(cols[name](items_of(samples, b.order[b.offsets[j] : b.offsets[j + 1]])), arm)
            t0, w0 = clock(), time.perf_counter()
            with autocast():
                got = train_micro(models, batch, attention)
            dt, dw = clock() - t0, time.perf_counter() - w0
            if r >= 0 and batch.contract is not None:
                per_pick[name][i] += dt
                timed[name][i] += 1
                seconds[name] += dt
                wall[name] += dw
                positions[name] += got
                slots[name] += int(batch.contract.input_ids.numel())
                real[name] += int(sum(batch.contract.doc_lengths))
    estimates = {
        name: {
            "epoch_cpu_seconds": epoch_seconds(
                per_pick[name] / np.maximum(timed[name], 1), picks[name], stratum, costs
            ),
            "epoch_padding_efficiency": eff,
        }
        for name, (stratum, costs, eff) in strata.items()
    }
    return {
        name: {
            **estimates.get(name, {}),
            "draft_pos_per_s": positions[name] / seconds[name] if seconds[name] else 0.0,
            "draft_positions": positions[name],
            "cpu_seconds": seconds[name],
            "wall_seconds": wall[name],
            "micro_batches": int(len(picks[name])),
            "slots": slots[name],
            "padding_efficiency": real[name] / max(slots[name], 1),
        }
        for name in arms
    }


def coverage(method: str, arm: Arm, samples: list[dict], recipe: Recipe, *, seed: int,
             check_alone: int = 64) -> dict:  # fmt: skip
    """Over the arm's whole epoch under ``recipe``: the share of supervised tokens (loss mask, not a
    document's first token) that some supervised draft position of the token's own document predicts
    (``anchor_coverage``); ``anchor_slot_efficiency``: DFlash: real anchors over the anchor slots the
    arm's trainer computes (:func:`as_trained`: 1.0 packed, SpecForge's per-batch width padded, speculators'
    ``max_anchors`` a row); EAGLE-3, which has no anchors: the per-position analogue, real (step, position)
    query slots over computed ones (``ttt x`` real tokens over ``ttt x`` slots, the token padding
    efficiency); for up to ``check_alone`` micro-batches, whether every document's covered tokens (and
    DFlash anchors) are the same as when the document is collated alone (``same_as_alone``); and the
    epoch's supervised draft positions (``epoch_draft_positions``, what :func:`speed`'s
    ``epoch_cpu_seconds`` trains)."""
    col = collator(method, arm, recipe, seed)
    alone = collator(method, Arm("alone", arm.batching, "packed"), recipe, seed)
    b = arm.batching
    covered = total = positions = 0
    real_slots = computed_slots = 0
    same = True
    for j in range(b.n_micro):
        ids = b.order[b.offsets[j] : b.offsets[j + 1]]
        if ids.size == 0:
            continue
        collated = col(items_of(samples, ids))
        batch = as_trained(collated, arm)
        assert batch.contract is not None
        if hasattr(batch.fields, "anchors"):
            real_slots += int(collated.fields.anchors.shape[0])
            computed_slots += int(batch.fields.anchors.shape[0])
        else:
            real_slots += int(sum(batch.contract.doc_lengths))
            computed_slots += int(batch.contract.input_ids.numel())
        per_doc = batch.covered()
        positions += batch.positions
        for d, sid in enumerate(ids):
            mask = np.asarray(samples[int(sid)]["loss_mask"], bool)
            total += int(mask[1:].sum())
            covered += len(per_doc[d])
        if j < check_alone:
            for d, sid in enumerate(ids):
                one = alone(items_of(samples, np.array([sid])))
                if one.covered()[0] != per_doc[d] or one.anchors_by_doc()[0] != batch.anchors_by_doc()[d]:
                    same = False
    return {
        "anchor_coverage": covered / max(total, 1),
        "anchor_slot_efficiency": real_slots / max(computed_slots, 1),
        "same_as_alone": same,
        "supervised_tokens": total,
        "epoch_draft_positions": positions,
    }


def epoch_rate(row: dict) -> dict:
    """``row`` (one arm's :func:`speed` and :func:`coverage` results) with ``draft_pos_per_s`` over the whole
    epoch (its draft positions / its estimated CPU seconds) where the estimate exists; the rate over the
    timed micro-batches alone is kept as ``sampled_pos_per_s``."""
    if "epoch_cpu_seconds" not in row or "epoch_draft_positions" not in row:
        return row
    rate = row["epoch_draft_positions"] / row["epoch_cpu_seconds"] if row["epoch_cpu_seconds"] else 0.0
    return {**row, "sampled_pos_per_s": row["draft_pos_per_s"], "draft_pos_per_s": rate}
