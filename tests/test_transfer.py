"""A StackedBatch pickles (as a DataLoader worker sends it) into one compact buffer, exactly."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import torch
from helpers import FULL_OPTIONS, PackedRecords
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from zephon_collate import Collator
from zephon_collate.collate import transfer
from zephon_collate.collate.transfer import StackedBatch, WireOutputs, pack, unpack

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float32]


def round_trip(batch: Any) -> Any:
    """Pickle and load, as a worker sends it; a StackedBatch widened, as the main process's finish uses it."""
    arrived = pickle.loads(pickle.dumps(batch))
    return arrived.widened() if isinstance(arrived, StackedBatch) else arrived


def assert_same_td(got: TensorDict, want: TensorDict) -> None:
    assert got.batch_size == want.batch_size and set(got.keys()) == set(want.keys())
    for key in want.keys():  # noqa: SIM118 - iterating a TensorDict walks its rows, not its keys
        assert got[key].dtype == want[key].dtype, key
        assert got[key].shape == want[key].shape, key
        assert torch.equal(got[key], want[key]), key
        if want[key].is_floating_point():  # bit for bit: -0.0 stays -0.0
            assert torch.equal(got[key].signbit(), want[key].signbit()), key


@st.composite
def tensordicts(draw: st.DrawFn) -> TensorDict:
    rows, length = draw(st.integers(0, 3)), draw(st.integers(0, 6))
    data = {}
    for index in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(DTYPES))
        if dtype == torch.bool:
            values = draw(st.lists(st.booleans(), min_size=rows * length, max_size=rows * length))
        elif dtype.is_floating_point:  # general floats, or a 0/1 mask (which travels as uint8)
            items = draw(st.sampled_from([st.floats(-1e6, 1e6, width=32), st.sampled_from([0.0, 1.0, -0.0])]))
            values = draw(st.lists(items, min_size=rows * length, max_size=rows * length))
        else:
            info = torch.iinfo(dtype)
            low = draw(st.sampled_from([info.min, -70_000, -129, -1, 0]))
            high = draw(st.sampled_from([0, 1, 255, 256, 32_767, 70_000, info.max]))
            low, high = max(low, info.min), min(high, info.max)
            values = draw(
                st.lists(st.integers(low, max(low, high)), min_size=rows * length, max_size=rows * length)
            )
        data[f"field{index}"] = torch.tensor(values, dtype=dtype).reshape(rows, length)
    return TensorDict(data, batch_size=[rows], device="cpu")


@settings(max_examples=200, deadline=None)
@given(tensordicts())
def test_round_trip_is_exact(td: TensorDict) -> None:
    buffer, fields = pack(td)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    assert_same_td(unpack(buffer, fields, td.batch_size), td)
    batch = StackedBatch(td, {"ids": [], "texts": []})
    assert_same_td(round_trip(batch).td, td)


def test_fields_travel_narrow() -> None:
    """Hand-worked: ids up to 32,000 go as int16, positions below 256 as uint8, a 0/1 mask as uint8."""
    td = TensorDict(
        input_ids=torch.tensor([[1, 32_000, 2]]),
        positions=torch.tensor([[0, 1, 255]]),
        loss_mask=torch.tensor([[0, 1, 1]]),
        big=torch.tensor([[0, 2**40, 1]]),
        batch_size=[1],
    )
    buffer, fields = pack(td)
    wire = {field.key: field.wire for field in fields}
    assert wire == {"input_ids": "int16", "positions": "uint8", "loss_mask": "uint8", "big": "int64"}
    assert buffer.numel() == 8 + 8 + 8 + 24  # 6, 3, 3 and 24 bytes, each rounded up to 8
    assert [field.offset % 8 for field in fields] == [0, 0, 0, 0]
    assert_same_td(unpack(buffer, fields, td.batch_size), td)


def test_float_masks_travel_as_bytes() -> None:
    """Hand-worked: a float field of 0.0 and 1.0 only goes as uint8; 0.5 or -0.0 keep it float32."""
    td = TensorDict(
        mask=torch.tensor([[0.0, 1.0, 1.0]]),
        half=torch.tensor([[0.0, 0.5, 1.0]]),
        signed=torch.tensor([[-0.0, 1.0, 0.0]]),
        batch_size=[1],
    )
    buffer, fields = pack(td)
    assert {field.key: field.wire for field in fields} == {
        "mask": "uint8",
        "half": "float32",
        "signed": "float32",
    }
    arrived = unpack(buffer, fields, td.batch_size)
    assert_same_td(arrived, td)
    assert arrived["mask"].dtype == torch.float32 and arrived["mask"].tolist() == [[0.0, 1.0, 1.0]]


def test_collator_batch_round_trip() -> None:
    collator = Collator(**FULL_OPTIONS)
    samples = [PackedRecords()[index] for index in range(4)]
    stacked = collator.stack(samples)
    arrived = round_trip(stacked)
    assert_same_td(arrived.td, stacked.td)
    assert arrived.per_record == stacked.per_record and arrived.metas == stacked.metas
    direct, sent = collator.finish(stacked), collator.finish(arrived)
    assert direct.keys() == sent.keys()
    for key, value in direct.items():
        if isinstance(value, torch.Tensor):
            assert sent[key].dtype == value.dtype and torch.equal(sent[key], value), key
        else:
            assert sent[key] == value, key


