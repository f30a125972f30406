"""What padfree changes inside the drafter trainers people run: each trainer's own sampler vs padfree's
adapter (padfree.integrations) on seed_mix-shaped lengths at 8 ranks, DFlash.

vllm speculators: their ``MultipackDistributedBatchSamplerV2`` (run here; rows padded to
``batch_max_length``; their ``select_anchors``: 512 per row) vs ``PadfreeMultipackSampler`` +
``PadfreeCollate`` (rows cut to a few lengths, anchors per document under their recipe, one anchor width).
SpecForge offline: their ``_distributed_sampler_indices`` + a fixed batch size (rows padded to the longest,
``min(512, valid)`` anchors per row, the block tensor as wide as the batch's most) vs ``PlanFeatureLoader``
(a padfree bucketed plan with a token and an anchor budget). Per trainer and side:

- token padding: computed token slots that hold no token;
- anchor slots padded: computed anchor slots (``rows x width``) that hold no anchor;
- anchor coverage per document: the share of a document's supervised tokens that a supervised block slot of
  its own predicts (simulated on a sample of rank 0's rows; a row-level choice lets blocks run into the next
  document, whose labels are not counted);
- modeled 8-rank imbalance: mean over steps of the busiest rank's modeled drafter cost over the mean
  (``padfree.drafter.methods.cost_model``, a 4096-wide 32-layer target);
- draft positions per CPU-second: supervised draft positions inside their own document over process CPU time
  of forward + backward through their own tiny DFlash model (CPU, float32, one thread) on rank 0's first
  micro-batches, at 1/8 scale (lengths, budgets, anchor caps).

seed_mix has lengths only: every token but each sample's first carries loss (padfree's drafter rule for
lengths without a loss-mask file). Needs the peers (``make setup-dev``).

    PYTHONPATH=src python benchmarks/integration_gain.py --out benchmarks/results [--quick]
    PYTHONPATH=src python benchmarks/integration_gain.py --lengths yours.npy --quick --out gain  # your data
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import numpy as np
import torch

import lab  # noqa: F401  (puts tests/ on sys.path, where support is)
from padfree.core import cost as costs
from padfree.core.anchors import choose_anchors
from padfree.core.config import PlanConfig
from padfree.core.planner import make_plan
from padfree.data.length_files import bundled_seed_mix
from padfree.drafter import recipes
from padfree.drafter.methods import cost_model
from padfree.integrations import feed
from padfree.integrations import speculators as sp
from padfree.integrations._common import doc_anchors
from support.peers import import_peer

WORLD, THEIR_ANCHORS = 8, 512
_THEIRS: dict = {}  # their multipack rows per (lengths, budget, seed): planned once, every rank


def masks_of(lengths: np.ndarray) -> list[np.ndarray]:
    out = []
    for n in lengths:
        m = np.ones(int(n), bool)
        m[0] = False
        out.append(m)
    return out


def anchor_width(lengths: np.ndarray, budget: int, cap: int) -> int:
    """The anchor width a full row needs on this data: 1.25 x the budget's share of anchors (speculators'
    recipe, ``cap`` per document), rounded up to 512 (to 64 below a 4096-token budget)."""
    rec = recipes.override(recipes.get("speculators", "dflash"), max_anchors=cap)
    share = float(sp.count_anchors(masks_of(lengths), rec).sum()) / float(lengths.sum())
    step = 512 if budget >= 4096 else 64
    return int(min(budget, -(-(1.25 * share * budget) // step) * step))


def imbalance(
    rows_by_rank: list[list[np.ndarray]], lengths: np.ndarray, anchors_of, model, packed=True
) -> float:
    """Mean over steps of max/mean modeled cost across ranks: a packed row's real tokens and anchors, a padded
    batch's ``count x longest`` slots and ``count x most`` blocks."""
    steps = min(len(r) for r in rows_by_rank)
    order, offsets, anchors = [], [0], []
    for s in range(steps):
        for r in range(WORLD):
            row = rows_by_rank[r][s]
            order.append(row)
            anchors.append(anchors_of(row))
            offsets.append(offsets[-1] + len(row))
    idx = np.concatenate(order)
    shapes = costs.micro_shapes(lengths[idx], np.asarray(offsets), packed, np.concatenate(anchors))
    return costs.imbalance(costs.rank_costs(costs.micro_costs(shapes, model), WORLD, 1))


