"""The host path equals the torch chain, whole collators over the whole option space.

On plain CPU data a plan runs each step's NumPy variant (``Transform.host``);
the torch transforms are the specification (they are what runs on a GPU and
under ``torch.compile``). Each case stacks a random batch once, runs its plan
twice, on the host and with ``use_host_pass(False)``, and compares every
output: keys, dtypes, shapes and values. Batches cover every integer payload
and output dtype and rows up to 10,000 tokens. ``tests/test_host_steps.py``
checks each step alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_collate import Collator, SampleMeta, SampleRecord, use_host_pass
from zephon_collate.layouts.plan import host_applies

CASES = settings(max_examples=120, deadline=None)
PAYLOAD_DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.int64]
OUTPUT_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64]


def assert_same(host: dict, spec: dict) -> None:
    assert list(host) == list(spec) or sorted(host) == sorted(spec), (sorted(host), sorted(spec))
    for key, value in spec.items():
        got = host[key]
        got = torch.from_numpy(got) if isinstance(got, np.ndarray) else got
        assert got.dtype == value.dtype, (key, got.dtype, value.dtype)
        assert got.shape == value.shape, (key, got.shape, value.shape)
        assert torch.equal(got, value), key


def both_ways(plan, data: dict) -> tuple[dict, dict]:
    assert host_applies(data)
    host = plan.run(data)
    with use_host_pass(False):
        assert not host_applies(data)
        spec = plan.run(data)
    return host, spec


@st.composite
def packed(draw: st.DrawFn) -> tuple[list[SampleRecord], np.dtype, int]:
    """1-4 records of one length (up to 10,000), restarting positions, a 0/1 mask, trailing padding."""
    rows = draw(st.integers(1, 4))
    length = draw(st.sampled_from([1, 2, 3, 17, 128, 1000, 10_000]))
    dtype = np.dtype(draw(st.sampled_from(PAYLOAD_DTYPES)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    high = min(np.iinfo(dtype).max, 60)
    records = []
    for index in range(rows):
        tokens = rng.integers(0, high + 1, length).astype(dtype)
        starts = rng.random(length) < draw(st.sampled_from([0.0, 0.01, 0.3]))
        starts[::100] = True  # positions stay below 100: they fit every output dtype
        positions = (
            np.arange(length) - np.maximum.accumulate(np.where(starts, np.arange(length), 0))
        ).astype(dtype)
        mask = (rng.random(length) < 0.7).astype(dtype)
        padding = int(rng.integers(0, length + 1))
        payload = {"input_ids": tokens, "positions": positions, "loss_mask": mask}
        meta = SampleMeta((0, 0, index), 0, 0, tags={"_padding_length": padding})
        records.append(SampleRecord(meta, payload))
    return records, dtype, high


@st.composite
def native_options(draw: st.DrawFn, high: int) -> dict:
    labels = draw(st.booleans())
    options = {
        "return_labels": labels,
        "dtype": draw(st.sampled_from(OUTPUT_DTYPES)),
        "flatten": draw(st.booleans()),
        "return_cu_seqlens": draw(st.booleans()),
        "return_padding_mask": draw(st.booleans()),
        "position_mode": draw(st.sampled_from(["preserve", "sequence"])),
        "boundary_safe_labels": draw(st.booleans()),
    }
    if labels:
        options["return_loss_mask"] = draw(st.booleans())
        options["return_num_valid_tokens"] = draw(st.booleans())
        options["ignore_index"] = draw(st.sampled_from([-100, -1, 0, 7]))
        if draw(st.booleans()):
            options.update(eos_mask_loss=True, eos_token_id=draw(st.sampled_from([2, high, 300])))
    if options["return_cu_seqlens"] and draw(st.booleans()):
        options["num_boundaries"] = 20_000 * 4 + 2  # static shape, wide enough for any case here
    return options


@CASES
@given(st.data())
def test_native_host_pass_equals_the_torch_chain(data):
    records, _, high = data.draw(packed())
    options = data.draw(native_options(high))
    if options["dtype"] == torch.int8 and options.get("eos_token_id") == 300:
        options["eos_token_id"] = 2  # 300 does not fit int8 (refused before any payload is read)
    collator = Collator(**options)
    try:
        stacked = collator.stack(records)
    except ValueError as error:  # sequence positions beyond the dtype: refused before either pass runs
        assert options["position_mode"] == "sequence" and options["dtype"] in (torch.int8, torch.int16)
        assert "positions numbered" in str(error) and "do not fit dtype" in str(error)
        return
    data_ = dict(stacked.td.items())
    host, spec = both_ways(collator.plan(tuple(data_)), data_)
    assert_same(host, spec)


@st.composite
def hf_batches(draw: st.DrawFn) -> list[dict]:
    rows = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    longest = draw(st.sampled_from([1, 5, 64, 3000]))
    dtype = np.dtype(draw(st.sampled_from(PAYLOAD_DTYPES)))
    out = []
    for _ in range(rows):
        length = int(rng.integers(1, longest + 1))
        ids = rng.integers(1, min(np.iinfo(dtype).max, 60), length).astype(dtype)
        example = {"input_ids": ids, "loss_mask": (rng.random(length) < 0.7).astype(np.int64)}
        if draw(st.booleans()):
            example["labels"] = np.where(rng.random(length) < 0.8, ids.astype(np.int64), -100)
        out.append(example)
    if draw(st.booleans()):  # all carry labels or none
        for example in out:
            example.pop("labels", None)
    return out


@CASES
@given(
    hf_batches(),
    st.booleans(),
    st.sampled_from([None, 1, 8]),
    st.sampled_from([-100, 0]),
    st.booleans(),
    st.sampled_from(["right", "left"]),
    st.booleans(),
)
def test_transformers_host_pass_equals_the_torch_chain(
    examples, padding_free, multiple, label_pad, boundary_safe, side, kwargs
):
    options = {
        "padding_free": padding_free,
        "pad_token_id": 0,
        "pad_to_multiple_of": multiple,
        "label_pad_token_id": label_pad,
        "boundary_safe_labels": boundary_safe,
    }
    if padding_free:
        options.update(return_flash_attn_kwargs=kwargs, return_seq_idx=kwargs)
    else:
        options.update(padding_side=side, return_position_ids=kwargs)
    collator = Collator.for_transformers(**options)
    stacked = collator.stack(examples)
    data_ = dict(stacked.td.items())
    host, spec = both_ways(collator.plan(tuple(data_)), data_)
    assert_same(host, spec)


def test_the_switch_is_per_thread_and_restores():
    import threading

    seen = []
    with use_host_pass(False):
        worker = threading.Thread(target=lambda: seen.append(host_applies({"x": torch.zeros(1)})))
        worker.start()
        worker.join()
        assert not host_applies({"x": torch.zeros(1)})
    assert seen == [True] and host_applies({"x": torch.zeros(1)})


@pytest.mark.parametrize(
    "value",
    [
        torch.zeros(1, requires_grad=True),
        torch.zeros(1, dtype=torch.bfloat16),
        torch.nn.Parameter(torch.zeros(1)),
    ],
)
def test_the_torch_chain_runs_where_numpy_cannot(value):
    assert not host_applies({"x": value})


@st.composite
def varied(draw: st.DrawFn) -> tuple[list[SampleRecord], dict]:
    """What ``packed`` leaves out: ragged rows padded by the Collator (``pad_token_id``, a multiple),
    per-token and per-record extra fields, ``[S, K]`` token rows, bool and float loss masks, and a
    ``num_boundaries`` exactly as tight as the batch allows."""
    rows = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    wide = draw(st.booleans())  # [S, K] token rows (no padding mask then: it needs [B, S] tokens)
    mask_dtype = draw(st.sampled_from([np.int64, np.bool_, np.float32]))
    ragged = not wide and draw(st.booleans())
    base = draw(st.sampled_from([1, 3, 17, 300]))
    records, most = [], 1
    for index in range(rows):
        length = int(rng.integers(1, base + 1)) if ragged else base
        length = max(length, 2) if wide else length  # a [1, K] row reads as a batch of one row: refused
        tokens = rng.integers(
            1, 50, (length, 2) if wide else length
        )  # never the pad id 0: refused at a row end
        starts = rng.random(length) < 0.2
        starts[0] = True
        positions = np.arange(length) - np.maximum.accumulate(np.where(starts, np.arange(length), 0))
        most = max(most, int(starts.sum()))
        payload = {
            "input_ids": tokens,
            "positions": positions,
            "loss_mask": (rng.random(length) < 0.7).astype(mask_dtype),
            "t": rng.integers(0, 9, length),  # per token
            "w": rng.integers(0, 9, 1),  # per record
        }
        records.append(SampleRecord(SampleMeta((0, 0, index), 0, 0, index), payload))
    labels = draw(st.booleans())
    flatten = draw(st.booleans()) and not wide
    per_record = [] if labels or flatten else ["w"]  # labels and flattening need per-token fields
    options = {
        "return_labels": labels,
        "extra_fields": per_record if wide else ["t", *per_record],
        "return_cu_seqlens": not wide and draw(st.booleans()),
        "return_padding_mask": not wide and draw(st.booleans()),
        "flatten": flatten,
        "boundary_safe_labels": draw(st.booleans()),
    }
    if labels:
        options["return_loss_mask"] = draw(st.booleans())
        options["return_num_valid_tokens"] = draw(st.booleans())
    if ragged or draw(st.booleans()):
        options.update(
            pad_token_id=draw(st.sampled_from([0, 99])), pad_to_multiple_of=draw(st.sampled_from([None, 8]))
        )
    if options["return_cu_seqlens"] and draw(st.booleans()):
        options["num_boundaries"] = rows * (most + 2) if options["flatten"] else most + 2  # +2: padding
    return records, options


@CASES
@given(varied())
def test_native_host_pass_equals_the_torch_chain_on_varied_batches(case):
    records, options = case
    collator = Collator(**options)
    try:
        stacked = collator.stack(records)
    except ValueError as error:  # the one refusal these cases can meet: a too-tight static boundary count
        assert "num_boundaries" in str(error) or "segments" in str(error), error
        return
    data = dict(stacked.td.items())
    host, spec = both_ways(collator.plan(tuple(data)), data)
    assert_same(host, spec)
