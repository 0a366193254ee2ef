"""Fields that change what gets supervised are used or refused, never silently dropped."""

from __future__ import annotations

import pytest
import torch
from helpers import batch, record

from zephon_collate import Collator, pack_flat

# Hugging Face-style rows: a prompt masked with -100 in labels, trailing padding marked 0 in attention_mask.
HF_ROWS = [
    {
        "input_ids": [1, 5, 6, 7, 0, 0],
        "attention_mask": [1, 1, 1, 1, 0, 0],
        "labels": [-100, -100, 6, 7, -100, -100],
    },
    {"input_ids": [1, 8, 9, 2, 3, 4], "attention_mask": [1] * 6, "labels": [-100, 8, 9, 2, 3, 4]},
]
OPTIONS = {"return_labels": True, "return_num_valid_tokens": True}


def test_hf_rows_are_refused_not_trained_on_padding_and_prompts():
    """The reproduction: these rows gave num_valid_tokens 10 where 4 was right; now an error names the fix."""
    with pytest.raises(
        ValueError,
        match=r"record 0 .*'attention_mask' with zeros.*Collator.for_transformers.*Collator\(pad_token_id",
    ):
        Collator(**OPTIONS)(HF_ROWS)
    with pytest.raises(ValueError, match=r"record 0 .*'attention_mask' with zeros"):
        batch(*HF_ROWS).to_training(**OPTIONS)
    no_mask = [{k: v for k, v in row.items() if k != "attention_mask"} for row in HF_ROWS]
    with pytest.raises(
        ValueError,
        match=r"record 0 .*'labels' that differ.*Collator.for_transformers.*loss_mask = labels != -100",
    ):
        Collator(**OPTIONS)(no_mask)


def test_for_transformers_uses_both_fields():
    """The first fix the errors name: HF rows, HF conventions (unshifted labels, padding dropped)."""
    out = Collator.for_transformers(pad_token_id=0)(HF_ROWS)
    assert out["input_ids"].tolist() == [[1, 5, 6, 7, 0, 0], [1, 8, 9, 2, 3, 4]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [1] * 6]
    assert out["labels"].tolist() == [[-100, -100, 6, 7, -100, -100], [-100, 8, 9, 2, 3, 4]]
    assert int((out["labels"] != -100).sum()) == 7


def test_the_named_fix_trains_exactly_the_supervised_tokens():
    fixed = [
        {"input_ids": row["input_ids"], "loss_mask": [int(label != -100) for label in row["labels"]]}
        for row in HF_ROWS
    ]
    out = Collator(**OPTIONS)(fixed)
    assert out["labels"].tolist() == [[-100, 6, 7, -100, -100], [8, 9, 2, 3, 4]]
    assert out["num_valid_tokens"] == 7  # 6, 7 in row 0; 8, 9, 2, 3, 4 in row 1


def test_assistant_masks_are_refused_unless_they_are_the_loss_mask():
    chat = {"input_ids": [1, 5, 6, 7], "assistant_masks": [0, 0, 1, 1]}
    with pytest.raises(
        ValueError, match=r"record 0 .*'assistant_masks' with zeros.*loss_mask = assistant_masks"
    ):
        Collator(**OPTIONS)([chat])
    with pytest.raises(ValueError, match="'assistant_masks' with zeros"):
        Collator(**OPTIONS)([{**chat, "loss_mask": [1, 1, 1, 1]}])
    out = Collator(**OPTIONS)([{**chat, "loss_mask": [0, 0, 1, 1]}])
    assert out["labels"].tolist() == [[-100, 6, 7]] and out["num_valid_tokens"] == 2
    assert Collator(**OPTIONS)([{**chat, "assistant_masks": [1] * 4}])["num_valid_tokens"] == 3


def test_harmless_copies_and_used_fields_pass():
    plain = {"input_ids": [1, 5, 6], "attention_mask": [1, 1, 1], "labels": [1, 5, 6]}
    assert Collator(**OPTIONS)([plain])["labels"].tolist() == [[5, 6]]
    through = batch({"input_ids": [5, 6, 7], "attention_mask": torch.tensor([1, 1, 0])})
    assert through.to_training(extra_fields=["attention_mask"])["attention_mask"].tolist() == [[1, 1, 0]]


def test_packed_labels_are_refused_at_collation():
    """pack_flat carries a labels field into its rows; to_training then refuses it instead of ignoring it."""
    rows = pack_flat(
        [record({"input_ids": [1, 5, 6], "labels": [-100, 5, 6]})], 4, pad_token_id=0, fields=["labels"]
    )
    with pytest.raises(ValueError, match=r"'labels' that differ from its tokens"):
        Collator(**OPTIONS)(rows)