def coverage(rows: list[np.ndarray], lengths: np.ndarray, pick, block: int) -> float:
    """Mean over the rows' documents of (supervised tokens a same-document block slot predicts /
    supervised)."""
    shares = []
    for row in rows:
        lens = lengths[row]
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        doc = np.repeat(np.arange(len(row)), lens)
        mask = np.ones(int(lens.sum()), bool)
        mask[starts] = False
        a = pick(row, lens, starts, mask)
        labels = (a[:, None] + np.arange(1, block)[None]).reshape(-1)
        owner = np.repeat(doc[a], block - 1)
        ok = labels < doc.shape[0]
        labels, owner = labels[ok], owner[ok]
        ok = (doc[labels] == owner) & mask[labels]
        covered = np.bincount(doc[np.unique(labels[ok])], minlength=len(row))
        shares.extend((covered / np.maximum(lens - 1, 1)).tolist())
    return float(np.mean(shares))


# --- speculators --------------------------------------------------------------------------------------------


def speculators_arms(
    lengths: np.ndarray, budget: int, width: int, seed: int, sample_rows: int, cap: int = THEIR_ANCHORS
) -> dict:
    """Both samplers at 8 ranks; ``cap``: their anchors per row and the recipe's per document."""
    mp = import_peer("speculators", "train.distributed_batch_sampler")
    rec = recipes.override(recipes.get("speculators", "dflash"), max_anchors=cap)
    model = cost_model("dflash", block_size=rec.block_size)
    anchors = sp.count_anchors(masks_of(lengths), rec)
    shapes = feed.ShapeSet.spread(budget, 8 if width > cap else 16, anchors=width)
    t0 = time.perf_counter()
    key = (lengths.shape[0], int(lengths.sum()), budget, seed)
    if key not in _THEIRS:
        theirs = [
            mp.MultipackDistributedBatchSamplerV2(budget, lengths, WORLD, r, seed=seed) for r in range(WORLD)
        ]
        _THEIRS[key] = ([list(s._generate_batches(0)) for s in theirs], time.perf_counter() - t0)
    their_rows, their_s = _THEIRS[key]
    t0 = time.perf_counter()
    config = PlanConfig(strategy="packed", anchor_budget=width, cost=model)
    ours = sp.PadfreeMultipackSampler(
        budget, lengths, WORLD, 0, seed=seed, config=config, anchors=anchors, recipe=rec
    )
    ours._generate_batches(0)
    plan = ours.last_plan
    assert plan is not None
    our_rows = [[plan.micro(int(k)) for k in plan.micro_ids(r)] for r in range(WORLD)]
    our_s = time.perf_counter() - t0

    def their_valid(row: np.ndarray) -> int:  # their rule: loss_mask over the row, the row's last block out
        n = int(lengths[row].sum())
        return int((lengths[row] - 1).sum() - max(0, n - (budget - rec.block_size)))

    def their_anchor_counts(row: np.ndarray) -> np.ndarray:
        a = (lengths[row] - 1).astype(np.float64)
        return a * min(1.0, cap / max(1.0, a.sum()))

    rng = np.random.default_rng(seed)

    def their_pick(row, lens, starts, mask):
        valid = np.flatnonzero(mask[: max(0, budget - rec.block_size)])
        return np.sort(rng.choice(valid, min(cap, valid.shape[0]), replace=False))

    policy = rec.anchor_policy(partial=False)

    def our_pick(row, lens, starts, mask):
        return doc_anchors(mask, starts, lens, row, policy=policy, seed=seed, epoch=0)

    all_theirs = [r for rank in their_rows for r in rank]
    all_ours = [r for rank in our_rows for r in rank]
    tokens = float(lengths.sum())
    their_slots = len(all_theirs) * budget
    our_slots = float(sum(shapes.width(int(lengths[r].sum())) for r in all_ours))
    their_real_anchors = float(sum(min(cap, their_valid(r)) for r in all_theirs))
    return {
        "budget": budget,
        "anchor_width": {"theirs": cap, "padfree": width},
        "rows": {"theirs": len(all_theirs), "padfree": len(all_ours)},
        "samples_trained": {
            "theirs": int(sum(len(r) for r in all_theirs)),
            "padfree": int(sum(len(r) for r in all_ours)),
        },
        "token_padding": {"theirs": 1 - tokens / their_slots, "padfree": 1 - tokens / our_slots},
        "anchor_slots_padded": {
            "theirs": 1 - their_real_anchors / (len(all_theirs) * cap),
            "padfree": 1 - float(anchors.sum()) / (len(all_ours) * width),
        },
        "anchor_coverage": {
            "theirs": coverage(their_rows[0][:sample_rows], lengths, their_pick, rec.block_size),
            "padfree": coverage(our_rows[0][:sample_rows], lengths, our_pick, rec.block_size),
        },
        "imbalance": {
            "theirs": imbalance(their_rows, lengths, their_anchor_counts, model),
            "padfree": imbalance(our_rows, lengths, lambda row: anchors[row], model),
        },
        "plan_seconds": {"theirs": their_s, "padfree": our_s},
        "_rows": (their_rows[0], our_rows[0]),
    }


