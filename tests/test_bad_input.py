"""Bad input, case by case: the inventory of docs/bad_input.md, one test (or parametrized test) a row.

Every error case checks the exact class (a plain ``ValueError`` or
``TypeError``, never a subclass or a raw torch/NumPy/Python error), that it is
raised by zephon_collate's own code, and what the message names (record,
field, fix). ``test_inventory_names_existing_tests`` keeps the table honest.
"""

from __future__ import annotations

import array
import ast
import re
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import BOS, EOS, PAD, as_lists, batch, record
from tensordict import TensorDict

import zephon_collate.layouts.native as prepare_module
from zephon_collate import (
    Chain,
    Collator,
    FlatPacker,
    PackedStream,
    SampleBatch,
    SampleMeta,
    SampleRecord,
    functional,
    pack_flat,
    to_training,
)
from zephon_collate.collate.sample_batch import stack_batch
from zephon_collate.collate.transfer import StackedBatch
from zephon_collate.transforms import CuSeqlens, EosMask, LossMask, PaddingMask, Positions, TokenShift

ROOT = Path(__file__).resolve().parent.parent
PACKED = [BOS, 10, EOS, BOS, 11, EOS]


def raises(kind: type[Exception], match: str, fn, *args, **kwargs) -> Exception:
    """Call ``fn``; it must raise exactly ``kind`` from zephon_collate code, matching ``match``."""
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    error = info.value
    assert type(error) is kind, f"expected {kind.__name__}, got {type(error).__name__}: {error}"
    origin = traceback.extract_tb(error.__traceback__)[-1].filename
    assert "/zephon_collate/" in origin or (kind is TypeError and "unexpected keyword" in str(error)), origin
    assert re.search(match, str(error)), f"{match!r} not in {error}"
    return error


def sentinel(index: int, tag: str, payload=None) -> SampleRecord:
    return SampleRecord(SampleMeta((0, 0, index), 0, 0, tags={tag: True}), payload)


def td_of(**fields) -> TensorDict:
    tensors = {key: torch.as_tensor(value) for key, value in fields.items()}
    return TensorDict(tensors, batch_size=[next(iter(tensors.values())).shape[0]])


# --- the inventory table --------------------------------------------------------------------------


def test_inventory_names_existing_tests():
    """Every row of docs/bad_input.md names a test that exists (file::function)."""
    table = (ROOT / "docs" / "bad_input.md").read_text()
    names = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", table)
    assert len(names) >= 60
    defined: dict[str, set[str]] = {}
    for path, function in names:
        if path not in defined:
            tree = ast.parse((ROOT / path).read_text())
            defined[path] = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        assert function in defined[path], f"docs/bad_input.md names {path}::{function}, which does not exist"


# --- A. the batch argument ------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["text", None, 3, {"input_ids": [1]}, b"\x01"])
def test_batch_not_records(bad):
    for fn in (to_training, stack_batch):
        raises(TypeError, "expected a SampleBatch or a list of SampleRecord", fn, bad)


def test_batch_of_plain_payload_dicts_points_to_collator():
    error = raises(
        TypeError,
        r"item 1 must be a SampleRecord, got dict",
        to_training,
        [record([1, 2]), {"input_ids": [1]}],
    )
    assert "Collator" in str(error)
    assert Collator()([{"input_ids": [1, 2]}])["input_ids"].tolist() == [[1, 2]]


def test_empty_batch_documented_result():
    out = SampleBatch([]).to_training(
        return_labels=True, return_cu_seqlens=True, flatten=True, return_num_valid_tokens=True
    )
    assert out == {
        "ids": [],
        "texts": [],
        "input_ids": [],
        "labels": [],
        "num_valid_tokens": 0,
        "cu_seqlens": [0],
        "max_seqlen": 0,
    }
    assert Collator(return_labels=True)([]) == SampleBatch([]).to_training(return_labels=True)
    td = stack_batch([], extra_fields=["w"])
    assert td.batch_size == torch.Size([0]) and td["input_ids"].shape == (0, 0) and td["w"].shape == (0, 0)


@pytest.mark.parametrize(("tag", "name"), [("_tombstone", "tombstone"), ("_flush", "flush sentinel")])
@pytest.mark.parametrize("payload", [None, [3, 4], {"input_ids": [3, 4]}])
def test_sentinel_records_are_an_error(tag, name, payload):
    """Decision: a sentinel reaching the collator is a pipeline bug: ValueError naming it, not a silent skip."""
    b = SampleBatch([record([1, 2]), sentinel(7, tag, payload)])
    for fn in (
        lambda: b.to_training(),
        lambda: Collator()(list(b.records)),
        lambda: Collator().stack(list(b.records)),
        lambda: b.to_tensordict(),
    ):
        error = raises(ValueError, rf"record 1 \(sample_id \(0, 0, 7\)\): is a {name}", fn)
        assert "is_sentinel" in str(error)


def test_duplicate_sample_ids_are_allowed():
    """Decision: duplicates are allowed (packed pieces of one document share its id; data is repeated)."""
    b = SampleBatch([record([1, 2], 5), record([3, 4], 5), record([1, 2], 5)])
    out = b.to_training(return_labels=True)
    assert out["ids"] == [(0, 0, 5)] * 3 and out["labels"].tolist() == [[2], [4], [2]]


# --- B. payloads and fields -----------------------------------------------------------------------


@pytest.mark.parametrize("payload", ["tokens", b"\x01\x02", None, 3, 2.5, {1, 2}, range(3)])
def test_payload_of_wrong_type(payload):
    raises(
        TypeError,
        r"record 1 .*payload must be a dict of fields or a token array",
        batch([1, 2], payload).to_training,
    )


@pytest.mark.parametrize(
    "value", ["ab", None, {"a": 1}, {1, 2}, (i for i in range(2)), range(2), array.array("q", [1, 2])]
)
def test_field_value_of_wrong_type(value):
    raises(
        TypeError,
        r"record 0 .*field 'input_ids' must be a list, tuple, NumPy array or torch tensor",
        batch({"input_ids": value}).to_training,
    )
    raises(
        TypeError,
        r"record 0 .*field 'w' must be",
        batch({"input_ids": [1, 2], "w": value}).to_training,
        extra_fields=["w"],
    )


def test_missing_tokens_field_lists_the_fields():
    raises(
        ValueError,
        r"tokens_field='auto' found none of .*record 0 .* has fields \['input_id', 'text'\]",
        batch({"input_id": [1], "text": "a"}).to_training,
    )
    raises(
        ValueError,
        r"record 1 .*no tokens field 'tokens' \(its fields: \['input_ids'\]\)",
        batch({"tokens": [1]}, {"input_ids": [2]}).to_training,
        tokens_field="tokens",
    )


def test_auto_tokens_field_with_no_common_candidate_names_both_records():
    """Every payload has a token field, but not the same one: a ValueError, not a StopIteration."""
    raises(
        ValueError,
        r"no token field that every payload has: record 0 .* has 'input_ids', record 2 .* has fields "
        r"\['tokens'\]",
        batch({"input_ids": [1], "tokens": [1]}, {"input_ids": [2]}, {"tokens": [3]}).to_training,
    )


def test_missing_or_misspelled_extra_field_lists_the_payload_fields():
    raises(
        ValueError,
        r"record 0 .*lacks field 'atention_mask' \(its fields: \['attention_mask', 'input_ids'\]\)",
        batch({"input_ids": [1, 2], "attention_mask": [1, 1]}).to_training,
        extra_fields=["atention_mask"],
    )


def test_unlisted_and_misspelled_optional_fields_are_ignored():
    """Documented: only the fields a call uses are read; an unlisted field (a misspelled 'loss_masks', an
    HF 'position_ids') is ignored like 'text' or any metadata field."""
    b = batch({"input_ids": [1, 2, 3], "loss_masks": [0, 0, 0], "position_ids": [0, 1, 2], "meta": object()})
    out = b.to_training(return_labels=True)
    assert out["labels"].tolist() == [[2, 3]] and "positions" not in out
    raises(
        ValueError,
        r"record 0 .*lacks field 'positions' \(its fields: \['input_ids', 'loss_masks', 'meta', 'position_ids'\]\)",
        b.to_training,
        return_cu_seqlens=True,
    )


@pytest.mark.parametrize("name", ["positions", "loss_mask", "w"])
def test_field_in_some_payloads_only(name):
    b = batch({"input_ids": [1, 2], name: [0, 1]}, {"input_ids": [3, 4]})
    raises(
        ValueError,
        rf"record 1 .*lacks field '{name}' .*some payloads have it and others lack it",
        b.to_training,
        return_labels=True,
        extra_fields=["w"] if name == "w" else (),
    )


def test_array_payload_beside_dict_fields():
    raises(
        ValueError,
        r"record 1 .*array payload holds only its token row",
        batch({"input_ids": [1, 2], "positions": [0, 1]}, [3, 4]).to_training,
    )


def test_ragged_rows():
    b = batch({"input_ids": [1, 2, 3]}, {"input_ids": [4]})
    for dtype in ("auto", np.int64, torch.int32):
        raises(
            ValueError,
            r"unequal shape into a tensor: record 0 .*has shape \(3,\), record 1 .* has \(1,\); .*dtype=None",
            b.to_training,
            dtype=dtype,
        )
    assert b.to_training(dtype=None, return_labels=True)["labels"] == [[2, 3], []]
    raises(ValueError, r"Collator.stack: rows of unequal length", Collator(dtype=None).stack, list(b.records))


def test_ragged_nested_row():
    raises(
        ValueError,
        r"record 0 .*'input_ids' is a ragged nested sequence",
        batch({"input_ids": [[1, 2], [3]]}).to_training,
    )


