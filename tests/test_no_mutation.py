"""Nothing lost, no interference: inputs survive every call, outputs own their memory, objects pickle,
and the collator serves several threads at once.

"Unchanged" is checked against a deep snapshot taken before the call: every
tensor's values and ``_version`` (which any in-place write bumps), every
array's values and writeable flag, every list, tuple, dict and tag.
"""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest
import torch
from helpers import EOS, FULL_OPTIONS, PackedRecords, as_lists, record
from test_invariants import assert_unchanged, snapshot

from zephon_collate import (
    Chain,
    Collator,
    FlatPacker,
    SampleBatch,
    SampleMeta,
    SampleRecord,
    pack_flat,
    to_training,
    use_host_pass,
)
from zephon_collate.collate.sample_batch import stack_batch
from zephon_collate.layouts.training import TrainingOptions
from zephon_collate.transforms import (
    CuSeqlens,
    EosMask,
    LossMask,
    PaddingMask,
    Positions,
    TokenShift,
    Transform,
)
from zephon_collate.types import ContributorRef

EVERYTHING = {**FULL_OPTIONS, "extra_fields": ["weights"]}
OPTION_SETS = [
    {},
    EVERYTHING,
    {**EVERYTHING, "flatten": True, "position_mode": "sequence"},
    {**EVERYTHING, "dtype": np.int64},
    {**EVERYTHING, "dtype": None},
    {**EVERYTHING, "dtype": torch.int32, "rename_fields": {"labels": "targets"}, "exclude_fields": ["texts"]},
]


def payloads(kind: str) -> list:
    """Three packed rows of 6 tokens (two documents, the last row with one pad) in one container kind."""
    rows = [[1, 10, 2, 1, 11, 2], [1, 12, 13, 14, 2, 0], [1, 15, 2, 1, 16, 2]]
    positions = [[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 0], [0, 1, 2, 0, 1, 2]]
    masks = [[1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 0], [1] * 6]

    def wrap(values):
        if kind == "numpy":
            return np.array(values)
        if kind == "torch":
            return torch.tensor(values)
        if kind == "strided":
            return torch.tensor(values).repeat_interleave(2)[::2]
        return list(values) if kind == "list" else tuple(values)

    return [
        {
            "input_ids": wrap(t),
            "positions": wrap(p),
            "loss_mask": wrap(m),
            "weights": wrap(m),
            "text": f"row {i}",
        }
        for i, (t, p, m) in enumerate(zip(rows, positions, masks, strict=True))
    ]


def records(kind: str) -> list[SampleRecord]:
    metas = [
        SampleMeta(
            (0, 0, i),
            0,
            0,
            tags={
                "_padding_length": pad,
                "_contributors": (ContributorRef(SampleMeta((0, 0, i), 0, 0).cursor),),
            },
        )
        for i, pad in enumerate([0, 1, 0])
    ]
    return [SampleRecord(meta, payload) for meta, payload in zip(metas, payloads(kind), strict=True)]


