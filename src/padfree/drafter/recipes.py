"""The published drafter training recipes as named presets: what SpecForge and vllm speculators train when a
user runs their DFlash or EAGLE-3 configs, field by field, so padfree trains (and counts, costs and plans) the
same workload. No torch here: the planner and the CLI read recipes too.

Every value comes from the recipes' source; docs/drafters.md ("Recipes") gives the file and line of each, read
at SpecForge a6b6b023 and speculators c05b95b3. A recipe is a frozen
dataclass; :func:`get` returns a preset for a method, :func:`override` changes fields one by one (the CLI's
``--recipe speculators --block-size 8``), checking every value.

>>> r = get("specforge", "dflash")
>>> r.block_size, r.max_anchors, r.anchor_density, r.objective, r.slot_weights, r.gamma, r.normalization
(16, 512, 1.0, 'data_ce', 'exp', 7.0, 'weighted')
>>> s = get("speculators", "dflash")
>>> s.objective, s.slot_weights, s.normalization, s.anchor_eligibility, s.anchor_margin, s.sliding_window
('argmax_ce', 'dpace', 'document', 'self', 16, 2048)
>>> override(s, block_size=8).anchor_margin  # speculators' margin is the block: it follows it
8
>>> e = get("specforge", "eagle3")
>>> e.ttt, e.step_decay, e.loss_gate, e.draft_vocab, e.out_of_vocab, e.head_init, e.head_trainable
(7, 0.8, 0, 32000, 'drop', 'random', True)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from numpy.typing import ArrayLike

from padfree.core.anchors import AnchorPolicy
from padfree.drafter import methods
from padfree.errors import ConfigError

OBJECTIVES = ("data_ce", "argmax_ce", "kl", "ce_tv")
"""``data_ce``: cross-entropy on the data token (SpecForge DFlash); ``argmax_ce``: cross-entropy on the
target's argmax (speculators DFlash); ``kl``: ``KL(target || drafter)`` on the target's distribution (EAGLE-3
in both; its soft cross-entropy is the KL plus a constant); ``ce_tv``: ``ce_weight`` x cross-entropy on the
target's argmax plus ``tv_weight`` x the total variation ``1 - sum_v min(p_v, q_v)`` to the target's
distribution, plus ``confidence_alpha`` x the binary cross-entropy of the drafter's confidence head against
``1 - TV`` where the drafter has one (DSpark, speculators' compound ``{"ce": a, "tv": b}``)."""

SLOT_WEIGHTS = ("exp", "dpace", "uniform")
"""DFlash block slot ``k`` (``k >= 1``): ``exp``: ``exp(-(k - 1) / gamma)``; ``dpace``: D-PACE, the suffix
sums of the block's cumulative smoothed confidence ``(1 - alpha) q + alpha`` (``q = exp(-CE)`` of the drafter
itself, no gradient); ``uniform``: 1."""

NORMALIZATIONS = ("weighted", "positions", "supervised", "document")
"""How a step's loss is divided: ``weighted``: ``sum(w * l) / sum(w)`` over the step's draft positions on all
ranks (SpecForge DFlash); ``positions``: ``sum(w * l)`` over the step's real token positions (SpecForge
EAGLE-3 divides by rows x T, its padding included; padfree has none to include); ``supervised``: over the
step's supervised draft positions; ``document``: each document's mean ``sum(w * l) / supervised`` (per
test-time-training step for EAGLE-3, summed over steps), documents averaged over the step (speculators'
per-row mean with one document per row: a packed row trains each document as it would train alone)."""


@dataclass(frozen=True)
class Recipe:
    """One recipe for one method. Fields a method does not use are carried and ignored.

    Attributes:
        name, method: the preset and the drafter method it is for. source: where its values come from.
        block_size: DFlash query tokens per block. max_anchors: anchors per document at most.
        anchor_density: anchors per valid position before the cap (1: every valid position).
        anchor_eligibility: ``pair``: ``mask[a] and mask[a + 1]``; ``self``: ``mask[a]``.
        anchor_margin: an anchor needs ``a + margin < len(document)`` (speculators: the block).
        objective: one of :data:`OBJECTIVES`. slot_weights: one of :data:`SLOT_WEIGHTS`; gamma, dpace_alpha:
        theirs. normalization: one of :data:`NORMALIZATIONS`.
        fused_layers, layer_rule: target layers the drafter fuses and how they are chosen (``spread``:
        z-lab's,
            from layer 1 to ``n - 3``; ``low_mid_high``: ``1, n // 2 - 1, n - 4``).
        sliding_window: DFlash draft layers see context within this many positions before the anchor (None:
        all);
            causal_in_block: on those layers a block slot sees only earlier slots of its block.
        noise: uniform noise ``+-noise`` on the target's hidden states the drafter reads (0: none).
        ttt: EAGLE-3 test-time-training steps. step_decay: step ``k`` weighs ``step_decay ** k``.
        loss_gate: EAGLE-3's prediction of ``x[t + 2 + k]`` is gated by ``loss_mask[t + k + loss_gate]``.
        draft_vocab: EAGLE-3 draft vocabulary (the most frequent tokens of the user's data; None: the
        target's). out_of_vocab: ``drop`` positions whose target argmax is outside the draft vocabulary, or
        ``keep`` them
            (the target restricted to the draft vocabulary and renormalised either way).
        head_init, head_trainable: the EAGLE-3 LM head starts ``random`` or from the ``target``'s rows; trains
        or not. fed_state: EAGLE-3 step ``k + 1`` is fed step ``k``'s ``prenorm`` or ``postnorm`` hidden
        state. norm_before_fc: an RMSNorm over the concatenated target layers before EAGLE-3's ``fc``.
        cod_ratio, cod_ratio_min: P-EAGLE's COD sampling keeps ``max(cod_ratio^d, cod_ratio_min)`` of a
            document's chains at depth ``d`` (``ttt``: its depths).
        ce_weight, tv_weight, confidence_alpha: the ``ce_tv`` objective's weights (DSpark).
        markov_rank: DSpark's Markov head rank (its low-rank previous-token logit bias).
        min_loss_tokens: documents with fewer loss tokens train nothing (DeepSpec drops such micro-batches,
            one sample each; 0: none dropped). DSpark.
        conv_kernel_size, conv_group_size: DFlash2's grouped causal convolution inside a block (taps, and
            hidden channels sharing one dynamic kernel). selector_rank, selector_top_k: its candidate
            selector's rank and candidates; selector_loss_alpha: the weight of the selector's cross-entropy.
    """

    name: str
    method: str
    source: str = ""
    block_size: int = 16
    max_anchors: int = 512
    anchor_density: float = 1.0
    anchor_eligibility: str = "pair"
    anchor_margin: int = 0
    objective: str = "data_ce"
    slot_weights: str = "exp"
    gamma: float = 7.0
    dpace_alpha: float = 0.5
    normalization: str = "weighted"
    fused_layers: int = 5
    layer_rule: str = "spread"
    sliding_window: int | None = None
    causal_in_block: bool = False
    noise: float = 0.0
    ttt: int = 7
    step_decay: float = 1.0
    loss_gate: int = 2
    draft_vocab: int | None = None
    out_of_vocab: str = "keep"
    head_init: str = "target"
    head_trainable: bool = False
    fed_state: str = "prenorm"
    norm_before_fc: bool = False
    cod_ratio: float = 0.7
    cod_ratio_min: float = 0.2
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    confidence_alpha: float = 1.0
    markov_rank: int = 256
    min_loss_tokens: int = 0
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    selector_loss_alpha: float = 1.0

    def __post_init__(self) -> None:
        _check(self)

    def anchor_policy(self, *, partial: bool = True) -> AnchorPolicy:
        """The DFlash anchor rule of this recipe (:mod:`padfree.core.anchors`)."""
        return AnchorPolicy(
            block_size=self.block_size,
            max_anchors=self.max_anchors,
            density=self.anchor_density,
            partial=partial,
            eligibility=self.anchor_eligibility,
            margin=self.anchor_margin,
        )

    def describe(self) -> str:
        """One line: the recipe and the values that set the drafter's work and its loss."""
        return methods.get(self.method).recipe_line(self)


@dataclass(frozen=True)
class FieldRule:
    """What values a recipe field takes: the one table (:data:`FIELDS`) that :class:`Recipe` checks and
    the CLI's recipe options (``padfree.drafter.options.add_recipe_arguments``) are made from.

    Attributes:
        kind: ``int``, ``float`` (finite), ``choice`` (one of ``choices``) or ``bool`` (``yes``/``no`` on the
            command line). lo, hi, above: the range of a number (``lo`` excluded when ``above``).
        optional: ``None`` (``none`` on the command line) is allowed too. help: the option's help.
        cli_lo, cli_hi: the command line's narrower range, where it has one (a recipe built in Python may go
            beyond what an option offers).
    """

    kind: str
    lo: float = 0.0
    hi: float = math.inf
    above: bool = False
    optional: bool = False
    choices: tuple[str, ...] = ()
    help: str | None = None
    cli_lo: float | None = None
    cli_hi: float | None = None

    @property
    def cli_range(self) -> tuple[float, float]:
        """The range the command-line option takes."""
        return (
            self.lo if self.cli_lo is None else self.cli_lo,
            self.hi if self.cli_hi is None else self.cli_hi,
        )

    def error(self, name: str, value: object) -> str | None:
        """Why ``value`` cannot be field ``name`` (``None``: it can)."""
        if value is None and self.optional:
            return None
        if self.kind == "choice":
            return None if value in self.choices else f"{name} must be one of {', '.join(self.choices)}"
        if self.kind == "bool":
            return None
        ok = False
        if self.kind == "int":
            what = (
                f"an integer >= {self.lo:g}"
                if math.isinf(self.hi)
                else f"an integer from {self.lo:g} to {self.hi:g}"
            )
            if isinstance(value, int) and not isinstance(value, bool):
                ok = self.lo <= value <= self.hi
        else:
            what = f"a number in {'(' if self.above else '['}{self.lo:g}, {self.hi:g}]"
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                ok = (value > self.lo if self.above else value >= self.lo) and value <= self.hi
        return None if ok else f"{name} must be {what}{' or none' if self.optional else ''}"


FIELDS: dict[str, FieldRule] = {
    "block_size": FieldRule("int", 2, help="DFlash block size", cli_hi=1024),
    "max_anchors": FieldRule("int", 1, help="DFlash anchors per document at most", cli_hi=2**31 - 1),
    "ttt": FieldRule("int", 1, help="EAGLE-3 test-time-training steps", cli_hi=64),
    "anchor_density": FieldRule("float", 0, 1, above=True, help="anchors per valid position before the cap"),
    "anchor_eligibility": FieldRule("choice", choices=("pair", "self")),
    "anchor_margin": FieldRule("int", 0, cli_hi=1024),
    "objective": FieldRule("choice", choices=OBJECTIVES),
    "slot_weights": FieldRule("choice", choices=SLOT_WEIGHTS),
    "normalization": FieldRule("choice", choices=NORMALIZATIONS),
    "layer_rule": FieldRule("choice", choices=tuple(methods.LAYER_RULES)),
    "out_of_vocab": FieldRule("choice", choices=("drop", "keep")),
    "head_init": FieldRule("choice", choices=("random", "target")),
    "fed_state": FieldRule("choice", choices=("prenorm", "postnorm")),
    "gamma": FieldRule("float", 0, 1e9, above=True, help="DFlash exp slot decay"),
    "dpace_alpha": FieldRule("float", 0, 1, above=True),
    "step_decay": FieldRule("float", 0, 1, above=True, help="EAGLE-3 step weight"),
    "loss_gate": FieldRule("int", 0, 2, help="EAGLE-3 gate loss_mask[t+k+GATE]"),
    "fused_layers": FieldRule("int", 1, help="target layers the drafter fuses", cli_hi=4096),
    "sliding_window": FieldRule("int", 1, optional=True, help="DFlash context window", cli_hi=2**20),
    "causal_in_block": FieldRule("bool"),
    "noise": FieldRule("float", 0, 1e3, help="uniform noise on target states"),
    "draft_vocab": FieldRule(
        "int", 1, optional=True, help="EAGLE-3 draft vocabulary", cli_lo=2, cli_hi=2**24
    ),
    "head_trainable": FieldRule("bool"),
    "norm_before_fc": FieldRule("bool"),
    "cod_ratio": FieldRule("float", 0, 1, above=True, help="P-EAGLE COD keep ratio per depth"),
    "cod_ratio_min": FieldRule("float", 0, 1, help="P-EAGLE COD keep ratio floor"),
    "ce_weight": FieldRule("float", 0, 1e3, help="ce_tv objective: cross-entropy weight"),
    "tv_weight": FieldRule("float", 0, 1e3, help="ce_tv objective: total-variation weight"),
    "confidence_alpha": FieldRule("float", 0, 1e3, help="DSpark confidence-head loss weight"),
    "markov_rank": FieldRule("int", 1, help="DSpark Markov head rank", cli_hi=65536),
    "min_loss_tokens": FieldRule(
        "int", 0, help="DSpark: documents under this many loss tokens dropped", cli_hi=2**20
    ),
    "conv_kernel_size": FieldRule("int", 1, help="DFlash2 convolution taps", cli_hi=1024),
    "conv_group_size": FieldRule("int", 1, help="DFlash2 channels per dynamic kernel", cli_hi=2**16),
    "selector_rank": FieldRule("int", 1, help="DFlash2 candidate selector rank", cli_hi=2**16),
    "selector_top_k": FieldRule("int", 1, help="DFlash2 candidates reranked", cli_hi=2**20),
    "selector_loss_alpha": FieldRule("float", 0, 1e3, help="DFlash2 selector loss weight"),
}
"""Every field a user may set, in the order the CLI lists them, with the values it takes."""


def _check(r: Recipe) -> None:
    for name, rule in FIELDS.items():
        value = getattr(r, name)
        why = rule.error(name, value)
        if why:
            raise ConfigError(f"recipe {r.name}: {why} (got {value!r})")
    if r.slot_weights == "dpace" and r.normalization in ("weighted",):
        raise ConfigError(
            f"recipe {r.name}: D-PACE weights depend on the drafter's own confidence, known only after the "
            "forward; the weighted mean needs its denominator before it: use normalization document or "
            "supervised"
        )
    if r.conv_kernel_size > r.block_size:
        raise ConfigError(
            f"recipe {r.name}: conv_kernel_size {r.conv_kernel_size} exceeds block_size {r.block_size} (the "
            "convolution stays inside a block)"
        )
    if r.layer_rule == "last" and r.fused_layers != 1:
        raise ConfigError(f"recipe {r.name}: the last rule reads 1 layer (got fused_layers {r.fused_layers})")
    if r.layer_rule == "low_mid_high" and r.fused_layers != 3:
        raise ConfigError(
            f"recipe {r.name}: the low_mid_high rule fuses 3 layers (got fused_layers {r.fused_layers})"
        )


_SPECULATORS: dict = {"name": "speculators", "normalization": "document"}
"""What every vllm speculators preset shares: one mean per document."""

_LOW_MID_HIGH: dict = {"fused_layers": 3, "layer_rule": "low_mid_high"}
"""Three fused target layers, low, middle and high."""

_EAGLE3: dict = {"method": "eagle3", "objective": "kl", **_LOW_MID_HIGH, "draft_vocab": 32000}
"""What both EAGLE-3 recipes share: KL to the target over a 32K draft vocabulary, three fused layers."""

_BLOCKS: dict = {**_SPECULATORS, "anchor_eligibility": "self"}
"""What speculators' block presets share: an anchor needs only its own loss mask."""

PRESETS: dict[tuple[str, str], Recipe] = {
    (r.name, r.method): r
    for r in (
        Recipe(
            name="specforge",
            method="dflash",
            source="SpecForge a6b6b023: examples/configs/qwen3-8b-dflash-online.yaml; "
            "specforge/algorithms/common/dflash_family_model.py",
        ),
        Recipe(
            **_BLOCKS,
            method="dflash",
            source="vllm speculators c05b95b3: train/config/schema.py; "
            "models/dflash/{core,utils,attention}.py; losses/utils.py; train/dataloader.py",
            anchor_margin=16,
            objective="argmax_ce",
            slot_weights="dpace",
            **_LOW_MID_HIGH,
            sliding_window=2048,
            causal_in_block=True,
            noise=0.05,
        ),
        Recipe(
            name="specforge",
            source="SpecForge a6b6b023: specforge/algorithms/eagle3/{model,data}.py; specforge/core/loss.py",
            **_EAGLE3,
            normalization="positions",
            step_decay=0.8,
            loss_gate=0,
            out_of_vocab="drop",
            head_init="random",
            head_trainable=True,
        ),
        Recipe(
            **_SPECULATORS,
            source="vllm speculators c05b95b3: models/eagle3/core.py; train/config/schema.py; "
            "losses/utils.py; train/dataloader.py",
            **_EAGLE3,
            noise=0.05,
            ttt=3,
            loss_gate=1,
            fed_state="postnorm",
            norm_before_fc=True,
        ),
        Recipe(
            **_SPECULATORS,
            method="mtp",
            source="vllm speculators 0.9.0 (the wheel padfree tests against): models/mtp/core.py "
            "(num_speculative_steps 3, compute_step_weights beta 0.6 normalised (FastMTP arXiv:2509.18362 "
            "eq. 2), cross-entropy on input_ids[t+k+2] under loss_mask[t+k+2], each step's mean over its "
            "labelled positions, summed over steps; verifier_last_hidden_states only; embed_tokens and "
            "lm_head the verifier's, frozen; no draft vocabulary); models/mtp/data.py (no noise)",
            fused_layers=1,
            layer_rule="last",
            ttt=3,
            step_decay=0.6,
        ),
        Recipe(
            **_SPECULATORS,
            source="vllm speculators 0.9.0 (the wheel padfree tests against): train/config/schema.py "
            "PEagleArgs (num_depths 8, down_sample_ratio 0.7, down_sample_ratio_min 0.2), loss_fn kl_div "
            "(_DEFAULT_LOSS_FN), norm_before_fc False for non-eagle3; models/peagle/{core,data,metrics}.py "
            "(one mean over the sampled elements under loss_mask at t+d, embed_requires_grad True, "
            "verifier LM head); draft vocabulary and layers as their EAGLE-3 recipe (one Llama layer, "
            "residual un-normed; their CLI would pick Qwen3 and norm_before_residual)",
            **{**_EAGLE3, "method": "peagle"},
            ttt=8,
            loss_gate=1,
        ),
        Recipe(
            **_BLOCKS,
            method="dspark",
            source="DeepSpec (deepseek-ai/DeepSpec 8c483c78) config/dspark/dspark_qwen3_4b_online.py: "
            "block_size 7, num_anchors 512, target_layer_ids [1, 9, 17, 25, 33] of Qwen3-4B's 36 (the spread "
            "rule), loss_decay_gamma 4.0, ce_loss_alpha 0.1, l1_loss_alpha 0.9, confidence_head_alpha 1.0, "
            "markov_rank 256 vanilla, confidence_head_with_markov, min_loss_tokens 14, num_draft_layers 5; "
            "trained as vllm speculators 0.9.0's DSparkDraftModel does (the wheel padfree tests against): "
            "models/dspark/{core,metrics,config}.py, models/dflash/{core,utils,attention}.py, "
            "losses/utils.py "
            "(sample_from_anchor: slot k scored against the verifier's distribution at a+k under "
            'loss_mask[a+k]; loss_fn \'{"ce": 0.1, "tv": 0.9}\' with ce on the verifier\'s argmax and '
            "tv = 1 - sum min(p, q), where DeepSpec's L1 is 2 x tv; exp(-k/gamma) slot weights; one mean per "
            "row; anchors on loss_mask[a] with the last block of the row free; non-causal full attention)",
            block_size=7,
            anchor_margin=7,
            objective="ce_tv",
            gamma=4.0,
            min_loss_tokens=14,
        ),
        Recipe(
            **_BLOCKS,
            method="dflash2",
            source="vllm speculators 0.9.0 (the wheel padfree tests against): train/config/schema.py "
            "(_DEFAULT_BLOCK_SIZE: 8 for dflash2; loss_fn kl_div (_DEFAULT_LOSS_FN); "
            "per_position_loss_weight fixed-exp-decay, dflash_decay_gamma 4.0 (DFlashArgs); max_anchors 512 "
            "(DataArgs); sliding_window 2048 on every draft layer, sliding_window_non_causal True for "
            "dflash2 (DraftArgs); num_layers 5 (--draft-layers); DFlash2Args conv_kernel_size 2, "
            "conv_group_size 16, selector_rank 256, selector_top_k 16, selector_loss_alpha 1.0); "
            "models/dflash2/{core,metrics,model_definitions}.py (full vocabulary only, unary KL + alpha x "
            "selector K-way CE, one mean over the row's supervised slots); models/dflash/utils.py "
            "select_anchors (loss_mask[a], last block excluded); models/utils.py resolve_target_layer_ids "
            "([2, n//2, n-3]); no noise in 0.9.0",
            block_size=8,
            anchor_margin=8,
            objective="kl",
            gamma=4.0,
            **_LOW_MID_HIGH,
            sliding_window=2048,
        ),
    )
}
"""Every preset by ``(name, method)``: each states what its source sets apart from :class:`Recipe`'s
defaults (SpecForge's DFlash values, and each method's own fields as its one published recipe sets them)."""

NAMES = tuple(dict.fromkeys(name for name, _ in PRESETS))
"""The preset names (``specforge``, the default, first)."""

DEFAULT = "specforge"


def get(name: str, method: str) -> Recipe:
    """The preset ``name`` for ``method``; anything else is a one-line :class:`ConfigError`. The default
    name (:data:`DEFAULT`) gives a method that has no such preset (MTP, P-EAGLE: SpecForge trains none) its
    first preset: the recipe a bare ``--method mtp`` trains.

    >>> [get(DEFAULT, m).name for m in ("mtp", "peagle", "dspark", "dflash2")]
    ['speculators', 'speculators', 'speculators', 'speculators']
    """
    if name == DEFAULT and (name, method) not in PRESETS:
        name = next((n for n, m in PRESETS if m == method), name)
    try:
        return PRESETS[(name, method)]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown recipe {name!r} for {method!r}: choose {' or '.join(NAMES)}") from None


def override(recipe: Recipe, **changes: object) -> Recipe:
    """``recipe`` with ``changes`` (fields by name; ``None`` values are left out, so unset CLI options change
    nothing). Where the preset ties the anchor margin to the block (speculators), a new block size moves it
    too. Unknown fields and bad values are one-line :class:`ConfigError`."""
    known = {f.name for f in dataclasses.fields(Recipe)} - {"name", "method", "source"}
    given = {k: v for k, v in changes.items() if v is not None}
    bad = sorted(set(given) - known)
    if bad:
        raise ConfigError(f"recipe {recipe.name}: no field {bad[0]!r} (fields: {', '.join(sorted(known))})")
    if "block_size" in given and "anchor_margin" not in given and recipe.anchor_margin == recipe.block_size:
        given["anchor_margin"] = given["block_size"]
    return dataclasses.replace(recipe, **given)  # type: ignore[arg-type]


def check_drafts(
    recipe: Recipe, anchors: ArrayLike | None, lengths: ArrayLike, supervised: int | None = None
) -> None:
    """Refuse, in one :class:`ConfigError` line, a run under which nothing drafts: with anchors (DFlash), no
    document gets one (``anchors``: per-sample counts under the recipe's rule, e.g. an anchor margin longer
    than every document); without (EAGLE-3), no supervised token (``supervised``: loss-bearing tokens of the
    data; ``None``: not known). Such a run would train zeros to the end, as an empty epoch would.

    >>> check_drafts(get("speculators", "dflash"), [0, 0], [10, 12], 15)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    padfree.errors.ConfigError: nothing drafts ... (block size 16, anchor margin 16, longest document 12...
    """
    import numpy as np

    lens = np.asarray(lengths)
    n = int(lens.shape[0])
    longest = int(lens.max()) if n else 0
    head = f"nothing drafts under recipe {recipe.name} ({recipe.method})"
    if supervised is not None and supervised <= 0:
        raise ConfigError(f"{head}: none of the {n} samples has a supervised token (loss mask all zero)")
    if anchors is None:  # a method without anchors (the setup counts none for it)
        return
    if int(np.asarray(anchors).sum()) > 0:
        return
    raise ConfigError(
        f"{head}: no document of {n} gets an anchor (block size {recipe.block_size}, anchor margin "
        f"{recipe.anchor_margin}, longest document {longest} tokens"
        f"{'' if supervised is None else f', {supervised} supervised tokens'}): an anchor "
        "needs a supervised position a with a + margin below its document's length; lower the anchor margin "
        "or block size, or train on longer documents"
    )