def same_document_slots(anchors: np.ndarray, doc: np.ndarray, mask: np.ndarray, block: int) -> int:
    """Block slots ``k >= 1`` whose label lies in the anchor's own document and carries loss: the draft
    positions that train that document (a label from the next document is not one)."""
    labels = (anchors[:, None] + np.arange(1, block)[None]).reshape(-1)
    owner = np.repeat(doc[anchors], block - 1)
    ok = labels < doc.shape[0]
    labels, owner = labels[ok], owner[ok]
    return int(((doc[labels] == owner) & (owner >= 0) & mask[labels].astype(bool)).sum())


def speculators_speed(
    lengths: np.ndarray, rows: tuple, budget: int, width: int, cap: int, seed: int, timed: int
) -> dict:
    """Draft positions per CPU-second through their DFlashDraftModel on rank 0's first micro-batches: forward
    and backward, positions counted inside each block's own document."""
    from padfree.drafter.target import build_target
    from support import drafters

    utils = import_peer("speculators", "models.dflash.utils")
    rec = recipes.override(recipes.get("speculators", "dflash"), max_anchors=cap)
    block, vocab = rec.block_size, 2048
    target = build_target(vocab_size=vocab)
    model = drafters.speculators_dflash(target, (1, 3), block_size=block, mask_token_id=vocab - 1)
    shapes = feed.ShapeSet.spread(budget, 8 if width > cap else 16, anchors=width)
    policy = rec.anchor_policy(partial=False)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for arm, arm_rows in zip(("theirs", "padfree"), rows, strict=True):
        slots = cap if arm == "theirs" else width
        kwargs = feed.trainer_kwargs(model, rec, loss_implementation="eager", max_anchors=slots)
        positions, seconds = 0.0, 0.0
        for row in arm_rows[:timed]:
            lens = lengths[row]
            n = int(lens.sum())
            w = budget if arm == "theirs" else shapes.width(n)
            starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
            mask = np.zeros(w, np.int64)
            mask[:n] = 1
            mask[starts] = 0
            doc = np.full(w, -1)
            doc[:n] = np.repeat(np.arange(len(row)), lens)
            pos = np.zeros(w, np.int64)
            pos[:n] = np.arange(n) - np.repeat(starts, lens)
            inputs = {
                "hidden_states": torch.randn(1, w, 128, generator=g),
                "input_ids": torch.randint(2, vocab - 1, (1, w), generator=g),
                "loss_mask": torch.from_numpy(mask)[None],
                "verifier_last_hidden_states": torch.randn(1, w, 64, generator=g),
                "document_ids": torch.from_numpy(doc)[None],
                "position_ids": torch.from_numpy(pos)[None],
            }
            if arm == "theirs":  # the anchors their forward draws (its first random draw), to count them
                torch.manual_seed(seed)
                a, valid = utils.select_anchors(inputs["loss_mask"], slots, block)
                a = a[valid].numpy()
                choice = None
            else:
                a = doc_anchors(mask[:n].astype(bool), starts, lens, row, policy=policy, seed=seed, epoch=0)
                choice = feed.AnchorChoice(torch.from_numpy(a), block, width)
            torch.manual_seed(seed)
            t0 = time.process_time()
            with feed.anchors_patched(choice) if choice is not None else contextlib.nullcontext():
                _, loss, _ = model(**inputs, **kwargs)
            model.zero_grad()
            loss.backward()
            seconds += time.process_time() - t0
            positions += same_document_slots(a, doc, mask, block)
        out[arm] = {
            "draft_positions": positions,
            "cpu_seconds": seconds,
            "per_cpu_second": positions / seconds,
        }
    return out


