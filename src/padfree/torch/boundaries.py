"""Where the documents of a packed row begin and end: from ``cu_seq_lens`` or restarting ``position_ids``."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def lengths_from_cu(cu_seq_lens: torch.Tensor | Sequence[int]) -> list[int]:
    """Document lengths from cumulative boundaries ``[0, l0, l0+l1, ...]``.

    >>> lengths_from_cu(torch.tensor([0, 3, 5, 9], dtype=torch.int32))
    [3, 2, 4]
    """
    cu = torch.as_tensor(cu_seq_lens).reshape(-1)
    return torch.diff(cu).tolist()


def lengths_from_position_ids(position_ids: torch.Tensor) -> list[int]:
    """Document lengths of the flattened rows of ``position_ids`` (B, T): a document starts at every row start
    and wherever the position does not continue by +1 (the rule transformers uses to detect packing).

    >>> lengths_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    [3, 2, 4]
    >>> lengths_from_position_ids(torch.tensor([[0, 1, 2], [0, 1, 2]]))
    [3, 3]
    """
    pos = position_ids if position_ids.dim() == 2 else position_ids.reshape(1, -1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = torch.diff(pos, dim=-1) != 1
    idx = torch.nonzero(starts.reshape(-1)).reshape(-1)
    ends = torch.cat([idx[1:], idx.new_tensor([pos.numel()])])
    return (ends - idx).tolist()
