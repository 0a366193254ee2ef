"""zephon_collate.read, the door: every input read once into one columnar type, checks that name the row."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from zephon_collate.read.arrow import columns_of
from zephon_collate.read.columns import MISSING, Ragged, concat, row_of, to_row
from zephon_collate.read.rows import Rows, payload_get
from zephon_collate.read.rules import check_fits, check_ids, check_zero_one


def names(index: int) -> str:
    return f"row {index}"


def test_concat_lays_rows_end_to_end_and_never_shares_memory():
    row = torch.tensor([5, 6, 7])
    field = concat([row, np.array([8], dtype=np.int32), np.array([9, 10])], "input_ids", names)
    assert isinstance(field.values, np.ndarray) and field.values.tolist() == [5, 6, 7, 8, 9, 10]
    assert field.offsets.tolist() == [0, 3, 4, 6] and field.lengths.tolist() == [3, 1, 2]
    single = concat([row], "input_ids", names)
    single.values[0] = 99
    assert row.tolist() == [5, 6, 7]  # one row is copied too
    assert concat([], "input_ids", names).offsets.tolist() == [0]


def test_concat_refuses_rows_of_other_trailing_shapes():
    with pytest.raises(ValueError, match=r"row 1: field 'x' has shape \(2, 3\), but row 0 has \(2, 2\)"):
        concat([np.zeros((2, 2)), np.zeros((2, 3))], "x", names)


def test_ragged_rows_select_and_take():
    field = concat([np.array([1, 2, 3]), np.array([4, 5])], "x", names)
    assert field.row(1).tolist() == [4, 5] and field.take(0).offsets.tolist() == [0, 3]
    kept = field.select(np.array([True, False, True, False, True]))
    assert kept.values.tolist() == [1, 3, 5] and kept.offsets.tolist() == [0, 2, 3]
    assert field.cast(torch.int8).values.dtype == np.int8
    assert row_of(field.offsets, 3) == 1 and row_of(np.array([0, 0, 2]), 0) == 1  # empty rows hold none


def test_checks_name_the_row_and_the_token():
    tokens = concat([np.array([1, 2]), np.array([3, -4, 5])], "input_ids", names)
    with pytest.raises(
        ValueError, match=r"row 1: field 'input_ids' token ids must be >= 0, found -4 at input_ids\[1\]"
    ):
        check_ids(tokens, "input_ids", names)
    mask = concat([np.array([0, 1]), np.array([1, 2])], "loss_mask", names)
    with pytest.raises(
        ValueError, match=r"row 1: field 'loss_mask' must hold only 0 and 1.*found 2 at loss_mask\[1\]"
    ):
        check_zero_one(mask, "loss_mask", names, "1 where trained")
    floats = concat([np.array([0.0, 1.5])], "w", names)
    with pytest.raises(ValueError, match=r"row 0: field 'w' holds non-integral .*1\.5 at w\[1\]"):
        check_fits(floats, torch.int64, "w", names)
    wide = concat([np.array([1, 300])], "x", names)
    with pytest.raises(ValueError, match=r"values outside the torch.int8 range \(e.g. 300 at x\[1\]\)"):
        check_fits(wide, torch.int8, "x", names)
    check_fits(concat([np.array([2**62], dtype=np.int64)], "x", names), torch.int64, "x", names)
    check_fits(concat([np.array([1.0, 2.0], dtype=np.float16)], "x", names), torch.int64, "x", names)


def test_checks_pass_clean_values_of_every_dtype():
    for dtype in (np.uint8, np.int8, np.int16, np.int32, np.int64, np.float32, np.bool_):
        values = concat([np.array([0, 1, 1], dtype=dtype)], "m", names)
        check_zero_one(values, "m", names, "")
        if dtype not in (np.float32, np.bool_):
            check_ids(values, "m", names)


class Upper(dict):
    def __getitem__(self, key):
        return super().__getitem__(key.lower())

    def __contains__(self, key):
        return super().__contains__(key.lower())


def rows_of(payloads: list) -> Rows:
    return Rows(payloads, names, tokens="input_ids", ids=[(0, 0, i) for i in range(len(payloads))])


def test_payloads_are_read_through_their_mapping_interface():
    payload = Upper(ids=[1, 2])
    assert payload_get(payload, "IDS") == [1, 2] and payload_get(payload, "X", MISSING) is MISSING
    field = rows_of([payload]).get("IDS", "ids")
    assert field is not None and field.values.tolist() == [1, 2]


def test_a_field_some_rows_lack_is_named_or_read_partially():
    batch = rows_of([{"m": [1, 0]}, {"x": [1]}])
    with pytest.raises(ValueError, match=r"row 1: payload lacks field 'm' .*some payloads have it"):
        batch.get("m", "values")
    partial = batch.get("m", "values", partial=True)
    assert partial is not None and partial.values.tolist() == [1, 0] and partial.lengths.tolist() == [2, 0]
    assert batch.carried("m").tolist() == [True, False] and batch.get("absent", "values") is None
    with pytest.raises(ValueError, match=r"row 0: payload lacks field 'absent' .*it is required"):
        batch.require("absent")


def test_rows_and_columns_read_into_the_same_fields():
    """The door: payload dicts and (values, offsets) pairs give the same Ragged, read once."""
    rows = rows_of([{"input_ids": [5, 6, 7], "m": [1, 0, 1]}, {"input_ids": [8], "m": [1]}])
    offsets = np.array([0, 3, 4])
    columns = columns_of(
        {"input_ids": (np.array([5, 6, 7, 8]), offsets), "m": (np.array([1, 0, 1, 1]), offsets)}
    )
    assert columns is not None
    for name in ("input_ids", "m"):
        a, b = rows.get(name, "values"), columns.get(name, "values")
        assert a is not None and b is not None
        assert a.values.tolist() == b.values.tolist() and a.offsets.tolist() == b.offsets.tolist()
    assert rows.get("m", "values") is rows.get("m", "values")  # read once


@pytest.mark.parametrize(
    ("value", "kind", "error", "match"),
    [
        ("abc", "ids", TypeError, "must be a list, tuple, NumPy array or torch tensor"),
        ([1.5, 2.0], "ids", TypeError, "it must hold integer token ids"),
        ([[1, 2]], "ids", ValueError, "a batch of one row"),
        (7, "ids", ValueError, "must be a sequence, got a scalar"),
        ([2**64], "ids", ValueError, "holds values beyond int64"),
        (torch.zeros(2, device="meta"), "values", ValueError, "'meta' device, which holds no data"),
    ],
)
def test_to_row_refuses_what_is_not_numbers(value, kind, error, match):
    with pytest.raises(error, match=match):
        to_row(value, "row 0", "f", kind)


def test_ragged_pickles():
    field = concat([np.array([1, 2])], "x", names)
    copy = pickle.loads(pickle.dumps(field))
    assert isinstance(copy, Ragged) and copy.values.tolist() == [1, 2] and copy.lengths.tolist() == [2]
