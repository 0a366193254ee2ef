"""Boundary-safe labels: no label predicts the first token of the next document, EOS or not."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from helpers import as_lists, batch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import packed_batches, training_options
from tensordict import TensorDict

from zephon_collate import Collator, SampleRecord, use_host_pass
from zephon_collate.transforms import BoundaryMask

PACKED = {"input_ids": [1, 10, 11, 1, 12, 13], "positions": [0, 1, 2, 0, 1, 2]}  # no EOS between documents
LABELS = {"return_labels": True, "return_num_valid_tokens": True}


def test_collator_masks_labels_across_documents_by_default():
    out = Collator(**LABELS)([PACKED])
    assert out["labels"].tolist() == [[10, 11, -100, 12, 13]]  # 11 -> 1 would cross into document 2
    assert out["num_valid_tokens"] == 4


def test_to_training_and_the_switch_keep_the_pages_labels():
    page = batch(PACKED).to_training(**LABELS)
    assert page["labels"].tolist() == [[10, 11, 1, 12, 13]] and page["num_valid_tokens"] == 5
    off = Collator(boundary_safe_labels=False, **LABELS)([PACKED])
    assert as_lists(off) == as_lists(page)


def test_with_a_loss_mask_and_every_output():
    payload = {**PACKED, "loss_mask": [0, 0, 1, 0, 1, 1]}
    out = Collator(return_loss_mask=True, return_cu_seqlens=True, return_padding_mask=True, **LABELS)(
        [payload]
    )
    assert out["labels"].tolist() == [[-100, 11, -100, 12, 13]]
    assert out["loss_mask"].tolist() == [[0.0, 1.0, 0.0, 1.0, 1.0]]
    assert out["cu_seqlens"].tolist() == [[0, 3, 5]] and out["num_valid_tokens"] == 3
    assert payload["loss_mask"] == [0, 0, 1, 0, 1, 1]  # the record is unchanged


def test_without_positions_or_labels_nothing_changes():
    unpacked = {"input_ids": [1, 10, 11, 1, 12]}
    assert Collator(**LABELS)([unpacked])["labels"].tolist() == [[10, 11, 1, 12]]
    assert as_lists(Collator()([PACKED])) == as_lists(batch(PACKED).to_training())


def test_boundary_mask_transform_keeps_the_mask_dtype_and_checks_shapes():
    td = TensorDict(
        positions=torch.tensor([[0, 1, 0, 1]]), loss_mask=torch.tensor([[1.0, 1.0, 1.0, 0.0]]), batch_size=[1]
    )
    out = BoundaryMask()(td)
    assert out["loss_mask"].tolist() == [[0.0, 1.0, 0.0, 0.0]] and out["loss_mask"].dtype == torch.float32
    assert td["loss_mask"].tolist() == [[1.0, 1.0, 1.0, 0.0]]
    boolean = BoundaryMask()(td.replace(loss_mask=torch.ones(1, 4, dtype=torch.bool)))["loss_mask"]
    assert boolean.dtype == torch.bool and boolean.tolist() == [[False, True, False, True]]
    with pytest.raises(ValueError, match=r"BoundaryMask: 'loss_mask' has shape \(1, 3\)"):
        BoundaryMask()(td.replace(loss_mask=torch.ones(1, 3)))
    with pytest.raises(ValueError, match=r"BoundaryMask: 'positions' must be \[B, S\] positions"):
        BoundaryMask()(TensorDict(positions=torch.zeros(4), batch_size=[]))


def test_rows_of_one_document_lose_only_their_first_token_on_every_backend():
    # positions_key=None: a padded batch, one document a row (a left-padded for_transformers batch).
    step = BoundaryMask(positions_key=None)
    assert step.in_keys == ["loss_mask"]
    for mask in (
        torch.tensor([[1, 1, 0], [0, 1, 1]]),
        torch.tensor([[True, True], [True, False]]),
        torch.ones(2, 3, 2),
    ):
        expected = mask.clone()
        expected[:, 0] = 0
        out = step(TensorDict(loss_mask=mask, batch_size=[2]))["loss_mask"]
        assert out.dtype == mask.dtype and out.tolist() == expected.tolist()
        host = step.host({"loss_mask": mask.numpy()})["loss_mask"]
        assert host.tolist() == expected.tolist() and mask[:, 0].any()  # the input kept
        assert (
            torch.compile(step.compute, dynamic=True)({"loss_mask": mask})["loss_mask"].tolist()
            == expected.tolist()
        )
    with pytest.raises(ValueError, match=r"BoundaryMask: 'loss_mask' must be \[B, S, \.\.\.\] mask"):
        step(TensorDict(loss_mask=torch.ones(3), batch_size=[]))


def _masked_by_hand(records: list[SampleRecord]) -> list[SampleRecord]:
    """Each record with its loss mask (or ones) zeroed where a segment starts: what the Collator trains."""
    out = []
    for r in records:
        positions = np.asarray(r.payload["positions"])
        starts = (positions == 0) | (np.arange(len(positions)) == 0)
        mask = np.asarray(r.payload.get("loss_mask", np.ones(len(positions), np.int64)))
        out.append(SampleRecord(r.meta, {**r.payload, "loss_mask": (mask * ~starts).astype(mask.dtype)}))
    return out


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_collator_equals_to_training_on_boundary_masked_records(data: st.DataObject) -> None:
    """Property: the Collator's default equals the page's to_training on records whose supervision mask is
    zero on every segment start, on the NumPy and the torch path."""
    b = data.draw(packed_batches())
    first = b.records[0].payload
    if not isinstance(first, dict) or "positions" not in first:
        return
    options: dict[str, Any] = {**data.draw(training_options(b)), "return_labels": True}
    options.pop("extra_fields", None)
    want = as_lists(type(b)(_masked_by_hand(list(b.records))).to_training(**options))
    for host in (True, False):
        with use_host_pass(host):
            assert as_lists(Collator(**options)(list(b.records))) == want
