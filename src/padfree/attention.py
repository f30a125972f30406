"""Kept for ``import padfree.attention`` (the name before 0.2): the implementation is
:mod:`padfree.torch.attention`; importing either registers ``padfree_varlen`` with transformers."""

from padfree.torch.attention import *  # noqa: F403
from padfree.torch.attention import NAME, attention_implementation, attn_for, prepare_for_packing, register

__all__ = ["NAME", "attention_implementation", "attn_for", "prepare_for_packing", "register"]
