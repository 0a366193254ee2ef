"""Attention metadata from the segment structure: segment ids, masks, cu_seqlens, and the leakage check.

Properties run on random packed batches laid out as ``pack_flat`` writes them
(documents restarting at position 0, trailing padding a segment of its own)
and compare every kind of metadata with a pure-Python reference of the
segments, then run a small attention layer with each mask (SDPA with the dense
mask; FlexAttention in eager mode, which runs on CPU without compiling in
torch 2.13) against each document alone.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import run_checked
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torch.nn.attention.flex_attention import create_mask, flex_attention

from zephon_collate.functional import cu_seqlens_flat, cu_seqlens_rows
from zephon_collate.functional.attention import (
    PADDING_SEGMENT,
    check_consistent,
    cu_seqlens_from_segment_ids,
    dense_document_mask,
    document_block_mask,
    document_mask_mod,
    flatten_segment_ids,
    padding_from_length,
    segment_ids_from_positions,
)
from zephon_collate.inspection.leakage import LeakageError, check_no_leakage
from zephon_collate.transforms import Chain, CuSeqlens, PaddingMask, SegmentIds, TokenShift

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

VOCAB, DIM, HEADS = 32, 8, 2
ROOT = Path(__file__).resolve().parent.parent


# -- random packed batches and the reference ---------------------------------------------------------


@st.composite
def packed(draw, max_rows=3, max_length=12):
    """(input_ids, positions, padding_length, spans): rows of documents then trailing padding.

    ``spans[b]`` lists row ``b``'s documents as ``(start, end)``; padding is what follows the last one.
    """
    rows = draw(st.integers(1, max_rows))
    length = draw(st.integers(1, max_length))
    positions, padding, spans = [], [], []
    for _ in range(rows):
        lengths = draw(st.lists(st.integers(1, length), max_size=length))
        row_spans, start = [], 0
        for size in lengths:
            if start + size > length:
                break
            row_spans.append((start, start + size))
            start += size
        pad = length - start
        positions.append([i - s for s, e in row_spans for i in range(s, e)] + list(range(pad)))
        padding.append(pad)
        spans.append(row_spans)
    seed = draw(st.integers(0, 2**16))
    input_ids = torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))
    return input_ids, torch.tensor(positions), torch.tensor(padding), spans


def reference_ids(spans, padding_length, length, mark):
    """Segment ids from the spans: documents 0, 1, ...; padding -1 when marked, else the next id."""
    rows = []
    for row_spans, pad in zip(spans, padding_length.tolist(), strict=True):
        ids = [doc for doc, (start, end) in enumerate(row_spans) for _ in range(start, end)]
        ids += [PADDING_SEGMENT if mark else len(row_spans)] * pad
        rows.append(ids)
    return torch.tensor(rows, dtype=torch.int32).reshape(len(spans), length)


def reference_mask(spans, length):
    """[B, 1, S, S]: causal inside each document; each padding token attends to itself only."""
    mask = torch.zeros(len(spans), 1, length, length, dtype=torch.bool)
    for row, row_spans in enumerate(spans):
        for start, end in row_spans:
            for query in range(start, end):
                mask[row, 0, query, start : query + 1] = True
        padding_start = row_spans[-1][1] if row_spans else 0
        for token in range(padding_start, length):
            mask[row, 0, token, token] = True
    return mask


def reference_boundaries(spans, padding_length, length):
    """Per-row cu_seqlens: each document's start, the padding's start (if any), then the row length."""
    rows = []
    for row_spans, pad in zip(spans, padding_length.tolist(), strict=True):
        starts = [start for start, _ in row_spans] + ([length - pad] if pad else [])
        rows.append([*starts, length])
    return rows


def padding_mask_of(padding_length, length):
    return padding_from_length(padding_length, length)


# -- the attention layer -------------------------------------------------------------------------------


def qkv(input_ids, seed=0):
    """Deterministic per-token q, k, v [B, H, S, D] from the token ids (no mixing across tokens)."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(3, VOCAB, HEADS, DIM, generator=generator, dtype=torch.float64)
    q, k, v = (t[input_ids].transpose(1, 2) for t in table)
    return q, k, v