# --- SpecForge ----------------------------------------------------------------------------------------------


def specforge_arms(
    lengths: np.ndarray, budget: int, seed: int, sample_rows: int, cap: int = THEIR_ANCHORS
) -> dict:
    """Both loaders at 8 ranks; ``cap``: anchors per sample (their ``num_anchors``, the recipe's cap). Rows
    are padded to their longest sample and the block tensor to the batch's most anchors, both sides."""
    from padfree.baselines import samples_per_batch
    from padfree.integrations.specforge import index_from_masks

    launch = import_peer("specforge", "launch")
    rec = recipes.override(recipes.get("specforge", "dflash"), max_anchors=cap)
    model = cost_model("dflash", block_size=rec.block_size)
    count = samples_per_batch(lengths, budget)
    anchors = index_from_masks(masks_of(lengths), max_len=int(lengths.max()), recipe=rec).anchors
    their_rows = []
    for r in range(WORLD):
        idx = np.asarray(
            launch._distributed_sampler_indices(len(lengths), dp_rank=r, dp_size=WORLD, seed=seed, epoch=0)
        )
        their_rows.append([idx[i : i + count] for i in range(0, len(idx) - count + 1, count)])
    anchor_budget = budget // 2  # the block tensor ([rows, most]) bounded too, so micro-batches cost alike
    config = PlanConfig(
        strategy="bucketed",
        budget=budget,
        anchor_budget=anchor_budget,
        world_size=WORLD,
        seed=seed,
        cost=model,
    )
    plan = make_plan(lengths, config, 0, anchors=anchors)
    our_rows = [[plan.micro(int(k)) for k in plan.micro_ids(r)] for r in range(WORLD)]

    def padded(rows):
        slots = real = aslots = areal = 0.0
        for row in rows:
            slots += len(row) * float(lengths[row].max())
            real += float(lengths[row].sum())
            aslots += len(row) * max(1.0, float(anchors[row].max()))
            areal += float(anchors[row].sum())
        return 1 - real / slots, 1 - areal / aslots

    all_theirs = [r for rank in their_rows for r in rank]
    all_ours = [r for rank in our_rows for r in rank]
    (tp_t, ap_t), (tp_o, ap_o) = padded(all_theirs), padded(all_ours)
    policy = rec.anchor_policy()
    rng = np.random.default_rng(seed)

    def pick(their: bool):
        def f(row, lens, starts, mask):
            out = []
            for d, (s, n) in enumerate(zip(starts, lens, strict=True)):
                m = mask[s : s + n]
                if their:  # their sampler: uniform without replacement, min(cap, valid) per row (one sample)
                    valid = np.flatnonzero(m[:-1] & m[1:])
                    a = rng.choice(valid, min(cap, valid.shape[0]), replace=False)
                else:
                    a = choose_anchors(m, policy, seed=seed, epoch=0, sample_id=int(row[d]))
                out.append(np.sort(a) + s)
            return np.concatenate(out)

        return f

    return {
        "budget": budget,
        "batch_size_theirs": count,
        "anchor_budget_padfree": anchor_budget,
        "rows": {"theirs": len(all_theirs), "padfree": len(all_ours)},
        "samples_trained": {
            "theirs": int(sum(len(r) for r in all_theirs)),
            "padfree": int(sum(len(r) for r in all_ours)),
        },
        "token_padding": {"theirs": tp_t, "padfree": tp_o},
        "anchor_slots_padded": {"theirs": ap_t, "padfree": ap_o},
        "anchor_coverage": {
            "theirs": coverage(their_rows[0][:sample_rows], lengths, pick(True), rec.block_size),
            "padfree": coverage(our_rows[0][:sample_rows], lengths, pick(False), rec.block_size),
        },
        "imbalance": {
            "theirs": imbalance(their_rows, lengths, lambda row: anchors[row], model, packed=False),
            "padfree": imbalance(our_rows, lengths, lambda row: anchors[row], model, packed=False),
        },
        "_rows": (their_rows[0], our_rows[0]),
    }


