"""Per-micro-batch SP/CP degree (verl's dynamic CP): short micro-batches run unsharded, one per GPU of the
group, long ones over the whole group, in a schedule of phases that keeps every GPU busy and every
collective aligned. A benchmark-only plan (``benchmarks/sp_cp_degree.py`` measures its modeled gain): no
sampler or trainer runs it, so it stays out of ``padfree.core`` until one does.

A plan with ``sp`` / ``cp`` > 1 gives each data-parallel (DP) rank a group of ``G = sp * cp`` GPUs with a
per-GPU budget ``B``; at the fixed full degree every micro-batch is one row of up to ``G * B`` tokens split
over the whole group (:mod:`padfree.core.shard`). :func:`plan_degrees` chooses the degree per micro-batch:

- a document over ``B`` tokens (it fits no single GPU) goes to a *degree-G* row: documents padded as the
  shard needs (:meth:`~padfree.core.shard.Shard.sizes`), best fit into rows of ``G * B``
  (:meth:`~padfree.core.shard.Shard.capacity`), every GPU of the group runs the row's shard;
- every other document goes to a *degree-1* row of at most ``B`` tokens (best fit, nothing padded), and
  ``G`` such rows make one phase: GPU ``g`` of the group runs row ``g`` on its own (the group is then ``G``
  data-parallel GPUs for that phase; a phase's rows have similar modeled cost, the costliest ``G`` rows
  together, and the epoch's last such phase may leave some GPUs a row with nothing in it);
- short documents fill the room the long ones leave in degree-G rows (``fill``, default), so that every
  phase holds about a full row's work and the DP ranks stay even.

The *phases* take the place of a fixed plan's micro-batches: ``world_size * grad_accum`` make an optimizer
step, each DP rank runs ``grad_accum`` of them (balanced by modeled cost, :func:`padfree.core.steps.
assign_ranks`), and every GPU of a group walks the same sequence of phases, so a degree-G phase's
collectives (all-to-all, ring) find all ``G`` GPUs::

    DP rank 0, G = 4:  phase 0 (degree 4)     phase 1 (degree 1)     phase 2 (degree 1)
      GPU 0            [ shard 0 of row a ]   [ row b0 <= B ]        [ row c0 ]
      GPU 1            [ shard 1 of row a ]   [ row b1 <= B ]        [ row c1 ]
      GPU 2            [ shard 2 of row a ]   [ row b2 <= B ]        [ row c2 ]
      GPU 3            [ shard 3 of row a ]   [ row b3 <= B ]        [ row c3 ]

The modeled cost of a phase is what one GPU of the group spends on it (:meth:`GroupPlan.costs`): for a
degree-``d`` row of ``slots`` tokens (padding included) and ``attention`` (sum of the padded documents'
squares), ``(a * slots + b * attention) / d + c + s * slots / d`` when ``d > 1``: the row's work (attention
per document) divided over the group plus ``s`` token-equivalents per token a GPU holds for the sharding's
communication (Ulysses' all-to-alls, a ring's key/value passes), the one stated term ``s`` (``comm``).
A degree-1 phase costs its costliest row (the next phase waits for it: an upper bound, since GPUs in
degree-1 phases only meet at the next degree-G phase). :func:`fixed_costs` gives the same per-GPU cost of a
fixed-degree plan's micro-batches, so :func:`epoch_cost` of both compares them.

Only the packed strategy is planned so (padded rows are cut by width, not by document).

>>> from padfree.core.config import PlanConfig
>>> cfg = PlanConfig(strategy="packed", budget=100, sp=2)  # groups of 2 GPUs, 100 tokens each
>>> gp = plan_degrees(np.array([150, 60, 40, 90, 10, 70, 30, 100, 80, 20]), cfg)
>>> gp.degree.tolist()  # phase 2 holds sample 0 (150 tokens): both GPUs run it, a shard each
[1, 1, 2, 1]
>>> [[gp.gpu_micro(k, g).tolist() for g in (0, 1)] for k in range(gp.n_phases)]
[[[1, 2], [3]], [[7], [6, 5]], [[0, 4, 9], [0, 4, 9]], [[8], []]]
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from padfree.core import _cuts, cost, kernels, steps
from padfree.core.config import PlanConfig
from padfree.core.items import Items, Report, make_items, validate_lengths
from padfree.core.plan import Plan, check_epoch, epoch_rng
from padfree.core.shard import Shard
from padfree.errors import ConfigError

DEGREE_STREAM = 35_005
"""The random stream of a per-micro-batch degree plan (a tag of :func:`padfree.core.plan.epoch_rng`): its
choices never reuse the fixed-degree plan's."""