@pytest.mark.parametrize("name", ["positions", "loss_mask", "w"])
def test_misaligned_per_token_field(name):
    b = batch({"input_ids": [1, 2, 3], name: [0, 1]})
    extras = ["w"] if name == "w" else []
    raises(
        ValueError,
        rf"record 0 .*'{name}' has 2 entries but the token row has 3",
        b.to_training,
        return_labels=True,
        extra_fields=extras,
    )
    raises(
        ValueError,
        rf"record 0 .*'{name}' has 2 entries but the token row has 3",
        b.to_training,
        flatten=True,
        extra_fields=extras,
    )
    if name == "w":  # without labels or flatten, an extra field is data of any length
        assert b.to_training(extra_fields=["w"])["w"].tolist() == [[0, 1]]


def test_scalar_token_field():
    for value in (5, np.int64(5), torch.tensor(5)):
        raises(
            ValueError,
            r"record 0 .*'input_ids' must be a sequence, got a scalar",
            batch({"input_ids": value}).to_training,
        )


def test_non_scalar_tokens():
    b = batch({"input_ids": [[1, 2], [3, 4], [5, 6]]}, paddings=[1])
    out = b.to_training(return_labels=True)
    assert out["labels"].tolist() == [[[3, 4], [-100, -100]]]
    raises(
        ValueError,
        r"record 0 .*'input_ids' has rows of shape \(2,\) per token, and return_padding_mask needs 2-D scalar "
        r"token rows .*turn return_padding_mask off",
        b.to_training,
        return_padding_mask=True,
    )
    raises(
        ValueError,
        r"record 0 .*'input_ids' has rows of shape \(2,\) per token, and eos_mask_loss needs 2-D scalar token rows",
        b.to_training,
        return_labels=True,
        eos_mask_loss=True,
        eos_token_id=EOS,
    )


# --- C. token dtypes and values -------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens",
    [[1.0, 2.0], np.array([1.0, 2.0]), torch.tensor([1.0, 2.0]), torch.tensor([1, 2], dtype=torch.bfloat16)],
)
def test_float_tokens(tokens):
    raises(
        TypeError,
        r"record 0 .*'input_ids' has dtype .*float.*; it must hold integer token ids",
        batch({"input_ids": tokens}).to_training,
    )


@pytest.mark.parametrize("tokens", [[True, False], np.array([True, False]), torch.tensor([True, False])])
def test_bool_tokens(tokens):
    raises(
        TypeError,
        r"record 0 .*'input_ids' has dtype .*bool.*; it must hold integer token ids",
        batch({"input_ids": tokens}).to_training,
    )
    # A list mixing ints and bools has the dtype NumPy infers for it: int64.
    assert batch({"input_ids": [5, True]}).to_training()["input_ids"].tolist() == [[5, 1]]


@pytest.mark.parametrize("tokens", [[1 + 2j], np.array([1j]), torch.tensor([1j])])
def test_complex_tokens(tokens):
    raises(
        TypeError,
        r"record 0 .*'input_ids' has dtype (torch.)?complex",
        batch({"input_ids": tokens}).to_training,
    )


@pytest.mark.parametrize(
    "tokens", [np.array([1, 2], dtype=object), [1, None], ["a", "b"], np.zeros(2, dtype="M8[s]")]
)
def test_object_and_string_tokens(tokens):
    raises(
        TypeError,
        r"record 0 .*'input_ids' (holds Python objects|has dtype)",
        batch({"input_ids": tokens}).to_training,
    )


@pytest.mark.parametrize(
    "tokens",
    [
        np.array([1, 2], np.uint8),
        torch.tensor([1, 2], dtype=torch.uint8),
        np.array([1, 2], np.uint16),
        np.array([1, 2], np.uint32),
        np.array([1, 2], np.uint64),
        torch.tensor([1, 2], dtype=torch.uint32),
        torch.tensor([1, 2], dtype=torch.uint64),
    ],
)
def test_unsigned_tokens(tokens):
    out = batch({"input_ids": tokens}).to_training(return_labels=True)
    assert out["input_ids"].tolist() == [[1]] and out["labels"].tolist() == [[2]]
    assert pack_flat([record({"input_ids": tokens})], 2, pad_token_id=0)[0].payload["input_ids"].tolist() == [
        1,
        2,
    ]
    if tokens.dtype in (np.uint64, torch.uint64):
        big = (
            np.array([2**63], np.uint64)
            if isinstance(tokens, np.ndarray)
            else torch.tensor([2**63], dtype=torch.uint64)
        )
        raises(
            ValueError,
            r"record 0 .*'input_ids' holds values beyond int64",
            batch({"input_ids": big}).to_training,
        )


@pytest.mark.parametrize("tokens", [[1, -1], np.array([-5]), torch.tensor([0, -1], dtype=torch.int8)])
def test_negative_token_ids(tokens):
    raises(
        ValueError,
        r"record 1 .*token ids must be >= 0",
        batch({"input_ids": [1] * len(tokens)}, {"input_ids": tokens}).to_training,
    )


@pytest.mark.parametrize("tokens", [[2**63], [2**64], [-(2**63) - 1]])
def test_token_ids_beyond_int64(tokens):
    raises(
        ValueError,
        r"record 0 .*'input_ids' holds (values|integers) (beyond|that do not fit in) int64",
        batch({"input_ids": tokens}).to_training,
    )


def test_token_ids_beyond_the_requested_dtype():
    raises(
        ValueError,
        r"record 0 .*'input_ids' holds values outside the torch.int32 range",
        batch({"input_ids": [2**40]}).to_training,
        dtype=torch.int32,
    )
    raises(
        ValueError,
        r"record 0 .*'input_ids' holds values outside the torch.int8 range",
        batch({"input_ids": [300]}).to_training,
        dtype=np.int8,
    )


def test_list_of_tensors():
    """A list of 0-d CPU tensors (as list(tensor) gives) reads as numbers; tensors without data cannot."""
    assert batch({"input_ids": list(torch.arange(3))}).to_training()["input_ids"].tolist() == [[0, 1, 2]]
    meta = [torch.tensor(1, device="meta")] * 2
    raises(
        TypeError,
        r"record 0 .*'input_ids' holds items that cannot be read as plain numbers",
        batch({"input_ids": meta}).to_training,
    )
    raises(
        TypeError,
        r"record 0 .*'input_ids' holds items that cannot be read as plain numbers",
        pack_flat,
        [record({"input_ids": meta})],
        4,
        pad_token_id=0,
    )


@pytest.mark.parametrize("empty", [torch.tensor([]), np.array([]), [], ()])
def test_empty_float_row_is_an_empty_row(empty):
    """torch.tensor([]) and np.array([]) are float: an empty row holds no float, so it reads as an empty row."""
    out = batch({"input_ids": empty}).to_training(return_labels=True)
    assert out["input_ids"].shape == (1, 0) and out["input_ids"].dtype == torch.long


# --- D. masks, positions, padding -----------------------------------------------------------------


@pytest.mark.parametrize(
    "mask",
    [
        [1, float("nan")],
        [1, 2],
        [1, -1],
        [1, 0.5],
        [1, float("inf")],
        np.array([1, 3], np.uint8),
        torch.tensor([1, 0.5], dtype=torch.bfloat16),
    ],
)
def test_loss_mask_not_zero_one_with_labels(mask):
    raises(
        ValueError,
        r"record 1 .*'loss_mask' must hold only 0 and 1",
        batch(
            {"input_ids": [1, 2], "loss_mask": [1, 1]}, {"input_ids": [1, 2], "loss_mask": mask}
        ).to_training,
        return_labels=True,
    )


def test_loss_mask_without_labels_is_a_data_field():
    raises(
        ValueError,
        r"record 0 .*'loss_mask' holds non-integral or non-finite values",
        batch({"input_ids": [1, 2], "loss_mask": [1.0, float("nan")]}).to_training,
    )
    raises(
        ValueError,
        r"record 0 .*'loss_mask' holds non-integral",
        batch({"input_ids": [1, 2], "loss_mask": [1.0, 0.5]}).to_training,
    )
    assert batch({"input_ids": [1, 2], "loss_mask": [1, 2]}).to_training()["loss_mask"].tolist() == [[1, 2]]


@pytest.mark.parametrize("mask", [["a", "b"], [1j, 0], [None, 1]])
def test_loss_mask_of_wrong_dtype(mask):
    raises(
        TypeError,
        r"record 0 .*'loss_mask' (has dtype|holds Python objects)",
        batch({"input_ids": [1, 2], "loss_mask": mask}).to_training,
        return_labels=True,
    )


@pytest.mark.parametrize("positions", [[0.0, 1.0], np.array([0.0, 1.0]), torch.tensor([0.0, 1.0])])
def test_float_positions(positions):
    """Named as positions, not as token ids (the message of the tokens field)."""
    expected = r"has dtype .*float.*; it must hold integer positions$"
    raises(
        TypeError,
        rf"record 0 .*'positions' {expected}",
        batch({"input_ids": [1, 2], "positions": positions}).to_training,
    )
    hf = Collator.for_transformers(pad_token_id=0)
    raises(
        TypeError,
        rf"example 0: field 'position_ids' {expected}",
        hf,
        [{"input_ids": [1, 2], "position_ids": positions}],
    )


def test_positions_not_starting_at_zero():
    b = batch({"input_ids": [1, 2], "positions": [0, 1]}, {"input_ids": [1, 2], "positions": [3, 4]})
    raises(
        ValueError,
        r"record 1 .*positions must start at zero in every row .* starts at 3",
        b.to_training,
        return_cu_seqlens=True,
    )
    assert b.to_training()["positions"].tolist() == [[0, 1], [3, 4]]  # forwarded as they are otherwise


def test_negative_positions_are_forwarded():
    """Documented: positions are forwarded as given; only zeros mark boundaries for cu_seqlens."""
    out = batch({"input_ids": [1, 2, 3], "positions": [0, -1, 0]}).to_training(return_cu_seqlens=True)
    assert out["positions"].tolist() == [[0, -1, 0]] and out["cu_seqlens"].tolist() == [[0, 2, 3]]


