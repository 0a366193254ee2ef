"""Edge cases of the packers, the balanced stream and the loss helpers, each a hand-worked regression.

- The packers read Hugging Face's ``position_ids`` as the Collator does: a document's positions (a 0
  starts a segment) where it has no ``positions``; both, differing, are refused; never packed as data.
- Padding-free ``pad_to_multiple_of`` padding is refused by the helpers that return sequences whatever
  ``label_pad_token_id`` is (exact with ``return_sequence_map=True``).
- A balanced stream never yields an empty step, nor an empty micro-batch (extra slots too few documents
  fill wait a window instead); every document is trained or dropped as documented.
- The loss helpers' arguments (``global_count``, ``normalizer``, ``padding_value``, complex logits),
  ``plan_balance``'s lengths, ``CostModel.fit``'s measurements and ``ColumnarDataset``'s indices are
  accepted when valid and refused, naming the function, the argument and the fix, when not.
"""

from __future__ import annotations

import io
import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from zephon_collate import (
    BalanceOptions,
    Collator,
    ColumnarDataset,
    CostModel,
    PackedStream,
    SampleMeta,
    SampleRecord,
    aggregate_loss,
    pack_columns,
    pack_flat,
    sequence_logprobs,
    token_logprobs,
    unpack,
)
from zephon_collate.losses import global_loss_count
from zephon_collate.packing.rows import row_segments
from zephon_collate.parallel.balance import plan_balance
from zephon_collate.parallel.sampler import BalancedBatchSampler
from zephon_collate.parallel.schedule import BalanceSchedule

ONE_ONE = CostModel(linear=1, quadratic=1)


def records(*payloads):
    return [SampleRecord(SampleMeta((0, 0, i), 0, 0, i), payload) for i, payload in enumerate(payloads)]