def test_smaller_on_the_wire() -> None:
    collator = Collator(**FULL_OPTIONS)
    stacked = collator.stack([PackedRecords(length=512)[index] for index in range(4)])
    tensor_bytes = sum(v.numel() * v.element_size() for v in stacked.td.values())
    buffer, _ = pack(stacked.td)
    assert buffer.numel() < tensor_bytes / 4  # int64 ids, positions, mask: 24 bytes a token, here 4


@pytest.mark.parametrize("limit", [0, transfer.PIPE_LIMIT])
def test_small_buffers_travel_inline_large_ones_as_tensors(
    monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    """Up to PIPE_LIMIT bytes the pickle carries bytes (no shared memory), above it a tensor; both exact."""
    monkeypatch.setattr(transfer, "PIPE_LIMIT", limit)
    collator = Collator(**FULL_OPTIONS)
    samples = [PackedRecords()[index] for index in range(4)]
    stacked, out = collator.stack(samples), collator(samples)
    carried = type(stacked.__reduce__()[1][0]), type(WireOutputs(out).__reduce__()[1][0])
    assert carried == ((torch.Tensor, torch.Tensor) if limit == 0 else (bytes, bytes))
    assert_same_td(round_trip(stacked).td, stacked.td)
    arrived = round_trip(WireOutputs(out))
    for key, value in out.items():
        assert torch.equal(arrived[key], value) if isinstance(value, torch.Tensor) else arrived[key] == value
    empty = TensorDict(x=torch.zeros(0, 3, dtype=torch.int64), batch_size=[0], device="cpu")
    assert_same_td(round_trip(StackedBatch(empty, {"ids": [], "texts": []})).td, empty)


def test_empty_and_unpackable_batches_pickle_as_they_are() -> None:
    empty = StackedBatch(None, {"ids": [], "texts": []})
    assert round_trip(empty).td is None
    bfloat = TensorDict(x=torch.ones(2, 3, dtype=torch.bfloat16), batch_size=[2], device="cpu")
    assert_same_td(round_trip(StackedBatch(bfloat, {"ids": [], "texts": []})).td, bfloat)


def test_the_sender_keeps_its_tensors() -> None:
    td = TensorDict(input_ids=torch.arange(6).reshape(2, 3), batch_size=[2], device="cpu")
    version = td["input_ids"]._version
    buffer, fields = pack(td)
    unpack(buffer, fields, td.batch_size)["input_ids"].zero_()
    assert td["input_ids"]._version == version and td["input_ids"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert np.shares_memory(buffer.numpy(), td["input_ids"].numpy()) is False


def test_outputs_leave_a_worker_as_one_buffer_and_arrive_as_a_plain_dict() -> None:
    collator = Collator(**FULL_OPTIONS, flatten=True)
    out = collator([PackedRecords()[index] for index in range(4)])
    assert type(out) is dict  # outside a worker: the plain dict to_training returns
    wired = WireOutputs(out)
    buffer, _ = pack({key: value for key, value in out.items() if isinstance(value, torch.Tensor)})
    assert buffer.numel() < sum(
        v.numel() * v.element_size() for v in out.values() if isinstance(v, torch.Tensor)
    )
    arrived = round_trip(wired)
    assert type(arrived) is dict and list(arrived) == list(out)
    for key, value in out.items():
        if isinstance(value, torch.Tensor):
            assert arrived[key].dtype == value.dtype and torch.equal(arrived[key], value), key
        else:
            assert arrived[key] == value, key


def test_list_outputs_pickle_as_they_are() -> None:
    out = Collator(return_labels=True, dtype=None)([{"input_ids": [1, 5, 2]}, {"input_ids": [1, 6, 7, 2]}])
    assert round_trip(WireOutputs(out)) == out


def test_stacked_batch_arrives_narrow_and_widens_exactly() -> None:
    """Hand-worked: token ids below 32,768 arrive as int16 (2 bytes a token for the device copy), and
    travel again as they are; finish gives what the unpickled-free path gives."""
    collator = Collator(return_labels=True, return_num_valid_tokens=True)
    samples = [
        {"input_ids": [1, 30_000, 2], "loss_mask": [0, 1, 1]},
        {"input_ids": [1, 7, 2], "loss_mask": [1] * 3},
    ]
    stacked = collator.stack(samples)
    arrived = pickle.loads(pickle.dumps(stacked))
    assert (
        arrived.td["input_ids"].dtype == torch.int16 and arrived.td["loss_mask"].dtype == torch.bool
    )  # a byte
    assert arrived.dtypes["input_ids"] == torch.int64
    again = pickle.loads(pickle.dumps(arrived))
    assert again.dtypes == arrived.dtypes and torch.equal(again.td["input_ids"], arrived.td["input_ids"])
    got, want = collator.finish(again), collator(samples)
    assert got["labels"].dtype == torch.int64 and got["labels"].tolist() == [[30_000, 2], [7, 2]]
    assert got["num_valid_tokens"] == want["num_valid_tokens"] == 4
    assert got["input_ids"].tolist() == want["input_ids"].tolist()
