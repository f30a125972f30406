"""The shared transformers attention call: one signature, the sliding window read once, grouped-query heads
repeated per query head, the sharded-row rule, and registration under transformers' two interfaces."""

from __future__ import annotations

import pytest
import torch

from padfree.errors import ConfigError
from padfree.torch.documents import interface as common


def _seen(call: common.Call) -> torch.Tensor:
    """Echo the call's query and remember the call (a body for :func:`common.interface`)."""
    _seen.last = call  # type: ignore[attr-defined]
    return call.query


@pytest.mark.parametrize(("window", "read"), [(None, None), (0, None), (-1, None), (3, 3)])
def test_interface_reads_the_call_once(window, read):
    fn = common.interface(_seen, "seen_forward")
    q, k = torch.randn(1, 4, 5, 2), torch.randn(1, 2, 5, 2)
    sinks = torch.zeros(4)
    out, none = fn(torch.nn.Linear(1, 1), q, k, k, None, sliding_window=window, scaling=0.5, s_aux=sinks, x=1)
    call = _seen.last  # type: ignore[attr-defined]
    assert out is q and none is None
    assert call.window == read and call.scaling == 0.5 and call.dropout == 0.0 and call.softcap is None
    assert call.sinks is sinks and call.kwargs == {"s_aux": sinks, "x": 1}
    assert fn.__name__ == "seen_forward" and fn.__doc__ == _seen.__doc__


def test_repeat_heads_gives_each_query_head_its_group():
    q, k, v = torch.zeros(1, 6, 3, 2), torch.randn(1, 2, 3, 2), torch.randn(1, 2, 3, 2)
    rk, rv = common.repeat_heads(q, k, v)
    assert rk.shape[1] == rv.shape[1] == 6
    assert (
        torch.equal(rk[:, 2], k[:, 0]) and torch.equal(rk[:, 3], k[:, 1]) and torch.equal(rv[:, 5], v[:, 1])
    )
    same = common.repeat_heads(torch.zeros(1, 2, 3, 2), k, v)
    assert same[0] is k and same[1] is v


@pytest.mark.parametrize(("batch", "mask"), [(2, None), (1, torch.ones(1, 1, 3, 3))])
def test_one_row_refuses_batches_and_masks(batch, mask):
    q = torch.zeros(batch, 2, 3, 2)
    call = common.Call(torch.nn.Linear(1, 1), q, q, q, mask, 0.0, None, None, None, {})
    with pytest.raises(ConfigError, match="one packed row per rank"):
        call.one_row("toy")


def test_register_puts_attention_and_mask_under_one_name():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    fn = common.interface(_seen, "seen_forward")
    try:
        assert common.register({"padfree_test_seen": fn}, _seen)
        assert AttentionInterface._global_mapping["padfree_test_seen"] is fn
        assert AttentionMaskInterface._global_mapping["padfree_test_seen"] is _seen
    finally:
        AttentionInterface._global_mapping.pop("padfree_test_seen", None)
        AttentionMaskInterface._global_mapping.pop("padfree_test_seen", None)
