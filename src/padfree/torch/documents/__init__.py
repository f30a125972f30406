"""Keeping packed documents apart inside the model: one boundary reader, per-document attention and
token mixers, attention over a long document's earlier chunks, and the probe that refuses what still leaks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from padfree.torch._face import lazy_names

if TYPE_CHECKING:
    from padfree.torch.documents.attention import attention_implementation, prepare_for_packing
    from padfree.torch.documents.boundaries import Boundaries, read_boundaries
    from padfree.torch.documents.leak_probe import against_own_attention, probe_leak, require_exact_packing
    from padfree.torch.documents.mixers import keep_documents_apart, per_document_mixers

_WHERE = {
    "Boundaries": "padfree.torch.documents.boundaries",
    "against_own_attention": "padfree.torch.documents.leak_probe",
    "attention_implementation": "padfree.torch.documents.attention",
    "keep_documents_apart": "padfree.torch.documents.mixers",
    "per_document_mixers": "padfree.torch.documents.mixers",
    "prepare_for_packing": "padfree.torch.documents.attention",
    "probe_leak": "padfree.torch.documents.leak_probe",
    "read_boundaries": "padfree.torch.documents.boundaries",
    "require_exact_packing": "padfree.torch.documents.leak_probe",
}
"""Where each name of this face is defined: it is imported on first use, so importing one module of
the room does not import the others."""

__all__ = [
    "Boundaries",
    "against_own_attention",
    "attention_implementation",
    "keep_documents_apart",
    "per_document_mixers",
    "prepare_for_packing",
    "probe_leak",
    "read_boundaries",
    "require_exact_packing",
]


__getattr__, __dir__ = lazy_names(__name__, _WHERE)