def sdpa(input_ids, mask):
    q, k, v = qkv(input_ids)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def flex(input_ids, block_mask):
    q, k, v = (t.float() for t in qkv(input_ids))
    return flex_attention(q, k, v, block_mask=block_mask)


def alone(input_ids, start, end, row, kernel):
    """The layer on one document by itself: plain causal attention over its tokens."""
    piece = input_ids[row : row + 1, start:end]
    if kernel == "sdpa":
        q, k, v = qkv(piece)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)[0]
    q, k, v = (t.float() for t in qkv(piece))
    causal = document_block_mask(torch.zeros(1, end - start, dtype=torch.int32), block_size=4)
    return flex_attention(q, k, v, block_mask=causal)[0]


def assert_matches_alone(out, input_ids, spans, kernel, atol):
    """out [B, H, S, D]: each document's slice equals the document run alone; padding rows are finite."""
    assert torch.isfinite(out).all()
    for row, row_spans in enumerate(spans):
        for start, end in row_spans:
            expected = alone(input_ids, start, end, row, kernel)
            torch.testing.assert_close(out[row, :, start:end], expected, atol=atol, rtol=0)


# -- segment ids -----------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(packed())
def test_segment_ids_follow_the_segments(batch):
    _, positions, padding_length, spans = batch
    length = positions.shape[1]
    unmarked = segment_ids_from_positions(positions)
    marked = segment_ids_from_positions(positions, padding_mask_of(padding_length, length))
    assert unmarked.dtype == marked.dtype == torch.int32
    assert torch.equal(unmarked, reference_ids(spans, padding_length, length, mark=False))
    assert torch.equal(marked, reference_ids(spans, padding_length, length, mark=True))
    # Flattened: every document of the batch has its own id, increasing along the sequence.
    flat = flatten_segment_ids(marked)
    expected, next_id = [], 0
    for row_ids in marked.tolist():
        row_map = {}
        for value in row_ids:
            if value >= 0 and value not in row_map:
                row_map[value], next_id = next_id, next_id + 1
            expected.append(row_map.get(value, PADDING_SEGMENT))
    assert flat.tolist() == expected
    # Flattened positions (to_training(flatten=True)) give the same batch-global ids directly.
    padding = padding_mask_of(padding_length, length)
    assert torch.equal(segment_ids_from_positions(positions.reshape(-1), padding.reshape(-1)), flat)
    flat_unmarked = segment_ids_from_positions(positions.reshape(-1))
    assert torch.equal(flat_unmarked, flatten_segment_ids(unmarked))


def test_segment_ids_row_without_zero_start():
    """A row whose positions do not start at 0 still has its first token in segment 0 (never -1)."""
    ids = segment_ids_from_positions(torch.tensor([[3, 4, 0, 1]]))
    assert ids.tolist() == [[0, 0, 1, 1]]


def test_segment_ids_empty_rows():
    empty = torch.zeros(2, 0, dtype=torch.long)
    assert segment_ids_from_positions(empty).shape == (2, 0)
    assert flatten_segment_ids(segment_ids_from_positions(empty)).shape == (0,)


# -- the SegmentIds transform ----------------------------------------------------------------------------


def example_td():
    return TensorDict(
        positions=torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]),
        padding_length=torch.tensor([1, 0]),
        batch_size=[2],
    )


def test_segment_ids_transform_keys_and_example():
    plain = SegmentIds()
    assert plain.in_keys == ["positions"] and plain.out_keys == ["segment_ids"]
    out = run_checked(plain, example_td())
    assert out["segment_ids"].tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 1, 1]]
    assert out["segment_ids"].dtype == torch.int32 and out.batch_size == torch.Size([2])
    assert torch.equal(out["positions"], example_td()["positions"])

    marking = SegmentIds(mark_padding=True, out_key="seq")
    assert marking.in_keys == ["positions", "padding_length"] and marking.out_keys == ["seq"]
    assert run_checked(marking, example_td())["seq"].tolist() == [[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, 1, 1]]

    flat = run_checked(SegmentIds(flatten=True, mark_padding=True), example_td())
    assert flat.batch_size == torch.Size([])
    assert flat["segment_ids"].tolist() == [0, 0, 0, 1, 1, -1, 2, 2, 2, 2, 3, 3]
    unmarked = run_checked(SegmentIds(flatten=True), example_td())["segment_ids"]
    assert unmarked.tolist() == [0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4, 4]


