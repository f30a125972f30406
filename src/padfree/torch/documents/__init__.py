"""Keeping packed documents apart inside the model: one boundary reader, per-document attention and
token mixers, attention over a long document's earlier chunks, and the probe that refuses what still leaks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from padfree.torch._face import lazy_names

# the names for type checkers (``X as X`` re-exports X); at run time each is imported on first use (below)
if TYPE_CHECKING:
    from padfree.torch.documents.attention import attention_implementation as attention_implementation
    from padfree.torch.documents.attention import prepare_for_packing as prepare_for_packing
    from padfree.torch.documents.boundaries import Boundaries as Boundaries
    from padfree.torch.documents.boundaries import read_boundaries as read_boundaries
    from padfree.torch.documents.leak_probe import against_own_attention as against_own_attention
    from padfree.torch.documents.leak_probe import probe_leak as probe_leak
    from padfree.torch.documents.leak_probe import require_exact_packing as require_exact_packing
    from padfree.torch.documents.mixers import keep_documents_apart as keep_documents_apart
    from padfree.torch.documents.mixers import per_document_mixers as per_document_mixers

__getattr__, __dir__, __all__ = lazy_names(
    __name__,
    {  # module of this room -> the names it defines, imported on first use
        "attention": ("attention_implementation", "prepare_for_packing"),
        "boundaries": ("Boundaries", "read_boundaries"),
        "leak_probe": ("against_own_attention", "probe_leak", "require_exact_packing"),
        "mixers": ("keep_documents_apart", "per_document_mixers"),
    },
)