def test_positions_beyond_the_requested_dtype():
    raises(
        ValueError,
        r"record 0 .*'positions' holds values outside the torch.int32 range",
        batch({"input_ids": [1, 2], "positions": [0, 2**40]}).to_training,
        dtype=torch.int32,
    )


def test_cu_seqlens_int32_overflow(monkeypatch):
    """Flattened, B * S input tokens beyond int32: ValueError; unflattened, a row's S (each row's boundaries
    are at most its length). The limit is lowered here; a real batch would need 16 GiB."""
    monkeypatch.setattr(prepare_module, "INT32_MAX", 5)
    b = batch(
        {"input_ids": [1, 2, 3], "positions": [0, 1, 2]}, {"input_ids": [1, 2, 3], "positions": [0, 1, 2]}
    )
    raises(
        ValueError,
        r"2 x 3 input tokens overflow the int32 cu_seqlens",
        b.to_training,
        return_cu_seqlens=True,
        flatten=True,
    )
    assert b.to_training(return_cu_seqlens=True)["cu_seqlens"].tolist() == [[0, 3], [0, 3]]  # rows of 3
    wide = batch({"input_ids": [1] * 6, "positions": list(range(6))})
    raises(
        ValueError,
        r"1 x 6 input tokens overflow the int32 cu_seqlens",
        wide.to_training,
        return_cu_seqlens=True,
    )
    assert b.to_training(return_cu_seqlens=True, return_labels=True)["cu_seqlens"].tolist() == [
        [0, 2],
        [0, 2],
    ]
    huge = TensorDict(
        positions=torch.zeros(1, 1, dtype=torch.long).expand(2**16, 2**15 + 1), batch_size=[2**16]
    )
    raises(
        ValueError, r"CuSeqlens: .* positions overflow the int32 boundaries", CuSeqlens(flatten=True), huge
    )
    CuSeqlens().check(huge)  # unflattened: rows of 2**15 + 1 fit


@pytest.mark.parametrize("padding", [-1, 4, 10**9])
def test_padding_length_out_of_range(padding):
    b = batch({"input_ids": [1, 2, 3]}, paddings=[padding])
    for flags in ({"return_labels": True}, {"return_padding_mask": True}):
        raises(
            ValueError,
            r"record 0 .*meta.padding_length is .* but must be an int from 0 to the token row's length 3",
            b.to_training,
            **flags,
        )
    assert b.to_training()["input_ids"].tolist() == [[1, 2, 3]]  # not read unless labels or a padding mask


@pytest.mark.parametrize("padding", [1.0, "1", True, torch.tensor(1), [1]])
def test_padding_length_of_wrong_type(padding):
    raises(
        ValueError,
        r"record 0 .*meta.padding_length is .* but must be an int",
        batch({"input_ids": [1, 2, 3]}, paddings=[padding]).to_training,
        return_labels=True,
    )
    assert batch({"input_ids": [1, 2, 3]}, paddings=[np.int64(1)]).to_training(return_padding_mask=True)[
        "padding_mask"
    ].tolist() == [[False, False, True]]


def test_a_padding_length_of_none_declares_no_padding():
    """meta.padding_length is the tag's value, an int or None: a tag set to None is no padding."""
    b = SampleBatch([SampleRecord(SampleMeta((0, 0, 0), 0, 0, tags={"_padding_length": None}), [1, 2, 3])])
    assert b.records[0].meta.padding_length is None
    assert b.to_training(return_labels=True)["labels"].tolist() == [[2, 3]]
    assert b.to_training(return_padding_mask=True)["padding_mask"].tolist() == [[False, False, False]]
    meta = SampleMeta((0, 0, 0), 0, 0, tags={"_padding_length": None})  # the payload's count is read then
    given = SampleBatch([SampleRecord(meta, {"input_ids": [1, 2, 0], "_padding_length": 1})])
    assert given.to_training(return_labels=True)["labels"].tolist() == [[2, -100]]


def test_a_bad_field_that_only_some_records_carry_names_its_own_record():
    """The rows that carry a field are read among themselves: the error names the record, not its place."""
    rows = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6], "labels": None}]
    raises(
        TypeError,
        r"^record 1 \(sample_id \(0, 0, 1\)\): field 'labels' must be",
        Collator(return_labels=True),
        rows,
    )


def test_zero_length_rows():
    b = batch({"input_ids": [], "positions": []}, {"input_ids": [], "positions": []})
    out = b.to_training(
        return_labels=True,
        return_cu_seqlens=True,
        return_loss_mask=True,
        return_num_valid_tokens=True,
        return_padding_mask=True,
    )
    assert out["input_ids"].shape == out["labels"].shape == out["loss_mask"].shape == (2, 0)
    assert (
        out["cu_seqlens"].tolist() == [[0], [0]]
        and out["max_seqlen"].tolist() == [0, 0]
        and out["num_valid_tokens"] == 0
    )
    flat = b.to_training(return_cu_seqlens=True, flatten=True)
    assert flat["cu_seqlens"].tolist() == [0] and flat["max_seqlen"] == 0


def test_rows_of_one_token_with_labels():
    b = SampleBatch(
        [record({"input_ids": [7], "positions": [0]}, 0, 1), record({"input_ids": [8], "positions": [0]}, 1)]
    )
    out = b.to_training(
        return_labels=True,
        return_cu_seqlens=True,
        return_padding_mask=True,
        return_num_valid_tokens=True,
        eos_mask_loss=True,
        eos_token_id=7,
    )
    assert out["input_ids"].shape == out["labels"].shape == out["padding_mask"].shape == (2, 0)
    assert out["cu_seqlens"].tolist() == [[0], [0]] and out["num_valid_tokens"] == 0


# --- E. tensors and devices -----------------------------------------------------------------------


def test_non_contiguous_and_strided_payloads():
    """Views of every layout read exactly like the contiguous row [0, 2, 4, 6]."""
    expected = as_lists(
        batch({"input_ids": [0, 2, 4, 6], "positions": [0, 1, 0, 1]}).to_training(
            return_labels=True, return_cu_seqlens=True
        )
    )
    readonly = np.arange(0, 8, 2)
    readonly.flags.writeable = False
    views = [
        torch.arange(8)[::2],  # strided tensor
        torch.arange(8).reshape(4, 2).t()[0],  # a row of a transposed tensor
        torch.arange(-2, 8)[2:][::2],  # storage offset and stride
        torch.tensor(0).expand(4) + torch.tensor([0, 2, 4, 6]),  # from a stride-0 tensor
        np.arange(8)[::2],  # strided array
        np.arange(6, -1, -2)[::-1],  # negative stride
        np.asfortranarray(np.arange(8).reshape(4, 2))[:, 0],  # a column of a Fortran-order array
        np.arange(0, 8, 2, dtype=">i8"),  # big-endian
        readonly,
    ]
    positions = [np.array([0, 0, 1, 1, 0, 0, 1, 1])[::2], torch.tensor([[0, 1, 0, 1]]).expand(2, 4)[1]]
    for tokens in views:
        for position in positions:
            out = batch({"input_ids": tokens, "positions": position}).to_training(
                return_labels=True, return_cu_seqlens=True
            )
            assert as_lists(out) == expected


@pytest.mark.parametrize("kind", ["sparse", "nested", "quantized"])
def test_sparse_nested_quantized_tensors(kind):
    with pytest.warns(UserWarning) if kind != "sparse" else _quiet():
        tensor = {
            "sparse": lambda: torch.arange(3).to_sparse(),
            "nested": lambda: torch.nested.nested_tensor([torch.arange(2), torch.arange(3)]),
            "quantized": lambda: torch.quantize_per_tensor(torch.ones(3), 1.0, 0, torch.quint8),
        }[kind]()
    raises(
        TypeError,
        rf"record 0 .*'input_ids' is a .*{kind if kind != 'sparse' else 'sparse'}.* tensor; give a plain dense tensor",
        batch({"input_ids": tensor}).to_training,
    )


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_mixed_devices():
    """A 'meta' tensor beside CPU data: refused for holding no data, naming the record and the field
    (two real devices are refused naming both: tests/test_cuda.py)."""
    meta = torch.zeros(3, dtype=torch.long, device="meta")
    raises(
        ValueError,
        r"record 1 .*field 'input_ids' is a tensor on the 'meta' device, which holds no data",
        batch([1, 2, 3], {"input_ids": meta}).to_training,
    )
    raises(
        ValueError,
        r"record 0 .*field 'positions' is a tensor on the 'meta' device",
        batch({"input_ids": [1, 2, 3], "positions": meta}).to_training,
    )


def test_tensors_without_data():
    meta = torch.zeros(3, dtype=torch.long, device="meta")
    raises(ValueError, r"on the 'meta' device, which holds no data", batch({"input_ids": meta}).to_training)


def test_payloads_requiring_grad():
    weights = torch.ones(3, requires_grad=True)
    out = batch({"input_ids": [1, 2, 3], "w": weights}).to_training(extra_fields=["w"], return_labels=True)
    assert not out["w"].requires_grad and out["w"].tolist() == [[1, 1]]
    assert batch({"input_ids": [1, 2, 3], "w": weights}).to_training(extra_fields=["w"], dtype=np.int64)[
        "w"
    ].tolist() == [[1, 1, 1]]


# --- F. to_training's arguments -------------------------------------------------------------------


@pytest.mark.parametrize("bad", [None, 5, "", ["input_ids"]])
def test_tokens_field_of_wrong_type(bad):
    raises(
        TypeError,
        r"to_training: tokens_field must be a field name or 'auto'",
        batch([1]).to_training,
        tokens_field=bad,
    )


