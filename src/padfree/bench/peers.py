"""Peer samplers and packers behind one three-phase adapter, so their planning time and padding can be
measured exactly like padfree's.

Each :class:`Peer` has ``prepare`` (build the peer's input from the lengths: not timed), ``run`` (the
peer's own planning work for one epoch: timed) and ``finish`` (turn the peer's output into a
:class:`~padfree.bench.measure.Batching`: not timed). Peers:

- ``hf_group_by_length``: ``transformers.trainer_pt_utils.LengthGroupedSampler`` (what
  ``train_sampling_strategy="group_by_length"`` uses) gives a sample order; the order is cut into padded
  micro-batches under the budget with :func:`padfree.core.batching.cut`.
- ``hf_flattening``: a shuffled fixed-count batch sampler (the Trainer default) whose batches
  ``transformers.DataCollatorWithFlattening`` concatenates into one row: measured as bins of the budget.
- ``trl_bfd``: ``trl.data_utils.pack_dataset(..., strategy="bfd")``, best-fit-decreasing packing.
- ``lhotse_dynamic_bucketing``: ``lhotse.dataset.DynamicBucketingSampler`` with a
  ``TokenConstraint(max_tokens=budget)`` (count x longest <= budget) over light items with ``num_tokens``.
- ``hf_batch_rebalance``: ``transformers.trainer_pt_utils.BatchRebalanceSampler`` (what
  ``train_sampling_strategy="batch_rebalance"`` uses): a fixed number of samples per optimizer step, sorted
  and split into ``world x grad_accum`` padded micro-batches balanced by its fixed cost
  ``bs*L + 0.001*bs*L^2``; every rank computes every rank's split and yields its own. Its micro-batches
  come out step after step, rank after rank, slot after slot: the layout of padfree's plans.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from padfree.bench.measure import Batching

PEER_NAMES = (
    "hf_group_by_length",
    "hf_flattening",
    "trl_bfd",
    "lhotse_dynamic_bucketing",
    "hf_batch_rebalance",
)


@dataclass(frozen=True)
class Peer:
    """A peer's adapter: ``prepare(lengths, budget, seed, **settings) -> state``, ``run(state) -> raw``,
    ``finish(state, raw) -> Batching``; ``needs`` lists the importable modules it needs."""

    name: str
    needs: tuple[str, ...]
    prepare: Callable[..., Any]
    run: Callable[[Any], Any]
    finish: Callable[[Any, Any], Batching]
    settings: dict = field(default_factory=dict)
    describe: str = ""


def missing(peer: Peer) -> str | None:
    """Why a peer cannot run here (a missing module), or None."""
    for mod in peer.needs:
        if importlib.util.find_spec(mod) is None:
            return f"python module {mod!r} is not installed (pip install 'padfree[bench]')"
    return None


def per_device_batch(lengths: np.ndarray, budget: int) -> int:
    """A fixed per-device sample count for fixed-count samplers: ``budget // mean length`` (at least 1)."""
    return max(1, int(budget // float(np.mean(lengths))))


# ---- hf_group_by_length ---------------------------------------------------------------------------------


def _hf_group_prepare(lengths: np.ndarray, budget: int, seed: int, grad_accum: int = 4) -> dict:
    import torch

    bs = per_device_batch(lengths, budget) * grad_accum  # what the Trainer passes: batch x grad accum
    g = torch.Generator().manual_seed(seed)
    return {"lengths": lengths, "list": lengths.tolist(), "batch_size": bs, "generator": g, "budget": budget}


def _hf_group_run(st: dict) -> np.ndarray:
    from transformers.trainer_pt_utils import LengthGroupedSampler

    sampler = LengthGroupedSampler(st["batch_size"], lengths=st["list"], generator=st["generator"])
    return np.fromiter(iter(sampler), dtype=np.int64, count=len(st["list"]))


def _hf_group_finish(st: dict, order: np.ndarray) -> Batching:
    from padfree.core.batching import cut

    offsets = cut(st["lengths"][order].astype(np.int64), st["budget"])
    note = (
        f"sample order from LengthGroupedSampler(batch_size={st['batch_size']}), cut into padded "
        "micro-batches under the budget with padfree.core.batching.cut"
    )
    return Batching(order, offsets, packed=False, note=note)


# ---- hf_flattening --------------------------------------------------------------------------------------


def _hf_flat_prepare(lengths: np.ndarray, budget: int, seed: int) -> dict:
    import torch

    return {
        "n": lengths.shape[0],
        "batch_size": per_device_batch(lengths, budget),
        "generator": torch.Generator().manual_seed(seed),
    }


def _hf_flat_run(st: dict) -> list[list[int]]:
    from torch.utils.data import BatchSampler, RandomSampler

    sampler = RandomSampler(range(st["n"]), generator=st["generator"])
    return list(BatchSampler(sampler, st["batch_size"], drop_last=False))


def _hf_flat_finish(st: dict, batches: list[list[int]]) -> Batching:
    order = np.fromiter((i for b in batches for i in b), dtype=np.int64, count=st["n"])
    offsets = np.concatenate(([0], np.cumsum([len(b) for b in batches]))).astype(np.int64)
    note = (
        f"shuffled batches of {st['batch_size']} samples (RandomSampler + BatchSampler); "
        "DataCollatorWithFlattening concatenates each into one row: measured as a bin of the budget "
        "(a batch over the budget counts its own size)"
    )
    return Batching(order, offsets, packed=True, note=note)


# ---- trl_bfd --------------------------------------------------------------------------------------------


def _trl_prepare(lengths: np.ndarray, budget: int, seed: int, map_batch_size: int | None = 1000) -> dict:
    import datasets
    import pyarrow as pa

    datasets.disable_progress_bars()
    off = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
    # input_ids as list<null>: the real list structure TRL packs, without the token payload in memory
    col = pa.LargeListArray.from_arrays(pa.array(off), pa.nulls(int(off[-1])))
    ds = datasets.Dataset(pa.table({"input_ids": col}))
    kwargs = {} if map_batch_size == 1000 else {"batch_size": map_batch_size}
    return {"lengths": lengths, "dataset": ds, "map_kwargs": kwargs, "budget": budget}


def _trl_run(st: dict):
    from trl.data_utils import pack_dataset

    packed = pack_dataset(st["dataset"], st["budget"], strategy="bfd", map_kwargs=dict(st["map_kwargs"]))
    return packed.data.column("seq_lengths").combine_chunks()


def _trl_finish(st: dict, seq_lengths) -> Batching:
    counts = np.diff(seq_lengths.offsets.to_numpy()).astype(np.int64)
    out_len = seq_lengths.values.to_numpy().astype(np.int64)
    lengths = st["lengths"]
    # TRL returns lengths per bin, not sample ids: give each output entry a sample of the same length
    # (equal-length samples are interchangeable for every measure used here)
    by_len_in = np.argsort(lengths, kind="stable")
    by_len_out = np.argsort(out_len, kind="stable")
    if out_len.shape[0] != lengths.shape[0] or not np.array_equal(lengths[by_len_in], out_len[by_len_out]):
        raise RuntimeError("trl pack_dataset did not return every sample exactly once")
    order = np.empty_like(by_len_out)
    order[by_len_out] = by_len_in
    offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    mb = st["map_kwargs"].get("batch_size", 1000)
    note = (
        f"pack_dataset(strategy='bfd', seq_length=budget), map batches of {mb or 'the whole dataset'}; "
        "bins give lengths, mapped back to sample ids by length"
    )
    return Batching(order, offsets, packed=True, note=note)


# ---- lhotse_dynamic_bucketing ---------------------------------------------------------------------------


class _Example:
    """The least a lhotse sampler needs of an example under a TokenConstraint."""

    __slots__ = ("id", "num_tokens", "dataloading_info")

    def __init__(self, i: int, n: int) -> None:
        self.id = i
        self.num_tokens = n


def _lhotse_prepare(
    lengths: np.ndarray, budget: int, seed: int, num_buckets: int = 30, buffer_size: int = 60000
) -> dict:
    items = [_Example(i, n) for i, n in enumerate(lengths.tolist())]
    return {"items": items, "budget": budget, "seed": seed, "num_buckets": num_buckets, "buffer": buffer_size}


def _lhotse_run(st: dict) -> list[list[int]]:
    import warnings

    from lhotse.dataset.sampling.base import TokenConstraint
    from lhotse.dataset.sampling.dynamic_bucketing import DynamicBucketingSampler

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sampler = DynamicBucketingSampler(
            st["items"],
            constraint=TokenConstraint(max_tokens=st["budget"]),
            num_buckets=st["num_buckets"],
            buffer_size=st["buffer"],
            shuffle=True,
            world_size=1,
            rank=0,
            seed=st["seed"],
        )
        return [[c.id for c in batch] for batch in sampler]


def _lhotse_finish(st: dict, batches: list[list[int]]) -> Batching:
    n = sum(len(b) for b in batches)
    order = np.fromiter((i for b in batches for i in b), dtype=np.int64, count=n)
    offsets = np.concatenate(([0], np.cumsum([len(b) for b in batches]))).astype(np.int64)
    note = (
        f"DynamicBucketingSampler(TokenConstraint(max_tokens=budget), num_buckets={st['num_buckets']}, "
        f"buffer_size={st['buffer']}, shuffle=True), one process yielding the whole epoch"
    )
    return Batching(order, offsets, packed=False, note=note)


# ---- hf_batch_rebalance ---------------------------------------------------------------------------------


def _hf_rebalance_prepare(
    lengths: np.ndarray, budget: int, seed: int, world_size: int = 8, grad_accum: int = 4
) -> dict:
    # the Trainer passes effective_batch_size = per-device batch x grad accum x world, drop_last=False
    ebs = per_device_batch(lengths, budget) * grad_accum * world_size
    return {"list": lengths.tolist(), "ebs": ebs, "world": world_size, "accum": grad_accum, "seed": seed}


def _hf_rebalance_run(st: dict) -> list:
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    class Recording(BatchRebalanceSampler):
        """The sampler unchanged, keeping the every-rank split that each rank computes anyway."""

        splits: list

        def _assign(self, indices, lengths):
            out = super()._assign(indices, lengths)
            self.splits.append(out)
            return out

    sampler = Recording(
        lengths=st["list"],
        effective_batch_size=st["ebs"],
        dp_size=st["world"],
        grad_accum=st["accum"],
        seed=st["seed"],
        rank=0,
        drop_last=False,
    )
    sampler.splits = []
    for _ in sampler:  # rank 0's epoch: the planning work one rank does
        pass
    return sampler.splits


def _hf_rebalance_finish(st: dict, splits: list) -> Batching:
    micro = [mb for step in splits for rank in step for mb in rank]
    order = np.fromiter((i for mb in micro for i in mb), dtype=np.int64, count=sum(len(m) for m in micro))
    offsets = np.concatenate(([0], np.cumsum([len(m) for m in micro]))).astype(np.int64)
    note = (
        f"BatchRebalanceSampler(effective_batch_size={st['ebs']}, dp_size={st['world']}, "
        f"grad_accum={st['accum']}, drop_last=False): {st['ebs']} samples per step split into padded "
        "micro-batches by its fixed cost; every rank's split of rank 0's epoch, step by step"
    )
    return Batching(order, offsets, packed=False, note=note)


PEERS: dict[str, Peer] = {
    "hf_group_by_length": Peer(
        "hf_group_by_length",
        ("transformers", "torch"),
        _hf_group_prepare,
        _hf_group_run,
        _hf_group_finish,
        {"grad_accum": 4},
        "transformers LengthGroupedSampler (megabatches sorted by length), cut under the padded budget",
    ),
    "hf_flattening": Peer(
        "hf_flattening",
        ("transformers", "torch"),
        _hf_flat_prepare,
        _hf_flat_run,
        _hf_flat_finish,
        {},
        "random fixed-count batches flattened by DataCollatorWithFlattening",
    ),
    "trl_bfd": Peer(
        "trl_bfd",
        ("trl", "datasets", "pyarrow"),
        _trl_prepare,
        _trl_run,
        _trl_finish,
        {"map_batch_size": 1000},
        "trl.data_utils.pack_dataset(strategy='bfd')",
    ),
    "lhotse_dynamic_bucketing": Peer(
        "lhotse_dynamic_bucketing",
        ("lhotse",),
        _lhotse_prepare,
        _lhotse_run,
        _lhotse_finish,
        {"num_buckets": 30, "buffer_size": 60000},
        "lhotse DynamicBucketingSampler with a TokenConstraint",
    ),
    "hf_batch_rebalance": Peer(
        "hf_batch_rebalance",
        ("transformers", "torch"),
        _hf_rebalance_prepare,
        _hf_rebalance_run,
        _hf_rebalance_finish,
        {"world_size": 8, "grad_accum": 4},
        "transformers BatchRebalanceSampler (a fixed sample count per step, split into world x accum "
        "padded micro-batches by a fixed cost)",
    ),
}


def plan_with_peer(name: str, lengths: np.ndarray, budget: int, seed: int = 0, **settings: Any) -> Batching:
    """One epoch of micro-batches from a peer (all three phases).

    >>> import numpy as np
    >>> b = plan_with_peer("hf_flattening", np.array([3, 5, 2, 7, 4]), budget=8)
    >>> sorted(b.order.tolist())
    [0, 1, 2, 3, 4]
    """
    peer = PEERS[name]
    why = missing(peer)
    if why:
        raise RuntimeError(f"{name}: {why}")
    st = peer.prepare(
        np.asarray(lengths, dtype=np.int64), int(budget), int(seed), **(peer.settings | settings)
    )
    return peer.finish(st, peer.run(st))
