"""Block-wise attention over earlier chunks' keys/values: the output and every gradient equal SDPA's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from padfree.errors import ConfigError
from padfree.torch.documents.past_attention import block_attention, chunk_attention_forward


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_blocks_give_sdpas_output_and_gradients(dtype: torch.dtype, fused: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    sizes = [5, 16, 1, 7]  # three earlier chunks of uneven sizes, then the queries' own 7 tokens
    q = torch.randn(1, 4, 7, 8, generator=gen, dtype=dtype, requires_grad=True)
    blocks = [
        (
            torch.randn(1, 2, n, 8, generator=gen, dtype=dtype, requires_grad=True),
            torch.randn(1, 2, n, 8, generator=gen, dtype=dtype, requires_grad=True),
        )
        for n in sizes
    ]
    seed = torch.randn(1, 4, 7, 8, generator=gen, dtype=dtype)
    out = block_attention(q, blocks, 0.3, fused=fused)
    (out * seed).sum().backward()
    got = [q.grad, *(t.grad for b in blocks for t in b)]
    for t in [q, *(t for b in blocks for t in b)]:
        t.grad = None
    keys = torch.cat([k for k, _ in blocks], dim=2).repeat_interleave(2, dim=1)
    values = torch.cat([v for _, v in blocks], dim=2).repeat_interleave(2, dim=1)
    mask = torch.ones(7, sum(sizes), dtype=torch.bool).tril(sum(sizes) - 7)
    ref = F.scaled_dot_product_attention(q, keys, values, mask, scale=0.3)
    (ref * seed).sum().backward()
    want = [q.grad, *(t.grad for b in blocks for t in b)]
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-12}
    torch.testing.assert_close(out, ref, **tol)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tol)


def test_outside_chunked_training_it_refuses_in_one_line() -> None:
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ConfigError, match="only inside padfree's chunked training"):
        chunk_attention_forward(torch.nn.Linear(1, 1), q, q, q, None)
