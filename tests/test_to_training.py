"""SampleBatch.to_training against the reference page, one sentence at a time.

Each test's docstring quotes (or names) the sentence of the page, or of
DECISIONS.md, that it checks. Expected values are worked out by hand.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from helpers import BOS, EOS, PAD, as_lists, batch, record

from zephon_collate import SampleBatch

PACKED = [BOS, 10, EOS, BOS, 11, EOS]
SEGMENT_POSITIONS = [0, 1, 2, 0, 1, 2]


# --- loss_mask (the paragraph above Parameters) -------------------------------------------


def test_loss_mask_consumed_with_labels():
    """'With return_labels=True it is consumed: labels whose mask entry (mask[:, 1:]) is 0 are set to ignore_index.'"""
    out = batch({"input_ids": [5, 6, 7, 8], "loss_mask": [1, 0, 1, 0]}).to_training(return_labels=True)
    # labels [6, 7, 8] pair with mask[1:] = [0, 1, 0]
    assert out["labels"].tolist() == [[-100, 7, -100]]
    assert "loss_mask" not in out


def test_loss_mask_recognized_automatically_without_listing():
    """'A "loss_mask" payload field ... is recognized automatically, like "positions".'"""
    out = batch({"input_ids": [5, 6, 7], "loss_mask": [1, 1, 0], "positions": [0, 1, 2]}).to_training()
    assert out["loss_mask"].tolist() == [[1, 1, 0]]
    assert out["positions"].tolist() == [[0, 1, 2]]


def test_loss_mask_surfaced_unshifted_without_labels():
    """'Without return_labels it is surfaced stacked and unshifted, like any data field.'"""
    out = batch(
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8, 9, 10], "loss_mask": [1, 1, 0]}
    )
    result = out.to_training()
    assert result["loss_mask"].dtype == torch.long
    assert result["loss_mask"].tolist() == [[0, 1, 1], [1, 1, 0]]


def test_return_loss_mask_after_supervision_padding_and_eos():
    """'return_loss_mask=True ... derived as labels != ignore_index after supervision, padding, and optional EOS masking.'"""
    payload = {"input_ids": [BOS, 10, EOS, BOS, 11, PAD], "loss_mask": [1, 1, 1, 0, 1, 0]}
    out = batch(payload, paddings=[1]).to_training(
        return_labels=True, return_loss_mask=True, eos_mask_loss=True, eos_token_id=EOS
    )
    # labels: [10, EOS, BOS, 11, PAD]; mask[1:] = [1, 1, 0, 1, 0] masks 2 and 4;
    # padding masks the last label (4); EOS at input 2 masks label 2.
    assert out["labels"].tolist() == [[10, EOS, -100, 11, -100]]
    assert out["loss_mask"].tolist() == [[1.0, 1.0, 0.0, 1.0, 0.0]]
    assert out["loss_mask"].dtype == torch.float32


def test_loss_mask_in_extra_fields_with_labels_is_error():
    """'Listing "loss_mask" in extra_fields together with return_labels is an error.'"""
    with pytest.raises(ValueError, match="loss_mask"):
        batch({"input_ids": [1, 2], "loss_mask": [1, 1]}).to_training(
            return_labels=True, extra_fields=["loss_mask"]
        )


def test_loss_mask_in_extra_fields_without_labels_is_allowed():
    """Without labels, listing 'loss_mask' as an extra field surfaces it once, unshifted."""
    out = batch({"input_ids": [1, 2], "loss_mask": [0, 1]}).to_training(extra_fields=["loss_mask"])
    assert out["loss_mask"].tolist() == [[0, 1]]


def test_loss_mask_in_some_payloads_only_is_error():
    """Raises: 'if a loss_mask is present in only some payloads'."""
    b = batch({"input_ids": [1, 2], "loss_mask": [1, 1]}, {"input_ids": [3, 4]})
    with pytest.raises(ValueError, match=r"record 1 .*'loss_mask'"):
        b.to_training(return_labels=True)


def test_loss_mask_misaligned_is_error():
    """Raises: 'or misaligned with the token field'."""
    with pytest.raises(ValueError, match=r"record 0 .*'loss_mask' has 2 entries but the token row has 3"):
        batch({"input_ids": [1, 2, 3], "loss_mask": [1, 1]}).to_training(return_labels=True)


# --- tokens_field --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ({"tokens": [7, 8], "token_ids": [1, 1], "ids": [2, 2]}, [[7, 8]]),
        ({"token_ids": [5, 6], "ids": [2, 2]}, [[5, 6]]),
        ({"ids": [3, 4]}, [[3, 4]]),
        ({"input_ids": [9, 9], "tokens": [1, 1]}, [[9, 9]]),
    ],
)
def test_tokens_field_auto_order(payload, expected):
    """'"auto" detects common names (input_ids, tokens, token_ids, ids), in that order.'"""
    assert batch(payload).to_training()["input_ids"].tolist() == expected


def test_tokens_field_auto_needs_a_name_every_payload_has():
    """DECISIONS: 'auto picks the first ... that every dict payload has'."""
    out = batch({"input_ids": [1], "tokens": [5]}, {"tokens": [6]}).to_training()
    assert out["input_ids"].tolist() == [[5], [6]]


def test_tokens_field_explicit_takes_precedence_and_output_is_input_ids():
    """'An explicit field takes precedence. ... output uses "input_ids" before rename_fields.'"""
    out = batch({"input_ids": [1, 1], "ids": [4, 5]}).to_training(tokens_field="ids")
    assert out["input_ids"].tolist() == [[4, 5]]
    assert list(out) == ["ids", "texts", "input_ids"]
    assert out["ids"] == [(0, 0, 0)]


def test_tokens_field_independent_of_eos_masking():
    """'Independent of EOS masking': EOS masking applies to the chosen field's tokens."""
    out = batch({"tokens": PACKED}).to_training(
        tokens_field="tokens", return_labels=True, eos_mask_loss=True, eos_token_id=EOS
    )
    assert out["labels"].tolist() == [[10, EOS, -100, 11, EOS]]