@pytest.mark.parametrize(
    "flag",
    [
        "return_labels",
        "flatten",
        "return_num_valid_tokens",
        "return_loss_mask",
        "return_cu_seqlens",
        "return_padding_mask",
        "eos_mask_loss",
    ],
)
@pytest.mark.parametrize("bad", [1, "yes", None])
def test_flags_of_wrong_type(flag, bad):
    raises(TypeError, rf"to_training: {flag} must be a bool", batch([1, 2]).to_training, **{flag: bad})


def test_dtype_arguments():
    for bad in (torch.float32, torch.uint8, torch.bool, np.uint8, np.float32, "float", torch.complex64):
        raises(ValueError, r"dtype must be a signed integer dtype", batch([1]).to_training, dtype=bad)
    for bad in (5, object(), "auto ", [torch.long]):
        raises(
            TypeError,
            r"dtype must be 'auto', None, a torch dtype or a NumPy dtype",
            batch([1]).to_training,
            dtype=bad,
        )
    out = batch([1, 2]).to_training(dtype="int32")  # a NumPy dtype name: NumPy output
    assert isinstance(out["input_ids"], np.ndarray) and out["input_ids"].dtype == np.int32


def test_extra_fields_arguments():
    b = batch({"input_ids": [1, 2], "w": [1, 1], "loss_mask": [1, 1], "padding_length": [0, 0]})
    raises(
        TypeError,
        r"extra_fields must be a sequence of field names, not the string 'w'; write \('w',\)",
        b.to_training,
        extra_fields="w",
    )
    for bad in (None, 5, {"w": 1}):
        raises(TypeError, r"extra_fields must be a sequence of field names", b.to_training, extra_fields=bad)
    raises(TypeError, r"extra_fields must hold str field names, got 5", b.to_training, extra_fields=[5])
    raises(ValueError, r"extra field 'input_ids' would overwrite", b.to_training, extra_fields=["input_ids"])
    raises(
        ValueError, r"extra field 'padding_length' collides", b.to_training, extra_fields=["padding_length"]
    )
    raises(
        ValueError,
        r"'loss_mask' cannot be an extra field with return_labels=True",
        b.to_training,
        extra_fields=["loss_mask"],
        return_labels=True,
    )


def test_ignore_index_arguments():
    for bad in (1.5, "x", None, True):
        raises(
            TypeError,
            r"ignore_index must be an int",
            batch([1, 2]).to_training,
            return_labels=True,
            ignore_index=bad,
        )
    raises(ValueError, r"ignore_index must fit in int64", batch([1, 2]).to_training, ignore_index=2**70)
    raises(
        ValueError,
        r"ignore_index -129 does not fit dtype torch.int8",
        batch([1, 2]).to_training,
        return_labels=True,
        ignore_index=-129,
        dtype=torch.int8,
    )


def test_rename_fields_arguments():
    b = batch([1, 2])
    for bad in ("a", [("a", "b")]):
        raises(TypeError, r"rename_fields must be a mapping", b.to_training, rename_fields=bad)
    for bad in ({"input_ids": 5}, {5: "a"}):
        raises(TypeError, r"rename_fields must map str to str", b.to_training, rename_fields=bad)
    raises(
        ValueError,
        r"rename_fields names 'labels', which this call does not emit",
        b.to_training,
        rename_fields={"labels": "y"},
    )
    raises(ValueError, r"same name 'texts'", b.to_training, rename_fields={"input_ids": "texts"})


def test_exclude_fields_arguments():
    raises(
        TypeError,
        r"exclude_fields must be a sequence of field names, not the string 'ids'",
        batch([1]).to_training,
        exclude_fields="ids",
    )
    raises(
        TypeError,
        r"exclude_fields must be a sequence of field names, got None",
        batch([1]).to_training,
        exclude_fields=None,
    )
    assert list(batch([1]).to_training(exclude_fields=["nothing", "texts"])) == ["ids", "input_ids"]


@pytest.mark.parametrize("bad", [-1, True, 2.0, "2", np.float32(2), 2**63, 2**70])
def test_eos_token_id_arguments(bad):
    raises(
        ValueError,
        r"eos_token_id must be a nonnegative int below 2\*\*63",
        batch(PACKED).to_training,
        return_labels=True,
        eos_mask_loss=True,
        eos_token_id=bad,
    )


def test_eos_token_id_without_masking_warns():
    with pytest.warns(UserWarning, match="eos_mask_loss=False"):
        out = batch(PACKED).to_training(return_labels=True, eos_token_id=EOS)
    assert out["labels"].tolist() == [[10, EOS, BOS, 11, EOS]]


@pytest.mark.parametrize("bad", [None, "Sequence", ["preserve"], 5])
def test_position_mode_arguments(bad):
    raises(
        ValueError,
        r"position_mode must be 'preserve' or 'sequence'",
        batch([1]).to_training,
        position_mode=bad,
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"return_num_valid_tokens": True}, "return_num_valid_tokens=True requires return_labels=True"),
        ({"return_loss_mask": True}, "return_loss_mask=True requires return_labels=True"),
        ({"eos_mask_loss": True, "eos_token_id": EOS}, "eos_mask_loss=True requires return_labels=True"),
        ({"eos_mask_loss": True, "return_labels": True}, "requires a known EOS id"),
    ],
)
def test_arguments_that_need_other_arguments(kwargs, match):
    raises(ValueError, match, SampleBatch([]).to_training, **kwargs)


def test_unknown_keyword_arguments():
    """An unknown keyword of to_training or the Collator gets the closest known name."""
    with pytest.raises(
        TypeError, match=r"to_training: unknown option 'return_label'; did you mean 'return_labels'\?"
    ):
        batch([1]).to_training(return_label=True)
    raises(
        TypeError,
        r"Collator: unknown option 'return_label'; did you mean 'return_labels'\?",
        Collator,
        return_label=True,
    )
    raises(TypeError, r"Collator: unknown option 'zzz'; known options: tokens_field", Collator, zzz=1)


# --- G. stack_batch / to_tensordict ---------------------------------------------------------------


def test_stack_batch_arguments():
    b = batch({"input_ids": [1, 2], "w": [1, 1]})
    raises(TypeError, r"stack_batch: dtype must be a torch dtype", b.to_tensordict, dtype=np.int64)
    raises(
        ValueError, r"stack_batch: dtype must be a signed integer dtype", b.to_tensordict, dtype=torch.float32
    )
    raises(
        TypeError,
        r"stack_batch: extra_fields must be a sequence of field names, not the string",
        b.to_tensordict,
        extra_fields="w",
    )
    raises(TypeError, r"stack_batch: tokens_field must be a field name", b.to_tensordict, tokens_field=["x"])
    raises(TypeError, r"stack_batch: pin_memory must be a bool", b.to_tensordict, pin_memory="no")
    if not torch.accelerator.is_available():
        raises(ValueError, r"pin_memory=True needs an accelerator", b.to_tensordict, pin_memory=True)


# --- H. Collator ----------------------------------------------------------------------------------


def test_collator_device_argument():
    raises(ValueError, r"device 'gpu' is not a device name", Collator, device="gpu")
    for bad in (5, [], 1.5):
        raises(
            TypeError, r"device must be None, a str such as 'cuda' or a torch.device", Collator, device=bad
        )
    raises(ValueError, r"device 'meta' holds no data", Collator, device="meta")
    if not torch.cuda.is_available():
        raises(ValueError, r"device 'cuda' is not available here", Collator, device="cuda")
    else:
        raises(ValueError, r"does not exist", Collator, device=f"cuda:{torch.cuda.device_count()}")


@pytest.mark.parametrize("name", ["compile", "python_scalars"])
def test_collator_flags_of_wrong_type(name):
    raises(TypeError, rf"Collator: {name} must be a bool", Collator, **{name: "yes"})


def test_collator_num_boundaries_argument():
    for bad in (1.5, True, "3"):
        raises(TypeError, r"num_boundaries must be an int >= 1 or None", Collator, num_boundaries=bad)
    raises(ValueError, r"num_boundaries must be an int >= 1 or None, got 0", Collator, num_boundaries=0)
    assert Collator(num_boundaries=np.int64(3)).settings.num_boundaries == 3


def test_collator_samples_of_wrong_type():
    for bad in ({"input_ids": [1]}, "abc", None, (x for x in [1])):
        raises(TypeError, r"Collator: expected a list of samples", Collator(), bad)
    raises(
        TypeError,
        r"Collator: item 1 must be a SampleRecord, a payload dict or a token array, got NoneType",
        Collator(),
        [{"input_ids": [1]}, None],
    )


def test_collator_finish_of_wrong_type():
    for bad in (None, [{"input_ids": [1]}], {"input_ids": torch.tensor([[1]])}):
        raises(TypeError, r"Collator.finish: expected the StackedBatch", Collator().finish, bad)


def test_segments_beyond_num_boundaries():
    """The Collator checks the segment count on the worker's CPU copy: a ValueError naming the record, never
    the device-side assertion, which only the bare CuSeqlens transform can raise (RuntimeError)."""
    rows = [
        {"input_ids": [1, 2, 3], "positions": [0, 1, 2]},
        {"input_ids": [1, 2, 3], "positions": [0, 0, 0]},
    ]
    for collate in (
        Collator(num_boundaries=2, return_cu_seqlens=True),
        Collator(device="cpu", num_boundaries=2, return_cu_seqlens=True),
    ):
        raises(ValueError, r"record 1 .*has 3 segments, more than num_boundaries - 1 = 1", collate, rows)
    raises(
        ValueError,
        r"the batch has 4 segments, more than num_boundaries - 1 = 2",
        Collator(num_boundaries=3, flatten=True, return_cu_seqlens=True),
        rows,
    )
    assert Collator(num_boundaries=2, return_cu_seqlens=True, return_labels=True)(rows[:1])[
        "cu_seqlens"
    ].tolist() == [[0, 2]]
    with pytest.raises(RuntimeError, match="num_boundaries"):
        CuSeqlens(num_boundaries=2)(td_of(positions=[[0, 0, 0]]))