def test_segment_ids_transform_config():
    for name in ("flatten", "mark_padding", "shifted"):
        with pytest.raises(TypeError, match=name):
            SegmentIds(**{name: 1})
    with pytest.raises(TypeError, match="positions_key"):
        SegmentIds(positions_key="")
    with pytest.raises(TypeError, match="out_key"):
        SegmentIds(out_key=None)


@settings(max_examples=40, deadline=None)
@given(packed())
def test_segment_ids_after_token_shift_mark_the_same_padding(batch):
    """shifted=True after TokenShift marks exactly what PaddingMask before the shift marks."""
    input_ids, positions, padding_length, _ = batch
    td = TensorDict(
        input_ids=input_ids, positions=positions, padding_length=padding_length, batch_size=[len(input_ids)]
    )
    chain = Chain(TokenShift(input_keys=["positions"]), SegmentIds(mark_padding=True, shifted=True))
    via_length = run_checked(chain, td)["segment_ids"]
    masked = Chain(PaddingMask(), TokenShift(input_keys=["positions", "padding_mask"]))(td)
    via_mask = segment_ids_from_positions(masked["positions"], masked["padding_mask"])
    assert torch.equal(via_length, via_mask)


# -- masks and cu_seqlens describe the same segments -----------------------------------------------------


def block_sets(block_mask):
    """(partial, full) sets of (row, query block, kv block) of a BlockMask with one head."""
    partial, full = set(), set()
    for target, counts, indices in (
        (partial, block_mask.kv_num_blocks, block_mask.kv_indices),
        (full, block_mask.full_kv_num_blocks, block_mask.full_kv_indices),
    ):
        for row in range(counts.shape[0]):
            for q_block in range(counts.shape[2]):
                for j in range(int(counts[row, 0, q_block])):
                    target.add((row, q_block, int(indices[row, 0, q_block, j])))
    return partial, full