def saved(state):
    """The state after a round trip through torch.save/torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def as_lists(payload):
    return {name: values.tolist() for name, values in payload.items()}


# --- the packers read position_ids as positions ---------------------------------------------------

TWO_DOCUMENTS = {"input_ids": [1, 5, 2, 1, 6, 2], "position_ids": [0, 1, 2, 0, 1, 2]}  # HF: 2 documents
SHORT = {"input_ids": [7, 8], "position_ids": [0, 1]}


def test_pack_flat_reads_position_ids_as_the_documents_positions():
    """position_ids were packed as data, and the written positions merged the record's two documents
    (labels crossed from 2 to 1); now they are its segments, as the Collator reads them."""
    given = records(dict(TWO_DOCUMENTS), dict(SHORT))
    (row,) = pack_flat(given, 8, pad_token_id=0)
    assert as_lists(row.payload) == {
        "input_ids": [1, 5, 2, 1, 6, 2, 7, 8],
        "positions": [0, 1, 2, 0, 1, 2, 0, 1],
    }
    assert [(s.sample_id, s.start, s.length) for s in row_segments(row)] == [
        ((0, 0, 0), 0, 3),
        ((0, 0, 0), 3, 3),
        ((0, 0, 1), 6, 2),
    ]
    out = Collator(return_labels=True, return_cu_seqlens=True)([row])
    assert out["labels"].tolist() == [[5, 2, -100, 6, 2, -100, 8]]
    assert out["cu_seqlens"].tolist() == [[0, 3, 6, 7]]
    streamed = list(PackedStream(given, 8, pad_token_id=0))  # the streaming packer reads them alike
    assert [as_lists(r.payload) for r in streamed] == [as_lists(row.payload)]
    assert given[0].payload == TWO_DOCUMENTS and given[1].payload == SHORT  # inputs untouched


def test_pack_columns_reads_position_ids_as_positions():
    """One document per row: read as its positions (one segment), not packed as data. Several: refused,
    as a 'positions' column is (columns carry no segments into the packer)."""
    offsets = np.array([0, 3, 5])
    ids = (np.array([5, 6, 7, 8, 9]), offsets)
    packed = pack_columns(
        {"input_ids": ids, "position_ids": (np.array([0, 1, 2, 0, 1]), offsets)}, 6, pad_token_id=0
    )
    assert as_lists(packed.fields) == {"input_ids": [[5, 6, 7, 8, 9, 0]], "positions": [[0, 1, 2, 0, 1, 0]]}
    merged = {
        "input_ids": (np.array([1, 5, 2, 1, 6, 2]), np.array([0, 6])),
        "position_ids": (np.array([0, 1, 2, 0, 1, 2]), np.array([0, 6])),
    }
    message = (
        r"example 0: field 'position_ids' does not count 0, 1, \.\.\..*fields=\(\.\.\., 'position_ids'\)"
    )
    with pytest.raises(ValueError, match=message):
        pack_columns(merged, 8, pad_token_id=0)
    with pytest.raises(ValueError, match=message):
        pack_flat(merged, 8, pad_token_id=0)


def test_positions_and_position_ids_that_differ_are_refused():
    both = {
        "input_ids": [1, 5, 2, 1, 6, 2],
        "positions": [0, 1, 2, 3, 4, 5],
        "position_ids": [0, 1, 2, 0, 1, 2],
    }
    message = r"both 'positions' and 'position_ids' \(Hugging Face's spelling\), and they differ.*keep one"
    with pytest.raises(ValueError, match=r"record 0 \(sample_id \(0, 0, 0\)\): payload has " + message):
        pack_flat(records(both), 8, pad_token_id=0)
    columns = {name: (np.array(values), np.array([0, 6])) for name, values in both.items()}
    with pytest.raises(ValueError, match=r"example 0: payload has " + message):
        pack_columns(columns, 8, pad_token_id=0)
    same = {**both, "positions": both["position_ids"]}  # equal: one spelling of the same documents
    (row,) = pack_flat(records(same), 8, pad_token_id=0)
    assert as_lists(row.payload) == {
        "input_ids": [1, 5, 2, 1, 6, 2, 0, 0],
        "positions": [0, 1, 2, 0, 1, 2, 0, 1],
    }


def test_position_ids_are_data_only_when_listed_without_emit_positions():
    given = records(dict(TWO_DOCUMENTS))
    with pytest.raises(
        ValueError,
        match=r"pack_flat: fields may not list 'position_ids', which the packer "
        r"reads as the documents' positions; pass emit_positions=False",
    ):
        pack_flat(given, 8, pad_token_id=0, fields=("position_ids",))
    (row,) = pack_flat(given, 8, pad_token_id=0, fields=("position_ids",), emit_positions=False)
    assert as_lists(row.payload) == {
        "input_ids": [1, 5, 2, 1, 6, 2, 0, 0],
        "position_ids": [0, 1, 2, 0, 1, 2, 0, 0],
    }
    (row,) = pack_flat(given, 8, pad_token_id=0, emit_positions=False)
    assert as_lists(row.payload) == {"input_ids": [1, 5, 2, 1, 6, 2, 0, 0]}
    with pytest.raises(ValueError, match=r"pack_flat: float field 'position_ids' collides with a field"):
        pack_flat(given, 8, pad_token_id=0, float_fields=["position_ids"])


# --- padding-free padding, whatever label_pad_token_id ----------------------------------------------

AMBIGUOUS = r"cannot tell padding from one-token sequences.*return_sequence_map=True"
EXAMPLES = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9]}]


@pytest.mark.parametrize("label_pad", [-100, -1, 3])
def test_pad_to_multiple_of_padding_is_refused_whatever_its_label(label_pad):
    """With label_pad_token_id -1 the three padding tokens came back as three more sequences."""
    options = {
        "padding_free": True,
        "pad_to_multiple_of": 8,
        "pad_token_id": 0,
        "label_pad_token_id": label_pad,
    }
    batch = Collator.for_transformers(**options)(EXAMPLES)
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, label_pad, label_pad, label_pad]]
    for call in (
        lambda: sequence_logprobs(torch.zeros(1, 8, 10), batch),
        lambda: unpack(batch["input_ids"], batch),
    ):
        with pytest.raises(ValueError, match=r"ends with 3 one-token sequence\(s\).*" + AMBIGUOUS):
            call()
    mapped = Collator.for_transformers(**options, return_sequence_map=True)(EXAMPLES)
    assert [row.tolist() for row in unpack(mapped["input_ids"], mapped)] == [[5, 6, 7], [8, 9]]
    out = sequence_logprobs(torch.zeros(1, 8, 10), mapped)  # uniform: log(1/10) per supervised token
    assert out.counts.tolist() == [2, 1]
    assert out.sums.tolist() == pytest.approx([2 * math.log(0.1), math.log(0.1)])


def test_a_labelled_one_token_example_no_longer_hides_the_padding_after_it():
    """boundary_safe_labels=False labels a one-token example with its token, and label_pad_token_id equal to
    the pad id labels padding with its own id: no label tells a row's closing one-token sequences from
    padding, so the sequences are refused without a map, and read exactly with one."""
    examples = [{"input_ids": [5, 6, 7]}, {"input_ids": [8]}]
    for options in ({"boundary_safe_labels": False}, {"label_pad_token_id": 0}):
        padded = Collator.for_transformers(padding_free=True, pad_token_id=0, pad_to_multiple_of=8, **options)
        batch = padded(examples)
        with pytest.raises(ValueError, match=r"ends with \d one-token sequence\(s\).*" + AMBIGUOUS):
            unpack(batch["input_ids"], batch)
        with pytest.raises(ValueError, match=AMBIGUOUS):
            global_loss_count(batch, mode="seq-mean-token-sum", empty="count")
        mapped = Collator.for_transformers(
            padding_free=True, pad_token_id=0, pad_to_multiple_of=8, return_sequence_map=True, **options
        )(examples)
        assert [row.tolist() for row in unpack(mapped["input_ids"], mapped)] == [[5, 6, 7], [8]]
        assert global_loss_count(mapped, mode="seq-mean-token-sum", empty="count") == 2


# --- balanced streams: no empty step, no empty micro-batch ---------------------------------------------


def stream_steps(stream):
    return [[[row.payload["input_ids"].tolist() for row in micro] for micro in step] for step in stream]


def balanced(docs, seq_len, options, rank):
    return PackedStream(
        docs, seq_len, pad_token_id=0, rank=rank, world_size=2, balance=options, overflow="split"
    )


def test_fixed_rows_never_yield_an_empty_step():
    """The epoch's tail (document 105 alone, for two ranks) was dropped and still yielded as a step of
    zero micro-batches on every rank; now the stream ends after the last step that has some."""
    docs = records(*({"input_ids": [100 + i] * n} for i, n in enumerate([14, 11, 5, 17, 9, 8])))
    options = BalanceOptions(cost=ONE_ONE, micro_batches=1, rows=1, seq_len=16)
    want = [
        [[[[103] * 16]], [[[100] * 14 + [103, 0]]]],
        [[[[101] * 11 + [102] * 5]], [[[104] * 9 + [0] * 7]]],
    ]
    for rank in range(2):
        expected = stream_steps(balanced(docs, 16, options, rank))
        assert expected == want[rank]
        for stop in range(len(expected) + 1):  # a resume after any step gives the rest, and no empty step
            stream = balanced(docs, 16, options, rank)
            steps = iter(stream)
            seen = stream_steps(next(steps) for _ in range(stop))
            resumed = balanced(docs, 16, options, rank)
            resumed.load_state_dict(saved(stream.state_dict()))
            assert seen + stream_steps(resumed) == expected, f"rank {rank}, resumed after {stop} steps"


def test_padding_free_never_builds_an_empty_micro_batch():
    """Window 3 held three pieces (1, 4, 4 tokens) that may not wait; an extra slot for the 1 gave rank 1
    an empty micro-batch, built as a row of nothing (NumPy's 'need at least one array to concatenate').
    Now the 1 waits: the epoch's last window holds it alone, for two ranks, and drops it, as documented."""
    docs = records(*({"input_ids": [100 + i] * n} for i, n in enumerate([2, 3, 7, 1, 8])))
    options = BalanceOptions(cost=ONE_ONE, micro_batches=1, max_tokens=4)
    got = [stream_steps(balanced(docs, 4, options, rank)) for rank in range(2)]
    assert got == [
        [[[[102] * 4]], [[[100] * 2]], [[[104] * 4]]],
        [[[[101] * 3]], [[[102] * 3]], [[[104] * 4]]],
    ]
    schedule = BalanceSchedule(options, ranks=2)  # the same windows, planned by hand
    assert schedule.plan([0, 1, 2, 3], [2, 3, 4, 3]).cells == (((2,), (1,)),)  # 0 and 3 wait
    assert schedule.plan([4, 5, 6], [1, 4, 4]).cells == (((0,), (3,)),)  # 4, 5, 6 wait
    third = schedule.plan([], [])
    assert third.cells == (((5,), (6,)),) and third.held == (4,) and third.extra_slots == 0
    last = schedule.plan([], [], final=True)
    assert last.cells == () and last.dropped == (4,) and schedule.dropped == 1


# --- loss-helper arguments ---------------------------------------------------------------------------


@pytest.fixture(name="batch")
def rollout_batch():
    """Supervised: tokens 2, 3 of the first rollout and 3 of the second (3 tokens, 2 sequences)."""
    return Collator.for_rollouts(padding_free=True)(
        [
            {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]},
            {"input_ids": [1, 3], "completion_mask": [0, 1]},
        ]
    )