def test_collator_data_errors_name_the_record():
    samples = [{"input_ids": [1, 2]}, {"input_ids": [1.5, 2]}]
    for fn in (Collator(), Collator().stack, Collator(device="cpu")):
        raises(
            TypeError, r"record 1 \(sample_id \(0, 0, 1\)\): field 'input_ids' has dtype float64", fn, samples
        )


def test_collator_stacked_batch_of_other_options():
    stacked = Collator(return_labels=True).stack([{"input_ids": [1, 2, 3]}])
    assert isinstance(stacked, StackedBatch)
    raises(ValueError, r"CuSeqlens reads 'positions'", Collator(return_cu_seqlens=True).finish, stacked)


# --- I. transforms and kernels --------------------------------------------------------------------


TRANSFORMS = [
    TokenShift(),
    PaddingMask(),
    EosMask(EOS),
    LossMask(),
    CuSeqlens(),
    Positions("sequence"),
    Chain(TokenShift()),
]


@pytest.mark.parametrize("transform", TRANSFORMS, ids=lambda t: type(t).__name__)
def test_transform_called_without_a_tensordict(transform):
    for bad in ({"input_ids": torch.tensor([[1, 2]])}, torch.tensor([[1, 2]]), None):
        raises(TypeError, r"expects a TensorDict", transform, bad)


@pytest.mark.parametrize("transform", TRANSFORMS, ids=lambda t: type(t).__name__)
def test_transform_missing_keys(transform):
    raises(
        ValueError,
        r"needs '\w+', which the TensorDict lacks \(it holds \['other'\]\)",
        transform,
        td_of(other=[[1, 2]]),
    )


def test_transform_wrong_rank():
    one_d = TensorDict(
        input_ids=torch.tensor([1, 2]),
        labels=torch.tensor([1, 2]),
        positions=torch.tensor([0, 1]),
        padding_length=torch.tensor([0, 0]),
        batch_size=[2],
    )
    for transform, key in (
        (TokenShift(), "input_ids"),
        (PaddingMask(), "input_ids"),
        (LossMask(supervision_key=None), "labels"),
        (CuSeqlens(), "positions"),
        (Positions("sequence"), "input_ids"),
    ):
        raises(ValueError, rf"{type(transform).__name__}: '{key}' must be", transform, one_d)
    raises(
        ValueError,
        r"'padding_length' must be \[B\] pad counts",
        PaddingMask(),
        td_of(input_ids=[[1, 2]], padding_length=[[0]]),
    )
    raises(
        ValueError,
        r"'positions' must be \[B, S\] positions, got shape \(1, 2, 1\)",
        CuSeqlens(),
        td_of(positions=[[[0], [1]]]),
    )


def test_transform_misaligned_shapes():
    raises(
        ValueError,
        r"TokenShift: 'positions' has shape \(1, 2\), which does not match 'input_ids' \(1, 3\)",
        TokenShift(input_keys=["positions"]),
        td_of(input_ids=[[1, 2, 3]], positions=[[0, 1]]),
    )
    raises(
        ValueError,
        r"EosMask: 'labels' has shape \(1, 2\)",
        EosMask(EOS),
        td_of(input_ids=[[1, 2, 3]], labels=[[1, 2]]),
    )
    raises(
        ValueError,
        r"LossMask: 'loss_mask' has shape \(1, 2\)",
        LossMask(padding_length_key=None),
        td_of(labels=[[1, 2, 3]], loss_mask=[[1, 1]]),
    )
    raises(
        ValueError,
        r"LossMask: 'loss_mask' must be a \[B, S, \.\.\.\] mask",
        LossMask(padding_length_key=None),
        td_of(labels=[[1, 2]], loss_mask=[[[1], [1]]]),
    )
    raises(
        ValueError,
        r"PaddingMask: 'padding_length' has shape \(3,\)",
        PaddingMask(),
        TensorDict(input_ids=torch.tensor([[1, 2]]), padding_length=torch.tensor([0, 0, 0]), batch_size=[]),
    )


def test_transform_ignore_index_beyond_labels_dtype():
    labels = td_of(
        input_ids=torch.tensor([[1, 2]], dtype=torch.int8), labels=torch.tensor([[1, 2]], dtype=torch.int8)
    )
    raises(
        ValueError,
        r"LossMask: ignore_index 300 does not fit 'labels' of dtype torch.int8",
        LossMask(300, supervision_key=None, padding_length_key=None),
        labels,
    )
    raises(ValueError, r"EosMask: ignore_index -300 does not fit", EosMask(EOS, ignore_index=-300), labels)


def test_transform_constructor_arguments():
    raises(TypeError, r"TokenShift: tokens_key must be a non-empty str", TokenShift, tokens_key=5)
    raises(
        TypeError,
        r"TokenShift: input_keys must be a sequence of keys, not the str",
        TokenShift,
        input_keys="positions",
    )
    raises(
        TypeError, r"TokenShift: input_keys must be a sequence of keys, got None", TokenShift, input_keys=None
    )
    raises(ValueError, r"TokenShift: keys must be distinct", TokenShift, input_keys=["labels"])
    raises(TypeError, r"LossMask: out_key must be a non-empty str", LossMask, out_key="")
    raises(TypeError, r"CuSeqlens: flatten must be a bool", CuSeqlens, flatten=1)
    raises(TypeError, r"CuSeqlens: num_boundaries must be an int", CuSeqlens, num_boundaries=1.5)
    raises(ValueError, r"CuSeqlens: num_boundaries must be an int >= 1", CuSeqlens, num_boundaries=0)
    raises(ValueError, r"EosMask: eos_token_id must be a nonnegative int", EosMask, 2**70)
    raises(ValueError, r"LossMask: ignore_index must fit in int64", LossMask, 2**63)
    raises(TypeError, r"LossMask: ignore_index must be an int", LossMask, "x")
    raises(ValueError, r"position_mode must be 'preserve' or 'sequence'", Positions, "continuous")


def test_transforms_do_not_check_values():
    """Documented: transforms never read values (no device sync); garbage values give garbage, to_training checks."""
    out = LossMask(padding_length_key=None)(td_of(labels=[[1, 2]], loss_mask=[[float("nan"), 1.0]]))
    assert out["labels"].tolist() == [[1, 2]]  # NaN is truthy: not masked
    out = PaddingMask()(td_of(input_ids=[[1, 2]], padding_length=[5]))
    assert out["padding_mask"].tolist() == [[True, True]]


def test_chain_arguments():
    raises(TypeError, r"Chain: item 0 \(None\) is not a transform", Chain, None)
    raises(TypeError, r"Chain: item 1 .* is not a transform", Chain, TokenShift(), TokenShift)
    raises(TypeError, r"Chain: item 1 .* is not a transform", Chain, TokenShift(), lambda td: td)
    raises(
        TypeError, r"Chain: input_keys must be a sequence of keys, got 5", Chain, TokenShift(), input_keys=5
    )
    raises(ValueError, r"Chain: EosMask reads 'labels'", Chain, EosMask(EOS), input_keys=["input_ids"])


def test_functional_kernel_arguments():
    raises(
        TypeError, r"shift_tokens: tokens must be a torch.Tensor, got list", functional.shift_tokens, [[1, 2]]
    )
    raises(
        ValueError,
        r"shift_tokens: tokens has shape \(2,\); it needs 2 to 64 dims",
        functional.shift_tokens,
        torch.tensor([1, 2]),
    )
    raises(
        ValueError,
        r"cu_seqlens_rows: positions has shape \(2,\)",
        functional.cu_seqlens_rows,
        torch.tensor([0, 1]),
    )
    raises(
        ValueError, r"cu_seqlens_flat: positions has shape", functional.cu_seqlens_flat, torch.zeros(1, 2, 1)
    )
    raises(
        TypeError,
        r"mask_labels: labels must be a torch.Tensor",
        functional.mask_labels,
        [[1]],
        torch.tensor([[True]]),
        -100,
    )
    raises(
        TypeError,
        r"as_float: mask must be a bool tensor, got torch.int64",
        functional.as_float,
        torch.tensor([1, 0]),
    )
    raises(
        ValueError,
        r"trailing_mask: padding_length has shape \(1, 1\)",
        functional.trailing_mask,
        torch.tensor([[1]]),
        3,
    )
    raises(
        ValueError,
        r"sequence_positions: like has shape \(3,\)",
        functional.sequence_positions,
        torch.tensor([1, 2, 3]),
    )
    raises(TypeError, r"eos_label_mask: inputs must be a torch.Tensor", functional.eos_label_mask, [1, 2], 2)


# --- J. pack_flat and FlatPacker ------------------------------------------------------------------


DOCS = [record({"input_ids": [1, 2, 3]}, 0), record({"input_ids": [4, 5]}, 1)]


