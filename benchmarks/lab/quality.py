"""Drafter quality per training second (``benchmarks/drafter_quality.py``): a small target trained on the
bundled chats, its greedy answers as the drafters' training responses, drafters trained under three batchings
for the same CPU seconds, and acceptance length measured on held-out prompts by the engines' own code.

- **Target** (:func:`build_target_folder`): a byte-level BPE tokenizer and a Qwen3 causal LM trained from
  scratch on the training split's chats (padfree's tokenization rule, packed rows), written as a transformers
  folder; deterministic for a seed on one machine (one thread, fixed steps).
- **Responses** (:func:`regenerate`): for each training chat, its first user turn and the assistant turn's
  header as the prompt, the target's greedy answer (to its end marker or ``max_new`` tokens) as the response,
  which carries the loss: the data-token objective then trains toward what the target emits, as the published
  recipes regenerate their data.
- **Arms** (:data:`ARMS`): padfree's packed plans (:func:`padfree.core.planner.make_plan`, anchors counted),
  SpecForge's random padded batches (:func:`padfree.baselines.fixed_count`, DFlash blocks padded to the row
  with the most: :func:`padfree.drafter.methods.dflash.model.pad_anchor_slots`), the field's length-sorted
  batches of the same count (:func:`padfree.baselines.sorted_fixed_count`, a composition that never changes).
  One micro-batch per optimizer step, the same recipe, learning rate and seed in every arm.
- **Acceptance length**: DFlash by the ``dflash`` package's ``dflash_generate`` (greedy) on the exported
folder
  loaded with ``DFlashDraftModel.from_pretrained`` (:func:`dflash_acceptance`); its timer calls
  ``torch.cuda.synchronize``, replaced here by a no-op so that its clock is ``time.perf_counter`` on a CPU.
  speculators has no decoding loop (vLLM serves its drafters), so EAGLE-3 is measured by
  :func:`eagle3_acceptance`: speculators' own ``Eagle3DraftModel.forward`` on the target's greedy output
  (test-time training feeds step ``k`` the drafter's own state and the true token ``k`` ahead, which is what a
  chain draft is fed as long as its earlier tokens were accepted), then greedy chain verification
  (:func:`chain_acceptance`). Both count, per verification step, the accepted draft tokens plus the target's
  own (the bonus token): the mean is the acceptance length.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

ARMS = ("padfree_packed", "specforge_random", "sorted_fixed")
"""The batchings compared (see the module docstring)."""

SPECIALS = ("<s>", "</s>", "<pad>", "<mask>")
"""The tokenizer's special tokens: begin and end of a turn (padfree's rule writes one pair around every
message), padding, and DFlash's mask token."""

CHAT_FILES = (
    "gsm8k",
    "hh_rlhf_harmless_test",
    "gpteacher_codegen",
    "gpteacher_roleplay_toolformer",
    "self_instruct_t0",
    "humaneval",
)
"""The bundled chat sets (``fixtures/samples``) the target and drafters learn from."""


# ----- data -------------------------------------------------------------------------------------------------
def read_chats(
    folder: Path, names: Sequence[str] = CHAT_FILES, per_file: int | None = None
) -> list[list[dict]]:
    """Chats (lists of ``{"role", "content"}``) of the sets ``names`` in ``folder`` that open with a user turn
    followed by an assistant turn, in file order (the first ``per_file`` of each set, if given)."""
    chats = []
    for name in names:
        kept = 0
        with gzip.open(folder / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
            for line in f:
                msgs = json.loads(line).get("messages") or []
                msgs = [{"role": m["role"], "content": m.get("content") or ""} for m in msgs]
                if len(msgs) >= 2 and msgs[0]["role"] == "user" and msgs[1]["role"] == "assistant":
                    chats.append(msgs)
                    kept += 1
                    if per_file is not None and kept >= per_file:
                        break
    return chats


def split(n: int, heldout: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(training, held-out)`` indices of ``n`` chats: ``heldout`` drawn at random, never trained on."""
    perm = np.random.default_rng([seed, 7]).permutation(n)
    return np.sort(perm[heldout:]), np.sort(perm[:heldout])


# ----- target -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TargetSpec:
    """The benchmark's target: tokenizer vocabulary, Qwen3 sizes and its training (packed rows of ``budget``
    tokens, AdamW at ``lr`` with a cosine decay, ``epochs`` over the training chats)."""

    vocab: int = 2048
    hidden: int = 128
    layers: int = 8
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 384
    head_dim: int | None = None
    budget: int = 2048
    epochs: int = 4
    lr: float = 3e-3
    seed: int = 0


def train_tokenizer(texts: Sequence[str], vocab: int, out: Path) -> Any:
    """A byte-level BPE tokenizer of ``vocab`` tokens (:data:`SPECIALS` first) trained on ``texts``, saved in
    ``out`` as a transformers fast tokenizer; returns it."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIALS[0],
        eos_token=SPECIALS[1],
        pad_token=SPECIALS[2],
        mask_token=SPECIALS[3],
    )
    fast.save_pretrained(out)
    return fast


