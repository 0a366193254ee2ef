"""Each step's host variant equals its torch ``compute``: one harness over every step that has one.

A step's ``host`` (NumPy, on the CPU) and its ``compute`` (torch: the
specification, what runs on a GPU and compiled) get the same random batch, in
every integer dtype, with rows of 0 to 300 tokens; their outputs must agree
key for key, dtype for dtype, value for value.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_collate import Transform
from zephon_collate.transforms import (
    AttentionMask,
    BoundaryMask,
    CopyKeys,
    CuSeqlens,
    EosMask,
    Flatten,
    LastTokenIndex,
    LeftPadding,
    LossMask,
    MRopePositions,
    PaddingMask,
    PositionOffset,
    Positions,
    SegmentIds,
    SeparatorLabels,
    TokenShift,
    UnshiftedLabels,
)

DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.int64]

STEPS: dict[str, Callable[[], Transform]] = {
    "PaddingMask": PaddingMask,
    "BoundaryMask": BoundaryMask,
    "BoundaryMask(created)": lambda: BoundaryMask(mask_key="fresh"),
    "TokenShift": lambda: TokenShift(input_keys=["positions"], label_keys=["loss_mask"]),
    "EosMask": lambda: EosMask(2),
    "EosMask(beyond the dtype)": lambda: EosMask(300),
    "LossMask": LossMask,
    "LossMask(no supervision, -1)": lambda: LossMask(-1, supervision_key=None),
    "CuSeqlens": CuSeqlens,
    "CuSeqlens(flat)": lambda: CuSeqlens(flatten=True),
    "CuSeqlens(static)": lambda: CuSeqlens(num_boundaries=400),
    "CuSeqlens(static, flat)": lambda: CuSeqlens(flatten=True, num_boundaries=2000),
    "Positions": lambda: Positions("sequence"),
    "UnshiftedLabels": UnshiftedLabels,
    "AttentionMask": AttentionMask,
    "LeftPadding": lambda: LeftPadding(["input_ids", "positions", "loss_mask"]),
    "SegmentIds": SegmentIds,
    "SegmentIds(marked, flat)": lambda: SegmentIds(flatten=True, mark_padding=True),
    "SegmentIds(marked, shifted)": lambda: SegmentIds(mark_padding=True, shifted=True),
    "PositionOffset": lambda: PositionOffset(2, "positions"),
    "SeparatorLabels": lambda: SeparatorLabels(-7, "positions"),
    "CopyKeys": lambda: CopyKeys({"positions": "copied"}),
    "Flatten": lambda: Flatten(["input_ids", "positions", "loss_mask", "padding_length"]),
    "LastTokenIndex": LastTokenIndex,
    "LastTokenIndex(skip)": lambda: LastTokenIndex(skip_id=3),
    "MRopePositions": lambda: MRopePositions("positions"),
}


@st.composite
def batches(draw: st.DrawFn) -> dict[str, np.ndarray]:
    rows = draw(st.integers(1, 4))
    length = draw(st.sampled_from([1, 2, 5, 64, 300]))
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tokens = rng.integers(0, min(np.iinfo(dtype).max, 60) + 1, (rows, length)).astype(dtype)
    starts = rng.random((rows, length)) < draw(st.sampled_from([0.0, 0.1, 0.5]))
    starts[:, 0] = True
    place = np.arange(length)
    positions = (place - np.maximum.accumulate(np.where(starts, place, 0), axis=1)).astype(dtype)
    counts = rng.integers(0, length + 1, rows)
    padding = place >= (length - counts)[:, None]
    numbers = np.cumsum(starts.reshape(-1)).reshape(rows, length) - 1  # each segment a sequence
    return {
        "sequence_index": np.where(padding, -1, numbers).astype(np.int64),
        "input_ids": tokens,
        "labels": np.where(rng.random((rows, length)) < 0.2, -100, tokens.astype(np.int64)),
        "positions": positions,
        "loss_mask": (rng.random((rows, length)) < 0.7).astype(dtype),
        "padding_length": counts.astype(np.int64),
        "padding_mask": padding,
        "mrope_positions": np.stack([positions, positions // 2, positions % 3], axis=-1).astype(np.int64),
    }


@pytest.mark.parametrize("name", STEPS)
@settings(max_examples=40, deadline=None)
@given(data=batches())
def test_each_host_variant_equals_its_torch_compute(name, data):
    step = STEPS[name]()
    assert type(step).host is not Transform.host, f"{name} has no host variant"
    keys = [*step.in_keys, *(key for key in step.optional_keys if key in data)]
    arrays = {key: data[key] for key in keys}
    try:
        spec = step.compute({key: torch.from_numpy(value) for key, value in arrays.items()})
    except ValueError as error:  # refused (positions beyond the dtype): refused alike on the host
        with pytest.raises(ValueError, match=re.escape(str(error))):
            step.host(arrays)
        return
    host = step.host(arrays)
    assert sorted(host) == sorted(spec), name
    for key, want in spec.items():
        got = torch.from_numpy(np.array(host[key]))  # a copy: 0-d stays 0-d
        assert got.dtype == want.dtype, (name, key, got.dtype, want.dtype)
        assert got.shape == want.shape, (name, key, got.shape, want.shape)
        assert torch.equal(got, want), (name, key)


@pytest.mark.parametrize("flatten", [False, True])
def test_too_few_static_boundaries_are_refused_on_the_host_as_by_the_kernel(flatten):
    """4 segments need 5 boundaries: with 4 the host dropped the last document; both paths refuse now."""
    positions = np.array([[0, 1, 0, 1, 2, 3, 4, 0, 0, 1, 2, 3]])
    fits = CuSeqlens(flatten=flatten, num_boundaries=5)
    host = fits.host({"positions": positions})
    want = fits.compute({"positions": torch.from_numpy(positions)})
    assert np.asarray(host["cu_seqlens"]).reshape(-1).tolist() == [0, 2, 7, 8, 12]
    assert torch.equal(torch.from_numpy(np.asarray(host["cu_seqlens"])), want["cu_seqlens"])
    for count in (4, 3, 2):
        short = CuSeqlens(flatten=flatten, num_boundaries=count)
        with pytest.raises(
            ValueError, match=rf"cu_seqlens: .* 4 segments, more than num_boundaries - 1 = {count - 1}"
        ):
            short.host({"positions": positions})
        with pytest.raises(RuntimeError, match=r"cu_seqlens: .* more segments than num_boundaries - 1"):
            short.compute({"positions": torch.from_numpy(positions)})