def assert_block_mask_matches(block_mask, dense, block):
    """Full blocks are all True in the dense mask, partial ones some, absent ones none."""
    rows, _, length, _ = dense.shape
    partial, full = block_sets(block_mask)
    assert not partial & full
    blocks = -(-length // block)
    for row in range(rows):
        for qb in range(blocks):
            for kb in range(blocks):
                tile = dense[row, 0, qb * block : (qb + 1) * block, kb * block : (kb + 1) * block]
                key = (row, qb, kb)
                assert (key in full) == bool(tile.all()) or (key in partial and tile.all()), key
                assert (key in full or key in partial) == bool(tile.any()), key
    # The mask_mod the BlockMask carries is the document mask, evaluated densely.
    assert torch.equal(create_mask(block_mask.mask_mod, rows, 1, length, length, device="cpu"), dense)


@settings(max_examples=40, deadline=None)
@given(packed(), st.booleans(), st.sampled_from([1, 2, 4]))
def test_dense_flex_and_cu_seqlens_describe_the_same_segments(batch, mark, block):
    _, positions, padding_length, spans = batch
    rows, length = positions.shape
    ids = segment_ids_from_positions(positions, padding_mask_of(padding_length, length) if mark else None)
    expected = reference_mask(spans, length) if mark else None

    dense = dense_document_mask(ids)
    assert dense.shape == (rows, 1, length, length) and dense.dtype == torch.bool
    if mark:
        assert torch.equal(dense, expected)
    else:  # unmarked, the padding is one more causal document
        with_pad = [
            s + ([(s[-1][1] if s else 0, length)] if p else [])
            for s, p in zip(spans, padding_length.tolist(), strict=True)
        ]
        assert torch.equal(dense, reference_mask(with_pad, length))
    assert dense.any(dim=-1).all(), "every query attends to something"

    assert torch.equal(create_mask(document_mask_mod(ids), rows, 1, length, length, device="cpu"), dense)
    block_mask = document_block_mask(ids, block_size=block)
    assert block_mask.shape == (rows, 1, length, length)
    assert_block_mask_matches(block_mask, dense, block)

    # cu_seqlens from the positions (the CuSeqlens kernels) and from the segment ids agree with the spans.
    boundaries, longest = cu_seqlens_rows(positions)
    reference = reference_boundaries(spans, padding_length, length)
    width = max(map(len, reference))
    assert boundaries.tolist() == [r + [length] * (width - len(r)) for r in reference]
    from_ids, from_ids_longest = cu_seqlens_from_segment_ids(ids)
    assert torch.equal(from_ids, boundaries) and torch.equal(from_ids_longest, longest)
    check_consistent(ids, boundaries)
    check_consistent(ids, cu_seqlens_rows(positions, num_boundaries=width + 2)[0])
    # Flattened: the batch-global ids and the flattened boundaries.
    flat_ids = flatten_segment_ids(segment_ids_from_positions(positions))
    flat_boundaries, flat_longest = cu_seqlens_flat(positions)
    flat_from_ids, flat_from_ids_longest = cu_seqlens_from_segment_ids(flat_ids)
    assert torch.equal(flat_from_ids, flat_boundaries) and torch.equal(flat_from_ids_longest, flat_longest)
    check_consistent(flat_ids, flat_boundaries)
    check_consistent(flat_ids, cu_seqlens_flat(positions, num_boundaries=rows * length + 1)[0])
    # Each row's dense mask is the block-diagonal of its cu_seqlens segments.
    for row in range(rows):
        cuts = boundaries[row].tolist()
        for start, end in itertools.pairwise(cuts):
            if mark and start >= length - int(padding_length[row]):
                continue
            block_rows = dense[row, 0, start:end]
            assert not block_rows[:, :start].any() and not block_rows[:, end:].any()


def test_padding_is_no_document_a_kernel_can_attend_into():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]])
    padding = torch.tensor([3, 0])
    ids = segment_ids_from_positions(positions, padding_from_length(padding, 8))
    assert ids.tolist() == [[0, 0, 0, 1, 1, -1, -1, -1], [0] * 8]
    dense = dense_document_mask(ids)[:, 0]
    is_pad = ids < 0
    # No real query attends a padding key; a padding query attends only to itself.
    assert not (dense & ~is_pad.unsqueeze(2) & is_pad.unsqueeze(1)).any()
    assert torch.equal(dense[0, 5:, :], torch.eye(8, dtype=torch.bool)[5:])
    flex_dense = document_block_mask(ids, block_size=2).to_dense()
    assert flex_dense[0, 0, 0:3, 3:].sum() == 0  # no real query block reaches the padding blocks
    # Varlen kernels: padding is a segment of its own (boundary at 5), never inside a document.
    cu = CuSeqlens()(TensorDict(positions=positions, batch_size=[2]))["cu_seqlens"]
    assert cu.tolist() == [[0, 3, 5, 8], [0, 8, 8, 8]]
    check_consistent(ids, cu)
    # Flattened, padding of row 0 is not joined to row 1's first document.
    flat = dense_document_mask(flatten_segment_ids(ids))[0, 0]
    assert not flat[8:, :8].any()


def test_check_consistent_names_the_row():
    ids = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0]])
    check_consistent(ids, torch.tensor([[0, 2, 4], [0, 4, 4]]))
    with pytest.raises(
        ValueError, match=r"row 1: segment ids give boundaries \[0, 4\], cu_seqlens holds \[0, 1, 4\]"
    ):
        check_consistent(ids, torch.tensor([[0, 2, 4], [0, 1, 4]]))
    with pytest.raises(ValueError, match="the flattened batch"):
        check_consistent(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match=r"pair \[B, S\]"):
        check_consistent(ids, torch.tensor([0, 2, 4, 8]))
    with pytest.raises(ValueError, match="2 rows of segment ids but 1 rows"):
        check_consistent(ids, torch.tensor([[0, 2, 4]]))


def test_masks_reject_other_ranks():
    with pytest.raises(ValueError, match=r"\[B, S\] \(per row\) or \[N\]"):
        dense_document_mask(torch.zeros(1, 2, 3, dtype=torch.int32))


# -- an attention layer with each mask equals each document alone ----------------------------------------