def test_global_count_is_an_int_or_a_0d_integer_tensor(batch):
    loss = torch.ones(1, 5)
    for count in (4, np.int64(4), torch.tensor(4)):
        assert float(aggregate_loss(loss, batch, global_count=count)) == 0.75  # 3 supervised tokens / 4
    refused = [
        ("3", TypeError, r"aggregate_loss: global_count must be an int >= 0, got '3' \(str\)"),
        (-1, ValueError, r"aggregate_loss: global_count must be an int >= 0, got -1"),
        (
            torch.tensor(-1),
            ValueError,
            r"aggregate_loss: global_count must be >= 0, got -1; pass global_loss_count",
        ),
        (
            torch.tensor([1, 2]),
            TypeError,
            r"global_count must be an int >= 0 or a 0-d integer tensor, got a tensor "
            r"of shape \(2,\)",
        ),
        (torch.tensor(4.0), TypeError, r"global_count .* dtype torch.float32; pass global_loss_count"),
    ]
    for count, error, match in refused:
        with pytest.raises(error, match=match):
            aggregate_loss(loss, batch, global_count=count)


def test_normalizer_is_a_finite_positive_number(batch):
    loss = torch.ones(1, 5)
    norm = "seq-mean-token-sum-norm"
    for normalizer in (2.0, np.float32(2.0), np.int64(2)):
        assert float(aggregate_loss(loss, batch, mode=norm, normalizer=normalizer)) == 0.75  # 3 / 2 seqs / 2
    for normalizer in (float("inf"), float("nan"), 0.0, -2.0, "2", True):
        with pytest.raises(
            ValueError,
            match=r"aggregate_loss: mode 'seq-mean-token-sum-norm' needs normalizer=, "
            r"a finite constant > 0",
        ):
            aggregate_loss(loss, batch, mode=norm, normalizer=normalizer)