@pytest.mark.parametrize("bad", ["abc", None, {"input_ids": [1]}, 3])
def test_pack_flat_records_not_records(bad):
    raises(TypeError, r"pack_flat: records must be a list of SampleRecord", pack_flat, bad, 4, pad_token_id=0)
    raises(
        TypeError,
        r"pack_flat: item 1 must be a SampleRecord, a payload dict or a token array, got str",
        pack_flat,
        [DOCS[0], "abc"],
        4,
        pad_token_id=0,
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"seq_len": 0}, ValueError, "seq_len must be an int >= 1"),
        ({"seq_len": 2**31}, ValueError, "seq_len must be an int <= 2147483647"),
        ({"seq_len": 1.5}, TypeError, "seq_len must be an int"),
        ({"seq_len": True}, TypeError, "seq_len must be an int"),
        ({"pad_token_id": -1}, ValueError, "pad_token_id must be an int >= 0"),
        ({"pad_token_id": 2**63}, ValueError, "pad_token_id must be an int <= 9223372036854775807"),
        ({"pad_token_id": None}, TypeError, "pad_token_id must be an int"),
        ({"emit_positions": 1}, TypeError, "emit_positions must be a bool"),
        ({"tokens_field": 5}, TypeError, "tokens_field must be 'auto' or a field name"),
        ({"strategy": "x"}, ValueError, "strategy must be 'greedy' or 'best_fit'"),
        ({"overflow": None}, ValueError, "overflow must be 'auto', 'split' or 'truncate'"),
        ({"buffer_size": 0}, ValueError, "buffer_size must be an int >= 1"),
        ({"buffer_size": 1.5}, TypeError, "buffer_size must be an int"),
        ({"fields": "loss_mask"}, TypeError, "fields must be None or a sequence of field names"),
        ({"fields": [5]}, TypeError, "fields must hold str field names"),
        ({"fields": ["w", "w"]}, ValueError, "fields lists a name twice"),
        ({"fields": ["positions"]}, ValueError, "fields may not list 'positions'"),
        ({"fields": ["input_ids"]}, ValueError, "the tokens field 'input_ids' is also listed in fields"),
        ({"strateg": "greedy"}, TypeError, "unknown option 'strateg'; did you mean 'strategy'"),
    ],
)
def test_pack_flat_option_arguments(kwargs, error, match):
    options = {"pad_token_id": 0, **kwargs}
    seq_len = options.pop("seq_len", 4)
    raises(error, match, pack_flat, DOCS, seq_len, **options)
    raises(error, match, lambda: list(FlatPacker(seq_len, **options).pack(DOCS)))


@pytest.mark.parametrize(
    ("tokens", "error", "match"),
    [
        ([1.0, 2.0], TypeError, "has dtype float64; it must hold integer token ids"),
        ([True, False], TypeError, "has dtype bool; it must hold integer token ids"),
        ([1j], TypeError, "has dtype complex128"),
        ([1, None], TypeError, r"holds Python objects that are not numbers \(dtype object\)"),
        ("abc", TypeError, "must be a list, tuple, NumPy array or torch tensor of numbers, got str"),
        ([1, -2, 3], ValueError, r"token ids must be >= 0, found -2 at input_ids\[1\]"),
        ([2**63], ValueError, "holds values beyond int64"),
        ([2**64], ValueError, "holds values beyond int64"),
        (np.array([2**63], np.uint64), ValueError, "holds values beyond int64"),
        ([[1, 2], [3, 4]], ValueError, r"must be 1-D \(one entry per token\), got shape \(2, 2\)"),
        ([[1, 2], [3]], ValueError, "is a ragged nested sequence"),
        (torch.arange(3).to_sparse(), TypeError, "is a torch.sparse_coo tensor"),
        (torch.arange(3, device="meta"), ValueError, "is a tensor on the 'meta' device, which holds no data"),
    ],
)
def test_pack_flat_bad_tokens(tokens, error, match):
    records = [DOCS[0], record({"input_ids": tokens}, 1)]
    raises(
        error,
        rf"record 1 \(sample_id \(0, 0, 1\)\): field 'input_ids' {match}",
        pack_flat,
        records,
        4,
        pad_token_id=0,
    )
    raises(error, rf"record 1 .*{match}", lambda: list(FlatPacker(4, pad_token_id=0).pack(records)))


@pytest.mark.parametrize("payload", [None, "abc", 3])
def test_pack_flat_payload_of_wrong_type(payload):
    raises(
        TypeError,
        r"record 1 .*payload must be a dict of fields or a token array",
        pack_flat,
        [DOCS[0], record(payload, 1)],
        4,
        pad_token_id=0,
    )


def test_pack_flat_loss_mask_problems():
    for mask in ([1, float("nan")], [1, 2], [0.5, 1]):
        raises(
            ValueError,
            r"record 0 .*'loss_mask' must hold only 0 and 1",
            pack_flat,
            [record({"input_ids": [1, 2], "loss_mask": mask})],
            4,
            pad_token_id=0,
        )
    raises(
        ValueError,
        r"record 0 .*'loss_mask' does not have one entry per token \(2\)",
        pack_flat,
        [record({"input_ids": [1, 2], "loss_mask": [1]})],
        4,
        pad_token_id=0,
    )
    raises(
        ValueError,
        r"record 0 .* has a 'loss_mask' but record 1 .* has none",
        pack_flat,
        [record({"input_ids": [1, 2], "loss_mask": [1, 1]}), record({"input_ids": [3]}, 1)],
        4,
        pad_token_id=0,
    )
    raises(ValueError, r"record 0 .*lacks field 'w'", pack_flat, DOCS, 4, pad_token_id=0, fields=["w"])


def test_pack_flat_skips_sentinels_and_empty_documents():
    """Documented: pack_flat consumes sentinels (tombstones skipped, flush closes the row) and skips empty docs."""
    records = [
        DOCS[0],
        SampleRecord(SampleMeta((0, 0, 8), 0, 0).with_tombstone(), None),
        sentinel(9, "_flush"),
        record({"input_ids": []}, 2),
        record({"input_ids": torch.tensor([])}, 3),
        DOCS[1],
    ]
    rows = pack_flat(records, 4, pad_token_id=PAD)
    assert [r.payload["input_ids"].tolist() for r in rows] == [[1, 2, 3, PAD], [4, 5, PAD, PAD]]
    assert pack_flat([], 4, pad_token_id=0) == []


def test_pack_flat_duplicate_ids_allowed():
    rows = pack_flat([record([1, 2], 3), record([4], 3)], 4, pad_token_id=0)
    assert [ref.cursor.sample_id for ref in rows[0].meta.contributors] == [(0, 0, 3), (0, 0, 3)]


def test_flat_packer_stream_of_wrong_type():
    for bad in (None, 3, "abc", {"a": 1}):
        raises(
            TypeError,
            r"FlatPacker.pack: records must be an iterable of SampleRecord",
            lambda bad=bad: list(FlatPacker(4, pad_token_id=0).pack(bad)),
        )
    raises(
        TypeError,
        r"FlatPacker: item 1 must be a SampleRecord, a payload dict or a token array, got NoneType",
        lambda: list(FlatPacker(4, pad_token_id=0).pack([DOCS[0], None])),
    )


def test_flat_packer_state_problems():
    packer = FlatPacker(4, pad_token_id=0)
    next(iter(packer.pack(DOCS + DOCS)))
    state = packer.state_dict()
    raises(
        TypeError, r"state must be a dict, got NoneType", FlatPacker(4, pad_token_id=0).load_state_dict, None
    )
    raises(ValueError, r"not a version-1 FlatPacker state", FlatPacker(4, pad_token_id=0).load_state_dict, {})
    raises(
        ValueError,
        r"saved with other options \(seq_len: saved 4, here 5\)",
        FlatPacker(5, pad_token_id=0).load_state_dict,
        state,
    )
    for key, bad in (
        ("pending", [{"tokens": [1]}]),
        ("pending", None),
        ("records_consumed", "x"),
        ("ready", [[5]]),
        ("options", None),
    ):
        broken = {**state, key: bad}
        raises(ValueError, r"the state is corrupt", FlatPacker(4, pad_token_id=0).load_state_dict, broken)
    restored = FlatPacker(4, pad_token_id=0)
    raises(ValueError, r"the state is corrupt", restored.load_state_dict, {**state, "pending": None})
    restored.load_state_dict(state)  # a failed restore leaves the packer usable
    assert restored.records_consumed == state["records_consumed"]


@pytest.mark.parametrize(("dtype", "eos"), [(torch.int8, 261), (torch.int16, 40_000), (np.int8, 128)])
def test_eos_token_id_beyond_the_output_dtype(dtype, eos):
    """An EOS id the output dtype cannot hold would wrap around (261 as int8 is 5): ValueError, before any
    payload is read, whether or not EOS masking is on."""
    b = batch({"input_ids": [1, 5, 2]})
    raises(
        ValueError,
        rf"eos_token_id {eos} does not fit dtype",
        b.to_training,
        return_labels=True,
        eos_mask_loss=True,
        eos_token_id=eos,
        dtype=dtype,
    )
    raises(
        ValueError, rf"eos_token_id {eos} does not fit dtype", b.to_training, eos_token_id=eos, dtype=dtype
    )


# --- K. Whole-number floats out of range, exotic dtypes, one-row batches, shared texts ---------------


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        ([3e9], torch.int32),  # wrapped to -2147483648
        ([40000.0], torch.int16),  # wrapped to -25536
        ([300.0], np.int8),  # wrapped to 44
        ([1e20], torch.int64),  # wrapped to INT64_MIN
        ([2.0**63], torch.int64),  # exactly one past int64
        ([-129.0], torch.int8),
    ],
)
def test_whole_number_floats_beyond_the_dtype(values, dtype):
    """A whole-number float that the output dtype cannot hold is refused, as an integer source is."""
    name = torch.int8 if dtype is np.int8 else dtype
    b = batch({"input_ids": [1, 2], "w": torch.tensor([values[0], 0.0], dtype=torch.float64)})
    raises(
        ValueError,
        rf"record 0 .*'w' holds values outside the {name} range",
        b.to_training,
        extra_fields=["w"],
        dtype=dtype,
    )
    mask = batch({"input_ids": [1, 2], "loss_mask": [values[0], 1.0]})
    raises(
        ValueError,
        rf"record 0 .*'loss_mask' holds values outside the {name} range",
        mask.to_training,
        dtype=dtype,
    )


def test_whole_number_floats_at_the_edges_pass():
    out = batch({"input_ids": [1, 2], "w": [-128.0, 127.0]}).to_training(extra_fields=["w"], dtype=torch.int8)
    assert out["w"].tolist() == [[-128, 127]] and out["w"].dtype == torch.int8


