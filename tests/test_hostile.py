"""The classes of the second hostile round, as properties: each a check the fuzz campaign runs at length.

- out-of-range whole-number floats, for every integer output dtype;
- ``eos_token_id`` against every output dtype, on the NumPy and the torch path;
- to_training through the NumPy twins against the torch kernels, over the option space;
- corrupt packer state dicts: a documented error, or a state that packs valid rows.

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

from zephon_collate import FlatPacker, use_host_pass

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
    for twins in (True, False):
        with use_host_pass(twins):
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
    """to_training through the NumPy twins equals it through the torch kernels (values and dtypes), or
    both paths raise the same documented error."""
    results = []
    for twins in (True, False):
        with use_host_pass(twins):
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