def test_unpack_padding_value_must_fit_the_dtype(batch):
    tensor = torch.tensor([[1, 2, 3, 4, 5]], dtype=torch.int8)
    assert unpack(tensor, batch, padded=True, padding_value=-1).tolist() == [[1, 2, 3], [4, 5, -1]]
    assert unpack(tensor.float(), batch, padded=True, padding_value=np.float32(0.5)).tolist() == [
        [1.0, 2.0, 3.0],
        [4.0, 5.0, 0.5],
    ]
    for value, dtype in (
        (1000, torch.int8),
        (-1, torch.uint8),
        (0.5, torch.int64),
        (2, torch.bool),
        (1e6, torch.float16),
    ):
        with pytest.raises(
            ValueError, match=rf"unpack: padding_value {value} does not fit the tensor's dtype {dtype}"
        ):
            unpack(tensor.to(dtype), batch, padded=True, padding_value=value)
    with pytest.raises(TypeError, match=r"unpack: padding_value must be a real number, got 'x'"):
        unpack(tensor, batch, padded=True, padding_value="x")


def test_complex_logits_are_refused(batch):
    logits = torch.zeros(1, 5, 5, dtype=torch.complex64)
    for call, owner in ((token_logprobs, "token_logprobs"), (sequence_logprobs, "sequence_logprobs")):
        with pytest.raises(
            TypeError, match=rf"{owner}: logits hold torch.complex64; give the model's real-valued"
        ):
            call(logits, batch)