@settings(max_examples=25, deadline=None)
@given(packed(), st.booleans())
def test_sdpa_with_dense_mask_equals_documents_alone(batch, mark):
    input_ids, positions, padding_length, spans = batch
    padding = padding_mask_of(padding_length, positions.shape[1]) if mark else None
    ids = segment_ids_from_positions(positions, padding)
    assert_matches_alone(sdpa(input_ids, dense_document_mask(ids)), input_ids, spans, "sdpa", 1e-12)
    # The flattened [1, B*S] layout with batch-global ids gives the same outputs.
    flat = sdpa(input_ids.reshape(1, -1), dense_document_mask(flatten_segment_ids(ids)))
    rows, length = input_ids.shape
    unflattened = flat.reshape(HEADS, rows, length, DIM).transpose(0, 1)
    assert_matches_alone(unflattened, input_ids, spans, "sdpa", 1e-12)


@settings(max_examples=15, deadline=None)
@given(packed(), st.booleans(), st.sampled_from([2, 4, 128]))
def test_flex_attention_eager_equals_documents_alone(batch, mark, block):
    input_ids, positions, padding_length, spans = batch
    padding = padding_mask_of(padding_length, positions.shape[1]) if mark else None
    ids = segment_ids_from_positions(positions, padding)
    out = flex(input_ids, document_block_mask(ids, block_size=block))
    assert_matches_alone(out, input_ids, spans, "flex", 1e-5)
    flat = flex(input_ids.reshape(1, -1), document_block_mask(flatten_segment_ids(ids), block_size=block))
    rows, length = input_ids.shape
    assert_matches_alone(
        flat.reshape(HEADS, rows, length, DIM).transpose(0, 1), input_ids, spans, "flex", 1e-5
    )


def test_per_row_ids_reshaped_would_join_documents():
    """Why flattened layouts need batch-global ids: reshaped per-row ids join row 1's first document to row 0's."""
    ids = segment_ids_from_positions(torch.tensor([[0, 1, 2], [0, 1, 2]]))
    assert dense_document_mask(ids.reshape(-1))[0, 0, 3, 0]
    assert not dense_document_mask(flatten_segment_ids(ids))[0, 0, 3, 0]


# -- the leakage check --------------------------------------------------------------------------------------


def embed_model(mask_kind):
    """A tiny model: embedding -> one attention layer -> vocabulary logits, with the mask of mask_kind."""
    generator = torch.Generator().manual_seed(1)
    embed = torch.randn(VOCAB, HEADS * DIM, generator=generator)
    rotary = torch.randn(64, HEADS * DIM, generator=generator)
    out = torch.randn(HEADS * DIM, VOCAB, generator=generator)

    def model_fn(input_ids, positions, segment_ids):
        x = embed[input_ids] + rotary[positions]
        b, s, _ = x.shape
        q = k = v = x.reshape(b, s, HEADS, DIM).transpose(1, 2)
        if mask_kind == "causal":  # plain causal attention over the whole row: leaks across documents
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif mask_kind == "dense":
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_document_mask(segment_ids))
        else:
            attended = flex_attention(q, k, v, block_mask=document_block_mask(segment_ids, block_size=4))
        return attended.transpose(1, 2).reshape(b, s, HEADS * DIM) @ out

    return model_fn


LEAK_BATCH = (
    torch.tensor([[3, 4, 5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14, 15, 16]]),
    torch.tensor([[0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 2, 3, 0, 1, 2, 3]]),
    torch.tensor([[False] * 6 + [True] * 2, [False] * 8]),
)


def test_check_no_leakage_catches_a_leaky_model():
    input_ids, positions, padding = LEAK_BATCH
    with pytest.raises(
        LeakageError, match=r"row 0, document 1 \(tokens 3:6\): max \|packed - alone\| = "
    ) as info:
        check_no_leakage(embed_model("causal"), input_ids, positions, padding_mask=padding)
    report = info.value.report
    assert isinstance(info.value, AssertionError) and not report.ok
    assert [(c.row, c.document, c.start, c.end) for c in report.leaks] == [(0, 1, 3, 6), (1, 1, 4, 8)]
    assert all(
        c.ok for c in report.documents if c.document == 0
    )  # causal leaks never reach a row's first document
    assert report.max_abs_diff > 1e-2 and "2 of 4 documents" in str(info.value)


