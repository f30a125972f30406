"""The frozen target a drafter learns from: a transformers causal LM run on a contract's rows (packed rows
through padfree's per-document attention), returning the hidden states of chosen layers per position.

For every document the result equals the target run on that document alone (``tests/drafter``;
``padfree check-drafter`` prints the difference). Layer ids count decoder layers from 0 (the output of
layer ``i``); each method's published choice is its ``target_layers`` rule in :mod:`padfree.drafter.methods`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from padfree.drafter.contract import Contract
from padfree.errors import ConfigError

TINY_TARGET = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
}
"""The tiny target of tests, ``check-drafter`` and the examples (random weights)."""


def build_target(name: str = "tiny-llama", *, seed: int = 0, attn: str = "padfree_varlen", **overrides):
    """A frozen (eval, no gradients) causal LM with random weights: ``name`` a built-in tiny family or a
    config directory; defaults to :data:`TINY_TARGET` sizes for the built-in families."""
    from padfree.models import FAMILIES, build_model

    sizes = {**TINY_TARGET, **overrides} if name in FAMILIES else overrides
    model = build_model(name, attn_implementation=attn, seed=seed, **sizes)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@dataclass(frozen=True)
class TargetOutput:
    """What the target gives the drafter, on the contract's flat view.

    Attributes:
        hidden: ``(1, R * W, len(layers) * H)``: the chosen layers' outputs, concatenated.
        last: ``(1, R * W, H)``: the final (normed) hidden state; ``lm_head(last)`` are the target's logits.
        prenorm: ``(1, R * W, H)``: the last decoder layer's output before the final norm (what trainers
            that apply the target's norm themselves, such as speculators, take as the verifier's state).
    """

    hidden: torch.Tensor
    last: torch.Tensor
    prenorm: torch.Tensor | None = None


@torch.no_grad()
def run_target(model, contract: Contract, layers: tuple[int, ...]) -> TargetOutput:
    """Run ``model`` once on ``contract``'s rows and collect the outputs of decoder ``layers``."""
    blocks = _decoder_layers(model)
    for i in layers:
        if not 0 <= i < len(blocks):
            raise ConfigError(f"target layer {i} outside 0..{len(blocks) - 1}")
    seen: dict[int, torch.Tensor] = {}
    hooks = []
    for i in sorted({*layers, len(blocks) - 1}):

        def keep(_m, _inp, out, i=i):
            seen[i] = out[0] if isinstance(out, tuple) else out

        hooks.append(blocks[i].register_forward_hook(keep))
    try:
        out = _base(model)(**contract.target_inputs(), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    hidden = torch.cat([seen[i] for i in layers], dim=-1)
    width = contract.width
    return TargetOutput(
        hidden.reshape(1, width, -1),
        out.last_hidden_state.reshape(1, width, -1),
        seen[len(blocks) - 1].reshape(1, width, -1),
    )


def _base(model):
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def _decoder_layers(model):
    return _base(model).layers


def lm_head(model) -> torch.nn.Module:
    """The target's output projection (hidden -> vocabulary logits)."""
    return model.get_output_embeddings()


def shared_weights(model) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embedding weight, LM head weight)`` of the target, which the reference drafters start from."""
    return model.get_input_embeddings().weight, model.get_output_embeddings().weight
