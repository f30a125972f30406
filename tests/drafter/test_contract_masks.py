"""The document contract of drafter rows, both drafter masks against loop-by-loop references, and the
frozen target on packed and padded rows against each document alone."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from padfree.drafter.contract import build_contract
from padfree.drafter.masks import (
    DFlashMask,
    cross_document_pairs,
    eagle3_block_mask,
    eagle3_dense_mask,
)
from padfree.drafter.target import build_target, run_target
from padfree.errors import ConfigError, InputError

docs_st = st.lists(
    st.lists(st.tuples(st.integers(0, 99), st.booleans()), min_size=1, max_size=12), min_size=1, max_size=5
)


def split(doc):
    return np.array([t for t, _ in doc]), np.array([m for _, m in doc])


@given(docs_st, st.sampled_from(["packed", "padded"]))
def test_contract_fields_describe_every_document(docs, layout):
    pairs = [split(d) for d in docs]
    c = build_contract(pairs, layout=layout, sample_ids=range(10, 10 + len(docs)))
    names = ("input_ids", "document_ids", "position_ids", "doc_remaining", "loss_mask")
    ids, doc, pos, rem, mask = (c.flat(n)[0].tolist() for n in names)
    assert c.n_docs == len(docs)
    real = 0
    for d, (tok, m) in enumerate(pairs):
        s = c.doc_slice(d)
        n = len(tok)
        assert ids[s] == tok.tolist() and mask[s] == m.tolist()
        assert doc[s] == [d] * n and pos[s] == list(range(n)) and rem[s] == [n - p for p in range(n)]
        real += n
    assert sum(x >= 0 for x in doc) == real  # everything else is padding
    assert all(r == 0 and not m for x, r, m in zip(doc, rem, mask) if x < 0)
    if layout == "packed":
        assert c.cu_seq_lens.tolist() == np.concatenate([[0], np.cumsum([len(p[0]) for p in pairs])]).tolist()
        assert c.input_ids.shape[0] == 1
    else:
        assert c.attention_mask.reshape(-1).tolist() == [int(x >= 0) for x in doc]


def test_contract_bad_documents_name_the_document():
    with pytest.raises(InputError, match="sample 1: empty document"):
        build_contract([([1, 2], [1, 1]), ([], [])])
    with pytest.raises(InputError, match="sample 0: loss mask has 1 entries for 2 tokens"):
        build_contract([([1, 2], [1])])
    with pytest.raises(ConfigError, match="layout"):
        build_contract([([1], [1])], layout="diagonal")


def brute_dflash(doc, anchors, block):
    n_ctx, n_q = len(doc), len(anchors) * block
    m = np.zeros((n_q, n_ctx + n_q), bool)
    for q in range(n_q):
        a = anchors[q // block]
        for kv in range(n_ctx + n_q):
            if kv < n_ctx:
                m[q, kv] = doc[kv] == doc[a] and doc[a] >= 0 and kv < a
            else:
                m[q, kv] = (kv - n_ctx) // block == q // block
    return m


def brute_eagle3(doc, step):
    n = len(doc)
    m = np.zeros((n, (step + 1) * n), bool)
    for q in range(n):
        for s in range(step + 1):
            for j in range(n):
                same = doc[q] >= 0 and doc[j] == doc[q] and j <= q
                m[q, s * n + j] = (j == q) or (s == 0 and same)
    return m


doc_ids_st = st.lists(st.integers(-1, 3), min_size=1, max_size=24).map(sorted)


@settings(max_examples=40, deadline=None)
@given(doc_ids_st, st.data(), st.integers(1, 5))
def test_dflash_mask_matches_the_loop_reference(doc, data, block):
    anchors = data.draw(st.lists(st.integers(0, len(doc) - 1), max_size=5))
    got = DFlashMask(torch.tensor(doc), torch.tensor(anchors, dtype=torch.long), block).dense()
    assert np.array_equal(got.numpy(), brute_dflash(doc, anchors, block))


@settings(max_examples=40, deadline=None)
@given(doc_ids_st, st.integers(0, 3))
def test_eagle3_mask_matches_the_loop_reference(doc, step):
    got = eagle3_dense_mask(torch.tensor(doc), step)
    assert np.array_equal(got.numpy(), brute_eagle3(doc, step))


def test_flex_block_masks_hold_the_same_predicate():
    from torch.nn.attention.flex_attention import create_mask

    doc = torch.tensor([0] * 40 + [1] * 50 + [2] * 38 + [-1] * 2)
    anchors = torch.tensor([3, 17, 39, 41, 60, 100])
    bm = DFlashMask(doc, anchors, 16).block_mask()
    dense = create_mask(bm.mask_mod, None, None, 6 * 16, doc.shape[0] + 6 * 16, device="cpu")
    assert torch.equal(dense[0, 0], DFlashMask(doc, anchors, 16).dense())
    assert bm.shape[-2:] == (96, 130 + 96)
    em = eagle3_block_mask(doc, 2)
    dense = create_mask(em.mask_mod, None, None, 130, 3 * 130, device="cpu")
    assert torch.equal(dense[0, 0], eagle3_dense_mask(doc, 2))


def test_cross_document_pairs_counts_only_foreign_keys():
    doc = torch.tensor([0, 0, 1, 1])
    mask = eagle3_dense_mask(doc, 0)
    assert cross_document_pairs(mask, doc, doc) == 0
    leaky = torch.ones(4, 4, dtype=torch.bool).tril()  # leaky: causal over the whole row
    assert cross_document_pairs(leaky, doc, doc) == 4  # (2,0) (2,1) (3,0) (3,1)


@pytest.fixture(scope="module")
def target():
    return build_target(vocab_size=128, num_hidden_layers=4)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_target_hidden_states_equal_each_document_alone(target, layout):
    g = torch.Generator().manual_seed(1)
    docs = [(torch.randint(0, 128, (n,), generator=g).numpy(), np.ones(n, bool)) for n in (23, 41, 1, 9)]
    layers = (0, 1, 2)
    c = build_contract(docs, layout=layout)
    out = run_target(target, c, layers)
    assert out.hidden.shape == (1, c.width, 3 * 64)
    for d in range(c.n_docs):
        alone = run_target(target, build_contract([docs[d]]), layers)
        s = c.doc_slice(d)
        assert torch.allclose(out.hidden[0, s], alone.hidden[0], atol=1e-5)
        assert torch.allclose(out.last[0, s], alone.last[0], atol=1e-5)


def test_target_under_leaky_attention_differs(target):
    """The comparison above can fail: leaky attention makes later documents differ."""
    import padfree.torch.documents.attention as pa

    g = torch.Generator().manual_seed(1)
    docs = [(torch.randint(0, 128, (n,), generator=g).numpy(), np.ones(n, bool)) for n in (23, 41)]
    target.set_attn_implementation(pa.LEAKY)
    try:
        out = run_target(target, build_contract(docs), (1,))
        alone = run_target(target, build_contract([docs[1]]), (1,))
    finally:
        target.set_attn_implementation(pa.NAME)
    assert (out.hidden[0, 23:] - alone.hidden[0]).abs().max() > 1e-2


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 3])
def test_crossings_counted_in_chunks_equal_the_dense_count(monkeypatch, window, causal):
    from padfree.drafter import masks

    monkeypatch.setattr(masks, "PAIRS_CHUNK", 37)  # many chunks, one of them partial
    doc = torch.tensor([0] * 7 + [1] * 5 + [2] * 6 + [-1] * 2)
    anchors = torch.tensor([1, 4, 8, 9, 13, 16])
    block = 3
    q_doc = doc[anchors].repeat_interleave(block)
    kv_doc = torch.cat([doc, q_doc])
    dense = DFlashMask(doc, anchors, block, window, causal).dense()
    visible = masks.DFlashMask(doc, anchors, block, window, causal).visible
    got = masks.count_cross_pairs(visible, q_doc, kv_doc, keys=doc.shape[0], own_block=block)
    assert got == cross_document_pairs(dense, q_doc, kv_doc) == 0

    def everything(q, kv):  # a predicate that leaks: every key visible
        return torch.ones(torch.broadcast_shapes(q.shape, kv.shape), dtype=torch.bool)

    leaks = masks.count_cross_pairs(everything, q_doc, kv_doc)
    assert leaks == int((q_doc[:, None] != kv_doc[None, :]).sum()) > 0
    step2 = eagle3_dense_mask(doc, 2)
    assert masks.count_cross_pairs(masks.eagle3_predicate(doc), doc, doc.repeat(3)) == cross_document_pairs(
        step2, doc, doc.repeat(3)
    )