def chat_texts(chats: Sequence[list[dict]]) -> list[str]:
    """The texts padfree's rule encodes for ``chats`` (``role + "\\n" + content + "\\n"`` per message)."""
    return [m["role"] + "\n" + m["content"] + "\n" for c in chats for m in c]


def encode_chats(folder: Path, chats: Sequence[list[dict]]) -> list[dict]:
    """``chats`` tokenized by padfree's rule with the folder's tokenizer (loss on assistant turns)."""
    from padfree.data.tokenization import Tokenizer, encode_samples

    enc = encode_samples(Tokenizer(folder), list(chats))
    return [
        {"input_ids": ids.astype(np.int64), "loss_mask": m.astype(bool)}
        for ids, m in map(enc.sample, range(len(enc)))
    ]


def train_lm(
    model: Any,
    samples: Sequence[dict],
    *,
    budget: int,
    epochs: int,
    lr: float,
    seed: int,
    say: Callable[[str], None] = print,
    dtype: str = "float32",
) -> dict:
    """Train ``model`` (a causal LM with padfree's per-document attention, on its device) as a language model
    on every token of ``samples``, packed rows of ``budget`` tokens (padfree plans), AdamW with warmup and
    cosine decay (``dtype="bfloat16"``: under bf16 autocast). Returns the token count, steps, CPU seconds and
    the last epoch's mean loss."""
    import torch

    from padfree.core.config import PlanConfig
    from padfree.core.planner import make_plan
    from padfree.drafter.contract import build_contract

    lengths = np.array([min(len(s["input_ids"]), budget) for s in samples], np.int64)
    cfg = PlanConfig(strategy="packed", budget=budget, seed=seed, overlong="truncate")
    plans = [make_plan(lengths, cfg, e) for e in range(epochs)]
    total = sum(p.offsets.shape[0] - 1 for p in plans)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warm = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + np.cos(np.pi * min(1.0, s / total)))
    )
    model.train()
    dev = next(model.parameters()).device
    bf16 = dtype == "bfloat16"
    t0, step, last = time.process_time(), 0, []
    for e, plan in enumerate(plans):
        losses = []
        for k in range(plan.offsets.shape[0] - 1):
            ids = plan.indices[plan.offsets[k] : plan.offsets[k + 1]]
            docs = [(samples[int(i)]["input_ids"][:budget], np.ones(int(lengths[i]), bool)) for i in ids]
            c = build_contract(docs, layout="packed")
            inputs = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in c.target_inputs().items()}
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(**inputs, use_cache=False).logits[0]
            flat = c.flat("input_ids")[0].to(dev)
            ok = (c.flat("doc_remaining")[0][:-1] > 1).to(dev)  # the next token is in the same document
            loss = torch.nn.functional.cross_entropy(logits[:-1][ok].float(), flat[1:][ok])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            step += 1
        last = losses
        spent = time.process_time() - t0
        say(f"target epoch {e}: loss {np.mean(losses):.3f} ({step}/{total} steps, {spent:.0f} CPU s)")
    model.eval()
    return {
        "tokens_per_epoch": int(lengths.sum()),
        "steps": step,
        "cpu_seconds": time.process_time() - t0,
        "last_epoch_loss": float(np.mean(last)) if last else None,
    }