def specforge_speed(lengths: np.ndarray, rows: tuple, cap: int, seed: int, timed: int) -> dict:
    """Draft positions per CPU-second through their OnlineDFlashModel (SDPA masks) on padded rows (each padded
    to its longest sample, anchors to the most): theirs with its own anchors, padfree's with the loader's."""
    from padfree.drafter.target import build_target
    from support import drafters

    rec = recipes.override(recipes.get("specforge", "dflash"), max_anchors=cap)
    block, vocab = rec.block_size, 2048
    target = build_target(vocab_size=vocab)
    model = drafters.specforge_dflash(
        target, (1, 3), block_size=block, mask_token_id=vocab - 1, num_anchors=cap
    )
    policy = rec.anchor_policy()
    g = torch.Generator().manual_seed(seed)
    out = {}
    for arm, arm_rows in zip(("theirs", "padfree"), rows, strict=True):
        positions, seconds = 0.0, 0.0
        for row in arm_rows[:timed]:
            lens = lengths[row]
            w = int(lens.max())
            mask = np.zeros((len(row), w), np.int64)
            for r, n in enumerate(lens):
                mask[r, 1:n] = 1
            model.__dict__.pop("_sample_anchor_positions", None)
            if arm == "padfree":  # what padfree.integrations.specforge.install puts in place
                a = [
                    choose_anchors(
                        mask[r, : lens[r]].astype(bool), policy, seed=seed, epoch=0, sample_id=int(i)
                    )
                    for r, i in enumerate(row)
                ]
                width = max(1, max(len(x) for x in a))
                anchors = torch.zeros((len(row), width), dtype=torch.long)
                valid = torch.zeros((len(row), width), dtype=torch.bool)
                for r, x in enumerate(a):
                    anchors[r, : len(x)], valid[r, : len(x)] = torch.from_numpy(x), True
                model._sample_anchor_positions = lambda *_a, an=anchors, va=valid: (an, va)
            torch.manual_seed(seed)
            t0 = time.process_time()
            loss, _, metrics = model(
                input_ids=torch.randint(2, vocab - 1, (len(row), w), generator=g),
                hidden_states=torch.randn(len(row), w, 128, generator=g),
                loss_mask=torch.from_numpy(mask),
            )
            model.zero_grad()
            loss.backward()
            seconds += time.process_time() - t0
            positions += float(metrics["accuracy_denom"])  # one sample per row: every label is its own
        out[arm] = {
            "draft_positions": positions,
            "cpu_seconds": seconds,
            "per_cpu_second": positions / seconds,
        }
    model.__dict__.pop("_sample_anchor_positions", None)
    return out


