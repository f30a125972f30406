"""The timed trainer of ``padfree bench``: a model and its AdamW optimizer with the collator and attention its
micro-batches need, one micro-batch per timed optimizer step; and the peak-memory watch around it."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass, field

from padfree.errors import ConfigError

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class ModelRun:
    """The model a bench run trains and how: ``padfree bench`` (:class:`~.train_speed.BenchConfig`) and
    ``padfree bench --converge`` (:class:`~.converge.ConvergeConfig`) extend it with what they measure.

    Attributes:
        budget: tokens per micro-batch (padded: count x longest; packed: sum of lengths).
        seed: the model's initial weights, the samples and the plans.
        model: built-in tiny model or a config directory; ``model_overrides``: config fields to override.
        lr, clip, weight_decay: AdamW learning rate, gradient-norm clip (0: off) and weight decay.
        device, threads: where it runs; torch CPU threads (None: leave torch's choice).
        dtype: ``float32``, or ``bfloat16``: float32 weights and optimizer, forward and loss under
            ``torch.autocast(dtype=torch.bfloat16)`` (mixed precision; on a GPU packed rows then reach a
            fused varlen attention kernel, which needs fp16/bf16).
        padded_mask: padded rows get an attention mask (else the causal kernel runs on right padding).
    """

    budget: int = 2048
    seed: int = 0
    model: str = "tiny-llama"
    model_overrides: dict = field(default_factory=dict)
    lr: float = 1e-4
    clip: float = 1.0
    weight_decay: float = 0.0
    device: str = "cpu"
    threads: int | None = 2
    dtype: str = "float32"
    padded_mask: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)} (got {self.dtype!r})")
        if self.budget < 2:
            raise ConfigError(f"budget must be >= 2 (got {self.budget})")


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

        from padfree.models import build_model
        from padfree.torch import PackCollator, PadCollator
        from padfree.torch.documents.attention import attention_for_rows

        self.attn = attention_for_rows(packed)
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
    def of(cls, run: ModelRun, packed: bool) -> Trainer:
        """The trainer of ``run`` for packed rows (``packed``) or padded ones."""
        return cls(
            run.model,
            run.model_overrides,
            run.seed,
            run.device,
            run.lr,
            run.clip,
            packed,
            run.weight_decay,
            dtype=run.dtype,
            padded_mask=run.padded_mask,
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
        import padfree.torch.documents.attention as pa
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