@pytest.mark.parametrize("kind", ["dense", "flex"])
def test_check_no_leakage_passes_a_document_masked_model(kind):
    input_ids, positions, padding = LEAK_BATCH
    report = check_no_leakage(embed_model(kind), input_ids, positions, padding_mask=padding)
    assert report.ok and len(report.documents) == 4 and report.max_abs_diff < 1e-5
    assert [(c.row, c.start, c.end) for c in report.documents] == [(0, 0, 3), (0, 3, 6), (1, 0, 4), (1, 4, 8)]
    assert str(report).startswith("no leakage: 4 documents")
    # Without a padding mask, the padding segment is checked like a document (and passes too).
    assert len(check_no_leakage(embed_model(kind), input_ids, positions).documents) == 5


def test_check_no_leakage_report_without_raising_and_errors():
    input_ids, positions, _ = LEAK_BATCH
    report = check_no_leakage(embed_model("causal"), input_ids, positions, raise_on_leak=False)
    assert not report.ok and len(report.leaks) == 3
    with pytest.raises(TypeError, match="must return a tensor"):
        check_no_leakage(lambda i, p, s: (i,), input_ids, positions)
    with pytest.raises(ValueError, match="first two dims"):
        check_no_leakage(lambda i, p, s: i.reshape(-1), input_ids, positions)
    with pytest.raises(ValueError, match=r"both be \[B, S\]"):
        check_no_leakage(embed_model("dense"), input_ids, positions[:, :3])
    with pytest.raises(ValueError, match="padding_mask must be"):
        check_no_leakage(
            embed_model("dense"), input_ids, positions, padding_mask=torch.zeros(2, 3, dtype=torch.bool)
        )
    nan = check_no_leakage(
        lambda i, p, s: torch.full((*i.shape, 1), float("nan")), input_ids, positions, raise_on_leak=False
    )
    assert not nan.ok


def test_check_no_leakage_does_not_write_into_its_inputs():
    input_ids, positions, padding = (t.clone() for t in LEAK_BATCH)
    versions = [t._version for t in (input_ids, positions, padding)]
    check_no_leakage(embed_model("dense"), input_ids, positions, padding_mask=padding)
    assert [t._version for t in (input_ids, positions, padding)] == versions
    assert all(torch.equal(a, b) for a, b in zip((input_ids, positions, padding), LEAK_BATCH, strict=True))


# -- compile and CUDA ---------------------------------------------------------------------------------------


@pytest.mark.compile
def test_segment_ids_transform_and_masks_compile_without_graph_breaks():
    """One full graph (dynamic shapes): the transform, global ids and the dense mask read no tensor value."""
    transform = SegmentIds(mark_padding=True, shifted=True)

    def metadata(td):
        ids = transform(td)["segment_ids"]
        return ids, flatten_segment_ids(ids), dense_document_mask(ids)

    compiled = torch.compile(metadata, fullgraph=True, dynamic=True)
    td = TensorDict(
        positions=torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]),
        padding_length=torch.tensor([2, 0]),
        batch_size=[2],
    )
    got, want = compiled(td), metadata(td)
    assert want[0].tolist() == [[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, 1, 1]]
    for got_tensor, want_tensor in zip(got, want, strict=True):
        assert torch.equal(got_tensor, want_tensor)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_equals_cpu_and_compiled_flex_matches_sdpa():
    generator = torch.Generator().manual_seed(0)
    rows, length = 4, 300
    input_ids = torch.randint(0, VOCAB, (rows, length), generator=generator)
    positions, padding_length = [], []
    for _ in range(rows):
        sizes = torch.randint(1, 120, (8,), generator=generator).tolist()
        row = [i for size in sizes for i in range(size)][: length - 7]
        positions.append(row + list(range(length - len(row))))
        padding_length.append(length - len(row))
    positions, padding_length = torch.tensor(positions), torch.tensor(padding_length)
    padding = padding_mask_of(padding_length, positions.shape[1])
    ids = segment_ids_from_positions(positions, padding)
    cuda_ids = segment_ids_from_positions(positions.cuda(), padding.cuda())
    assert cuda_ids.device.type == "cuda" and torch.equal(cuda_ids.cpu(), ids)
    assert torch.equal(dense_document_mask(cuda_ids).cpu(), dense_document_mask(ids))
    assert torch.equal(flatten_segment_ids(cuda_ids).cpu(), flatten_segment_ids(ids))
    td = TensorDict(positions=positions, padding_length=padding_length, batch_size=[len(positions)]).cuda()
    assert torch.equal(SegmentIds(mark_padding=True)(td)["segment_ids"].cpu(), ids)
    block_mask = document_block_mask(cuda_ids, compile=True)
    q, k, v = (t.float().cuda() for t in qkv(input_ids))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.compile(flex_attention)(q, k, v, block_mask=block_mask)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_document_mask(cuda_ids))
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)


