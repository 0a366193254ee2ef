"""The Collator pads ragged rows (unpacked SFT examples) on the right, as the page's trailing padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import as_lists, record

from zephon_collate import Collator, SampleBatch, SampleMeta, SampleRecord

LABELS = {"return_labels": True, "return_num_valid_tokens": True, "return_padding_mask": True}


def test_ragged_examples_padded_hand_worked():
    collate = Collator(pad_token_id=0, return_loss_mask=True, **LABELS)
    samples = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8, 9], "loss_mask": [1, 1]}]
    out = collate(samples)
    assert out["input_ids"].tolist() == [[5, 6], [8, 9]]
    assert out["labels"].tolist() == [[6, 7], [9, -100]]  # the pad token is never a target
    assert out["loss_mask"].tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert out["padding_mask"].tolist() == [[False, False], [False, False]]  # the one pad is cut by the shift
    assert out["num_valid_tokens"] == 3


def test_pad_to_multiple_of_with_positions_and_cu_seqlens():
    collate = Collator(pad_token_id=0, pad_to_multiple_of=4, return_cu_seqlens=True, **LABELS)
    samples = [{"input_ids": [5, 6, 7], "positions": [0, 1, 2]}, {"input_ids": [8, 9], "positions": [0, 1]}]
    out = collate(samples)
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert out["labels"].tolist() == [[6, 7, -100], [9, -100, -100]]
    assert out["positions"].tolist() == [[0, 1, 2], [0, 1, 0]]  # the padding is a segment of its own
    assert out["padding_mask"].tolist() == [[False, False, False], [False, False, True]]
    assert out["cu_seqlens"].tolist() == [[0, 3, 3], [0, 2, 3]] and out["max_seqlen"].tolist() == [3, 2]
    assert out["num_valid_tokens"] == 3


def test_padding_equals_the_pages_trailing_padding_and_changes_no_record():
    """Collator(pad_token_id) gives what to_training gives on rows padded by hand with _padding_length."""
    meta = SampleMeta((0, 0, 1), 0, 0, tags={"_padding_length": 1})
    ragged = [
        record({"input_ids": [4, 5, 6, 7], "w": [1, 2, 3, 4]}, 0),
        SampleRecord(meta, {"input_ids": [8, 0], "w": [5, 0]}),
    ]
    options = {"extra_fields": ["w"], "return_loss_mask": True, "return_cu_seqlens": False, **LABELS}
    got = Collator(pad_token_id=0, **options)(ragged)
    by_hand = [
        ragged[0],
        SampleRecord(
            SampleMeta((0, 0, 1), 0, 0, tags={"_padding_length": 3}),
            {"input_ids": [8, 0, 0, 0], "w": [5, 0, 0, 0]},
        ),
    ]
    want = SampleBatch(by_hand).to_training(**options)
    assert as_lists(got) == as_lists(want)
    assert ragged[1].meta.padding_length == 1 and ragged[1].payload["input_ids"] == [8, 0]
    stacked = Collator(pad_token_id=0, **options).stack(ragged)  # the worker half pads too
    assert as_lists(Collator(pad_token_id=0, **options).finish(stacked)) == as_lists(want)


def test_tensor_rows_pad_on_their_device_and_dtype():
    samples = [
        {"input_ids": torch.tensor([5, 6, 7], dtype=torch.int32)},
        {"input_ids": torch.tensor([8], dtype=torch.int32)},
    ]
    out = Collator(pad_token_id=3, dtype=torch.int32)(samples)
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 3, 3]] and out["input_ids"].dtype == torch.int32
    assert samples[1]["input_ids"].tolist() == [8]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"pad_to_multiple_of": 8}, ValueError, "pad_to_multiple_of needs pad_token_id"),
        ({"pad_token_id": -1}, ValueError, r"pad_token_id must be an int >= 0, got -1"),
        ({"pad_token_id": "0"}, TypeError, r"pad_token_id must be an int >= 0"),
        ({"pad_token_id": 0, "pad_to_multiple_of": 0}, ValueError, r"pad_to_multiple_of must be an int >= 1"),
        ({"pad_token_id": True}, TypeError, r"pad_token_id must be an int"),
    ],
)
def test_padding_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        Collator(**kwargs)


def test_without_pad_token_id_ragged_rows_still_name_the_fix():
    with pytest.raises(
        ValueError, match=r"unequal shape.*pad them \(Collator\(pad_token_id=\.\.\.\)\) or pack them"
    ):
        Collator(return_labels=True)([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}])


@pytest.mark.parametrize(
    ("dtype", "pad"),
    [(np.uint8, 256), (np.int16, 40_000), (torch.uint8, 256), (torch.int16, 40_000), (np.int8, 2**40)],
)
def test_padding_writes_in_the_output_dtype_not_the_payloads(dtype, pad):
    """A pad id beyond the payload row's own dtype is written in the output dtype (int64)."""
    make = (
        (lambda v: np.array(v, dtype=dtype))
        if isinstance(dtype, type)
        else (lambda v: torch.tensor(v, dtype=dtype))
    )
    records = [
        SampleRecord(SampleMeta((0, 0, 0), 0, 0, 0), {"input_ids": make([1, 2, 3])}),
        SampleRecord(SampleMeta((0, 0, 1), 0, 0, 1), {"input_ids": make([4])}),
    ]
    out = Collator(pad_token_id=pad)(records)
    assert out["input_ids"].dtype == torch.int64
    assert out["input_ids"].tolist() == [[1, 2, 3], [4, pad, pad]]


def test_narrow_positions_padded_past_their_range_do_not_wrap():
    """uint8 positions padded to 512: the padding counts 0, 1, ... in int64, never wrapping at 256
    (a wrap would put a second boundary inside the padding)."""
    records = [
        SampleRecord(
            SampleMeta((0, 0, i), 0, 0, i),
            {"input_ids": list(range(1, n + 1)), "positions": np.arange(n, dtype=np.uint8)},
        )
        for i, n in enumerate((200, 10))
    ]
    out = Collator(
        pad_token_id=0, pad_to_multiple_of=512, extra_fields=["positions"], return_cu_seqlens=True
    )(records)
    assert out["positions"].dtype == torch.int64
    assert out["positions"][1, 10:].tolist() == list(range(502))
    assert out["cu_seqlens"].tolist() == [[0, 200, 512], [0, 10, 512]]


def test_per_record_fields_are_not_padded():
    """A field with one value per record (not per token) stays [B, 1] with pad_token_id; it is not
    padded to the row length, and no error advises the option already given."""
    records = [
        SampleRecord(SampleMeta((0, 0, 0), 0, 0, 0), {"input_ids": [1, 2, 3], "w": [7]}),
        SampleRecord(SampleMeta((0, 0, 1), 0, 0, 1), {"input_ids": [4], "w": [8]}),
    ]
    out = Collator(pad_token_id=0, extra_fields=["w"])(records)
    assert out["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert out["w"].tolist() == [[7], [8]]