# --- plan_balance lengths, CostModel.fit, ColumnarDataset indices -----------------------------------------


def test_lengths_beyond_int64_are_named_as_given():
    lengths = np.array([2**63 + 5, 3], dtype=np.uint64)
    options = BalanceOptions(cost=ONE_ONE, micro_batches=1, max_tokens=2**62)
    with pytest.raises(
        ValueError,
        match=r"plan_balance: lengths\[0\] is 9223372036854775813; every entry must be "
        r"an int from 1 to 2\*\*63 - 1",
    ):
        plan_balance(lengths, options, ranks=1)
    with pytest.raises(ValueError, match=r"BalancedBatchSampler: lengths\[0\] is 9223372036854775813"):
        BalancedBatchSampler(lengths, options, num_replicas=1, rank=0)


def test_cost_model_fit_names_the_bad_measurement():
    with pytest.raises(
        ValueError,
        match=r"CostModel.fit: seconds\[1\] is nan; every measurement must be a finite "
        r"number: drop the failed measurement",
    ):
        CostModel.fit([1, 2, 3], [1, 4, 9], [1.0, float("nan"), 9.0])
    with pytest.raises(ValueError, match=r"CostModel.fit: tokens\[2\] is inf"):
        CostModel.fit([1, 2, float("inf")], [1, 4, 9], [1.0, 4.0, 9.0])
    with pytest.raises(
        TypeError, match=r"CostModel.fit: seconds must be a sequence of numbers .*\['a', 'b', 'c'\]"
    ):
        CostModel.fit([1, 2, 3], [1, 4, 9], ["a", "b", "c"])


def test_columnar_dataset_refuses_a_non_integer_index():
    dataset = ColumnarDataset(pa.table({"input_ids": [[1, 2], [3, 4, 5], [6]]}))
    values, offsets = dataset.__getitems__([np.int64(1), -1])[0]["input_ids"]
    assert values.tolist() == [3, 4, 5, 6] and offsets.tolist() == [0, 3, 4]
    for indices in ([1.7], [True], np.array([1.0])):
        with pytest.raises(TypeError, match=r"ColumnarDataset: indices must be ints \(row numbers"):
            dataset.__getitems__(indices)
    with pytest.raises(TypeError, match=r"ColumnarDataset: indices must be ints"):
        dataset[1.7]
    with pytest.raises(
        IndexError, match=r"ColumnarDataset: index 18446744073709551615 is out of range for 3 rows"
    ):
        dataset.__getitems__(np.array([2**64 - 1], dtype=np.uint64))  # read as row -1 before


def test_a_per_example_labels_column_of_any_type_is_named_by_the_packer() -> None:
    """Class names (strings), dictionary-encoded or null labels: one value per document, from the
    schema alone, named as such."""
    tokens = pa.array([[1, 2, 3], [4, 5], [6, 7, 8]])
    for labels in (
        pa.array(["pos", "neg", "pos"]),
        pa.array(["a", "b", "a"]).dictionary_encode(),
        pa.array([None, None, None], pa.int64()),
    ):
        table = pa.table({"input_ids": tokens, "labels": labels})
        with pytest.raises(ValueError, match="example 0: field 'labels' holds one value per document"):
            pack_columns(table, 5, pad_token_id=0)


def test_unpack_refuses_an_integer_past_every_float() -> None:
    batch = Collator.for_rollouts(padding_free=True)([{"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]}])
    for dtype in (torch.int64, torch.float32):
        with pytest.raises(ValueError, match=r"padding_value .* does not fit the tensor's dtype"):
            unpack(torch.ones(1, 3, dtype=dtype), batch, padded=True, padding_value=10**400)