# -- the page and the example run ------------------------------------------------------------------------------


def test_packed_attention_page_snippets_run():
    """docs/packed_attention.md: every python block runs in order, except those marked as needing a package."""
    page = (ROOT / "docs" / "packed_attention.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    runnable = [block for block in blocks if not block.startswith("# Needs")]
    assert len(blocks) - len(runnable) == 2 and len(runnable) >= 5
    namespace: dict = {"__name__": "packed_attention_page"}
    for index, block in enumerate(runnable):
        exec(compile(block, f"docs/packed_attention.md block {index}", "exec"), namespace)
    assert namespace["report"].ok and len(namespace["report"].documents) == 4
    assert namespace["ids"].tolist()[1] == [0] * 9 + [-1] * 6
    assert namespace["flat_attn"].shape == (1, HEADS, namespace["B"] * namespace["S"], 16)


def test_packed_attention_example_runs():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "packed_attention.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert result.stdout.count("no leakage: 7 documents") == 2
    assert "flattened [1, 45] layout equals the per-row one" in result.stdout
    assert "attention leaks across documents: 4 of 7 documents" in result.stdout


def test_flex_attention_has_no_cpu_backward_as_the_docs_say():
    """docs/packed_attention.md points CPU training to the SDPA mask because FlexAttention has no
    backward on the CPU in this torch; if that changes, this fails and the docs get updated."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    q = torch.randn(1, 1, 128, 16, requires_grad=True)
    mask = flex.create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 1, 128, 128, device="cpu")
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex.flex_attention(q, q, q, block_mask=mask).sum().backward()


def test_shared_prompt_masks_agree_and_keep_branches_apart():
    """branch_mask_mod, its BlockMask and the dense mask agree; FlexAttention (eager, CPU) over a shared
    prompt equals each branch run with its prompt alone, and a sibling's values never reach it."""
    from zephon_collate import Collator
    from zephon_collate.functional.attention import branch_block_mask, branch_mask_mod, dense_branch_mask

    pairs = [
        {"prompt_input_ids": [1, 2, 3], "chosen_input_ids": [4, 5], "rejected_input_ids": [6]},
        {"prompt_input_ids": [7, 8], "chosen_input_ids": [9], "rejected_input_ids": [10, 11, 12]},
    ]
    batch = Collator.for_preference(padding_free=True, shared_prompt=True)(pairs)
    docs, branches = batch["document_ids"], batch["branch_ids"]
    dense = dense_branch_mask(docs, branches)
    length = docs.shape[1]
    assert torch.equal(
        create_mask(branch_mask_mod(docs, branches), 1, None, length, length, device="cpu"), dense
    )
    block = branch_block_mask(docs, branches, block_size=4)
    assert block.shape == (1, 1, length, length)
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 2, length, 8).unbind(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        flex = flex_attention(q, k, v, block_mask=branch_block_mask(docs, branches))
    assert torch.allclose(flex, F.scaled_dot_product_attention(q, k, v, attn_mask=dense), atol=1e-5)
    for index in range(batch["num_sequences"]):  # prompt + own branch alone, causal
        own = (batch["sequence_index"][0] == index).nonzero()[:, 0]
        doc = int(docs[0, own[0]])
        keep = torch.cat([((docs[0] == doc) & (branches[0] == 0)).nonzero()[:, 0], own])
        alone = F.scaled_dot_product_attention(
            q[..., keep, :], k[..., keep, :], v[..., keep, :], is_causal=True
        )
        assert torch.allclose(flex[..., keep, :], alone, atol=1e-5)
