"""Does drafter packing leak? One packed row of real documents against each document alone: the frozen
target's hidden states, each document's anchors and drafter loss, and the attention pairs and labels that
cross a document boundary (the logic of ``padfree check-drafter``).

A correct setup gives, for every document, the same target hidden states (to float noise), the same anchor
set, the same loss numerator and denominator, and no (query, key) pair, shifted input or label joining two
documents. The last two are counted structurally (from the fields' ``labelled`` gate and ``input_index``),
not only where they change a loss: a label taken from the next document is a leak even when that token
carries no loss on this data. ``leaky=True`` builds the batch the way row-level packers do (DFlash anchors
chosen over the row with one quota, block labels and the EAGLE-3 shift running across the row), which the
check must catch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from padfree.drafter import methods
from padfree.errors import ConfigError

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"
DEFAULT_CHATS = ("gsm8k", "hh_rlhf_harmless_test", "gpteacher_codegen")
DEFAULT_DOCS = ("llamafactory_c4_wiki_docs", "python_stdlib_code")
HIDDEN_TOL = 1e-4  # float32: packed and alone agree to ~1e-6 on the tiny target
LOSS_TOL = 1e-4  # relative, on each document's loss numerator


@dataclass(frozen=True)
class DocResult:
    """One document of the packed row: its sample, tokens, anchors and loss, packed and alone."""

    sample_id: int
    tokens: int
    loss_tokens: int
    anchors_packed: tuple[int, ...]
    anchors_alone: tuple[int, ...]
    num_packed: float
    den_packed: float
    num_alone: float
    den_alone: float

    @property
    def loss_matches(self) -> bool:
        return self.den_packed == self.den_alone and abs(self.num_packed - self.num_alone) <= LOSS_TOL * max(
            1.0, abs(self.num_alone)
        )


@dataclass(frozen=True)
class DrafterCheck:
    """What :func:`check_drafter` measured (``ok``: everything matches; else a leak, said by ``reason``).

    A leak is judged structurally as well as by the losses: a (query, key) pair joining two documents, or a
    shifted input or label taken from another document (``j >= doc_remaining[t]``), is a leak even where it
    happens to change no loss on this data (the next document's first tokens carry no loss).

    Attributes:
        target_probe: the target's leak probe (:mod:`padfree.torch.documents.leak_probe`): how far a later
        document's
            logits move when the first document changes, held to ``target_probe_allowance`` (its noise);
            ``target_causal``: how far earlier logits move when every document's last token changes (the same
            allowance); ``target_own``: max |packed - each document alone through the target's own eager/sdpa
            attention| of the target's logits, held to ``HIDDEN_TOL``.
        cross_pairs: attended (query, key) pairs joining two documents.
        cross_inputs: draft inputs read from another document (EAGLE-3's shifted tokens; DFlash blocks feed
            only the anchor's token and mask tokens).
        cross_labels: draft positions whose label (the token they are trained to predict) lies in another
            document, counted whether or not that token carries loss here.
        cross_supervised: of ``cross_inputs + cross_labels``, those that reach a supervised draft position on
            this data (the rest is latent: it leaks as soon as a document starts with supervised tokens).
    """

    method: str
    leaky: bool
    path: str
    layout: str
    docs: tuple[DocResult, ...]
    max_hidden_diff: float
    cross_pairs: int
    cross_inputs: int
    cross_labels: int
    cross_supervised: int
    block_size: int
    ttt: int
    recipe: str = ""
    target_probe: float = 0.0
    target_probe_allowance: float = 0.0
    target_causal: float = 0.0
    target_own: float = 0.0

    @property
    def anchors_identical(self) -> bool:
        return all(d.anchors_packed == d.anchors_alone for d in self.docs)

    @property
    def losses_match(self) -> bool:
        return all(d.loss_matches for d in self.docs)

    @property
    def docs_differ(self) -> int:
        """Documents whose anchor set or loss differs packed vs alone."""
        return sum(d.anchors_packed != d.anchors_alone or not d.loss_matches for d in self.docs)

    @property
    def ok(self) -> bool:
        return self.reason == ""

    @property
    def reason(self) -> str:
        """One line saying what leaks (empty when nothing does)."""
        parts = []
        if self.target_probe > self.target_probe_allowance:
            parts.append(
                f"changing document 1 moves the target's later documents by {self.target_probe:.3g} (probe)"
            )
        if self.target_causal > self.target_probe_allowance:
            parts.append(
                f"changing each document's last token moves the target's earlier logits by "
                f"{self.target_causal:.3g} (it attends to future tokens)"
            )
        if not self.target_own <= HIDDEN_TOL:
            parts.append(
                f"the target's packed logits differ from each document alone through its own attention by "
                f"{self.target_own:.3g}"
            )
        if self.max_hidden_diff > HIDDEN_TOL:
            parts.append(f"target hidden states differ packed vs alone by {self.max_hidden_diff:.3g}")
        if self.docs_differ:
            what = "anchors or losses" if methods.get(self.method).uses_anchors else "losses"
            parts.append(f"{self.docs_differ} of {len(self.docs)} documents get other {what} than alone")
        if self.cross_pairs:
            parts.append(f"{self.cross_pairs} attended (query, key) pairs join two documents")
        crossing = self.cross_inputs + self.cross_labels
        if crossing:
            what = methods.get(self.method).crossing
            latent = ": the leak is latent here" if self.cross_supervised == 0 else ""
            parts.append(
                f"{crossing} {what} cross a document end ({self.cross_supervised} supervised on this data"
                f"{latent})"
            )
        return "; ".join(parts)


def fixture_documents(n_docs: int = 6, max_tokens: int = 160) -> list[dict]:
    """Real documents from the bundled fixtures: chats (loss on assistant turns) alternating with plain
    documents (loss on every token), each cut to ``max_tokens``, tokenized by the one rule."""
    from padfree.data.samples import load_samples

    tok = FIXTURES / "tokenizers" / "llama_sp32k.model"
    if not tok.is_file():
        raise ConfigError(
            f"check-drafter: the bundled fixtures are not here ({FIXTURES}); pass --data FILE --tokenizer TOK"
        )
    files = [FIXTURES / "samples" / f"{n}.jsonl.gz" for n in DEFAULT_CHATS]
    chats = load_samples(files, tok, per_file=1, max_len=max_tokens)
    files = [FIXTURES / "samples" / f"{n}.jsonl.gz" for n in DEFAULT_DOCS]
    docs = load_samples(files, tok, per_file=2, max_len=max_tokens)
    mixed = (
        [x for pair in zip(chats, docs) for x in pair] + list(chats[len(docs) :]) + list(docs[len(chats) :])
    )
    return mixed[:n_docs]


def frozen_target(name_or_dir: str, vocab: int, seed: int):
    """The target check-drafter runs: a folder with weights is loaded (its vocabulary must cover the
    documents), else a built-in tiny family or a config directory is built, random weights, at ``vocab``."""
    from pathlib import Path

    from padfree.drafter.target import build_target, load_target

    p = Path(name_or_dir)
    if p.is_dir() and any(p.glob("*.safetensors")):
        model = load_target(p)
        if int(model.config.vocab_size) < vocab:
            raise ConfigError(
                f"{p}: vocabulary of {model.config.vocab_size} ids, the documents use ids up to {vocab - 2}"
            )
        return model
    return build_target(name_or_dir, seed=seed, vocab_size=vocab)


def check_memory(models, samples: list[dict], layout: str) -> None:
    """Refuse in one line a check whose batch would not fit in the memory this machine has available: the
    drafter's activation model (:func:`padfree.drafter.train.memory_model`, a training micro-batch's, an upper
    bound for the check's no-gradient forward) on the batch's tokens, draft blocks (``block_size`` queries
    each, their ``B x B`` scores) and reach. Nothing is refused where the available memory is unknown."""
    from padfree.core.cost import micro_shapes
    from padfree.drafter import proc
    from padfree.drafter.setup import sample_anchors
    from padfree.drafter.train import memory_model

    free = proc.available_bytes()
    if free is None:
        return
    masks = [np.asarray(s["loss_mask"]).astype(bool) for s in samples]
    lengths = np.array([m.size for m in masks], np.int64)
    anchors = sample_anchors(models.recipe, lengths, np.concatenate(masks))
    shapes = micro_shapes(lengths, np.array([0, lengths.size]), layout == "packed", anchors)
    need = float(memory_model(models).micro_bytes(shapes)[0])
    if need > free:
        r = models.recipe
        if anchors is not None:
            what, lower = (
                f"{int(anchors.sum())} draft blocks of {r.block_size} queries",
                "--block-size, --docs",
            )
        else:
            what, lower = f"{r.ttt} test-time-training steps", "--ttt, --docs"
        raise ConfigError(
            f"check-drafter: {len(samples)} documents of {int(lengths.sum())} tokens with {what} need about "
            f"{need / 2**30:.1f} GiB; this machine has {free / 2**30:.1f} GiB available: lower {lower} or "
            "--max-tokens"
        )


def drafts(recipe, samples: list[dict]) -> np.ndarray:
    """Which of ``samples`` have a supervised draft position under ``recipe``: an anchor its rule allows
    (methods with anchors), else a loss token after the first."""
    from padfree.drafter.setup import sample_anchors

    masks = [np.asarray(d["loss_mask"]).astype(bool) for d in samples]
    flat = np.concatenate(masks) if masks else np.zeros(0, bool)
    anchors = sample_anchors(recipe, [m.size for m in masks], flat)
    if anchors is not None:
        return np.asarray(anchors) > 0
    return np.array([bool(m[1:].any()) for m in masks], bool)


def why_nothing_drafts(recipe, samples: list[dict]) -> str:
    """Why no document of ``samples`` has a supervised draft position under ``recipe``, with the numbers:
    no loss token at all, or (methods with anchors) loss tokens but no anchor within the recipe's margin.

    >>> from padfree.drafter import recipes
    >>> doc = {"input_ids": np.arange(12), "loss_mask": np.r_[np.zeros(4), np.ones(8)].astype(np.int8)}
    >>> print(why_nothing_drafts(recipes.get("speculators", "dflash"), [doc, doc]))  # doctest: +ELLIPSIS
    no anchor fits within the anchor margin: 2 of 2 documents have loss tokens (16 in all), but an anchor...
    """
    masks = [np.asarray(d["loss_mask"]).astype(bool) for d in samples]
    with_loss = sum(bool(m.any()) for m in masks)
    if not with_loss:
        return (
            f"no loss tokens in any of the {len(samples)} documents; use data with assistant turns (or "
            "--loss-on all), or raise --max-tokens"
        )
    longest = max(m.size for m in masks)
    supervised = sum(int(m.sum()) for m in masks)
    if methods.get(recipe.method).uses_anchors:
        return (
            f"no anchor fits within the anchor margin: {with_loss} of {len(samples)} documents have loss "
            f"tokens ({supervised} in all), but an anchor needs a supervised position a with a + "
            f"{recipe.anchor_margin} (the anchor margin of recipe {recipe.name}) below its document's "
            f"length and the longest document is {longest} tokens (block size {recipe.block_size}); lower "
            "--anchor-margin or --block-size, or raise --max-tokens"
        )
    return (
        f"no supervised draft position under recipe {recipe.name}: {with_loss} of {len(samples)} documents "
        f"have loss tokens ({supervised} in all), none after a document's first token"
    )


def check_drafter(
    method: str = "dflash",
    samples: list[dict] | None = None,
    *,
    leaky: bool = False,
    recipe=None,
    block_size: int | None = None,
    ttt: int | None = None,
    seed: int = 0,
    epoch: int = 0,
    layout: str = "packed",
    target: str = "tiny-llama",
) -> DrafterCheck:
    """Pack ``samples`` (``{"input_ids", "loss_mask"}``; default :func:`fixture_documents`) into one row
    (``layout="padded"``: a padded batch, a row each), run the tiny target and a reference drafter (random
    weights, float32, CPU, dense masks) under ``recipe`` (default: the ``specforge`` preset; ``block_size``
    and ``ttt`` override it; ``target``: a built-in tiny family, a config directory (random weights) or a
    target folder with weights, refused if its packed documents leak) on it and on each document alone, and
    compare each document's loss numerator and denominator. Under a per-document normalisation (speculators:
    a row's mean, one document per row) "alone" is the document's own mean; the packed row's numerator for it
    must equal that, and its denominator 1."""
    import padfree.torch.documents.attention as pa
    from padfree.drafter.collate import DrafterCollator
    from padfree.drafter.target import run_target
    from padfree.drafter.train import build_models, loss_sums, token_counts
    from padfree.torch.documents.leak_probe import against_own_attention, probe_leak

    spec = methods.get(method)
    samples = fixture_documents() if samples is None else samples
    if layout not in ("packed", "padded"):
        raise ConfigError(f"check-drafter: layout must be packed or padded (got {layout!r})")
    if leaky and layout != "packed":
        raise ConfigError(
            "check-drafter: --leaky reproduces what packers do to packed rows; use --layout packed"
        )
    if len(samples) < 2:
        raise ConfigError(f"check-drafter: needs at least 2 documents to pack (got {len(samples)})")
    items = [{**s, "sample_id": i} for i, s in enumerate(samples)]
    vocab = int(max(int(np.max(s["input_ids"])) for s in samples)) + 2
    mask_id = vocab - 1
    counts = token_counts(samples, vocab)
    models = build_models(
        method,
        vocab=vocab,
        seed=seed,
        recipe=recipe,
        block_size=block_size,
        ttt=ttt,
        counts=counts,
        target=None if target == "tiny-llama" else frozen_target(target, vocab, seed),
    )
    recipe = models.recipe
    if not drafts(recipe, samples).any():  # before any forward: say why, not what it leads to
        raise ConfigError(f"check-drafter: nothing to compare: {why_nothing_drafts(recipe, samples)}")
    check_memory(models, samples, layout)
    packed = DrafterCollator(
        method, recipe=recipe, seed=seed, mask_token_id=mask_id, leaky=leaky, layout=layout
    )
    alone = DrafterCollator(method, recipe=recipe, seed=seed, mask_token_id=mask_id)
    packed.set_epoch(epoch)
    alone.set_epoch(epoch)

    pa.reset_path()
    batch = packed(items)
    c = batch.contract
    assert c is not None
    with torch.no_grad():
        out = run_target(models.target, c, models.layers)
        path = pa.last_path() or "transformers attention"
        num, den = loss_sums(models, batch, out=out)
    probe = probe_leak(models.target)
    own = against_own_attention(models.target, grads=False)
    f = batch.fields
    doc = c.flat("document_ids")[0]
    pairs, cross_in, reaches = spec.load().crossings(batch)
    lab = f.label_index
    cross_lab = f.labelled & ((lab < 0) | (doc[lab.clamp(min=0)] != f.query_doc))
    supervised_crossing = int((cross_lab & f.supervised).sum() + (cross_in & reaches).sum())
    results, max_diff = _each_alone(models, batch, out, num, den, alone, items, samples)
    if not any(r.den_alone for r in results):
        raise ConfigError(f"check-drafter: nothing to compare: {why_nothing_drafts(recipe, samples)}")
    return DrafterCheck(
        method,
        leaky,
        path,
        layout,
        tuple(results),
        max_diff,
        pairs,
        int(cross_in.sum()),
        int(cross_lab.sum()),
        supervised_crossing,
        recipe.block_size,
        recipe.ttt,
        recipe.name,
        probe.diff,
        probe.allowance,
        probe.causal,
        own.logits,
    )


def _each_alone(
    models: Any, batch: Any, out: Any, num: Any, den: Any, alone: Any, items: list, samples: list
) -> tuple[list[DocResult], float]:
    """Each document of the packed ``batch`` run alone (``alone``: the collator of one document): its loss
    numerator and denominator beside the packed row's, and the largest difference of the target's outputs."""
    from padfree.drafter.target import run_target
    from padfree.drafter.train import loss_sums

    c = batch.contract
    results = []
    max_diff = 0.0
    for d in range(c.n_docs):
        one = alone([items[d]])
        assert one.contract is not None
        with torch.no_grad():
            o1 = run_target(models.target, one.contract, models.layers)
            n1, d1 = loss_sums(models, one, out=o1)
        s = c.doc_slice(d)
        max_diff = max(
            max_diff,
            float((out.hidden[0, s] - o1.hidden[0]).abs().max()),
            float((out.last[0, s] - o1.last[0]).abs().max()),
        )
        a_p, a_1 = batch.anchors_by_doc()[d], one.anchors_by_doc()[0]
        lm = np.asarray(samples[d]["loss_mask"]).astype(bool)
        loss = (float(num[d]), float(den[d]), float(n1[0]), float(d1[0]))
        results.append(DocResult(d, int(c.doc_lengths[d]), int(lm.sum()), a_p, a_1, *loss))
    return results, max_diff