def test_list_of_bool_tensors_as_token_ids():
    """``list(torch.tensor([True, False, True]))`` is not token ids [1, 0, 1], in every entry point."""
    tokens = list(torch.tensor([True, False, True]))
    raises(
        TypeError,
        r"record 0 .*'input_ids' has dtype bool; it must hold integer token ids",
        batch({"input_ids": tokens}).to_training,
    )
    raises(TypeError, r"sample 0|record 0 .*dtype bool", Collator(), [{"input_ids": tokens}])
    raises(TypeError, r"record 0 .*dtype bool", pack_flat, [record({"input_ids": tokens})], 4, pad_token_id=0)


def test_list_of_int_tensors_still_reads():
    out = batch({"input_ids": list(torch.tensor([5, 6, 7]))}).to_training(return_labels=True)
    assert out["labels"].tolist() == [[6, 7]]


def test_one_row_batch_tensors_name_the_fix():
    """``tokenizer(..., return_tensors="pt")["input_ids"]`` is ``[1, S]``: a clear error, not one token of S channels."""
    hf = {"input_ids": torch.tensor([[1, 5, 6, 2]]), "labels": torch.tensor([[1, 5, 6, 2]])}
    raises(
        ValueError,
        r"record 0 .*'input_ids' has shape \(1, 4\): a batch of one row.*squeeze\(0\)",
        batch(hf).to_training,
        return_labels=True,
    )
    raises(ValueError, r"has shape \(1, 4\)", Collator(return_labels=True), [hf])
    assert batch({"input_ids": hf["input_ids"][0]}).to_training(return_labels=True)["labels"].tolist() == [
        [5, 6, 2]
    ]


def test_texts_are_copies_not_the_payloads_objects():
    chat = [{"role": "user", "content": "hi"}]
    b = batch({"input_ids": [1, 2], "text": chat})
    out = b.to_training()
    out["texts"][0].append({"role": "assistant", "content": "x"})
    out["texts"][0][0]["content"] = "changed"
    assert chat == [{"role": "user", "content": "hi"}]
    assert Collator()([b.records[0]])["texts"][0] == chat


@pytest.mark.parametrize(
    "value",
    [
        torch.tensor([1.0, 0.0]).to(torch.float8_e4m3fn),
        torch.tensor([1.0, 0.0]).to(torch.float8_e5m2),
    ],
    ids=["float8_e4m3fn", "float8_e5m2"],
)
def test_float8_fields_are_refused_clearly(value):
    b = batch({"input_ids": [1, 2], "loss_mask": value})
    raises(
        TypeError,
        r"record 0 .*'loss_mask' has dtype torch.float8_e\w+, which collating cannot compute with; cast it with \.float\(\)",
        b.to_training,
        return_labels=True,
    )
    raises(
        TypeError,
        r"record 0 .*'w' has dtype torch.float8",
        batch({"input_ids": [1, 2], "w": value}).to_training,
        extra_fields=["w"],
    )
    raises(
        TypeError,
        r"record 0 .*'loss_mask' has dtype torch.float8",
        pack_flat,
        [record({"input_ids": [1, 2], "loss_mask": value})],
        4,
        pad_token_id=0,
    )


def test_longdouble_mask_is_refused_clearly():
    mask = np.array([1, 1], dtype=np.longdouble)
    if mask.dtype.itemsize <= 8:  # pragma: no cover - platforms where long double is double
        pytest.skip("np.longdouble is float64 here")
    raises(
        TypeError,
        r"record 0 .*'loss_mask' has dtype float128, which torch cannot hold; cast it with \.astype\(np\.float64\)",
        batch({"input_ids": [1, 2], "loss_mask": mask}).to_training,
        return_labels=True,
    )


def test_big_endian_dtype_and_payloads():
    raises(
        ValueError,
        r"dtype '>i4' is not in this machine's byte order; pass np.dtype\('int32'\)",
        batch({"input_ids": [1, 2]}).to_training,
        dtype=np.dtype(">i4"),
    )
    tokens = np.array([3, 4, 5], dtype=">i8")  # big-endian payloads read exactly
    assert batch({"input_ids": tokens}).to_training(return_labels=True)["labels"].tolist() == [[4, 5]]


@pytest.mark.parametrize("tokens", [[1, 2**63], [2**64, 1], [-(2**63) - 1]])
def test_python_ints_beyond_int64_say_so(tokens):
    raises(
        ValueError,
        r"record 0 .*'input_ids' holds values beyond int64",
        batch({"input_ids": tokens}).to_training,
    )


def test_pack_flat_field_of_int64_and_uint64_stays_exact():
    """One document's field int64, the next uint64: packed exactly, not through float64."""
    big = 2**60 + 1
    docs = [
        record({"input_ids": [1, 2], "w": np.array([big, 1], dtype=np.int64)}, 0),
        record({"input_ids": [3, 4], "w": np.array([big, 2], dtype=np.uint64)}, 1),
    ]
    row = pack_flat(docs, 4, pad_token_id=0, fields=["w"])[0].payload
    assert row["w"].dtype == np.int64 and row["w"].tolist() == [big, 1, big, 2]


# --- L. Corrupt packer and stream states -----------------------------------------------------------


def _packer_state_with_open_row():
    """A greedy packer of 4-token rows that has emitted [1, 2, 3, pad] and holds [4, 5, 6] open."""
    packer = FlatPacker(4, pad_token_id=0)
    rows = packer.pack([record({"input_ids": [1, 2, 3]}, 0), record({"input_ids": [4, 5, 6]}, 1)])
    assert next(rows).payload["input_ids"].tolist() == [1, 2, 3, 0]
    state = packer.state_dict()
    assert [p["tokens"].tolist() for p in state["pending"]] == [[4, 5, 6]]
    return state


def _corrupted(change):
    state = _packer_state_with_open_row()
    change(state)
    return state


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda s: s["pending"][0].update(tokens=[1.5, 2.5, 3.9]),
            r"state\['pending'\]\[0\]\['tokens'\] is not a row of token ids",
        ),
        (
            lambda s: s["pending"][0].update(tokens=[4, -5, 6]),
            r"state\['pending'\]\[0\]\['tokens'\] .*token ids must be >= 0",
        ),
        (
            lambda s: s["pending"][0].update(tokens=list(range(1, 10))),
            r"holds 9 tokens; a piece holds 1 to seq_len=4",
        ),
        (
            lambda s: s["pending"].append(dict(s["pending"][0])),
            r"state\['pending'\] holds more than seq_len=4 tokens",
        ),
        (lambda s: s.update(records_consumed=-1), r"state\['records_consumed'\] must be an int >= 0, got -1"),
        (lambda s: s.update(rows_emitted="1"), r"state\['rows_emitted'\] must be an int >= 0"),
        (lambda s: s.update(pending="abc"), r"state\['pending'\] must be a list"),
        (lambda s: s.update(ready=[[]]), r"state\['ready'\]\[0\] must be a non-empty list of pieces"),
        (
            lambda s: s["pending"][0]["base"].update(lane_id="x"),
            r"state\['pending'\]\[0\]\['base'\] is not record metadata",
        ),
        (
            lambda s: s["pending"][0].update(fields={"w": [1, 2, 3]}),
            r"\['fields'\] must hold exactly the packed fields \[\]",
        ),
        (lambda s: s["pending"][0].update(closes="yes"), r"\['closes'\] must be a bool"),
        (lambda s: s.update(fields="loss_mask"), r"state\['fields'\] must be a list of field names or None"),
    ],
    ids=[
        "float-tokens",
        "negative-token",
        "piece-too-long",
        "row-too-long",
        "negative-count",
        "str-count",
        "pending-str",
        "empty-ready-row",
        "bad-base",
        "extra-field",
        "closes-str",
        "fields-str",
    ],
)
def test_corrupt_packer_state_names_the_key(change, match):
    """A state dict is input: each corruption is a ValueError naming the key, never a wrong row or a raw error."""
    state = _corrupted(change)
    raises(
        ValueError,
        rf"FlatPacker.load_state_dict: .*{match}",
        FlatPacker(4, pad_token_id=0).load_state_dict,
        state,
    )


def test_a_valid_packer_state_still_resumes_exactly():
    state = _packer_state_with_open_row()
    packer = FlatPacker(4, pad_token_id=0)
    packer.load_state_dict(state)
    rows = list(packer.pack([record({"input_ids": [7]}, 2)]))
    assert [row.payload["input_ids"].tolist() for row in rows] == [[4, 5, 6, 7]]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"epoch": "x"}, r"state\['epoch'\] must be an int >= 0, got 'x'"),
        ({"epoch": -1}, r"state\['epoch'\] must be an int >= 0"),
        ({"shard": 2, "num_shards": 2}, r"state\['shard'\] is 2, not below num_shards=2"),
        ({"shard": None}, r"must both be ints or both None"),
        ({"last_cursor": "abc"}, r"state\['last_cursor'\] is not a cursor key"),
        ({"packer": {"version": 1}}, r"FlatPacker.load_state_dict: not a version-1 FlatPacker state"),
    ],
)
def test_corrupt_stream_state_names_the_key(change, match):
    stream = PackedStream([record({"input_ids": [1, 2, 3]}, i) for i in range(4)], 4, pad_token_id=0)
    state = {**stream.state_dict(), **change}
    raises(ValueError, match, stream.load_state_dict, state)


# --- M. Messages stay short whatever was passed --------------------------------------------------