KINDS = ["list", "tuple", "numpy", "torch", "strided"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("options", OPTION_SETS, ids=range(len(OPTION_SETS)))
def test_successful_calls_change_nothing(kind, options):
    rows = records(kind)
    before = snapshot(rows)
    calls = [
        lambda: to_training(rows, **options),
        lambda: SampleBatch(rows).to_training(**options),
        lambda: Collator(**options)(rows),
        lambda: Collator(**options).finish(Collator(**options).stack(rows)),
        lambda: stack_batch(rows, extra_fields=["weights"]),
        lambda: pack_flat(rows, 5, pad_token_id=0, overflow="split"),
        lambda: list(
            FlatPacker(5, pad_token_id=0, strategy="best_fit", buffer_size=2, overflow="split").pack(rows)
        ),
    ]
    for fn in calls:
        fn()
        assert_unchanged(before, rows)


BAD = [
    ({"input_ids": [1, -1, 3, 4, 5, 6]}, ValueError),
    ({"input_ids": [1.5] * 6}, TypeError),
    ({"input_ids": [1, 2, 3]}, ValueError),
    (None, TypeError),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("bad", "error"), BAD)
def test_failed_calls_change_nothing(kind, bad, error):
    """A bad last record fails the call after the good ones were read (and partly converted): nothing changes."""
    rows = [*records(kind), record(bad, 3)]
    before = snapshot(rows)
    for fn in (
        lambda: to_training(rows, **EVERYTHING),
        lambda: Collator(**EVERYTHING)(rows),
        lambda: Collator(device="cpu", **EVERYTHING)(rows),
        lambda: pack_flat(rows, 5, pad_token_id=0),
    ):
        with pytest.raises((ValueError, TypeError)):
            fn()
        assert_unchanged(before, rows)


@pytest.mark.parametrize("kind", ["numpy", "torch", "list"])
@pytest.mark.parametrize(
    "options", [{}, EVERYTHING, {**EVERYTHING, "flatten": True}, {**EVERYTHING, "dtype": np.int64}]
)
def test_outputs_own_their_memory(kind, options):
    """Writing into every output changes no payload and no other output (one record: no shortcut views)."""
    for rows in (records(kind)[:1], records(kind)):
        before = snapshot(rows)
        out = to_training(rows, **options)
        reference = as_lists(to_training(rows, **options))
        for name, value in out.items():
            if isinstance(value, torch.Tensor) and value.numel():
                value[...] = True if value.dtype == torch.bool else 77
            elif isinstance(value, np.ndarray) and value.size:
                value[...] = True if value.dtype == np.bool_ else 77
            else:
                continue
            reference[name] = as_lists(value)
        assert_unchanged(before, rows)
        assert as_lists(out) == reference  # each write landed in its own output only


class _Copy(Transform):
    """A step of yours that returns its input: two outputs, one tensor."""

    in_keys, out_keys = ["labels"], ["targets"]

    def compute(self, data):
        return {"targets": data["labels"]}


@pytest.mark.parametrize("host", [True, False])
@pytest.mark.parametrize("dtype", [torch.long, np.int64])
def test_outputs_of_a_chain_of_yours_own_their_memory(host, dtype):
    """TokenShift cuts contiguous views from one row, a step may return its input: each output is copied."""
    with use_host_pass(host):
        for collate in (
            Collator(chain=[TokenShift()], dtype=dtype),
            Collator(return_labels=True, transforms=[_Copy()], dtype=dtype),
        ):
            out = collate([{"input_ids": [3, 4, 5, 6]}])
            reference = as_lists(out)
            for name in [name for name in out if name not in ("ids", "texts")]:
                out[name][0, 0] = -7
                reference[name][0][0] = -7
                assert as_lists(out) == reference  # the write landed in that output only


def test_transforms_and_chains_change_nothing():
    rows = records("torch")
    td = SampleBatch(rows).to_tensordict(extra_fields=["weights"])
    before = {key: (value.clone(), value._version) for key, value in td.items()}
    chain = Chain(*TrainingOptions(**EVERYTHING).chain(tuple(td.keys())), input_keys=tuple(td.keys()))
    for transform in (
        chain,
        TokenShift(),
        PaddingMask(),
        Positions("sequence"),
        Chain(
            TokenShift(input_keys=["positions", "weights"], label_keys=["loss_mask"]),
            EosMask(EOS),
            LossMask(),
        ),
    ):
        transform(td)
    for key, (value, version) in before.items():
        assert torch.equal(td.get(key), value) and td.get(key)._version == version, key


def test_flat_packer_keeps_views_without_writing():
    """The packer holds views of its input until a row is emitted; it never writes into them."""
    rows = records("numpy")
    before = snapshot(rows)
    packer = FlatPacker(7, pad_token_id=0, overflow="split")
    first = next(iter(packer.pack(rows)))
    first.payload["input_ids"][:] = 99  # writing into an emitted row does not reach the input
    state = packer.state_dict()
    state["pending"][0]["tokens"][:] = 98  # nor does writing into a saved state
    list(packer.pack([]))
    assert_unchanged(before, rows)


# --- pickling -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_records_and_batches_pickle(kind):
    rows = records(kind)
    assert pickle.loads(pickle.dumps(rows[0].meta)) == rows[0].meta
    assert pickle.loads(pickle.dumps(rows[0].meta.cursor)) == rows[0].meta.cursor
    clone_record = pickle.loads(pickle.dumps(rows[1]))
    assert clone_record.meta == rows[1].meta and as_lists(clone_record.payload) == as_lists(rows[1].payload)
    clone = pickle.loads(pickle.dumps(SampleBatch(rows)))
    assert as_lists(clone.to_training(**EVERYTHING)) == as_lists(SampleBatch(rows).to_training(**EVERYTHING))
    assert clone.records[1].meta == rows[1].meta and clone.ids == SampleBatch(rows).ids


def test_collator_stacked_batches_transforms_and_packer_pickle():
    rows = records("torch")
    for options in ({**EVERYTHING, "device": "cpu", "num_boundaries": 4}, {**EVERYTHING, "dtype": None}):
        collator = Collator(**options)
        first = as_lists(collator(rows))
        clone = pickle.loads(pickle.dumps(collator))
        assert as_lists(clone(rows)) == first and as_lists(collator(rows)) == first
    collator = Collator(**EVERYTHING)
    stacked = pickle.loads(pickle.dumps(collator.stack(rows)))
    assert as_lists(collator.finish(stacked)) == as_lists(collator(rows))
    options = TrainingOptions(**EVERYTHING)
    assert pickle.loads(pickle.dumps(options)) == options
    for transform in (
        TokenShift(input_keys=["positions"]),
        CuSeqlens(flatten=True),
        Chain(TokenShift(input_keys=["positions"], label_keys=["loss_mask"]), EosMask(EOS), LossMask()),
    ):
        td = SampleBatch(rows).to_tensordict()
        clone = pickle.loads(pickle.dumps(transform))
        assert as_lists(dict(clone(td).items())) == as_lists(dict(transform(td).items()))
    packer = FlatPacker(5, pad_token_id=0, overflow="split")
    next(iter(packer.pack(rows)))
    restored = FlatPacker(5, pad_token_id=0, overflow="split")
    restored.load_state_dict(pickle.loads(pickle.dumps(packer.state_dict())))
    assert restored.records_consumed == packer.records_consumed


# --- threads --------------------------------------------------------------------------------------


THREADED = {key: value for key, value in EVERYTHING.items() if key != "extra_fields"}


@pytest.mark.parametrize(
    "options", [THREADED, {**THREADED, "device": "cpu"}, {**THREADED, "device": "cpu", "num_boundaries": 6}]
)
def test_collator_serves_threads_with_good_and_bad_batches(options):
    """Eight threads call one collator at once (a barrier lines them up), half of them with bad batches:
    every good batch comes out as it does alone, every bad one raises its own error, the inputs stay put."""
    collator = Collator(**options)
    data = PackedRecords(32)
    good = [[data[i] for i in range(start, start + 4)] for start in range(0, 32, 4)]
    bad = []
    for k, chunk in enumerate(good):
        payload = dict(chunk[3].payload)
        payload["input_ids"] = payload["input_ids"].clone()
        payload["input_ids"][1] = -1 - k
        bad.append([*chunk[:3], record(payload, 100 + k, chunk[3].meta.padding_length)])
    expected = [as_lists(Collator(**options)(chunk)) for chunk in good]
    before = snapshot(good)
    barrier = threading.Barrier(8)
    results: dict[tuple[int, int], object] = {}

    def work(index: int) -> None:
        barrier.wait()
        for round_ in range(6):
            chunk = good[index] if (index + round_) % 2 else bad[index]
            try:
                results[index, round_] = as_lists(collator(chunk))
            except ValueError as error:
                results[index, round_] = error

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for (index, round_), result in results.items():
        if (index + round_) % 2:
            assert result == expected[index]
        else:
            assert isinstance(result, ValueError) and f"record 3 (sample_id (0, 0, {100 + index}))" in str(
                result
            )
            assert ">= 0" in str(result)
    assert len(results) == 48
    assert_unchanged(before, good)
