"""The classes of the second hostile round, as properties: each a check the fuzz campaign runs at length.

- out-of-range whole-number floats, for every integer output dtype;
- ``eos_token_id`` against every output dtype, on the NumPy and the torch path;
- to_training through the fused host pass against the torch chain, over the option space;
- corrupt packer state dicts: a documented error, or a state that packs valid rows;
- narrow payload dtypes (uint8 to int32, NumPy and torch) through the Collator's padding: the
  same batch as the int64 payloads of the same values, whatever the pad id and multiple;
- packing with any ``fields=``: every token kept, and ``overflow="auto"`` refusing a long
  document with a prompt whether or not its ``loss_mask`` is packed.

``tests/fuzz/fuzz_to_training.py`` runs these same checks with many more examples.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import torch
from helpers import as_lists, batch, record
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_to_training
from strategies import packed_batches, training_options
from test_invariants import assert_documented_error

from zephon_collate import Collator, FlatPacker, SampleMeta, SampleRecord, pack_flat, use_host_pass

CASES = settings(max_examples=60, deadline=None)
INT_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, np.int8, np.int16, np.int32, np.int64]


def _torch_dtype(dtype: Any) -> torch.dtype:
    return dtype if isinstance(dtype, torch.dtype) else torch.from_numpy(np.empty(0, dtype)).dtype


@st.composite
def float_cases(draw: st.DrawFn) -> tuple[Any, float]:
    """An integer output dtype and a float near, at or beyond its bounds (or not whole, or not finite)."""
    dtype = draw(st.sampled_from(INT_DTYPES))
    info = torch.iinfo(_torch_dtype(dtype))
    edge = draw(st.sampled_from([info.min, info.max, info.max + 1, info.min - 1, 2 * info.max, 0]))
    value = draw(
        st.one_of(
            st.just(float(edge)),
            st.floats(-1e20, 1e20, allow_nan=False).map(float),
            st.sampled_from([math.inf, -math.inf, math.nan, 0.5, -0.5]),
            st.integers(-(2**70), 2**70).map(float),
        )
    )
    return dtype, value


def check_float_case(dtype: Any, value: float) -> str:
    """A whole number the dtype holds comes out exactly; anything else is a documented ValueError."""
    info = torch.iinfo(_torch_dtype(dtype))
    fits = math.isfinite(value) and value == int(value) and info.min <= int(value) <= info.max
    b = batch({"input_ids": [1, 2], "w": torch.tensor([value, 0.0], dtype=torch.float64)})
    try:
        out = b.to_training(extra_fields=["w"], dtype=dtype)
    except ValueError as error:
        assert not fits, f"{value} fits {dtype} but was refused: {error}"
        assert_documented_error(error, 1)
        assert "'w' holds" in str(error)
        return "error"
    assert fits, f"{value} does not fit {dtype} but came out as {as_lists(out['w'])}"
    assert as_lists(out["w"]) == [[int(value), 0]]
    return "ok"


@CASES
@given(float_cases())
def test_whole_number_floats_come_out_exactly_or_are_refused(case: tuple[Any, float]) -> None:
    check_float_case(*case)


@st.composite
def eos_cases(draw: st.DrawFn) -> tuple[Any, int, list[int]]:
    dtype = draw(st.sampled_from(INT_DTYPES))
    info = torch.iinfo(_torch_dtype(dtype))
    eos = draw(st.one_of(st.integers(0, 3), st.sampled_from([info.max, info.max + 1, 261, 2**40])))
    tokens = draw(st.lists(st.sampled_from([0, 1, 2, 3, 5, min(eos, 127)]), min_size=2, max_size=8))
    return dtype, eos, tokens


def check_eos_case(dtype: Any, eos: int, tokens: list[int]) -> str:
    """EOS masking agrees between the NumPy and the torch path and with the reference, or eos is refused."""
    fits = eos <= torch.iinfo(_torch_dtype(dtype)).max
    b = batch({"input_ids": tokens})
    options = {"return_labels": True, "eos_mask_loss": True, "eos_token_id": eos, "dtype": dtype}
    outs = []
    for host in (True, False):
        with use_host_pass(host):
            try:
                outs.append(as_lists(b.to_training(**options)))
            except ValueError as error:
                assert not fits and ("does not fit" in str(error) or "below 2**63" in str(error)), error
                assert_documented_error(error, 1)
                outs.append("error")
    assert outs[0] == outs[1], outs
    if outs[0] == "error":
        return "error"
    assert fits
    want = reference_to_training(b.records, **{k: v for k, v in options.items() if k != "dtype"})
    assert outs[0]["labels"] == want["labels"]
    return "ok"


@CASES
@given(eos_cases())
def test_eos_token_id_per_dtype_on_both_paths(case: tuple[Any, int, list[int]]) -> None:
    check_eos_case(*case)


@st.composite
def path_cases(draw: st.DrawFn) -> tuple[Any, dict[str, Any]]:
    """A packed batch and options over the whole space: flags, output dtype, EOS ids beyond small dtypes."""
    b = draw(packed_batches())
    options = draw(training_options(b))
    options["dtype"] = draw(st.sampled_from(["auto", None, *INT_DTYPES]))
    if options.get("eos_mask_loss") and draw(st.booleans()):
        options["eos_token_id"] = draw(st.sampled_from([127, 128, 255, 261, 32_767, 32_768, 2**31]))
    return b, options


def check_paths_case(b: Any, options: dict[str, Any]) -> str:
    """to_training through the host pass equals it through the torch chain (values and dtypes), or
    both paths raise the same documented error."""
    results = []
    for host in (True, False):
        with use_host_pass(host):
            try:
                results.append(("ok", b.to_training(**options)))
            except (ValueError, TypeError) as error:
                assert_documented_error(error, len(b.records))
                results.append(("error", str(error)))
    (kind, fast), (other, plain) = results
    assert kind == other, results
    if kind == "error":
        assert fast == plain
        return "error"
    assert as_lists(fast) == as_lists(plain)
    for key, value in plain.items():
        if isinstance(value, (torch.Tensor, np.ndarray)):
            assert fast[key].dtype == value.dtype, key
    return "ok"


@CASES
@given(path_cases())
def test_numpy_path_equals_torch_path_over_the_option_space(case: tuple[Any, dict[str, Any]]) -> None:
    check_paths_case(*case)


JUNK = [None, -1, -5, 1.5, "x", [], {}, [1.5, 2.5], [4, -5], list(range(20)), True, np.array([[1, 2]])]


def _packer_state(docs: list[list[int]], seq_len: int, taken: int) -> dict[str, Any]:
    packer = FlatPacker(seq_len, pad_token_id=0)
    rows = packer.pack([record({"input_ids": d}, i) for i, d in enumerate(docs)])
    for _ in range(taken):
        if next(rows, None) is None:
            break
    return packer.state_dict()


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path into a state (dict keys and list indices)."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*prefix, index))
    return found


@st.composite
def corrupt_states(draw: st.DrawFn) -> tuple[int, dict[str, Any]]:
    seq_len = draw(st.integers(2, 6))
    docs = draw(st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=8), min_size=1, max_size=6))
    state = _packer_state(docs, seq_len, draw(st.integers(0, 2)))
    paths = [p for p in _paths(state) if p[0] != "options"]
    path = draw(st.sampled_from(paths)) if paths else ("records_consumed",)
    corrupted = copy.deepcopy(state)
    target = corrupted
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = draw(st.sampled_from(JUNK))
    return seq_len, corrupted


def check_state_case(seq_len: int, state: dict[str, Any]) -> str:
    """A corrupt state: a documented error naming a state key, or a loaded state that packs valid rows
    (or names the record that does not fit it, e.g. a state that says the token field is 'x')."""
    packer = FlatPacker(seq_len, pad_token_id=0)
    try:
        packer.load_state_dict(state)
    except (ValueError, TypeError) as error:
        assert_documented_error(error, 0)
        assert "state" in str(error), error
        return "error"
    try:
        rows = list(packer.pack([record({"input_ids": [7]}, 99)]))
    except (ValueError, TypeError) as error:
        assert_documented_error(error, 2**63)  # named by its place in the stream the state resumes
        assert "(sample_id (0, 0, 99))" in str(error), error
        return "error"
    for row in rows:
        tokens = row.payload["input_ids"]
        assert tokens.dtype == np.int64 and tokens.shape == (seq_len,) and (tokens >= 0).all()
    return "ok"


@CASES
@given(corrupt_states())
def test_corrupt_packer_states_are_refused_or_harmless(case: tuple[int, dict[str, Any]]) -> None:
    check_state_case(*case)


# --- narrow payload dtypes through padding --------------------------------------------------------

NARROW = [np.uint8, np.int8, np.int16, np.int32, torch.uint8, torch.int8, torch.int16, torch.int32]


@st.composite
def narrow_padding_cases(draw: st.DrawFn) -> tuple[Any, list[list[int]], dict[str, Any]]:
    """Ragged rows stored in a narrow dtype (tokens and positions), and padding options that overflow
    it: a pad id beyond the dtype, a multiple that pads positions past its range."""
    dtype = draw(st.sampled_from(NARROW))
    top = int(np.iinfo(dtype).max if isinstance(dtype, type) else torch.iinfo(dtype).max)
    rows = draw(st.lists(st.lists(st.integers(0, min(top, 300)), max_size=12), min_size=1, max_size=4))
    options: dict[str, Any] = {
        "pad_token_id": draw(st.sampled_from([0, 7, 127, 128, 255, 256, 40_000, 2**31, 2**40])),
        "pad_to_multiple_of": draw(st.sampled_from([None, 1, 8, 64, 300])),
        "return_labels": draw(st.booleans()),
        "return_cu_seqlens": draw(st.booleans()),
        "return_padding_mask": True,
        "extra_fields": ["positions"],
    }
    return dtype, rows, options


def _narrow_records(dtype: Any, rows: list[list[int]], wide: bool) -> list[SampleRecord]:
    records = []
    for i, row in enumerate(rows):
        # Rows longer than 3 hold two documents: positions restart at token 3.
        positions = [*range(min(3, len(row))), *range(len(row) - 3)]
        values = {"input_ids": row, "positions": positions}
        if wide:
            payload = {k: np.array(v, dtype=np.int64) for k, v in values.items()}
        elif isinstance(dtype, type):
            payload = {k: np.array(v, dtype=dtype) for k, v in values.items()}
        else:
            payload = {k: torch.tensor(v, dtype=dtype) for k, v in values.items()}
        records.append(SampleRecord(SampleMeta((0, 0, i), 0, 0, i), payload))
    return records


def check_narrow_padding_case(dtype: Any, rows: list[list[int]], options: dict[str, Any]) -> str:
    """The Collator pads in the output dtype: narrow payloads give the int64 payloads' batch exactly
    (values, dtypes, keys), or the same documented error."""
    results = []
    for wide in (True, False):
        try:
            results.append(("ok", Collator(**options)(_narrow_records(dtype, rows, wide))))
        except (ValueError, TypeError) as error:
            assert_documented_error(error, len(rows))
            results.append(("error", str(error)))
    (kind, wide_out), (other, narrow_out) = results
    assert kind == other, results
    if kind == "error":
        assert wide_out == narrow_out
        return "error"
    assert as_lists(narrow_out) == as_lists(wide_out)
    for key, value in wide_out.items():
        if isinstance(value, torch.Tensor):
            assert narrow_out[key].dtype == value.dtype, key
    return "ok"


@CASES
@given(narrow_padding_cases())
def test_narrow_payload_dtypes_pad_as_int64_payloads(
    case: tuple[Any, list[list[int]], dict[str, Any]],
) -> None:
    check_narrow_padding_case(*case)


# --- packing with any fields= ---------------------------------------------------------------------


@st.composite
def packing_field_cases(draw: st.DrawFn) -> tuple[list[dict[str, list[int]]], int, dict[str, Any]]:
    """Chat-like documents (a loss_mask, a weight field), any fields= selection, strategy and overflow."""
    seq_len = draw(st.integers(1, 8))
    documents = []
    for _ in range(draw(st.integers(1, 5))):
        length = draw(st.integers(1, 12))
        prompt = draw(st.integers(0, length))
        documents.append(
            {
                "input_ids": draw(st.lists(st.integers(1, 50), min_size=length, max_size=length)),
                "loss_mask": [0] * prompt + [1] * (length - prompt),
                "w": list(range(length)),
            }
        )
    options = {
        "fields": draw(st.sampled_from([None, (), ("w",), ("loss_mask",), ("loss_mask", "w")])),
        "strategy": draw(st.sampled_from(["greedy", "best_fit"])),
        "overflow": draw(st.sampled_from(["auto", "split", "truncate"])),
    }
    return documents, seq_len, options


def check_packing_fields_case(
    documents: list[dict[str, list[int]]], seq_len: int, options: dict[str, Any]
) -> str:
    """``overflow='auto'`` raises exactly when a document longer than ``seq_len`` has a prompt, whatever
    ``fields=``; otherwise every token is kept (split) or each document's head (truncate), packed fields
    aligned with their tokens."""
    before = copy.deepcopy(documents)
    records = [SampleRecord(SampleMeta((0, 0, i), 0, 0, i), d) for i, d in enumerate(documents)]
    must_refuse = options["overflow"] == "auto" and any(
        len(d["input_ids"]) > seq_len and 0 in d["loss_mask"] for d in documents
    )
    try:
        rows = pack_flat(records, seq_len, pad_token_id=0, **options)
    except ValueError as error:
        assert must_refuse, error
        assert "overflow=" in str(error)
        assert documents == before
        return "error"
    assert not must_refuse, "a long document with a prompt was cut under overflow='auto'"
    assert documents == before
    keep = seq_len if options["overflow"] == "truncate" else None
    expected = sorted(t for d in documents for t in d["input_ids"][:keep])
    packed = sorted(
        t for r in rows for t in r.payload["input_ids"][: seq_len - r.meta.padding_length].tolist()
    )
    assert packed == expected
    packed_fields = ("loss_mask", "w") if options["fields"] is None else options["fields"]
    for row in rows:
        assert sorted(k for k in row.payload if k not in ("input_ids", "positions")) == sorted(packed_fields)
    return "ok"


@CASES
@given(packing_field_cases())
def test_packing_with_any_fields(case: tuple[list[dict[str, list[int]]], int, dict[str, Any]]) -> None:
    check_packing_fields_case(*case)