_META = SampleMeta((0, 0, 0), 0, 0)
_BIG = SampleRecord(_META, {"input_ids": torch.arange(100_000)})
LONG_INPUTS = {
    "a record where a list belongs": lambda: SampleBatch(_BIG),
    "exclude_fields as a long str": lambda: SampleBatch([_BIG]).to_training(exclude_fields="x" * 10_000),
    "tokens_field as a long list": lambda: SampleBatch([_BIG]).to_training(tokens_field=["a"] * 10_000),
    "dtype as a long list": lambda: SampleBatch([_BIG]).to_training(dtype=list(range(10_000))),
    "rename_fields as a long list": lambda: SampleBatch([_BIG]).to_training(
        rename_fields=list(range(10_000))
    ),
    "eos_token_id as a long str": lambda: SampleBatch([_BIG]).to_training(
        eos_token_id="y" * 10_000, return_labels=True, eos_mask_loss=True
    ),
    "ignore_index as a long str": lambda: SampleBatch([_BIG]).to_training(ignore_index="q" * 10_000),
    "a long device name": lambda: Collator(device="z" * 10_000),
    "a long field name": lambda: SampleBatch(
        [SampleRecord(_META, {"k" * 10_000: 1, "z": [1]})]
    ).to_training(),
    "a long sample_id": lambda: SampleMeta(("s" * 10_000, 0, 0), 0, 0),
    "a long Chain item": lambda: Chain("x" * 10_000),
    "a long state version": lambda: FlatPacker(4, pad_token_id=0).load_state_dict({"version": "v" * 10_000}),
    "a long padding_length": lambda: batch({"input_ids": [1, 2]}, paddings=[list(range(10_000))]).to_training(
        return_labels=True
    ),
}


@pytest.mark.parametrize("make", list(LONG_INPUTS.values()), ids=list(LONG_INPUTS))
def test_error_messages_stay_short(make):
    """A huge value in the wrong place is quoted cut short: every message stays under 400 characters."""
    with pytest.raises((TypeError, ValueError)) as info:
        make()
    assert len(str(info.value)) < 400, str(info.value)[:500]


@pytest.mark.parametrize("host", [True, False])
def test_sequence_positions_beyond_the_dtype_are_refused_on_both_passes(host):
    """position_mode='sequence' numbers 0 .. S - 1; in int8, 300 tokens would wrap to -128 on the host
    pass: refused, as the torch kernel refuses it, naming the fix."""
    from zephon_collate import use_host_pass

    records = [record([1] * 300)]
    with use_host_pass(host):
        for call in (
            lambda: Collator(dtype=torch.int8, position_mode="sequence")(records),
            lambda: to_training(records, dtype=torch.int8, position_mode="sequence"),
            lambda: to_training(records, dtype=np.int8, position_mode="sequence", return_labels=True),
        ):
            raises(
                ValueError,
                r"positions numbered (300|299) tokens do not fit dtype torch.int8 .*wider dtype",
                call,
            )
    short = to_training([record([1] * 128)], dtype=torch.int8, position_mode="sequence")
    assert short["positions"].tolist() == [list(range(128))]


# --- found by fuzzing: raw errors from odd but plausible input -----------------------------------


def test_zero_d_arrays_are_the_per_example_values_they_hold():
    """``datasets``' NumPy rows hand a bool column over as ``array(True)``: a 0-d array (NumPy or torch)
    is the value it holds in every per-example field, as a NumPy scalar is (a 0-d NumPy array was refused
    where the tensor passed)."""
    forms = (lambda v: v, lambda v: np.asarray(v)[()], torch.tensor, np.array)

    def same(collate, rows, key):
        batches = [as_lists(collate([{**row, key: form(row[key])} for row in rows])) for form in forms]
        assert all(b == batches[0] for b in batches[1:])

    kto = [
        {"prompt_ids": [5, 6], "completion_ids": [7, 8], "KL_completion_ids": [9], "label": True},
        {"prompt_ids": [4], "completion_ids": [9], "KL_completion_ids": [7, 8], "label": False},
    ]
    same(Collator.for_preference(padding_free=True), kto, "label")
    openrlhf = [
        {"chosen_ids": [1, 2, 3, 4], "reject_ids": [1, 2, 5], "extra": 2},
        {"chosen_ids": [6, 7], "reject_ids": [6, 8, 9], "extra": 1},
    ]
    same(Collator.for_preference(padding_free=True), openrlhf, "extra")
    nodes = [
        {"node_id": 0, "parent_id": -1, "input_ids": [1, 2], "completion_mask": [0, 0]},
        {"node_id": 1, "parent_id": 0, "input_ids": [3], "completion_mask": [1]},
    ]
    same(Collator.for_trees(), nodes, "node_id")
    rewards = [{"chosen_input_ids": [1, 2], "rejected_input_ids": [1, 3], "margin": 0.5}]
    same(Collator.for_rewards(padding_free=True), rewards, "margin")
    for bad in (np.array(1), np.array([True])):
        with pytest.raises(ValueError, match=r"example 0: 'label' is"):
            Collator.for_preference(padding_free=True)([{**kto[0], "label": bad}])


def test_numpy_int_options_are_the_ints_they_hold():
    """A NumPy int option is checked and kept as a Python int: the same rows as the int."""
    pairs = [
        {"prompt_input_ids": [26, 41, 10, 15], "chosen_input_ids": [10], "rejected_input_ids": [1]},
        {"prompt_input_ids": [49, 38], "chosen_input_ids": [20], "rejected_input_ids": [18]},
    ]
    want = Collator.for_preference(padding_free=True, max_row_tokens=9, pad_token_id=0)(pairs)
    for width in (np.int32(9), np.int64(9)):
        got = Collator.for_preference(padding_free=True, max_row_tokens=width, pad_token_id=0)(pairs)
        assert got["input_ids"].tolist() == want["input_ids"].tolist()
    trajectories = [{"input_ids": [1, 2, 3, 4], "completion_mask": [0, 0, 1, 1]}]
    raises(
        ValueError,
        r"example 0: its tree holds 4 tokens, more than max_row_tokens=3",
        Collator.for_rollouts(padding_free=True, max_row_tokens=np.int64(3)),
        trajectories,
    )


def test_odd_inputs_found_by_fuzzing_raise_the_packages_errors():
    pairs = [
        {
            "chosen_input_ids": [1, 2, 3],
            "rejected_input_ids": [1, 2, 4],
            "chosen_labels": [-100, 2, 3],
            "rejected_labels": [-100, 2, 4, 4],  # one label too many
            "chosen_attention_mask": [1, 1, 1],
            "rejected_attention_mask": [1, 1, 1],
        }
    ]
    raises(
        ValueError,
        r"example 0: field 'rejected_labels' has 4 entries but the token row has 3",
        Collator.for_preference(pad_token_id=0),
        pairs,
    )
    raises(ValueError, r"padding must be True/'longest'.*got \[\]", Collator.for_transformers, padding=[])
    stream = {"input_ids": [1]}  # one payload, not a sequence of records
    raises(
        TypeError,
        r"source must be a sequence of SampleRecord .*got dict",
        PackedStream,
        stream,
        4,
        pad_token_id=0,
    )


def test_zero_d_and_ragged_containers_raise_the_packages_errors():
    raises(
        TypeError,
        r"'input_ids' must be a list of token rows, got Tensor",
        Collator.for_transformers(padding_free=True),
        {"input_ids": torch.tensor(3)},
    )
    raises(
        TypeError,
        r"'input_ids' must be a list of token rows, got dict",
        Collator.for_transformers(padding_free=True),
        {"input_ids": {"a": 1}},
    )
    raises(
        TypeError,
        r"records must be an iterable of SampleRecord, got ndarray",
        lambda: list(FlatPacker(4, pad_token_id=0).pack(np.array(3))),
    )
    raises(
        TypeError,
        r"source must be a sequence of SampleRecord .*got ndarray",
        PackedStream,
        np.array(3),
        4,
        pad_token_id=0,
    )
    turns = [
        {"input_ids": [[1, 2], [3]], "completion_mask": [0, 1], "extra": [[torch.tensor([1, 2]), 3], [4]]}
    ]
    raises(
        ValueError,
        r"example 0: 'extra' holds a turn that is not a flat row of values",
        Collator.for_trees(),
        turns,
    )


def test_a_tensor_as_dtype_is_a_type_error():
    raises(
        TypeError,
        r"dtype must be 'auto', None, a torch dtype or a NumPy dtype, got tensor\(3\)",
        to_training,
        [record({"input_ids": [1, 2]})],
        dtype=torch.tensor(3),
    )


def test_more_odd_inputs_found_by_fuzzing():
    for zero_d in (torch.tensor(3), np.array(3)):
        raises(
            TypeError, r"to_training: expected a SampleBatch or a list of SampleRecord", to_training, zero_d
        )
        raises(TypeError, r"SampleBatch.records must be a sequence of SampleRecord", SampleBatch, zero_d)
        raises(
            TypeError,
            r"pack_flat: records must be a list of SampleRecord",
            pack_flat,
            zero_d,
            4,
            pad_token_id=0,
        )
        raises(
            TypeError,
            r"fields must be None or a sequence of field names",
            FlatPacker,
            4,
            pad_token_id=0,
            fields=zero_d,
        )
    cube = record({"input_ids": [30, 46], "loss_mask": np.zeros((2, 2, 2), np.int64)})
    raises(
        ValueError,
        r"record 0 .*'loss_mask' has shape \(2, 2\) per token",
        to_training,
        [cube],
        return_labels=True,
    )
    # an empty record's loss_mask is skipped with the record: pack_flat agrees with FlatPacker
    docs = [
        SampleRecord(SampleMeta((0, 0, 0), 0, 0), {"input_ids": [], "loss_mask": []}),
        SampleRecord(SampleMeta((0, 0, 1), 0, 0), {"input_ids": [5, 6]}),
    ]
    rows = pack_flat(docs, 4, pad_token_id=0)
    assert [row.payload["input_ids"].tolist() for row in rows] == [[5, 6, 0, 0]]
    assert [r.payload["input_ids"].tolist() for r in FlatPacker(4, pad_token_id=0).pack(docs)] == [
        [5, 6, 0, 0]
    ]