def table(res: dict) -> list[str]:
    lines = ["| trainer | metric | theirs | padfree |", "|---|---|---:|---:|"]
    names = {
        "speculators": f"speculators (padfree width {res['speculators']['anchor_width']['padfree']})",
        "speculators_same_width": "speculators (padfree width 512, theirs)",
        "specforge": "SpecForge offline",
    }
    for key, name in names.items():
        r = res[key]
        for field, title, fmt in (
            ("token_padding", "token padding", "{:.3f}"),
            ("anchor_slots_padded", "anchor slots padded", "{:.3f}"),
            ("anchor_coverage", "anchor coverage per document", "{:.3f}"),
            ("imbalance", "modeled 8-rank imbalance", "{:.3f}"),
            ("rows", "micro-batches (8 ranks, one epoch)", "{:,}"),
        ):
            lines.append(
                f"| {name} | {title} | {fmt.format(r[field]['theirs'])} | {fmt.format(r[field]['padfree'])} |"
            )
        s = r["speed"]
        lines.append(
            f"| {name} | draft positions per CPU-second (their model, 1/8 scale) | "
            f"{s['theirs']['per_cpu_second']:,.0f} | {s['padfree']['per_cpu_second']:,.0f} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, help="folder for integration_gain.json and .md")
    ap.add_argument("--quick", action="store_true", help="20K samples, fewer timed micro-batches (~2 min)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--lengths",
        default=None,
        help="your data's token counts (.npy, `padfree lengths` writes it) instead of the bundled seed_mix",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    n, sample_rows, timed = (20_000, 60, 3) if args.quick else (200_000, 300, 8)
    if args.lengths is not None:
        from padfree.data.length_files import read_lengths

        # both trainers cut a sample at their max length (speculators' batch_max_length 8192 here)
        all_lengths = np.minimum(read_lengths(args.lengths).astype(np.int64), 8192)
    else:
        all_lengths = bundled_seed_mix().astype(np.int64)
    n = min(n, int(all_lengths.shape[0]))
    lengths = all_lengths[np.random.default_rng(args.seed).permutation(all_lengths.shape[0])[:n]]
    small = np.maximum(2, lengths // 8)  # the speed runs: 1/8 of the lengths, budgets and anchor caps
    t0 = time.perf_counter()
    source = args.lengths or "seed_mix (bundled)"
    res: dict = {"samples": n, "source": f"{source}, a seeded random subset", "seed": args.seed}
    width, width_small = anchor_width(lengths, 8192, THEIR_ANCHORS), anchor_width(small, 1024, 64)
    spec = speculators_arms(lengths, 8192, width, args.seed, sample_rows)
    rows_small = speculators_arms(small, 1024, width_small, args.seed, 1, cap=64)["_rows"]
    spec["speed"] = speculators_speed(small, rows_small, 1024, width_small, 64, args.seed, timed)
    same = speculators_arms(lengths, 8192, THEIR_ANCHORS, args.seed, sample_rows)
    rows_small = speculators_arms(small, 1024, 64, args.seed, 1, cap=64)["_rows"]
    same["speed"] = speculators_speed(small, rows_small, 1024, 64, 64, args.seed, timed)
    forge = specforge_arms(lengths, 16384, args.seed, sample_rows)
    rows_small = specforge_arms(small, 1024, args.seed, 1, cap=64)["_rows"]
    forge["speed"] = specforge_speed(small, rows_small, 64, args.seed, timed)
    for r in (spec, same, forge):
        r.pop("_rows")
    res["speculators"], res["speculators_same_width"], res["specforge"] = spec, same, forge
    res["seconds"] = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "integration_gain.json").write_text(json.dumps(res, indent=2) + "\n")
    lines = [
        "# padfree inside speculators and SpecForge: their sampler vs padfree's adapter (DFlash, 8 ranks)",
        "",
        (
            f"seed_mix-shaped lengths ({n:,} of the bundled seed_mix's samples"
            if args.lengths is None
            else f"{args.lengths} ({n:,} samples, each cut at 8192 tokens"
        )
        + ", every token but the first "
        "supervised). speculators at batch_max_length 8192: theirs 512 anchor slots per row; padfree anchor "
        f"width {width} (1.25 x a full row's share of the recipe's anchors, rounded to 512) or 512, rows cut "
        "to 8 lengths (16 at width 512). SpecForge at 16384 tokens per micro-batch "
        f"({forge['batch_size_theirs']} samples per batch theirs, padded to the longest); padfree bucketed, "
        f"anchor budget {forge['anchor_budget_padfree']}. Speed: their own tiny model on CPU at 1/8 scale "
        "(lengths, budgets and anchor caps / 8; SpecForge 1024 tokens per micro-batch). "
        f"`python benchmarks/integration_gain.py --out DIR{' --quick' if args.quick else ''}`, "
        f"{res['seconds']:.0f} s.",
        "",
        *table(res),
    ]
    (out / "integration_gain.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
