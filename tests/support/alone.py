"""The exactness check each drafter method's peer test runs: a packed micro-batch trains each document
through the peer's own model exactly as that document alone, and padfree's drafter on the packed row gives
each document its loss alone and the step the mean of their gradients alone."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from padfree.drafter.train import loss_sums


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_packed_trains_as_alone(
    theirs: Any,
    forward: Callable[..., Any],
    collate: Callable[[list], Any],
    packed: Any,
    docs: Sequence[Any],
    models: Any,
    names: Mapping[str, str],
    *,
    min_docs: int,
    keys: Callable[[set[str]], bool] = lambda _: True,
    rtol: float = 1e-4,
    loss_tol: float = 1e-5,
) -> None:
    """Assert, for the peer model ``theirs`` run by ``forward(batch, doc=None)`` (``doc``: only that
    document's loss on the row; returns their ``(..., loss, ...)``):

    - each document of ``packed`` (``collate(docs)``) has on the packed row the gradients (of every
      parameter; ``keys`` holds of their names) and the loss it has alone (``collate([doc])``);
    - padfree's ``loss_sums`` on the packed row: each document's numerator is its loss alone, denominators
      are 0 or 1 with at least ``min_docs`` ones, and the step's gradient of padfree's parameter ``names[n]``
      is the sum of their gradients of ``n`` alone over the denominators' sum."""
    sum_alone: dict[str, torch.Tensor] = {}
    for d, item in enumerate(docs):
        theirs.zero_grad()
        forward(packed, d)[1].backward()
        in_row = _grads(theirs)
        theirs.zero_grad()
        loss = forward(collate([item]))[1]
        loss.backward()
        alone = _grads(theirs)
        assert sorted(in_row) == sorted(alone) and keys(set(alone)), (d, sorted(alone))
        for n in alone:  # the document in the packed row trains exactly as alone
            assert torch.allclose(in_row[n], alone[n], atol=1e-6, rtol=rtol), (d, n)
            sum_alone[n] = sum_alone.get(n, 0) + alone[n]
        with torch.no_grad():
            in_row_loss = float(forward(packed, d)[1])
        assert abs(in_row_loss - float(loss)) < 1e-5 * max(1.0, float(loss)), d
    models.drafter.zero_grad()
    num, den = loss_sums(models, packed)
    assert set(den.tolist()) <= {0.0, 1.0} and float(den.sum()) >= min_docs, den.tolist()
    for d, item in enumerate(docs):
        with torch.no_grad():
            alone_loss = float(forward(collate([item]))[1])
        assert abs(float(num[d].detach()) - alone_loss) < loss_tol * max(1.0, alone_loss), (d, alone_loss)
    (num.sum() / den.sum()).backward()
    ours = dict(models.drafter.named_parameters())
    for n, o in names.items():
        assert torch.allclose(ours[o].grad, sum_alone[n] / den.sum(), atol=1e-6, rtol=1e-4), n


def assert_packed_equals_padded(method: str, models: Any, items: list[dict], recipe: Any, mask: int) -> None:
    """Assert that ``items`` collated packed and padded (one row each) give padfree's drafter ``models`` the
    same per-document loss sums and denominators, a loss above 0, and the same gradients."""
    from padfree.drafter.collate import DrafterCollator

    runs = {}
    for layout in ("packed", "padded"):
        b = DrafterCollator(method, recipe=recipe, layout=layout, mask_token_id=mask, seed=2)(items)
        models.drafter.zero_grad()
        num, den = loss_sums(models, b)
        (num.sum() / den.sum()).backward()
        runs[layout] = (num.detach(), den, [p.grad.clone() for p in models.trainable()])
    (pn, pd, pg), (qn, qd, qg) = runs["packed"], runs["padded"]
    assert torch.equal(pd, qd) and torch.allclose(pn, qn, rtol=1e-5, atol=1e-6) and float(pn.sum()) > 0
    for g, h in zip(pg, qg, strict=True):
        assert torch.allclose(g, h, atol=1e-6, rtol=1e-4)