@dataclass(frozen=True)
class GroupPlan:
    """An epoch of phases, each run by every GPU of a group at degree ``G`` (one row, sharded) or 1 (``G``
    rows, one per GPU); see the module.

    Attributes:
        config, epoch: what made it (``config.sp * config.cp`` is ``G``).
        indices, lengths, starts: sample ids, row after row, their tokens and (``overlong='split'``) first
            token inside the sample (else ``starts`` is ``None``).
        row_offsets: row boundaries into ``indices`` (a row with nothing in it is an idle GPU's).
        degree: each phase's degree, ``G`` or 1.
        first_row: phase ``k`` holds rows ``first_row[k] .. first_row[k + 1] - 1``: one at degree ``G``,
            ``G`` at degree 1.
        comm: ``s``, the per-token communication term of a sharded row (token-equivalents).
        report: the overlong policy's report (samples, truncated, split, dropped).
    """

    config: PlanConfig
    epoch: int
    indices: np.ndarray
    lengths: np.ndarray
    starts: np.ndarray | None
    row_offsets: np.ndarray
    degree: np.ndarray
    first_row: np.ndarray
    comm: float
    report: Report

    @property
    def group(self) -> int:
        return self.config.shard.group

    @property
    def n_phases(self) -> int:
        return int(self.degree.shape[0])

    @property
    def n_steps(self) -> int:
        return self.n_phases // self.config.micro_per_step

    def row(self, j: int) -> np.ndarray:
        """Sample ids of row ``j``."""
        return self.indices[self.row_offsets[j] : self.row_offsets[j + 1]]

    def phase_ids(self, rank: int) -> np.ndarray:
        """The phases DP rank ``rank`` runs, in order (``grad_accum`` per step; the layout of
        :meth:`padfree.core.plan.Plan.micro_ids`)."""
        c = self.config
        if not 0 <= rank < c.world_size:
            raise ConfigError(f"rank {rank} outside world size {c.world_size}")
        base = np.arange(self.n_steps, dtype=np.int64)[:, None] * c.micro_per_step + rank * c.grad_accum
        return (base + np.arange(c.grad_accum, dtype=np.int64)[None, :]).ravel()

    def gpu_row(self, phase: int, gpu: int) -> int:
        """The row GPU ``gpu`` (0 .. G-1) of the group runs in ``phase``: the phase's one row at degree
        ``G`` (every GPU its shard of it), its ``gpu``-th row at degree 1."""
        if not 0 <= gpu < self.group:
            raise ConfigError(f"GPU {gpu} outside a group of {self.group} (sp x cp)")
        first = int(self.first_row[phase])
        return first if self.degree[phase] > 1 else first + gpu

    def gpu_micro(self, phase: int, gpu: int) -> np.ndarray:
        """Sample ids GPU ``gpu`` of the group runs in ``phase`` (see :meth:`gpu_row`)."""
        return self.row(self.gpu_row(phase, gpu))

    def schedule(self, rank: int, gpu: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """``(phase, degree, sample ids)`` for GPU ``gpu`` of DP rank ``rank``, in the order it runs them."""
        for k in self.phase_ids(rank).tolist():
            yield k, int(self.degree[k]), self.gpu_micro(k, gpu)

    def records(self) -> Iterator[dict]:
        """One dict per phase: ``{"epoch", "step", "rank", "micro", "degree"}`` and, at degree ``G``,
        ``"indices"`` (every GPU of the group runs its shard of that row), at degree 1 ``"gpus"``: ``G``
        lists of sample ids, GPU ``g`` runs the ``g``-th. With ``pieces`` (samples split or truncated)
        ``"starts"`` and ``"lengths"`` follow the same shape (``starts`` when split)."""
        c = self.config
        k = c.micro_per_step
        pieces = self.starts is not None or self.report.truncated > 0
        for j in range(self.n_phases):
            rows = range(int(self.first_row[j]), int(self.first_row[j + 1]))
            spans = [(int(self.row_offsets[r]), int(self.row_offsets[r + 1])) for r in rows]
            rec: dict = {
                "epoch": self.epoch,
                "step": j // k,
                "rank": (j % k) // c.grad_accum,
                "micro": j % c.grad_accum,
                "degree": int(self.degree[j]),
            }
            fields = [("indices", self.indices)]
            if self.starts is not None:
                fields.append(("starts", self.starts))
            if pieces:
                fields.append(("lengths", self.lengths))
            for name, arr in fields:
                per_row = [arr[a:b].tolist() for a, b in spans]
                if self.degree[j] > 1:
                    rec[name] = per_row[0]
                else:
                    rec["gpus" if name == "indices" else f"gpu_{name}"] = per_row
            yield rec

    def row_degrees(self) -> np.ndarray:
        """The degree of each row (its phase's)."""
        return np.repeat(self.degree, np.diff(self.first_row))

    def costs(self) -> np.ndarray:
        """Modeled cost of each phase for one GPU of the group (see the module)."""
        return phase_costs(
            self.lengths, self.row_offsets, self.row_degrees(), self.first_row, self.config, self.comm
        )


def row_costs(
    lens: np.ndarray, offsets: np.ndarray, degree: np.ndarray, config: PlanConfig, comm: float
) -> np.ndarray:
    """One GPU's modeled cost of each packed row at its degree: ``(a*slots + b*attention) / d + c``, plus
    ``comm * slots / d`` when ``d > 1`` (slots and attention of the row padded for ``config``'s shard at
    ``d > 1``, unpadded at ``d == 1``); 0 for an empty row."""
    m = config.cost
    sharded = cost.micro_shapes(lens, offsets, True, shard=config.shard)
    alone = cost.micro_shapes(lens, offsets, True)
    wide = degree > 1
    slots = np.where(wide, sharded.slots, alone.slots)
    attn = np.where(wide, sharded.attn, alone.attn)
    d = degree.astype(np.float64)
    out = (m.a * slots + m.b * attn) / d + m.c + np.where(wide, comm * slots / d, 0.0)
    return np.where(np.diff(offsets) > 0, out, 0.0)


def phase_costs(
    lens: np.ndarray,
    offsets: np.ndarray,
    degree: np.ndarray,
    first_row: np.ndarray,
    config: PlanConfig,
    comm: float,
) -> np.ndarray:
    """Each phase's cost for one GPU: its costliest row (:func:`row_costs`; a degree-G phase has one)."""
    per_row = row_costs(lens, offsets, degree, config, comm)
    return np.maximum.reduceat(per_row, first_row[:-1]) if per_row.size else np.zeros(0)


def fixed_costs(plan: Plan, comm: float = 0.0) -> np.ndarray:
    """One GPU's modeled cost of each micro-batch of a fixed-degree SP/CP plan: every row at degree
    ``G`` (:func:`row_costs`)."""
    g = plan.config.shard.group
    degree = np.full(plan.n_micro, g, np.int64)
    return row_costs(plan.lengths, plan.offsets, degree, plan.config, comm)


def epoch_cost(costs: np.ndarray, world_size: int, grad_accum: int) -> float:
    """Modeled time of an epoch: over steps, the sum of the slowest DP rank's cost (the gradient all-reduce
    waits for it)."""
    return float(cost.step_costs(cost.rank_costs(costs, world_size, grad_accum)).sum())


def check_comm(comm: object) -> float:
    """``comm`` as a float, or a :class:`ConfigError` unless it is a finite number >= 0."""
    if isinstance(comm, bool) or not isinstance(comm, (int, float)) or not 0 <= comm < math.inf:
        raise ConfigError(f"comm must be a finite number >= 0 token-equivalents per token (got {comm!r})")
    return float(comm)


def _bins(ids: np.ndarray, size: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Best fit of items ``ids`` (sizes ``size``, in this order) into rows of ``budget``: ``(order,
    offsets)``, rows in the order they were opened."""
    if ids.size == 0:
        return ids, np.zeros(1, np.int64)
    bin_of, n_bins = kernels.best_fit(size, int(budget))
    order = ids[kernels.counting_argsort(bin_of, int(n_bins))]
    return order, np.concatenate(([0], np.cumsum(np.bincount(bin_of, minlength=n_bins)))).astype(np.int64)


def _wide_rows(
    long_ids: np.ndarray, short_ids: np.ndarray, length: np.ndarray, shard: Shard, cap: int, fill: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The degree-G rows: the long items best fit into rows of ``cap`` (padded for ``shard``), then
    (``fill``) the short items, in their order, best fit into the room those rows leave; returns the rows
    ``(order, offsets)`` and the short items left for degree-1 rows (in order)."""
    if long_ids.size == 0:
        return long_ids, np.zeros(1, np.int64), short_ids
    ids = np.concatenate((long_ids, short_ids)) if fill else long_ids
    bin_of, n_bins = kernels.best_fit(shard.sizes(length[ids], packed=True), int(cap))
    n_wide = int(bin_of[: long_ids.size].max()) + 1  # bins are numbered as opened: the long items' first
    in_wide = bin_of < n_wide
    order = ids[in_wide][kernels.counting_argsort(bin_of[in_wide], n_wide)]
    offsets = np.concatenate(([0], np.cumsum(np.bincount(bin_of[in_wide], minlength=n_wide))))
    return order, offsets.astype(np.int64), ids[~in_wide] if fill else short_ids


def plan_degrees(
    lengths: ArrayLike,
    config: PlanConfig,
    epoch: int = 0,
    *,
    comm: float = 0.0,
    fill: bool = True,
    path: str | None = None,
) -> GroupPlan:
    """Plan one epoch with a degree per micro-batch (see the module): a pure function of (lengths,
    config, epoch, comm). ``config`` is a packed SP/CP plan's (``sp * cp > 1``); documents over its group
    row (``sp * cp * budget``) meet its overlong policy; ``comm`` is the communication term of a sharded
    row in the costs that balance the DP ranks (:meth:`GroupPlan.costs`). ``fill``: short documents fill
    the room the long ones leave in degree-G rows (every phase then does about a full row's work, which
    keeps the DP ranks even, at ``comm`` per token for those documents); ``False`` keeps them all at
    degree 1.
    """
    epoch = check_epoch(epoch)
    comm = check_comm(comm)
    shard = config.shard
    if not shard.active:
        raise ConfigError("a per-micro-batch degree needs sp or cp > 1 (a group of GPUs to shard over)")
    if config.strategy != "packed":
        raise ConfigError(
            "a per-micro-batch degree is planned for packed rows "
            f"(strategy 'packed', not {config.strategy!r})"
        )
    lengths = validate_lengths(lengths, path)
    g, budget, k = shard.group, config.budget, config.micro_per_step
    cap = shard.capacity(budget)
    items = make_items(lengths, cap, config.overlong, path)
    if len(items) < k:
        raise ConfigError(
            f"{len(items)} samples cannot fill one step of {k} phases "
            f"(world_size {config.world_size} x grad_accum {config.grad_accum})"
        )
    rng = epoch_rng(config.seed, epoch, config.strategy, DEGREE_STREAM)
    length = items.length
    perm = rng.permutation(len(items))
    wide = length[perm] > budget
    long_order, long_off, short_ids = _wide_rows(perm[wide], perm[~wide], length, shard, cap, fill)
    short_order, short_off = _bins(short_ids, length[short_ids], budget)
    order = np.concatenate((long_order, short_order))
    offsets = np.concatenate((long_off, long_off[-1] + short_off[1:]))
    n_long = long_off.shape[0] - 1
    n_short = short_off.shape[0] - 1
    degree_of_row = np.concatenate((np.full(n_long, g), np.ones(n_short, np.int64))).astype(np.int64)
    own = row_costs(length[order], offsets, degree_of_row, config, comm)
    # degree-1 phases: the short rows, costliest first, G at a time (an idle GPU's empty row fills the last)
    short_rows = n_long + np.argsort(-own[n_long:], kind="stable")
    n_empty = -n_short % g
    rows = np.concatenate((np.arange(n_long), short_rows, n_long + n_short + np.arange(n_empty)))
    offsets = np.concatenate((offsets, np.full(n_empty, offsets[-1])))
    degree = np.concatenate((np.full(n_long, g), np.ones((n_short + n_empty) // g, np.int64)))
    first = np.concatenate(([0], np.cumsum(np.where(degree > 1, 1, g)))).astype(np.int64)
    phase_perm = rng.permutation(degree.shape[0])
    rows, first = kernels.gather_segments(rows, first, phase_perm)
    degree = degree[phase_perm]
    order, row_offsets = kernels.gather_segments(order, offsets, rows)
    order, row_offsets, degree, first = _whole_steps(order, row_offsets, degree, first, length, config)
    if config.world_size > 1:
        pc = phase_costs(length[order], row_offsets, np.repeat(degree, np.diff(first)), first, config, comm)
        p = steps.assign_ranks(pc, config.world_size, config.grad_accum)
        rows, first = kernels.gather_segments(np.arange(row_offsets.shape[0] - 1), first, p)
        order, row_offsets = kernels.gather_segments(order, row_offsets, rows)
        degree = degree[p]
    return _group_plan(items, config, epoch, order, row_offsets, degree, first, comm)


def _whole_steps(
    order: np.ndarray,
    row_offsets: np.ndarray,
    degree: np.ndarray,
    first: np.ndarray,
    length: np.ndarray,
    config: PlanConfig,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Make the phase count a multiple of the step (``world_size * grad_accum``): the trailing partial
    step's degree-1 rows are dealt anew, longest document first, over as many more degree-1 phases as the
    step lacks (:func:`padfree.core._cuts.lpt_bins`; rows left empty where documents are too few, or
    empty phases added where that overflows a row)."""
    k, g, budget = config.micro_per_step, config.shard.group, config.budget
    m = degree.shape[0]
    r = m % k
    if r == 0:
        return order, row_offsets, degree, first
    tail = np.arange(m - r, m)
    short = tail[degree[tail] == 1]
    keep = np.setdiff1d(np.arange(m), short)
    need = k - r + short.size  # degree-1 phases the tail will hold
    every_row = np.arange(row_offsets.shape[0] - 1, dtype=np.int64)
    keep_rows = kernels.gather_segments(every_row, first, keep)[0]
    tail_rows = kernels.gather_segments(every_row, first, short)[0]
    ids = kernels.gather_segments(order, row_offsets, tail_rows)[0]
    bins = _cuts.lpt_bins(length[ids], need * g, budget) if ids.size else np.zeros(0, np.int64)
    if ids.size and bins.size == 0:  # a dealt row would overflow: keep the rows, add empty phases
        new_order, new_off = kernels.gather_segments(
            order, row_offsets, np.concatenate((keep_rows, tail_rows))
        )
        new_off = np.concatenate((new_off, np.full((k - r) * g, new_off[-1])))
        new_degree = np.concatenate((degree[keep], degree[short], np.ones(k - r, np.int64)))
    else:
        head_order, head_off = kernels.gather_segments(order, row_offsets, keep_rows)
        dealt = ids[kernels.counting_argsort(bins, need * g)] if ids.size else ids
        counts = np.bincount(bins, minlength=need * g)
        new_order = np.concatenate((head_order, dealt))
        new_off = np.concatenate((head_off, head_off[-1] + np.cumsum(counts)))
        new_degree = np.concatenate((degree[keep], np.ones(need, np.int64)))
    new_first = np.concatenate(([0], np.cumsum(np.where(new_degree > 1, 1, g)))).astype(np.int64)
    return new_order, new_off.astype(np.int64), new_degree, new_first


def _group_plan(
    items: Items,
    config: PlanConfig,
    epoch: int,
    order: np.ndarray,
    row_offsets: np.ndarray,
    degree: np.ndarray,
    first: np.ndarray,
    comm: float,
) -> GroupPlan:
    starts = None if items.start is None else items.start[order]
    return GroupPlan(
        config, epoch, items.sample_ids()[order], items.length[order], starts, row_offsets, degree, first,
        comm, items.report,
    )  # fmt: skip