def build_target_folder(
    out: Path,
    chats: Sequence[list[dict]],
    spec: TargetSpec,
    *,
    say=print,
    device: str = "cpu",
    dtype: str = "float32",
) -> dict:
    """Train the benchmark's tokenizer and target on ``chats`` into the folder ``out`` (kept: a folder that
    already holds ``target.json`` of the same spec is reused), on ``device`` (float32 weights, ``dtype``
    autocast). Returns what ``target.json`` records."""
    import dataclasses

    import torch
    import transformers

    record = out / "target.json"
    if record.is_file():
        info = json.loads(record.read_text())
        if info.get("spec") == dataclasses.asdict(spec):
            say(f"target: reusing {out}")
            return info
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.process_time()
    tok = train_tokenizer(chat_texts(chats), spec.vocab, out)
    samples = encode_chats(out, chats)
    import padfree.torch.documents.attention  # noqa: F401  (registers padfree_varlen)

    cfg = transformers.Qwen3Config(
        vocab_size=len(tok),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim or spec.hidden // spec.heads,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(spec.seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="padfree_varlen").to(
        device
    )
    stats = train_lm(
        model,
        samples,
        budget=spec.budget,
        epochs=spec.epochs,
        lr=spec.lr,
        seed=spec.seed,
        say=say,
        dtype=dtype,
    )
    model.config.use_cache = True
    model.cpu().save_pretrained(out)
    info = {
        "spec": dataclasses.asdict(spec),
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "chats": len(chats),
        "train": stats,
        "build_cpu_seconds": time.process_time() - t0,
        "path": str(out),
    }
    record.write_text(json.dumps(info, indent=2) + "\n")
    return info


# ----- prompts and responses --------------------------------------------------------------------------------
def prompts_of(
    folder: Path, chats: Sequence[list[dict]], max_prompt: int
) -> list[tuple[int, np.ndarray, int]]:
    """For each chat whose prompt fits ``max_prompt`` tokens: ``(chat index, prompt, user tokens)``, the
    prompt being its first user turn by padfree's rule then the assistant turn's begin marker and role line
    (what the target answers), of which the first ``user tokens`` are the user turn."""
    from padfree.data.tokenization import Tokenizer, encode_samples

    tok = Tokenizer(folder)
    enc = encode_samples(tok, [[c[0]] for c in chats])
    head = np.concatenate([[tok.markers[0]], np.asarray(tok.encode(["assistant\n"])[0], np.int64)])
    out = []
    for i in range(len(enc)):
        user = enc.sample(i)[0].astype(np.int64)
        if user.shape[0] + head.shape[0] <= max_prompt:
            out.append((i, np.concatenate([user, head]), int(user.shape[0])))
    return out


def load_decoder(folder: Path, dtype: str = "float32", device: str = "cpu") -> Any:
    """The target folder's model for decoding: SDPA attention, its KV cache on."""
    from padfree.drafter.target import load_target

    model = load_target(folder, dtype=dtype, device=device, attn="sdpa")
    model.config.use_cache = True
    return model