def test_tokens_field_auto_not_found():
    """Raises: 'If tokens_field cannot be auto-detected'."""
    with pytest.raises(ValueError, match=r"record 0 .*tokens_field"):
        batch({"text": "hello"}).to_training()


def test_tokens_field_explicit_missing():
    """Raises: '(if tokens_field) is missing'."""
    with pytest.raises(ValueError, match=r"record 1 .*no tokens field 'tokens'"):
        batch({"tokens": [1]}, {"input_ids": [2]}).to_training(tokens_field="tokens")


# --- return_labels --------------------------------------------------------------------------


def test_return_labels_shift():
    """'input_ids becomes tokens[:, :-1] and labels becomes tokens[:, 1:].'"""
    out = batch({"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10, 11, 12]}).to_training(return_labels=True)
    assert out["input_ids"].tolist() == [[5, 6, 7], [9, 10, 11]]
    assert out["labels"].tolist() == [[6, 7, 8], [10, 11, 12]]


def test_return_labels_slices_extra_fields_like_inputs():
    """'Extra fields are sliced like input_ids (drop the last token), so they stay aligned with it.'"""
    out = batch({"input_ids": [5, 6, 7], "attention_mask": [1, 1, 0]}).to_training(
        return_labels=True, extra_fields=["attention_mask"]
    )
    assert out["attention_mask"].tolist() == [[1, 1]]


def test_labels_are_not_views_of_inputs():
    """Outputs are independent tensors: writing into labels cannot change input_ids."""
    out = batch({"input_ids": [5, 6, 7]}).to_training(return_labels=True)
    out["labels"][0, 0] = 99
    assert out["input_ids"].tolist() == [[5, 6]]


# --- dtype ----------------------------------------------------------------------------------


def _all_outputs(dtype):
    payload = {"input_ids": [BOS, 10, EOS, PAD], "positions": [0, 1, 2, 0], "loss_mask": [1, 1, 1, 0]}
    return batch(payload, paddings=[1]).to_training(
        dtype=dtype,
        return_labels=True,
        return_loss_mask=True,
        return_num_valid_tokens=True,
        return_cu_seqlens=True,
        return_padding_mask=True,
    )


def test_dtype_auto_is_torch_long():
    """'"auto" ... prefers torch.long'; loss mask float32, cu_seqlens/max int32, padding mask bool."""
    out = _all_outputs("auto")
    assert out["input_ids"].dtype == out["labels"].dtype == out["positions"].dtype == torch.long
    assert out["loss_mask"].dtype == torch.float32
    assert out["cu_seqlens"].dtype == out["max_seqlen"].dtype == torch.int32
    assert out["padding_mask"].dtype == torch.bool
    assert isinstance(out["num_valid_tokens"], int)


def test_dtype_torch_int32():
    """A torch dtype gives torch tensors of it; the mask dtypes are independent of it."""
    out = _all_outputs(torch.int32)
    assert out["input_ids"].dtype == out["labels"].dtype == out["positions"].dtype == torch.int32
    assert out["loss_mask"].dtype == torch.float32


@pytest.mark.parametrize("dtype", [np.int64, np.dtype("int32")])
def test_dtype_numpy_gives_arrays(dtype):
    """DECISIONS: 'a NumPy dtype (np.int64, np.dtype("int32")) gives NumPy arrays'."""
    out = _all_outputs(dtype)
    assert isinstance(out["input_ids"], np.ndarray) and out["input_ids"].dtype == np.dtype(dtype)
    assert out["labels"].dtype == np.dtype(dtype)
    assert out["loss_mask"].dtype == np.float32
    assert out["cu_seqlens"].dtype == out["max_seqlen"].dtype == np.int32
    assert out["padding_mask"].dtype == np.bool_
    assert out["input_ids"].tolist() == [[BOS, 10, EOS]]
    assert out["labels"].tolist() == [[10, EOS, -100]]


def test_dtype_none_gives_python_lists():
    """'Use None to explicitly return lists'; 'Python floats for lists', 'Python ints for lists', bools."""
    out = _all_outputs(None)
    assert out["input_ids"] == [[BOS, 10, EOS]]
    assert out["loss_mask"] == [[1.0, 1.0, 0.0]] and isinstance(out["loss_mask"][0][0], float)
    assert out["cu_seqlens"] == [[0, 3]] and isinstance(out["cu_seqlens"][0][0], int)
    assert out["max_seqlen"] == [3]
    assert out["padding_mask"] == [[False, False, False]]


def test_dtype_none_allows_ragged_rows():
    """DECISIONS: 'lists, with dtype=None, may be ragged'."""
    b = batch({"input_ids": [1, 2, 3], "positions": [0, 1, 0]}, {"input_ids": [4, 5], "positions": [0, 1]})
    out = b.to_training(dtype=None, return_labels=True, return_cu_seqlens=True, return_num_valid_tokens=True)
    assert out["input_ids"] == [[1, 2], [4]]
    assert out["labels"] == [[2, 3], [5]]
    assert out["cu_seqlens"] == [[0, 2], [0, 1]]
    assert out["max_seqlen"] == [2, 1]
    assert out["num_valid_tokens"] == 3
    flat = b.to_training(dtype=None, return_labels=True, return_cu_seqlens=True, flatten=True)
    assert flat["input_ids"] == [1, 2, 4]
    assert flat["cu_seqlens"] == [0, 2, 3] and flat["max_seqlen"] == 2


def test_unequal_rows_cannot_be_stacked():
    """DECISIONS: 'Token rows of unequal length cannot be stacked into a tensor or array: ValueError that says so'."""
    with pytest.raises(ValueError, match=r"unequal shape.*record 1"):
        batch({"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}).to_training()


def test_flatten_max_seqlen_is_python_int():
    """'With flatten=True, the maximum is always a Python int.'"""
    for dtype in ("auto", np.int32, None):
        out = batch({"input_ids": [1, 2, 3], "positions": [0, 1, 0]}).to_training(
            dtype=dtype, return_cu_seqlens=True, flatten=True
        )
        assert type(out["max_seqlen"]) is int and out["max_seqlen"] == 2


# --- extra_fields ---------------------------------------------------------------------------


def test_extra_fields_included_and_stacked():
    """'Additional fields to include and stack (e.g., ["attention_mask"]).'"""
    out = batch(
        {"input_ids": [1, 2], "attention_mask": [1, 0]}, {"input_ids": [3, 4], "attention_mask": [1, 1]}
    )
    assert out.to_training(extra_fields=["attention_mask"])["attention_mask"].tolist() == [[1, 0], [1, 1]]


def test_positions_surfaced_without_listing_and_listing_is_harmless():
    """'A "positions" field (emitted by pack_flat) is surfaced automatically and need not be listed here.'"""
    b = batch({"input_ids": [1, 2, 3], "positions": [0, 1, 0]})
    assert as_lists(b.to_training()) == as_lists(b.to_training(extra_fields=["positions"]))


@pytest.mark.parametrize("name", ["input_ids", "ids", "texts"])
def test_extra_fields_cannot_overwrite_generated(name):
    """'Extra fields cannot overwrite generated output fields, such as input_ids or labels.'"""
    with pytest.raises(ValueError, match=f"'{name}' would overwrite"):
        batch({"tokens": [1, 2], name: [1, 2]}).to_training(extra_fields=[name])


def test_extra_field_labels_only_collides_when_labels_generated():
    """'labels' is a generated field only with return_labels=True."""
    b = batch({"input_ids": [1, 2], "labels": [7, 7]})
    assert b.to_training(extra_fields=["labels"])["labels"].tolist() == [[7, 7]]
    with pytest.raises(ValueError, match="'labels' would overwrite"):
        b.to_training(extra_fields=["labels"], return_labels=True)


# --- ignore_index ---------------------------------------------------------------------------


def test_ignore_index_on_trailing_padding():
    """'With return_labels, each record's trailing pad labels (meta.padding_length) are set to this value.'"""
    b = batch({"input_ids": [5, 6, 7, PAD, PAD]}, {"input_ids": [5, 6, 7, 8, 9]}, paddings=[2, None])
    out = b.to_training(return_labels=True, ignore_index=-1)
    # row 0 labels [6, 7, PAD, PAD]: last 2 ignored; row 1 has no padding
    assert out["labels"].tolist() == [[6, 7, -1, -1], [6, 7, 8, 9]]


# --- rename_fields --------------------------------------------------------------------------


def test_rename_before_exclusion():
    """'applied to the output dict before exclusion (e.g. {"input_ids": "input"})'."""
    b = batch({"input_ids": [1, 2, 3]})
    out = b.to_training(rename_fields={"input_ids": "input"}, exclude_fields=["texts"])
    assert list(out) == ["ids", "input"] and out["input"].tolist() == [[1, 2, 3]]
    assert "input" not in b.to_training(rename_fields={"input_ids": "input"}, exclude_fields=["input"])
    kept = b.to_training(rename_fields={"input_ids": "input"}, exclude_fields=["input_ids"])
    assert "input" in kept


def test_rename_missing_source_nonempty_is_error():
    """'Source keys must be present in the output ...' (Raises: missing source key in a nonempty batch)."""
    with pytest.raises(ValueError, match="'labels'"):
        batch({"input_ids": [1, 2]}).to_training(rename_fields={"labels": "targets"})


def test_rename_missing_source_ignored_for_empty_batch_and_renames_emitted():
    """'except for empty batches, where missing sources are ignored. All emitted fields are renamed, including for empty batches'."""
    out = SampleBatch([]).to_training(rename_fields={"labels": "targets", "input_ids": "input"})
    assert out == {"ids": [], "texts": [], "input": []}


def test_rename_collision_is_error():
    """'their final names must be unique' (Raises: produces a key collision)."""
    with pytest.raises(ValueError, match="same name 'texts'"):
        batch({"input_ids": [1, 2]}).to_training(rename_fields={"input_ids": "texts"})


def test_rename_swap_allowed():
    """'Swaps are allowed.'"""
    out = batch({"input_ids": [5, 6, 7]}).to_training(
        return_labels=True, rename_fields={"input_ids": "labels", "labels": "input_ids"}
    )
    assert out["labels"].tolist() == [[5, 6]] and out["input_ids"].tolist() == [[6, 7]]


# --- flatten --------------------------------------------------------------------------------


def test_flatten_after_shift_and_masking():
    """'Flatten stacked scalar token fields from [B, S] to [B * S] after per-sequence shifting and masking.'"""
    b = batch(
        {"input_ids": [5, 6, 7], "positions": [0, 1, 2]},
        {"input_ids": [8, 9, PAD], "positions": [0, 1, 0]},
        paddings=[0, 1],
    )
    out = b.to_training(return_labels=True, flatten=True, return_loss_mask=True, return_padding_mask=True)
    assert out["input_ids"].tolist() == [5, 6, 8, 9]
    assert out["labels"].tolist() == [6, 7, 9, -100]
    assert out["positions"].tolist() == [0, 1, 0, 1]
    assert out["loss_mask"].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert out["padding_mask"].tolist() == [False, False, False, False]


def test_flatten_keeps_ids_and_texts_per_record():
    """'The ids/texts fields remain per-record lists.'"""
    out = batch({"input_ids": [1, 2], "text": "a"}, {"input_ids": [3, 4]}).to_training(flatten=True)
    assert out["ids"] == [(0, 0, 0), (0, 0, 1)] and out["texts"] == ["a", None]


# --- exclude_fields -------------------------------------------------------------------------


def test_exclude_fields_after_renaming_absent_ignored():
    """'Output names to omit after renaming, e.g. ("ids", "texts"). Absent names are ignored.'"""
    out = batch({"input_ids": [1, 2]}).to_training(exclude_fields=("ids", "texts", "nothing"))
    assert list(out) == ["input_ids"]


def test_exclude_fields_string_is_type_error():
    """Raises TypeError if 'exclude_fields is a string instead of a sequence of field names'."""
    with pytest.raises(TypeError, match="exclude_fields"):
        batch({"input_ids": [1, 2]}).to_training(exclude_fields="texts")


# --- return_num_valid_tokens ----------------------------------------------------------------


def test_num_valid_tokens_counts_non_ignored_labels():
    """'a Python int counting labels unequal to ignore_index after masking'."""
    b = batch(
        {"input_ids": PACKED, "loss_mask": [1, 1, 1, 1, 0, 1]},
        {"input_ids": [1, 2, 3, 4, 5, PAD], "loss_mask": [1] * 6},
        paddings=[0, 1],
    )
    out = b.to_training(
        return_labels=True, return_num_valid_tokens=True, eos_mask_loss=True, eos_token_id=EOS
    )
    # row 0 labels [10, EOS, BOS, 11, EOS]: EOS input masks label 2; mask[1:] zero at index 3 -> 3 valid
    # row 1 labels [2, 3, 4, 5, PAD]: input 2 is EOS -> label 1 masked; last label is padding -> 3 valid
    assert out["num_valid_tokens"] == 6 and type(out["num_valid_tokens"]) is int


def test_num_valid_tokens_zero_for_empty_batch():
    """'(zero for empty batches)'."""
    assert (
        SampleBatch([]).to_training(return_labels=True, return_num_valid_tokens=True)["num_valid_tokens"] == 0
    )


@pytest.mark.parametrize("flag", ["return_num_valid_tokens", "return_loss_mask"])
def test_num_valid_tokens_and_loss_mask_require_labels(flag):
    """'Requires return_labels=True.' (Raises: used without return_labels)."""
    with pytest.raises(ValueError, match=f"{flag}=True requires return_labels=True"):
        batch({"input_ids": [1, 2]}).to_training(**{flag: True})


# --- return_loss_mask -----------------------------------------------------------------------


def test_loss_mask_empty_batch_and_follows_rename_exclude():
    """'an empty list for empty batches. Follows flatten, rename_fields, and exclude_fields'."""
    assert SampleBatch([]).to_training(return_labels=True, return_loss_mask=True)["loss_mask"] == []
    b = batch({"input_ids": [1, 3, 4]})
    out = b.to_training(return_labels=True, return_loss_mask=True, rename_fields={"loss_mask": "weights"})
    assert out["weights"].tolist() == [[1.0, 1.0]]
    assert "loss_mask" not in b.to_training(
        return_labels=True, return_loss_mask=True, exclude_fields=["loss_mask"]
    )


# --- return_padding_mask --------------------------------------------------------------------


def test_padding_mask_trailing_padding_only():
    """'True only for trailing padding described by each record's meta.padding_length (missing metadata means no padding).'"""
    b = batch({"input_ids": [5, 6, PAD, PAD]}, {"input_ids": [5, 6, 7, PAD]}, paddings=[2, None])
    out = b.to_training(return_padding_mask=True)
    assert out["padding_mask"].tolist() == [[False, False, True, True], [False, False, False, False]]
    assert out["padding_mask"].dtype == torch.bool


def test_padding_mask_with_labels_drops_last():
    """'With labels, drops the last token like input_ids'."""
    out = batch({"input_ids": [5, 6, PAD, PAD]}, paddings=[2]).to_training(
        return_padding_mask=True, return_labels=True
    )
    assert out["padding_mask"].tolist() == [[False, False, True]]


def test_padding_mask_independent_of_loss_mask_and_token_ids():
    """'Independent of loss_mask: real unsupervised tokens are not padding.' 'Does not infer padding from token IDs or ignore_index.'"""
    payload = {"input_ids": [PAD, -100 + 100, 5, 7], "loss_mask": [0, 0, 0, 1]}
    out = batch(payload).to_training(return_padding_mask=True, return_labels=True, ignore_index=0)
    assert out["padding_mask"].tolist() == [[False, False, False]]


def test_padding_mask_empty_batch_and_rename():
    """'Empty batches return [].' '... then follows flatten, rename_fields, and exclude_fields.'"""
    assert SampleBatch([]).to_training(return_padding_mask=True)["padding_mask"] == []
    out = batch({"input_ids": [1, 2]}, paddings=[1]).to_training(
        return_padding_mask=True, rename_fields={"padding_mask": "is_pad"}
    )
    assert out["is_pad"].tolist() == [[False, True]]


def test_padding_mask_requires_2d_tokens_for_tensors():
    """'Requires 2-D scalar token rows for tensor/array output.'"""
    b = batch({"input_ids": [[1, 2], [3, 4]]})
    with pytest.raises(ValueError, match="2-D scalar token rows"):
        b.to_training(return_padding_mask=True)
    assert b.to_training(return_padding_mask=True, dtype=None)["padding_mask"] == [[False, False]]


@pytest.mark.parametrize("padding", [-1, 4])
def test_padding_length_out_of_row_is_error(padding):
    """Raises: 'if requested padding lengths fall outside their token rows'; DECISIONS: checked when labels or a padding mask are requested."""
    b = batch({"input_ids": [1, 2, 3]}, paddings=[padding])
    for flags in ({"return_labels": True}, {"return_padding_mask": True}):
        with pytest.raises(ValueError, match=r"record 0 .*padding_length"):
            b.to_training(**flags)
    assert b.to_training()["input_ids"].tolist() == [[1, 2, 3]]


# --- return_cu_seqlens ----------------------------------------------------------------------


def test_cu_seqlens_rows_padded_with_row_length():
    """'With flatten=False, boundaries have shape [B, K], where K is the largest boundary count ..., padded with each row's input length. Maxima have shape [B].'"""
    b = batch(
        {"input_ids": [1] * 6, "positions": [0, 1, 0, 1, 2, 0]},
        {"input_ids": [1] * 6, "positions": list(range(6))},
    )
    out = b.to_training(return_cu_seqlens=True)
    assert out["cu_seqlens"].tolist() == [[0, 2, 5, 6], [0, 6, 6, 6]]
    assert out["max_seqlen"].tolist() == [3, 6]


def test_cu_seqlens_decisions_example_with_labels_and_flatten():
    """DECISIONS: positions [0,1,2,0,1,2] with labels give input positions [0,1,2,0,1], boundaries [0,3,5], maximum 3; flattened rows [0,3,5] and [0,5] give [0,3,5,10]."""
    b = batch(
        {"input_ids": PACKED, "positions": SEGMENT_POSITIONS},
        {"input_ids": [1] * 6, "positions": list(range(6))},
    )
    out = b.to_training(return_labels=True, return_cu_seqlens=True)
    assert out["cu_seqlens"].tolist() == [[0, 3, 5], [0, 5, 5]]
    assert out["max_seqlen"].tolist() == [3, 5]
    flat = b.to_training(return_labels=True, return_cu_seqlens=True, flatten=True)
    assert flat["cu_seqlens"].tolist() == [0, 3, 5, 10] and flat["max_seqlen"] == 5


def test_cu_seqlens_empty_batch():
    """'Empty batches return []/[] for boundaries/maxima, or [0]/0 when flattened.'"""
    out = SampleBatch([]).to_training(return_cu_seqlens=True)
    assert out["cu_seqlens"] == [] and out["max_seqlen"] == []
    flat = SampleBatch([]).to_training(return_cu_seqlens=True, flatten=True)
    assert flat["cu_seqlens"] == [0] and flat["max_seqlen"] == 0


def test_cu_seqlens_padding_segment_preserved_labels_unchanged():
    """'Padding segments are preserved; this metadata does not itself enable attention masking or change labels.'"""
    b = batch({"input_ids": [1, 5, 6, PAD, PAD], "positions": [0, 1, 2, 0, 1]})
    with_cu = b.to_training(return_labels=True, return_cu_seqlens=True)
    assert with_cu["cu_seqlens"].tolist() == [[0, 3, 4]]
    assert (
        with_cu["labels"].tolist()
        == b.to_training(return_labels=True)["labels"].tolist()
        == [[5, 6, PAD, PAD]]
    )


def test_cu_seqlens_uses_payload_positions_under_sequence_mode():
    """'Always uses the payload positions, independently of position_mode.'"""
    out = batch({"input_ids": PACKED, "positions": SEGMENT_POSITIONS}).to_training(
        return_cu_seqlens=True, position_mode="sequence"
    )
    assert out["positions"].tolist() == [[0, 1, 2, 3, 4, 5]]
    assert out["cu_seqlens"].tolist() == [[0, 3, 6]]


def test_cu_seqlens_without_labels_and_rename():
    """'Works with or without return_labels.' 'Renaming and exclusion apply normally.'"""
    out = batch({"input_ids": [1, 2, 3], "positions": [0, 0, 1]}).to_training(
        return_cu_seqlens=True, rename_fields={"cu_seqlens": "cu_seq_lens_q"}, exclude_fields=["max_seqlen"]
    )
    assert out["cu_seq_lens_q"].tolist() == [[0, 1, 3]] and "max_seqlen" not in out


@pytest.mark.parametrize(
    ("payloads", "match"),
    [
        ([{"input_ids": [1, 2]}], r"record 0 .*'positions'"),
        ([{"input_ids": [1, 2], "positions": [0, 1]}, {"input_ids": [1, 2]}], r"record 1 .*'positions'"),
        ([{"input_ids": [1, 2], "positions": [0]}], r"record 0 .*'positions' has 1 entries"),
        (
            [{"input_ids": [1, 2], "positions": [0, 1]}, {"input_ids": [1, 2], "positions": [1, 2]}],
            r"record 1 .*start at zero",
        ),
    ],
)
def test_cu_seqlens_positions_requirements(payloads, match):
    """'Requires a positions sequence matching the tokens in every payload, starting at zero in every nonempty input row.'"""
    with pytest.raises(ValueError, match=match):
        batch(*payloads).to_training(return_cu_seqlens=True)


def test_cu_seqlens_positions_required_under_sequence_mode():
    """'those original positions are still required for this metadata.'"""
    with pytest.raises(ValueError, match="'positions'"):
        batch({"input_ids": [1, 2]}).to_training(return_cu_seqlens=True, position_mode="sequence")


def test_cu_seqlens_row_of_one_token_with_labels():
    """A length-1 row with labels has an empty input row: no zero needed, boundaries [0]."""
    out = batch({"input_ids": [7], "positions": [3]}).to_training(return_labels=True, return_cu_seqlens=True)
    assert out["cu_seqlens"].tolist() == [[0]] and out["max_seqlen"].tolist() == [0]
    assert out["input_ids"].tolist() == [[]] and out["labels"].tolist() == [[]]


# --- eos_mask_loss / eos_token_id ---------------------------------------------------------


def test_eos_mask_page_example():
    """'For packed [BOS, A, EOS, BOS, B, EOS], this masks the EOS -> BOS prediction, not the A -> EOS or B -> EOS predictions.'"""
    out = batch({"input_ids": PACKED}).to_training(return_labels=True, eos_mask_loss=True, eos_token_id=EOS)
    assert out["input_ids"].tolist() == [[BOS, 10, EOS, BOS, 11]]
    assert out["labels"].tolist() == [[10, EOS, -100, 11, EOS]]


def test_eos_mask_default_off_keeps_eos_to_bos():
    """'Defaults to False ... this keeps EOS -> BOS transitions supervised.'"""
    out = batch({"input_ids": PACKED}).to_training(return_labels=True)
    assert out["labels"].tolist() == [[10, EOS, BOS, 11, EOS]]


def test_eos_mask_reflected_in_loss_mask_and_counts():
    """'Requested loss masks and valid-token counts reflect this masking'."""
    out = batch({"input_ids": PACKED}).to_training(
        return_labels=True,
        eos_mask_loss=True,
        eos_token_id=EOS,
        return_loss_mask=True,
        return_num_valid_tokens=True,
    )
    assert out["loss_mask"].tolist() == [[1.0, 1.0, 0.0, 1.0, 1.0]] and out["num_valid_tokens"] == 4


def test_eos_equal_to_bos_masks_first_content_token():
    """'CAREFUL: ... If BOS and EOS share an ID, this also masks predictions after BOS, including the first content token.'"""
    same = 3
    out = batch({"input_ids": [same, 10, 11, same, same, 12]}).to_training(
        return_labels=True, eos_mask_loss=True, eos_token_id=same
    )
    assert out["labels"].tolist() == [[-100, 11, same, -100, -100]]


@pytest.mark.parametrize(
    "kwargs",
    [{"eos_mask_loss": True, "eos_token_id": EOS}, {"eos_mask_loss": True, "return_labels": True}],
)
def test_eos_mask_requires_labels_and_id(kwargs):
    """'Requires return_labels=True and a known EOS ID' (Raises)."""
    with pytest.raises(ValueError, match="eos_mask_loss"):
        batch({"input_ids": PACKED}).to_training(**kwargs)


@pytest.mark.parametrize("bad", [-1, True, 2.0, "2", np.float32(2)])
def test_eos_token_id_must_be_nonnegative_int(bad):
    """'Nonnegative EOS ID'; DECISIONS: 'an int (not bool) and >= 0; otherwise ValueError'."""
    with pytest.raises(ValueError, match="eos_token_id"):
        batch({"input_ids": PACKED}).to_training(return_labels=True, eos_mask_loss=True, eos_token_id=bad)


def test_eos_token_id_alone_warns_and_does_not_mask():
    """'Supplying an ID alone does not enable masking and warns when eos_mask_loss=False.'"""
    with pytest.warns(UserWarning, match="eos_mask_loss=False"):
        out = batch({"input_ids": PACKED}).to_training(return_labels=True, eos_token_id=EOS)
    assert out["labels"].tolist() == [[10, EOS, BOS, 11, EOS]]


def test_eos_warning_once_per_call_cached_or_not():
    """The warning fires once per call: on the first call of an option set (built then) as on later
    calls (served from the options cache), never twice."""
    options = {"return_labels": True, "eos_token_id": 987_654}  # an option set no other test uses
    for _ in range(3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batch({"input_ids": PACKED}).to_training(**options)
        assert [str(w.message).count("eos_mask_loss=False") for w in caught] == [1]


def test_eos_warning_even_for_empty_batch():
    """DECISIONS: argument errors and the warning come before any payload is read, even for empty batches."""
    with pytest.warns(UserWarning):
        SampleBatch([]).to_training(eos_token_id=EOS)


def test_no_warning_when_masking():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = batch({"input_ids": PACKED}).to_training(
            return_labels=True, eos_mask_loss=True, eos_token_id=EOS
        )
    # labels of [BOS, 10, EOS, BOS, 11, EOS] are the next tokens; the one after each EOS is masked
    assert out["labels"].tolist() == [[10, EOS, -100, 11, EOS]]


# --- position_mode --------------------------------------------------------------------------


def test_position_mode_preserve_page_example():
    """'"preserve" (default) forwards payload positions, sliced like input_ids ... two three-token documents have positions [0, 1, 2, 0, 1, 2].'"""
    b = batch({"input_ids": PACKED, "positions": SEGMENT_POSITIONS})
    assert b.to_training()["positions"].tolist() == [SEGMENT_POSITIONS]
    assert b.to_training(return_labels=True)["positions"].tolist() == [[0, 1, 2, 0, 1]]


def test_position_mode_preserve_omits_absent():
    """'... and omits them when absent.'"""
    assert "positions" not in batch({"input_ids": PACKED}).to_training()


def test_position_mode_sequence_page_example():
    """'"sequence" generates [0, 1, ..., S-1] in every input row, including when payload positions are absent. The same example becomes [0, 1, 2, 3, 4, 5].'"""
    with_positions = batch({"input_ids": PACKED, "positions": SEGMENT_POSITIONS})
    assert with_positions.to_training(position_mode="sequence")["positions"].tolist() == [[0, 1, 2, 3, 4, 5]]
    without = batch({"input_ids": PACKED})
    assert without.to_training(position_mode="sequence", return_labels=True)["positions"].tolist() == [
        [0, 1, 2, 3, 4]
    ]


def test_position_mode_sequence_restarts_per_row_when_flattened():
    """'Numbering restarts per row even with flatten=True.'"""
    out = batch({"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6]}).to_training(
        position_mode="sequence", flatten=True
    )
    assert out["positions"].tolist() == [0, 1, 2, 0, 1, 2]


def test_position_mode_sequence_dtype_and_empty():
    """'Generated positions use the input dtype/device; empty batches return an empty list.'"""
    out = batch({"input_ids": [1, 2, 3]}).to_training(position_mode="sequence", dtype=torch.int16)
    assert out["positions"].dtype == torch.int16 and out["positions"].device == out["input_ids"].device
    assert SampleBatch([]).to_training(position_mode="sequence")["positions"] == []


def test_position_mode_unknown_is_error():
    """Raises: 'position_mode is unknown'."""
    with pytest.raises(ValueError, match="position_mode"):
        batch({"input_ids": [1]}).to_training(position_mode="continuous")


def test_position_mode_never_changes_loss_masking():
    """'They never change loss masking.'"""
    b = batch({"input_ids": PACKED, "positions": SEGMENT_POSITIONS, "loss_mask": [1, 1, 0, 1, 1, 1]})
    kwargs = {"return_labels": True, "return_loss_mask": True}
    assert (
        b.to_training(position_mode="sequence", **kwargs)["loss_mask"].tolist()
        == b.to_training(**kwargs)["loss_mask"].tolist()
    )


# --- Returns --------------------------------------------------------------------------------


def test_returns_ids_and_texts_lists():
    """'"ids": List of sample IDs (always list, not stacked)'; '"texts": List of text strings'; DECISIONS: None where no text."""
    out = batch({"input_ids": [1, 2], "text": "first"}, [3, 4]).to_training()
    assert out["ids"] == [(0, 0, 0), (0, 0, 1)]
    assert out["texts"] == ["first", None]


def test_returns_key_order():
    """The Returns list order: ids, texts, input_ids, labels, positions, extras, num_valid_tokens, loss_mask, cu_seqlens, max_seqlen, padding_mask."""
    payload = {"input_ids": [1, 2, 3], "positions": [0, 1, 2], "weights": [1, 1, 1]}
    out = batch(payload).to_training(
        return_labels=True,
        extra_fields=["weights"],
        return_num_valid_tokens=True,
        return_loss_mask=True,
        return_cu_seqlens=True,
        return_padding_mask=True,
    )
    assert list(out) == [
        "ids", "texts", "input_ids", "labels", "positions", "weights", "num_valid_tokens",
        "loss_mask", "cu_seqlens", "max_seqlen", "padding_mask",
    ]  # fmt: skip


def test_empty_batch_outputs():
    """Empty batches: every requested sequence key is [] (the page's rule for each key), counts 0."""
    out = SampleBatch([]).to_training(
        return_labels=True, extra_fields=["weights"], return_num_valid_tokens=True, return_padding_mask=True
    )
    assert out == {
        "ids": [], "texts": [], "input_ids": [], "labels": [], "weights": [], "num_valid_tokens": 0, "padding_mask": [],
    }  # fmt: skip


# --- payload kinds (DECISIONS) --------------------------------------------------------------


def test_array_payloads_of_every_kind_mix_with_dicts():
    """DECISIONS: 'a dict, or an array (a list or tuple of numbers, a NumPy array or a torch tensor ...). One batch may mix the two kinds'."""
    payloads = [
        [1, 2, 3],
        (4, 5, 6),
        np.array([7, 8, 9], dtype=np.int32),
        torch.tensor([10, 11, 12], dtype=torch.int16),
        {"input_ids": torch.tensor([13, 14, 15], dtype=torch.uint8)},
    ]
    out = batch(*payloads).to_training(return_labels=True)
    assert out["input_ids"].tolist() == [[1, 2], [4, 5], [7, 8], [10, 11], [13, 14]]
    assert out["labels"].tolist() == [[2, 3], [5, 6], [8, 9], [11, 12], [14, 15]]


@pytest.mark.parametrize("payload", ["tokens", b"\x01\x02", None, 3, 2.5])
def test_non_dict_non_array_payload_is_type_error(payload):
    """Raises TypeError 'If payloads are neither dicts nor arrays'; DECISIONS: str, bytes, None."""
    with pytest.raises(TypeError, match=r"record 1 .*payload must be a dict"):
        batch([1, 2], payload).to_training()


def test_array_payload_has_no_other_field():
    """DECISIONS: 'an array payload is its token row and has no other field'."""
    with pytest.raises(ValueError, match=r"record 1 .*array payload holds only its token row"):
        batch({"input_ids": [1, 2], "weights": [1, 1]}, [3, 4]).to_training(extra_fields=["weights"])


def test_argument_errors_before_payloads_are_read():
    """DECISIONS: 'Errors that the arguments alone decide ... are raised before any payload is read'."""
    bad_payloads = batch("not a payload")
    with pytest.raises(ValueError, match="position_mode"):
        bad_payloads.to_training(position_mode="nope")
    with pytest.raises(TypeError, match="exclude_fields"):
        SampleBatch([]).to_training(exclude_fields="ids")
    for renames in ({"input_ids": "labels"}, {"ids": "texts"}, {"input_ids": "ids"}):  # always emitted
        with pytest.raises(ValueError, match=r"rename_fields gives .* the same name"):
            bad_payloads.to_training(return_labels=True, rename_fields=renames)


def test_unflattened_cu_seqlens_are_int32_per_row():
    """Raises: 'if requested boundaries cannot be ... represented as int32': unflattened, each row's
    boundaries are at most its length, so only a row (not the batch) must fit."""
    from zephon_collate.transforms import CuSeqlens

    wide = torch.zeros(1, 1, dtype=torch.int64).expand(2, 2**30 + 2)  # no memory behind it
    CuSeqlens().check({"positions": wide})  # 2 rows of 2**30 + 2: each fits
    with pytest.raises(ValueError, match="overflow the int32 boundaries"):
        CuSeqlens(flatten=True).check({"positions": wide})


def test_field_in_some_payloads_only_named():
    """DECISIONS: 'A field that some payloads have and others lack ... where the call uses it: ValueError, naming the field.'"""
    b = batch({"input_ids": [1, 2], "positions": [0, 1]}, {"input_ids": [3, 4]})
    with pytest.raises(ValueError, match="'positions'"):
        b.to_training()
    assert "positions" in b.to_training(position_mode="sequence")


def test_to_training_changes_nothing():
    """DECISIONS: 'to_training never changes the records, their payloads or their metadata.'"""
    tokens = torch.tensor(PACKED)
    mask = np.array([1, 1, 1, 0, 1, 1])
    rec = record({"input_ids": tokens, "loss_mask": mask, "positions": list(SEGMENT_POSITIONS)}, padding=1)
    before = (
        tokens.clone(),
        tokens._version,
        mask.copy(),
        dict(rec.meta.tags),
        list(rec.payload["positions"]),
    )
    SampleBatch([rec]).to_training(
        return_labels=True, return_loss_mask=True, eos_mask_loss=True, eos_token_id=EOS, return_cu_seqlens=True,
        return_padding_mask=True, position_mode="sequence", flatten=True,
    )  # fmt: skip
    assert torch.equal(tokens, before[0]) and tokens._version == before[1]
    assert np.array_equal(mask, before[2]) and rec.meta.tags == before[3]
    assert rec.payload["positions"] == before[4]
