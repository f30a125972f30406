"""Real training throughput of every strategy, padfree's and the peers', side by side (``padfree bench``).

Every strategy trains its own copy of the same model (same config, same initial weights): forward,
backward, gradient clipping and an AdamW update per micro-batch, on the same samples and the same token
budget per micro-batch. The micro-batches come from padfree's plan (``sorted``, ``random``, ``bucketed``,
``packed``) or from a peer's adapter (:mod:`padfree.bench.peers`); padded micro-batches go through
:class:`~padfree.torch.PadCollator` (one row per sample, right-padded, ``sdpa``), packed ones through
:class:`~padfree.torch.PackCollator` (one row, documents attend only to themselves, through
:func:`padfree.torch.attention_implementation`: padfree's varlen attention when present). So a packed
peer's number is its *bin choice* trained on padfree's packed path, and the result says so.

Protocol:

- every strategy plans the same samples (one epoch); ``select="stratified"`` (the default) measures
  ``steps`` of its micro-batches: the epoch's micro-batches are ordered by modeled work per loss token
  (slots plus attention pairs weighted by the model's shape: what padding and attention length cost), cut
  into ``steps`` strata of equal count, and the middle one of each is trained (:func:`stratified`).
  ``real_tok_per_s`` is then the *epoch's* loss tokens over the epoch's estimated seconds: each pick's
  measured seconds per unit of modeled work times its stratum's modeled work (:func:`epoch_seconds`), so a
  few measured steps stand for the whole epoch's padding and length mix, and strategies are compared on
  the same samples; ``measured_real_tok_per_s`` is the measured steps' own ratio;
  ``select="epoch"`` trains every micro-batch of the epoch: with a small sample set
  (:func:`bench_subset`: about ``steps x budget`` tokens) all strategies then do exactly the same useful
  work, though plans over so few samples pad more than over a real dataset (and ``bucketed``, whose
  buckets merge until each holds ``mix`` micro-batches, falls back to near-random order);
- strategies run interleaved in rounds (A B C D ... A B C D ...), so a slow spell of a shared machine
  hits every strategy alike; a strategy with fewer micro-batches (less padding) simply stops earlier;
- ``warmup`` untimed rounds come first, on seeded random micro-batches of the same epoch;
  with ``repeats`` > 1 all measured rounds run that many times and every step keeps its fastest time;
- a step is timed from the collated batch to the end of the optimizer update (the device synchronized);
  collation is not timed;
- loss-bearing tokens are the real (non-padding) tokens after each document's first; per-step medians and
  ranges of the measured steps are reported too;
- peak memory: on CUDA ``torch.cuda.max_memory_allocated`` during the strategy's steps; on CPU the
  process RSS sampled every 2 ms during its steps (``peak_rss_mb``, which includes every strategy's
  model and optimizer state) and its rise over the RSS before the step (``peak_step_mb``: the step's own
  activations and gradients).
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from padfree.bench.measure import Batching, batching_stats
from padfree.bench.peers import PEER_NAMES, PEERS, missing, plan_with_peer
from padfree.core.config import PlanConfig
from padfree.core.cost import micro_shapes
from padfree.core.planner import make_plan
from padfree.errors import ConfigError

PADFREE = ("sorted", "random", "bucketed", "packed")
STRATEGIES = PADFREE + PEER_NAMES
PACKED = ("packed", "hf_flattening", "trl_bfd")
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class BenchConfig:
    """What ``padfree bench`` measures.

    Attributes:
        budget: tokens per micro-batch (padded: count x longest; packed: sum of lengths).
        steps: measured steps per strategy; ``warmup``: untimed steps per strategy before them.
        select: ``stratified`` measures ``steps`` micro-batches of each strategy's epoch over all the
            samples, one per stratum of modeled work per loss token, and estimates the epoch's seconds
            from them (:func:`epoch_seconds`); ``epoch`` trains every micro-batch of the epoch (give it a
            small sample set, e.g. :func:`bench_subset`, so that every strategy does exactly the same work).
        repeats: passes over the measured rounds; each micro-batch keeps its fastest time (on a shared
            machine the minimum drops the steps another process slowed down).
        model: built-in tiny model or a config directory; ``model_overrides``: config fields to override.
        strategies: names from :data:`STRATEGIES`, in round order.
        lr, clip: AdamW learning rate and gradient-norm clip (0: off).
        threads: torch CPU threads (None: leave torch's choice).
        dtype: ``float32``, or ``bfloat16``: float32 weights and optimizer, forward and loss under
            ``torch.autocast(dtype=torch.bfloat16)`` (mixed precision; on a GPU packed rows then reach a
            fused varlen attention kernel, which needs fp16/bf16).
    """

    budget: int = 2048
    steps: int = 10
    warmup: int = 2
    select: str = "stratified"
    repeats: int = 1
    seed: int = 0
    model: str = "tiny-llama"
    model_overrides: dict = field(default_factory=dict)
    strategies: tuple[str, ...] = STRATEGIES
    lr: float = 1e-4
    clip: float = 1.0
    device: str = "cpu"
    threads: int | None = 2
    dtype: str = "float32"
    padded_mask: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)} (got {self.dtype!r})")
        if self.budget < 2:
            raise ConfigError(f"budget must be >= 2 (got {self.budget})")
        if self.steps < 1 or self.warmup < 0:
            raise ConfigError(f"steps must be >= 1 and warmup >= 0 (got {self.steps}, {self.warmup})")
        if self.repeats < 1:
            raise ConfigError(f"repeats must be >= 1 (got {self.repeats})")
        if self.select not in ("stratified", "epoch"):
            raise ConfigError(f"select must be 'stratified' or 'epoch' (got {self.select!r})")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown or not self.strategies:
            raise ConfigError(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")


# ----- data ----------------------------------------------------------------------------------------------


class RandomIds(Sequence):
    """Random token ids (1 .. vocab-1) of sample ``i``, drawn when asked for from a generator seeded by
    ``(seed, i)``: the same ids every time, and a 902K-sample dataset costs its lengths, not its tokens.

    >>> ids = RandomIds(np.array([3, 5]), vocab=100, seed=0)
    >>> len(ids), ids[1].shape, bool((ids[1] == ids[1]).all()), int(ids[0].min()) >= 1
    (2, (5,), True, True)
    """

    def __init__(self, lengths: np.ndarray, vocab: int, seed: int) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.vocab = max(2, int(vocab))
        self.seed = int(seed)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, i):  # type: ignore[override]
        rng = np.random.default_rng((self.seed, int(i)))
        return rng.integers(1, self.vocab, size=int(self.lengths[i]), dtype=np.int64)


class _Items(Sequence):
    """``{"input_ids": ...}`` per sample, built when indexed."""

    def __init__(self, ids: Sequence) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):  # type: ignore[override]
        return {"input_ids": self.ids[i]}


@dataclass(frozen=True)
class Samples:
    """Token ids per sample (a list, or a lazy :class:`RandomIds`) and the loss-bearing tokens of each
    (label positions after the first)."""

    input_ids: Sequence
    loss_tokens: np.ndarray
    source: str

    @property
    def lengths(self) -> np.ndarray:
        known = getattr(self.input_ids, "lengths", None)
        if known is not None:
            return known
        return np.array([a.shape[0] for a in self.input_ids], dtype=np.int64)

    def items(self) -> Sequence[dict]:
        return _Items(self.input_ids)


def fit_lengths(lengths: np.ndarray, budget: int, overlong: str = "truncate") -> np.ndarray:
    """Lengths that fit the budget: longer ones cut to it (``truncate``) or left out (``drop``; their
    entries become 0 and the caller removes them)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if overlong == "truncate":
        return np.minimum(lengths, budget)
    if overlong == "drop":
        return np.where(lengths > budget, 0, lengths)
    raise ConfigError(f"--overlong must be truncate or drop for bench (got {overlong!r})")


def random_samples(lengths: np.ndarray, vocab: int, seed: int, source: str) -> Samples:
    """Random token ids (1 .. vocab-1) of the given lengths, drawn per sample when trained
    (:class:`RandomIds`); every token after the first bears loss."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return Samples(RandomIds(lengths, vocab, seed), np.maximum(lengths - 1, 0), source)


# ----- micro-batches per strategy ------------------------------------------------------------------------


def strategy_batching(name: str, lengths: np.ndarray, budget: int, seed: int) -> Batching:
    """One epoch of micro-batches of a strategy over ``lengths`` (all within the budget)."""
    if name in PADFREE:
        plan = make_plan(
            lengths, PlanConfig(strategy=name, budget=budget, world_size=1, grad_accum=1, seed=seed)
        )
        return Batching(
            plan.indices.astype(np.int64), plan.offsets.astype(np.int64), name == "packed", "padfree plan"
        )
    return plan_with_peer(name, lengths, budget, seed)


def bench_subset(lengths: np.ndarray, steps: int, budget: int, seed: int) -> np.ndarray:
    """Ids of a seeded random subset of samples holding about ``steps x budget`` tokens (at least two
    samples), in id order: an epoch of it is about ``steps`` full micro-batches.

    >>> bench_subset(np.full(100, 10), steps=2, budget=50, seed=0).shape
    (10,)
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    perm = np.random.default_rng(seed).permutation(lengths.shape[0])
    n = int(np.searchsorted(np.cumsum(lengths[perm]), steps * budget, side="right"))
    return np.sort(perm[: max(2, min(n, lengths.shape[0]))])


def micro_work(lengths: np.ndarray, b: Batching, attn_weight: float) -> tuple[np.ndarray, np.ndarray]:
    """Per micro-batch: ``(modeled work, loss tokens)``. Work = computed slots + ``attn_weight`` x causal
    attention pairs (padded: ``count x longest^2``; packed: the sum of each document's square), the shape
    of :meth:`padfree.core.config.CostModel.from_shape` with ``a = 1``; loss tokens = tokens after each
    sample's first.

    >>> b = Batching(np.array([0, 1, 2]), np.array([0, 2, 3]), packed=False)
    >>> work, loss = micro_work(np.array([4, 2, 6]), b, attn_weight=0.5)
    >>> work.tolist(), loss.tolist()
    ([24.0, 24.0], [4.0, 5.0])
    """
    sh = micro_shapes(lengths[b.order], b.offsets, b.packed)
    loss = sh["real"] - sh["count"]
    return sh["slots"] + attn_weight * sh["attn"], loss


def stratified(work_per_token: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``k`` micro-batches that represent an epoch, and the stratum each stands for: the micro-batches are
    ordered by modeled work per loss token (what sets their speed: padding and attention length), cut into
    ``k`` strata of equal count, and the middle one of each is taken. Returns ``(picks in epoch order,
    stratum id of every micro-batch, indexed like the picks)``; with at most ``k`` micro-batches every one
    is its own stratum.

    >>> picks, stratum = stratified(np.array([5.0, 1.0, 4.0, 2.0, 3.0, 6.0]), 2)
    >>> picks.tolist(), stratum.tolist()
    ([0, 3], [0, 1, 0, 1, 1, 0])
    """
    n = work_per_token.shape[0]
    if n <= k:
        return np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64)
    by = np.argsort(work_per_token, kind="stable")
    rank_of = np.empty(n, dtype=np.int64)
    rank_of[by] = np.arange(n)
    edges = np.floor(np.arange(k + 1) * n / k).astype(np.int64)
    stratum_by_rank = np.searchsorted(edges, np.arange(n), side="right") - 1
    mids = by[(edges[:-1] + edges[1:]) // 2]
    order = np.argsort(mids, kind="stable")  # picks in epoch order; renumber strata to match
    renumber = np.empty(k, dtype=np.int64)
    renumber[order] = np.arange(k)
    return mids[order], renumber[stratum_by_rank[rank_of]]


def epoch_seconds(sec: np.ndarray, picks: np.ndarray, stratum: np.ndarray, work: np.ndarray) -> float:
    """An epoch's training seconds estimated from its measured picks: each pick's seconds per unit of
    modeled work, times the modeled work of the stratum it stands for (a ratio estimator: the model
    carries each pick's speed to micro-batches of the same kind; the seconds themselves are measured).

    >>> epoch_seconds(np.array([2.0, 6.0]), np.array([0, 2]), np.array([0, 0, 1, 1]),
    ...               np.array([1.0, 3.0, 3.0, 3.0]))
    20.0
    """
    per_work = sec / work[picks]
    stratum_work = np.bincount(stratum, weights=work, minlength=picks.shape[0])
    return float(per_work @ stratum_work)


def micro_ids(b: Batching, k: int) -> np.ndarray:
    return b.order[b.offsets[k] : b.offsets[k + 1]]


# ----- one training step ---------------------------------------------------------------------------------


class Trainer:
    """A model (built from a config, same seed -> same initial weights) and its AdamW optimizer, with the
    collator and attention its micro-batches need (packed rows or padded rows).

    ``dtype="bfloat16"`` keeps float32 weights and optimizer state and runs forward and loss under
    ``torch.autocast`` in bfloat16 (the usual mixed-precision recipe). ``attention_paths`` counts the
    attention code that ran in each forward pass (padfree's kernel choice, or transformers' own
    implementation); ``attention_path`` says it in one line.
    """

    def __init__(
        self,
        model: str,
        overrides: dict,
        seed: int,
        device: str,
        lr: float,
        clip: float,
        packed: bool,
        weight_decay: float = 0.0,
        dtype: str = "float32",
        padded_mask: bool = True,
    ) -> None:
        import torch

        from padfree.testing.models import build_model
        from padfree.torch import PackCollator, PadCollator
        from padfree.torch.attention import attention_implementation

        self.attn = attention_implementation("packed" if packed else "sorted")
        self.model = build_model(model, attn_implementation=self.attn, seed=seed, **overrides).to(device)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        self.collate = PackCollator() if packed else PadCollator(attention_mask=padded_mask)
        self.padded_mask = padded_mask
        self.clip = clip
        self.device = device
        self.sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        if dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
        self.dtype = dtype
        self.attention_paths: dict[str, int] = {}

    @classmethod
    def for_bench(cls, cfg: BenchConfig, packed: bool) -> Trainer:
        return cls(
            cfg.model,
            cfg.model_overrides,
            cfg.seed,
            cfg.device,
            cfg.lr,
            cfg.clip,
            packed,
            dtype=cfg.dtype,
            padded_mask=cfg.padded_mask,
        )

    @property
    def attention_path(self) -> str | None:
        """The attention code every forward pass so far ran, or each with its count when they differed
        (e.g. a fused kernel falling back for some inputs); ``None`` before the first pass."""
        paths = self.attention_paths
        if len(paths) <= 1:
            return next(iter(paths), None)
        return "; ".join(f"{p} (x{n})" for p, n in paths.items())

    def _autocast(self):
        import contextlib

        import torch

        if self.dtype == "float32":
            return contextlib.nullcontext()
        kind = "cuda" if self.device.startswith("cuda") else "cpu"
        return torch.autocast(device_type=kind, dtype=getattr(torch, self.dtype))

    def loss_sum(self, batch):
        """Sum of the token losses of a collated batch (forward and loss under autocast for bfloat16)."""
        import padfree.torch.attention as pa
        from padfree.torch import token_loss_sum

        inputs = {k: v.to(self.device) if hasattr(v, "to") else v for k, v in batch.items()}
        labels = inputs.pop("labels")
        pa.reset_path()
        with self._autocast():
            loss = token_loss_sum(self.model(**inputs).logits, labels)
        path = pa.last_path() or f"transformers {self.attn}"
        self.attention_paths[path] = self.attention_paths.get(path, 0) + 1
        return loss

    def backward(self, batch, step_tokens: int) -> float:
        """Forward and backward of one micro-batch, its loss scaled by the step's loss tokens; returns the
        micro-batch's loss sum."""
        from padfree.torch import step_loss

        loss = self.loss_sum(batch)
        step_loss(loss, step_tokens).backward()
        return float(loss.detach())

    def update(self, lr: float | None = None) -> None:
        """Clip, AdamW step (at ``lr`` when given), zero the gradients."""
        import torch

        if lr is not None:
            for g in self.opt.param_groups:
                g["lr"] = lr
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def step(self, batch, step_tokens: int) -> tuple[float, float]:
        """One micro-batch as a whole optimizer step, timed (device synchronized): ``(seconds, loss sum)``."""
        self.sync()
        t0 = time.perf_counter()
        loss = self.backward(batch, step_tokens)
        self.update()
        self.sync()
        return time.perf_counter() - t0, loss


class MemoryWatch:
    """Peak memory while a block runs: CUDA's max allocated, or the RSS sampled every 2 ms on CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.peak = 0
        self.rise = 0

    @staticmethod
    def rss() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):  # not Linux: the process's peak so far
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def __enter__(self) -> MemoryWatch:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            return self
        self._base = self.rss()
        self._peak = self._base
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.wait(0.002):
                self._peak = max(self._peak, self.rss())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            import torch

            peak = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._thread.join()
            peak = max(self._peak, self.rss())
        self.peak = max(self.peak, peak)
        self.rise = max(self.rise, peak - self._base)


def return_freed_memory() -> None:
    """glibc: serve allocations >= 64 KiB with mmap and hand them back on free, so the RSS follows the
    live tensors instead of the allocator's high-water mark (best effort; no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD (fixing it also stops glibc's dynamic threshold)
        libc.mallopt(-1, 1 << 16)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


# ----- the benchmark -------------------------------------------------------------------------------------


def machine(device: str, dtype: str | None = None) -> dict:
    import torch

    out = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": device,
    }
    if dtype is not None:
        out["dtype"] = dtype
        out["precision"] = (
            "float32"
            if dtype == "float32"
            else f"float32 weights and AdamW, forward + loss under torch.autocast({dtype})"
        )
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    if device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name()
    if hasattr(os, "getloadavg"):
        out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return out


def run_bench(
    samples: Samples,
    cfg: BenchConfig,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Train every strategy in interleaved rounds; returns ``{"machine", "config", "order", "strategies"}``.

    A strategy that cannot run here (a peer's module missing, a peer failing) gets ``{"error": why}``.
    """
    import torch

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    if not cfg.device.startswith("cuda"):
        return_freed_memory()
    say = progress or (lambda _m: None)
    lengths = samples.lengths
    if lengths.size == 0 or int(lengths.min()) < 1:
        raise ConfigError("every sample needs at least one token")
    if int(lengths.max()) > cfg.budget:
        raise ConfigError(f"samples longer than the budget {cfg.budget}: cut or drop them first")
    items = samples.items()
    attn_weight = attention_weight(cfg)

    results: dict[str, dict] = {}
    runners: dict[str, dict] = {}
    for name in cfg.strategies:
        why = missing(PEERS[name]) if name in PEERS else None
        if why:
            results[name] = {"error": why}
            continue
        try:
            t0 = time.perf_counter()
            b = strategy_batching(name, lengths, cfg.budget, cfg.seed)
            plan_s = time.perf_counter() - t0
        except Exception as exc:  # a peer failing here is a result, not a crash
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        trainer = Trainer.for_bench(cfg, packed=b.packed)
        work, loss = micro_work(lengths, b, attn_weight)
        if cfg.select == "epoch":
            picks = stratum = np.arange(b.n_micro, dtype=np.int64)
        else:
            picks, stratum = stratified(work / np.maximum(loss, 1.0), cfg.steps)
        runners[name] = {
            "batching": b,
            "warm": np.random.default_rng(cfg.seed + 1).integers(0, b.n_micro, size=max(cfg.warmup, 1)),
            "trainer": trainer,
            "plan_s": plan_s,
            "picks": picks,
            "stratum": stratum,
            "work": work,
            "epoch_loss_tokens": float(loss.sum()),
        }
        results[name] = {}
        say(f"{name}: {b.n_micro} micro-batches, attention {trainer.attn}")

    order: list[list] = []
    rec = {name: {"sec": [], "loss_tok": [], "tok": [], "slots": [], "rows": []} for name in runners}
    watches = {name: MemoryWatch(cfg.device) for name in runners}
    measured = max([r["picks"].shape[0] for r in runners.values()], default=0)
    rounds = cfg.warmup + cfg.repeats * measured
    for r in range(rounds):
        for name, run in runners.items():
            trainer = run["trainer"]
            if r < cfg.warmup:
                k = int(run["warm"][r])  # a seeded random micro-batch of the same epoch
                batch = trainer.collate([items[i] for i in micro_ids(run["batching"], k)])
                trainer.step(batch, batch.loss_tokens)
                order.append([r, name, "warmup"])
                continue
            rep, k = divmod(r - cfg.warmup, measured)
            if k >= run["picks"].shape[0]:
                continue
            batch = trainer.collate([items[i] for i in micro_ids(run["batching"], int(run["picks"][k]))])
            with watches[name]:
                sec, _ = trainer.step(batch, batch.loss_tokens)
            order.append([r, name, "measured"])
            x = rec[name]
            if rep > 0:  # the same micro-batch again: keep its fastest time
                x["sec"][k] = min(x["sec"][k], sec)
                continue
            x["sec"].append(sec)
            x["loss_tok"].append(batch.loss_tokens)
            x["tok"].append(batch.tokens)
            x["slots"].append(int(batch["input_ids"].numel()))
            x["rows"].append(int(batch["input_ids"].shape[0]))
        say(f"round {r + 1}/{rounds} done" + (" (warm-up)" if r < cfg.warmup else ""))

    for name, run in runners.items():
        results[name] = summarize(name, run, rec[name], watches[name], lengths, cfg)
    base = results.get("sorted", {}).get("real_tok_per_s")
    for res in results.values():
        if base and "real_tok_per_s" in res:
            res["vs_sorted"] = res["real_tok_per_s"] / base
    return {
        "machine": machine(cfg.device, cfg.dtype),
        "config": {
            "budget": cfg.budget,
            "steps": cfg.steps,
            "warmup": cfg.warmup,
            "select": cfg.select,
            "repeats": cfg.repeats,
            "seed": cfg.seed,
            "model": cfg.model,
            "model_overrides": cfg.model_overrides,
            "padded_mask": cfg.padded_mask,
            "lr": cfg.lr,
            "clip": cfg.clip,
            "samples": int(lengths.shape[0]),
            "tokens": int(lengths.sum()),
            "data": samples.source,
            "step": "forward + backward + clip + AdamW per micro-batch (collation untimed)",
        },
        "order": order,
        "strategies": results,
    }


def attention_weight(cfg: BenchConfig) -> float:
    """Modeled cost of one causal attention pair relative to one token's dense work, for the bench's model
    (:meth:`padfree.core.config.CostModel.from_shape` of its hidden size, layers and vocabulary)."""
    from padfree.core.config import CostModel
    from padfree.testing.models import build_config

    c = build_config(cfg.model, **cfg.model_overrides)
    return CostModel.from_shape(c.hidden_size, c.num_hidden_layers, c.vocab_size).b


def _stats(values: Sequence[float]) -> dict:
    v = np.asarray(values, dtype=np.float64)
    return {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max())}


def summarize(
    name: str, run: dict, x: dict, watch: MemoryWatch, lengths: np.ndarray, cfg: BenchConfig
) -> dict:
    b: Batching = run["batching"]
    sec = np.asarray(x["sec"])
    loss_tok, tok, slots = (np.asarray(x[k], dtype=np.float64) for k in ("loss_tok", "tok", "slots"))
    epoch = batching_stats(lengths, b, cfg.budget)
    packed = b.packed
    est = epoch_seconds(sec, run["picks"], run["stratum"], run["work"])
    out = {
        "real_tok_per_s": run["epoch_loss_tokens"] / est,
        "measured_real_tok_per_s": float(loss_tok.sum() / sec.sum()),
        "epoch_seconds_estimate": est,
        "epoch_loss_tokens": int(run["epoch_loss_tokens"]),
        "slots_per_s": float(slots.sum() / sec.sum()),
        "step_real_tok_per_s": _stats(loss_tok / sec),
        "step_seconds": _stats(sec),
        "padding_efficiency": float(tok.sum() / slots.sum()),
        "bin_padding_efficiency": epoch["padding_efficiency"],
        "steps": int(sec.shape[0]),
        "micro_batches_in_epoch": b.n_micro,
        "measured_micro_batches": [int(k) for k in run["picks"]],
        "warmup_steps": cfg.warmup,
        "loss_tokens": int(loss_tok.sum()),
        "real_tokens": int(tok.sum()),
        "slots": int(slots.sum()),
        "rows_per_step": _stats(x["rows"]),
        "packed": packed,
        "attention": run["trainer"].attn,
        "attention_path": run["trainer"].attention_path,
        "collator": "PackCollator (one row per micro-batch)"
        if packed
        else "PadCollator (one row per sample)",
        "plan_seconds": run["plan_s"],
    }
    if cfg.device.startswith("cuda"):
        out["peak_memory_mb"] = watch.peak / 2**20
        out["memory"] = "torch.cuda.max_memory_allocated during the strategy's measured steps"
    else:
        out["peak_rss_mb"] = watch.peak / 2**20
        out["peak_step_mb"] = watch.rise / 2**20
        out["peak_memory_mb"] = out["peak_step_mb"]
        out["memory"] = (
            "process RSS sampled every 2 ms during the strategy's steps; step = rise over the RSS before it"
        )
    if name in PEERS:
        out["peer"] = PEERS[name].describe
        out["note"] = b.note + (
            "; trained as packed rows through padfree's PackCollator and attention (the kernel is padfree's)"
            if packed
            else "; trained as padded rows through padfree's PadCollator"
        )
    return out


# ----- reports -------------------------------------------------------------------------------------------


def markdown(result: dict, command: str = "") -> str:
    c, m = result["config"], result["machine"]
    lines = [
        "# Training throughput per strategy",
        "",
        f"Command: `{command}`" if command else "",
        "",
        f"Machine: {m.get('processor')} ({m.get('cpus')} CPUs), {m.get('platform')}, torch {m.get('torch')} "
        f"({m.get('torch_threads')} threads), transformers {m.get('transformers', '?')}, device "
        f"{m.get('device')}{', ' + m['gpu'] if 'gpu' in m else ''}, precision "
        f"{m.get('precision', 'float32')}; load average at the end "
        f"{m.get('load_average')}.",
        "",
        f"Model {c['model']} {c['model_overrides'] or ''}, budget {c['budget']} tokens per micro-batch, "
        f"{c['samples']} samples ({c['tokens']} tokens) from {c['data']}; "
        + (
            "every strategy trains one whole epoch of them"
            if c["select"] == "epoch"
            else f"{c['steps']} micro-batches per strategy measured, one from each of {c['steps']} equal "
            "strata of its epoch ordered by modeled work per loss token"
        )
        + f", {c['warmup']} warm-up steps first, interleaved in rounds"
        + (f", every round run {c['repeats']} times, fastest time kept" if c.get("repeats", 1) > 1 else "")
        + f"; step = {c['step']}"
        + (
            "; padded rows are right-padded and given the attention mask (transformers then runs a masked "
            "SDPA kernel whenever a micro-batch has a pad)."
            if c.get("padded_mask")
            else "; padded rows are right-padded and trained without an attention mask (a causal LM needs "
            "none: real tokens only see earlier, real ones; pads carry no loss), so SDPA runs is_causal for "
            "every strategy and only the slots differ."
        ),
        "",
        "| strategy | real tok/s | vs sorted | step tok/s median [min, max] | slots/s | padding eff. "
        "(computed / bins) | steps | rows/step | peak step MB | attention |",
        "|---|---:|---:|---|---:|---|---:|---:|---:|---|",
    ]
    for name, r in result["strategies"].items():
        if "error" in r:
            lines.append(f"| {name} | — | — | not run: {r['error']} | | | | | | |")
            continue
        s = r["step_real_tok_per_s"]
        vs = f"{r['vs_sorted']:.2f}x" if "vs_sorted" in r else "—"
        lines.append(
            f"| {name} | {r['real_tok_per_s']:,.0f} | {vs} | {s['median']:,.0f} "
            f"[{s['min']:,.0f}, {s['max']:,.0f}] | {r['slots_per_s']:,.0f} | {r['padding_efficiency']:.3f} / "
            f"{r['bin_padding_efficiency']:.3f} | {r['steps']} | {r['rows_per_step']['median']:.0f} | "
            f"{r['peak_memory_mb']:.0f} | {r['attention']}"
            f"{' — ' + r['attention_path'] if r.get('attention_path') else ''} |"
        )
    lines += [
        "",
        (
            "real tok/s: loss-bearing (non-padding) tokens of the epoch / its seconds, every micro-batch "
            "trained (the same tokens for every strategy)"
            if c["select"] == "epoch"
            else "real tok/s: the epoch's loss-bearing (non-padding) tokens / its estimated seconds (each "
            "measured step's seconds per unit of modeled work x the modeled work of the micro-batches it "
            "stands for: every strategy is compared on the same samples)"
        )
        + "; step tok/s: loss tokens / seconds of each measured step. Padding efficiency: real tokens / "
        "slots the model computed, and "
        "with packed bins counted at the full budget (the fixed-shape convention of `padfree.bench.measure`; "
        "equal to the first for padded strategies). Peak step MB: see `memory` in the JSON.",
        "",
    ]
    notes = [f"- `{n}`: {r['note']}" for n, r in result["strategies"].items() if r.get("note")]
    if notes:
        lines += ["Peers:", "", *notes, ""]
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in result["strategies"].items() if "error" not in r]
    rs = [result["strategies"][n] for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    ax = axes[0]
    y = [r["real_tok_per_s"] for r in rs]
    lo = [r["real_tok_per_s"] - r["step_real_tok_per_s"]["min"] for r in rs]
    hi = [r["step_real_tok_per_s"]["max"] - r["real_tok_per_s"] for r in rs]
    colors = ["tab:blue" if n in PADFREE else "tab:gray" for n in names]
    ax.bar(names, y, color=colors, yerr=[np.maximum(lo, 0), np.maximum(hi, 0)], capsize=3)
    ax.set_ylabel("real (loss-bearing) tokens / s")
    ax.set_title(f"training throughput, budget {result['config']['budget']}")
    ax.tick_params(axis="x", rotation=35)
    ax = axes[1]
    ax.bar(names, [r["padding_efficiency"] for r in rs], color=colors)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("padding efficiency (measured steps)")
    ax.tick_params(axis="x", rotation=35)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