def regenerate(
    model: Any, prompts: Sequence[np.ndarray], *, max_new: int, eos: int, pad: int, batch: int = 32
) -> list[np.ndarray]:
    """Each prompt's greedy answer by ``model`` (up to and including ``eos``, at most ``max_new`` tokens);
    prompts of similar length batched together, left-padded."""
    import torch

    out: list[np.ndarray | None] = [None] * len(prompts)
    order = np.argsort([len(p) for p in prompts], kind="stable")
    dev = next(model.parameters()).device
    for a in range(0, len(order), batch):
        idx = order[a : a + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        att = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            p = torch.as_tensor(prompts[i])
            ids[r, width - len(p) :] = p
            att[r, width - len(p) :] = 1
        with torch.no_grad():
            gen = (
                model.generate(
                    input_ids=ids.to(dev),
                    attention_mask=att.to(dev),
                    max_new_tokens=max_new,
                    do_sample=False,
                    eos_token_id=eos,
                    pad_token_id=pad,
                )[:, width:]
                .cpu()
                .numpy()
            )
        for r, i in enumerate(idx):
            g = gen[r]
            stop = np.flatnonzero(g == eos)
            out[i] = g[: stop[0] + 1] if stop.size else g
    return [np.asarray(g, np.int64) for g in out]


def response_samples(
    prompts: Sequence[np.ndarray], answers: Sequence[np.ndarray], users: Sequence[int]
) -> list[dict]:
    """Training samples: prompt + answer, the loss on the assistant turn (its begin marker, role line and the
    answer, as padfree's rule marks an assistant turn); ``users[i]``: prompt ``i``'s user-turn tokens."""
    out = []
    for p, g, u in zip(prompts, answers, users, strict=True):
        ids = np.concatenate([p, g]).astype(np.int64)
        mask = np.zeros(ids.shape[0], bool)
        mask[u:] = True
        out.append({"input_ids": ids, "loss_mask": mask})
    return out


def greedy(model: Any, prompt: np.ndarray, *, max_new: int, eos: int) -> np.ndarray:
    """The target's greedy continuation of one prompt (no padding: the reference decoding is checked
    against)."""
    import torch

    dev = next(model.parameters()).device
    with torch.no_grad():
        g = (
            model.generate(
                input_ids=torch.as_tensor(prompt)[None].to(dev),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
            )[0, len(prompt) :]
            .cpu()
            .numpy()
        )
    stop = np.flatnonzero(g == eos)
    return np.asarray(g[: stop[0] + 1] if stop.size else g, np.int64)


# ----- acceptance length ------------------------------------------------------------------------------------
@dataclass
class Acceptance:
    """Acceptance over held-out prompts: ``steps`` verification steps produced ``tokens`` tokens (accepted
    drafts plus the target's own each step); ``matches``: prompts whose decoded output equals the target's
    greedy output (speculative decoding must not change it)."""

    tokens: int = 0
    steps: int = 0
    matches: int = 0
    prompts: int = 0
    per_prompt: list[float] = field(default_factory=list)

    @property
    def length(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


def zlab_dflash2_folder(models: Any, out: Path, *, mask_token_id: int, target_path: Path) -> Path:
    """``models``' DFlash2 drafter as z-lab's folder (:func:`padfree.drafter.methods.dflash2.model.
    zlab_files`), which their ``dflash_generate`` decodes (padfree's export writes speculators' DFlash2
    format)."""
    import json

    from safetensors.torch import save_file

    from padfree.drafter.export import export_meta
    from padfree.drafter.methods.dflash2.model import zlab_files

    meta = export_meta(models, mask_token_id=mask_token_id, target_path=target_path)
    state = {k: v.detach().float().cpu() for k, v in models.drafter.state_dict().items()}
    config, tensors = zlab_files(state, meta)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


def dflash_acceptance(
    draft_dir: Path,
    decoder: Any,
    prompts: Sequence[np.ndarray],
    references: Sequence[np.ndarray],
    *,
    max_new: int,
    eos: int,
    model_class: str = "DFlashDraftModel",
) -> Acceptance:
    """Acceptance length of the exported DFlash drafter in ``draft_dir`` by the ``dflash`` package: its
    ``model_class.from_pretrained`` (``DFlash2DraftModel``: drafts through its candidate selector) and
    ``dflash_generate`` (greedy, stop at ``eos``). The package times
    prefill and decode with ``torch.cuda.synchronize`` then ``time.perf_counter``; on a CPU the synchronize is
    patched to a no-op for the call (``unittest.mock.patch("torch.cuda.synchronize")``)."""
    import torch

    from support.peers import import_peer

    zlab = import_peer("dflash", "model")
    model = getattr(zlab, model_class).from_pretrained(str(draft_dir)).eval()
    dev = next(decoder.parameters()).device
    model.to(dev)
    acc = Acceptance()
    with mock.patch("torch.cuda.synchronize", lambda *a, **k: None), torch.no_grad():
        for p, ref in zip(prompts, references, strict=True):
            r = zlab.dflash_generate(
                model, decoder, torch.as_tensor(p)[None].to(dev), max_new, [eos], return_stats=True
            )
            got = r.output_ids[0, len(p) :].cpu().numpy()
            acc.matches += int(np.array_equal(got, ref))
            acc.prompts += 1
            acc.tokens += int(sum(r.acceptance_lengths))
            acc.steps += len(r.acceptance_lengths)
            acc.per_prompt.append(float(np.mean(r.acceptance_lengths)) if r.acceptance_lengths else 0.0)
    return acc


def chain_acceptance(drafts: np.ndarray, seq: np.ndarray, start: int) -> list[int]:
    """Greedy chain verification over a known greedy output: ``seq`` is prompt + the target's greedy tokens,
    ``seq[start]`` the first generated token (the prefill's); ``drafts[k, t]`` the drafter's token ``k + 1``
    ahead when fed the target's state at ``t`` and the token ``seq[t + 1]`` (it predicts ``seq[t + 2 + k]``).
    A verification step at known token ``j`` accepts the leading drafts ``drafts[:, j - 1]`` equal to
    ``seq[j + 1 ...]`` and adds the target's own next token. Returns the tokens each step produced.

    >>> seq = np.array([5, 6, 7, 8, 9, 10])  # prompt [5, 6]; generated 7 8 9 10
    >>> drafts = np.array([[0, 8, 0, 0, 0], [0, 0, 0, 0, 0]])  # at t=1 (fed 7): 8 right, then wrong
    >>> chain_acceptance(drafts, seq, 2)  # step at j=2: 8 accepted + 9 from the target; then 10
    [2, 1]
    """
    k_max = drafts.shape[0]
    out, j, end = [], start, seq.shape[0] - 1
    while j < end:
        n = 0
        while n < k_max and j + 1 + n <= end and drafts[n, j - 1] == seq[j + 1 + n]:
            n += 1
        produced = min(n + 1, end - j)
        out.append(produced)
        j += produced
    return out


def eagle3_acceptance(
    draft_dir: Path,
    decoder: Any,
    prompts: Sequence[np.ndarray],
    references: Sequence[np.ndarray],
) -> Acceptance:
    """Acceptance length of the exported EAGLE-3 drafter in ``draft_dir`` by speculators' ``Eagle3DraftModel``
    (``from_pretrained``, SDPA attention): its forward over each prompt + the target's greedy output
    (``references``) gives every chain draft at once; :func:`chain_acceptance` verifies them
    (``speculative_tokens`` of its config drafts per step)."""
    import torch

    from support.peers import import_peer

    import_peer("speculators")
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    cfg = Eagle3SpeculatorConfig.from_pretrained(str(draft_dir))
    cfg.transformer_layer_config._attn_implementation = "sdpa"
    model = Eagle3DraftModel.from_pretrained(str(draft_dir), config=cfg).eval()
    dev = next(decoder.parameters()).device
    model.to(dev)
    spec = json.loads((Path(draft_dir) / "config.json").read_text())["speculators_config"]
    k = int(spec["proposal_methods"][0]["speculative_tokens"])
    layers = list(cfg.eagle_aux_hidden_state_layer_ids)
    acc = Acceptance()
    for p, ref in zip(prompts, references, strict=True):
        seq = np.concatenate([p, ref])
        if ref.shape[0] < 2:
            continue
        ids = torch.as_tensor(seq)[None].to(dev)
        with torch.no_grad():
            hs = decoder(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
            aux = torch.cat([hs[i] for i in layers], -1).float()
            t = seq.shape[0] - 1
            tokens = model(
                hidden_states=aux[:, :t],
                input_ids=ids[:, 1:],
                document_ids=torch.zeros(1, t, dtype=torch.long, device=dev),
                position_ids=torch.arange(1, t + 1, device=dev)[None],
                ttt_steps=k,
            )
        drafts = torch.cat(tokens, 0)
        if model.d2t is not None and model.use_draft_vocab:
            drafts = drafts + model.d2t[drafts]
        steps = chain_acceptance(drafts.cpu().numpy(), seq, len(p))
        acc.prompts += 1
        acc.matches += 1
        acc.tokens += int(sum(steps))
        acc.steps += len(steps)
        acc.per_prompt.append(float(np.mean(steps)) if steps else 0.0)
    return acc


# ----- training under each batching -------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """One drafter trained under one batching for ``seconds`` CPU seconds, evaluated at ``marks`` (fractions
    of ``seconds``) and at the end of its first ``epoch_evals`` epochs; everything it reads is on disk (it
    runs
    in a worker process)."""

    method: str
    arm: str
    seed: int
    seconds: float
    marks: tuple[float, ...]
    target: str
    data: str
    workdir: str
    budget: int = 2048
    lr: float = 1e-3
    draft_layers: int = 1
    max_new: int = 96
    block_size: int | None = None
    ttt: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    attention: str = "dense"
    epoch_evals: int = 6


def save_data(
    path: Path, samples: Sequence[dict], prompts: Sequence[np.ndarray], references: Sequence[np.ndarray]
) -> None:
    """What every job reads: the drafters' training samples and the held-out prompts with the target's greedy
    outputs."""

    def flat(arrays):
        arrays = [np.asarray(a, np.int64) for a in arrays]
        return np.concatenate(arrays or [np.zeros(0, np.int64)]), np.cumsum([0, *map(len, arrays)])

    ids, offs = flat([s["input_ids"] for s in samples])
    mask, _ = flat([s["loss_mask"] for s in samples])
    p, p_offs = flat(prompts)
    r, r_offs = flat(references)
    np.savez(path, ids=ids, offs=offs, mask=mask, p=p, p_offs=p_offs, r=r, r_offs=r_offs)


def load_data(path: str | Path) -> tuple[list[dict], list[np.ndarray], list[np.ndarray]]:
    z = np.load(path)

    def cut(a, o):
        return [a[o[i] : o[i + 1]] for i in range(len(o) - 1)]

    samples = [
        {"input_ids": i, "loss_mask": m.astype(bool)}
        for i, m in zip(cut(z["ids"], z["offs"]), cut(z["mask"], z["offs"]), strict=True)
    ]
    return samples, cut(z["p"], z["p_offs"]), cut(z["r"], z["r_offs"])


def epoch_batches(
    arm: str, lengths: np.ndarray, anchors: np.ndarray | None, budget: int, seed: int, epoch: int, cost: Any
) -> tuple[np.ndarray, np.ndarray, str]:
    """``(order, offsets, layout)`` of one epoch of ``arm``."""
    from padfree.baselines import fixed_count, sorted_fixed_count
    from padfree.core.config import PlanConfig
    from padfree.core.planner import make_plan

    if arm == "padfree_packed":
        cfg = PlanConfig(strategy="packed", budget=budget, seed=seed, cost=cost, overlong="truncate")
        plan = make_plan(lengths, cfg, epoch, anchors=anchors)
        return plan.indices, plan.offsets, "packed"
    rng = np.random.default_rng([seed, epoch, 11])
    if arm == "specforge_random":
        return (*fixed_count(lengths, budget, rng), "padded")
    if arm == "sorted_fixed":  # the same micro-batches every epoch, in a new random order
        from padfree.core import kernels

        order, offsets = sorted_fixed_count(lengths, budget, np.random.default_rng([seed, 0, 11]))
        return (*kernels.gather_segments(order, offsets, rng.permutation(offsets.shape[0] - 1)), "padded")
    raise ValueError(f"unknown arm {arm!r}")


def run_job(job: Job) -> dict:
    """Train, evaluate along the way, return the curve: per evaluation its CPU seconds, tokens and epochs
    trained, acceptance length (and per prompt), and why it was taken (``mark`` or ``epoch``)."""
    import torch

    from padfree.core.config import PlanConfig
    from padfree.drafter import recipes
    from padfree.drafter.collate import DrafterCollator
    from padfree.drafter.export import default_format, export_models
    from padfree.drafter.setup import TargetShape, drafter_setup
    from padfree.drafter.target import default_mask_token, load_target
    from padfree.drafter.train import build_models, loss_sums, token_counts

    gpu = job.device.startswith("cuda")
    if not gpu:
        torch.set_num_threads(1)

    def clock() -> float:  # CPU seconds of this process; on a GPU, wall seconds with the device synchronized
        if gpu:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()

    bf16 = gpu and job.dtype == "bfloat16"
    samples, prompts, references = load_data(job.data)
    folder = Path(job.target)
    target = load_target(folder, dtype=job.dtype, device=job.device)
    decoder = load_decoder(folder, device=job.device)
    vocab = int(target.config.vocab_size)
    eos = int(target.config.eos_token_id)
    mask_token = default_mask_token(folder)
    recipe = recipes.get("specforge", job.method)
    if job.method == "dflash2":  # z-lab serves DFlash2 without speculators' per-anchor window: train so
        recipe = dataclasses.replace(recipe, sliding_window=None)
    models = build_models(
        job.method,
        vocab=vocab,
        seed=job.seed,
        recipe=recipe,
        target=target,
        block_size=job.block_size,
        ttt=job.ttt,
        draft_layers=job.draft_layers,
        counts=token_counts(samples, vocab),
    )
    recipe = models.recipe
    models.drafter.to(job.device)
    params = models.trainable()
    opt = torch.optim.AdamW(params, lr=job.lr, weight_decay=0.0)
    lengths = np.array([min(len(s["input_ids"]), job.budget) for s in samples], np.int64)
    spec = models.method
    setup = drafter_setup(
        recipe,
        PlanConfig(strategy="packed", budget=job.budget, seed=job.seed, overlong="truncate"),
        target=TargetShape.of_config(target.config),
        lengths=np.array([len(s["input_ids"]) for s in samples], np.int64),
        loss_mask=np.concatenate([s["loss_mask"] for s in samples]),
        draft_layers=job.draft_layers,
    )
    anchors, cost = setup.anchors, setup.cost
    padding = spec.load().field_padding
    fmt = default_format(spec.name)
    work = Path(job.workdir)
    work.mkdir(parents=True, exist_ok=True)
    marks = [m * job.seconds for m in job.marks]
    curve: list[dict] = []
    spent, tokens, trained_samples = 0.0, 0, 0

    def evaluate(why: str, epoch: float) -> None:
        out = work / f"{why}-{len(curve)}"
        if spec.name == "dflash2":
            zlab_dflash2_folder(models, out, mask_token_id=mask_token, target_path=folder)
        else:
            export_models(models, fmt, out, mask_token_id=mask_token, target_path=folder)
        t0 = time.perf_counter()
        if spec.name == "dflash2":  # z-lab's DFlash2 folder, decoded through its selector
            acc = dflash_acceptance(
                out,
                decoder,
                prompts,
                references,
                max_new=job.max_new,
                eos=eos,
                model_class="DFlash2DraftModel",
            )
        elif fmt == "dflash":  # z-lab's folder, decoded by their dflash_generate
            acc = dflash_acceptance(out, decoder, prompts, references, max_new=job.max_new, eos=eos)
        else:  # speculators' folder: their model's forward, chain-verified
            acc = eagle3_acceptance(out, decoder, prompts, references)
        curve.append(
            {
                "why": why,
                "seconds": spent,
                "tokens": tokens,
                "samples": trained_samples,
                "epochs": epoch,
                "acceptance_length": acc.length,
                "per_prompt": acc.per_prompt,
                "greedy_matches": acc.matches,
                "prompts": acc.prompts,
                "eval_wall_seconds": time.perf_counter() - t0,
            }
        )

    evaluate("mark", 0.0)
    epoch, done = 0, False
    while not done:
        t0 = clock()
        order, offsets, layout = epoch_batches(job.arm, lengths, anchors, job.budget, job.seed, epoch, cost)
        col = DrafterCollator(
            spec.name, recipe=recipe, seed=job.seed, layout=layout, mask_token_id=mask_token
        )
        col.set_epoch(epoch)
        spent += clock() - t0
        n_micro = offsets.shape[0] - 1
        for k in range(n_micro):
            t0 = clock()
            ids = order[offsets[k] : offsets[k + 1]]
            items = [
                {
                    "input_ids": samples[i]["input_ids"][: job.budget],
                    "loss_mask": samples[i]["loss_mask"][: job.budget],
                    "sample_id": int(i),
                }
                for i in ids
            ]
            batch = col(items)
            if layout != "packed":
                batch = padding(batch, mask_token)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                num, den = loss_sums(models, batch, attention=job.attention)
                loss = num.sum() / den.sum().clamp(min=1e-6)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            spent += clock() - t0
            tokens += int(lengths[ids].sum())
            trained_samples += len(ids)
            while marks and spent >= marks[0]:
                marks.pop(0)
                evaluate("mark", epoch + (k + 1) / n_micro)
            if not marks:
                done = True
                break
        epoch += 1
        if not done and epoch <= job.epoch_evals:
            evaluate("epoch", float(epoch))
    return {
        "method": job.method,
        "arm": job.arm,
        "seed": job.seed,
        "curve": curve,
        "drafter_params": int(sum(p.numel() for p in params)),
    }
