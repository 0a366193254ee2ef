"""pack_flat and FlatPacker: hand-worked layouts, properties against a reference model, errors, to_training."""

from __future__ import annotations

import copy
import inspect
import itertools
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon_collate.packing.pack_flat import pack_flat
from zephon_collate.packing.packer import FlatPacker
from zephon_collate.types import ContributorRef, SampleBatch, SampleMeta, SampleRecord

PAD, BOS, EOS = 0, 1, 2
FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def doc(
    i: int, n: int | list[int], *, comp: Any = 0, lineage: tuple[int, ...] = (), **fields: Any
) -> SampleRecord:
    """Document ``i``: tokens ``1000 * (i + 1) + k`` (unique), or the given list."""
    tokens = list(n) if isinstance(n, list) else [1000 * (i + 1) + k for k in range(n)]
    counts = comp if isinstance(comp, dict) else {comp: 1}
    meta = SampleMeta((0, i // 7, i), lane_id=i % 2, chunk_id=i // 5, chunk_offset=i,
                      component_sample_counts=counts, lineage=lineage)  # fmt: skip
    return SampleRecord(meta, {"input_ids": tokens, **fields})


def flush(i: int = 0) -> SampleRecord:
    return SampleRecord(SampleMeta((9, 9, i), 0, 0, tags={"_flush": True}), None)


def tombstone(i: int = 0) -> SampleRecord:
    return SampleRecord(SampleMeta((8, 8, i), 0, 0).with_tombstone(), None)


def ids(row: SampleRecord) -> list[int]:
    return row.payload["input_ids"].tolist()


def refs(row: SampleRecord) -> list[tuple[int, tuple[int, ...], bool]]:
    return [(r.cursor.sample_id[2], r.cursor.lineage, r.is_last_child) for r in row.meta.contributors]


def assert_rows_equal(left: list[SampleRecord], right: list[SampleRecord]) -> None:
    assert len(left) == len(right)
    for a, b in zip(left, right, strict=True):
        assert a.meta == b.meta
        assert list(a.payload) == list(b.payload)
        for key in a.payload:
            assert a.payload[key].dtype == b.payload[key].dtype
            np.testing.assert_array_equal(a.payload[key], b.payload[key])


def snapshot(records: list[SampleRecord]) -> list[Any]:
    return [(copy.deepcopy(r.meta), pickle.dumps(r.payload)) for r in records]


# ---------------------------------------------------------------- hand-worked examples


def test_greedy_worked_example() -> None:
    records = [
        doc(0, 3, comp=0, loss_mask=[0, 1, 1]),
        doc(1, 2, comp=1, loss_mask=[1, 1]),
        doc(2, 4, comp=0, loss_mask=[0, 0, 1, 1]),
    ]
    rows = pack_flat(records, 5, pad_token_id=PAD)
    assert [ids(r) for r in rows] == [[1000, 1001, 1002, 2000, 2001], [3000, 3001, 3002, 3003, PAD]]
    assert [r.payload["positions"].tolist() for r in rows] == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert [r.payload["loss_mask"].tolist() for r in rows] == [[0, 1, 1, 1, 1], [0, 0, 1, 1, 0]]
    assert [r.meta.padding_length for r in rows] == [0, 1]
    assert [r.meta.tags["_padding_length"] for r in rows] == [0, 1]
    assert list(rows[0].payload) == ["input_ids", "loss_mask", "positions"]
    assert all(v.dtype == np.int64 for v in (rows[0].payload["input_ids"], rows[0].payload["positions"]))
    assert refs(rows[0]) == [(0, (0,), True), (1, (0,), True)]
    assert refs(rows[1]) == [(2, (0,), True)]
    assert rows[0].meta.component_sample_counts == {0: 1, 1: 1}
    assert rows[0].meta.component_token_counts == {0: 3, 1: 2}
    assert rows[1].meta.component_sample_counts == {0: 1}
    assert rows[1].meta.component_token_counts == {0: 4}
    first = rows[1].meta
    assert (first.sample_id, first.lane_id, first.chunk_id, first.chunk_offset) == ((0, 0, 2), 0, 0, 2)
    assert first.lineage == (0,) and first.cursor == first.contributors[0].cursor
    assert first.contributors[0] == ContributorRef(records[2].meta.cursor.child(0), True)


def test_best_fit_worked_example() -> None:
    records = [doc(0, 3), doc(1, 2), doc(2, 4)]
    rows = pack_flat(records, 5, pad_token_id=PAD, strategy="best_fit")
    assert [ids(r) for r in rows] == [[3000, 3001, 3002, 3003, PAD], [1000, 1001, 1002, 2000, 2001]]
    assert [refs(r) for r in rows] == [[(2, (0,), True)], [(0, (0,), True), (1, (0,), True)]]
    # buffer_size=2: the first round holds docs 0 and 1 only
    rows = pack_flat([*records, doc(3, 1)], 5, pad_token_id=PAD, strategy="best_fit", buffer_size=2)
    assert [ids(r) for r in rows] == [[1000, 1001, 1002, 2000, 2001], [3000, 3001, 3002, 3003, 4000]]


def test_best_fit_picks_the_tightest_row() -> None:
    # sorted 6, 5, 4, 3 into 10: 6 -> A (4 left), 5 -> B (5 left), 4 -> A (tightest), 3 -> B
    rows = pack_flat([doc(0, 3), doc(1, 6), doc(2, 4), doc(3, 5)], 10, pad_token_id=PAD, strategy="best_fit")
    assert [[ref[0] for ref in refs(r)] for r in rows] == [[1, 2], [3, 0]]
    assert [r.meta.padding_length for r in rows] == [0, 2]


def test_split_overflow() -> None:
    rows = pack_flat([doc(0, 12, comp=4), doc(1, 2, comp=4)], 5, pad_token_id=PAD)
    assert [ids(r) for r in rows] == [
        [1000, 1001, 1002, 1003, 1004],
        [1005, 1006, 1007, 1008, 1009],
        [1010, 1011, 2000, 2001, PAD],
    ]
    assert [refs(r) for r in rows] == [
        [(0, (0,), False)],
        [(0, (1,), False)],
        [(0, (2,), True), (1, (0,), True)],
    ]
    assert rows[2].payload["positions"].tolist() == [0, 1, 0, 1, 0]
    assert [r.meta.component_sample_counts for r in rows] == [{4: 0}, {4: 0}, {4: 2}]
    assert [r.meta.component_token_counts for r in rows] == [{4: 5}, {4: 5}, {4: 4}]
    assert [r.meta.lineage for r in rows] == [(0,), (1,), (2,)]


def test_truncate_overflow_keeps_the_head_and_closes() -> None:
    rows = pack_flat([doc(0, 12), doc(1, 2)], 5, pad_token_id=PAD, overflow="truncate")
    assert [ids(r) for r in rows] == [[1000, 1001, 1002, 1003, 1004], [2000, 2001, PAD, PAD, PAD]]
    assert [refs(r) for r in rows] == [[(0, (0,), True)], [(1, (0,), True)]]


def test_one_signature_for_the_packing_options() -> None:
    """pack_flat and FlatPacker take the same keywords, from one place; only buffer_size's default differs."""
    listed, streamed = inspect.signature(pack_flat), inspect.signature(FlatPacker)
    assert (
        list(listed.parameters)[:2] == ["records", "seq_len"] and next(iter(streamed.parameters)) == "seq_len"
    )
    assert list(listed.parameters)[2:] == list(streamed.parameters)[1:] == [
        "pad_token_id", "emit_positions", "tokens_field", "strategy", "overflow", "buffer_size", "fields",
        "float_fields", "group_key",
    ]  # fmt: skip
    assert listed.parameters["overflow"].default == streamed.parameters["overflow"].default == "auto"
    assert (listed.parameters["buffer_size"].default, streamed.parameters["buffer_size"].default) == (
        None,
        1024,
    )
    assert FlatPacker(4, pad_token_id=0).options.buffer_size == 1024
    for call in (lambda: pack_flat([], 4), lambda: FlatPacker(4)):
        with pytest.raises(TypeError, match="pad_token_id is required"):
            call()


def test_a_long_document_with_a_prompt_is_not_split_by_default() -> None:
    """A chat example's response must not land in a row of its own, restarting at position 0 without its prompt."""
    chat = doc(1, 7, loss_mask=[0, 0, 0, 1, 1, 1, 1])  # a 3-token prompt, a 4-token response
    records = [doc(0, 2, loss_mask=[1, 1]), chat]
    for pack in (
        lambda **kw: pack_flat(records, 5, pad_token_id=PAD, **kw),
        lambda **kw: list(
            FlatPacker(5, pad_token_id=PAD, strategy="best_fit", buffer_size=4, **kw).pack(records)
        ),
    ):
        with pytest.raises(
            ValueError,
            match=r"record 1 \(sample_id \(0, 0, 1\)\): has 7 tokens, more than seq_len=5.*overflow=",
        ):
            pack()
        assert [2000, 2001, 2002, 2003, 2004] in [ids(r) for r in pack(overflow="truncate")]
        assert any(2006 in ids(r) for r in pack(overflow="split"))  # asked for: the tail is packed
    fits = pack_flat([chat], 7, pad_token_id=PAD)  # a chat example that fits is packed whole
    assert fits[0].payload["loss_mask"].tolist() == [0, 0, 0, 1, 1, 1, 1]


def test_long_documents_without_a_prompt_still_split_by_default() -> None:
    for fields in ({}, {"loss_mask": [1] * 12}):
        rows = pack_flat([doc(0, 12, **fields)], 5, pad_token_id=PAD)
        assert [ids(r) for r in rows] == [
            list(range(1000, 1005)),
            list(range(1005, 1010)),
            [1010, 1011, 0, 0, 0],
        ]


def test_flush_sentinel_closes_the_open_row() -> None:
    records = [doc(0, 2), flush(), doc(1, 2)]
    for strategy in ("greedy", "best_fit"):
        rows = pack_flat(records, 5, pad_token_id=PAD, strategy=strategy)
        assert [ids(r) for r in rows] == [[1000, 1001, 0, 0, 0], [2000, 2001, 0, 0, 0]]
        assert [r.meta.padding_length for r in rows] == [3, 3]
        assert [r.payload["positions"].tolist() for r in rows] == [[0, 1, 0, 1, 2]] * 2
    assert [ids(r) for r in pack_flat(records[::2], 5, pad_token_id=PAD)] == [[1000, 1001, 2000, 2001, 0]]
    assert pack_flat([flush(), flush()], 5, pad_token_id=PAD) == []


def test_tombstones_and_empty_documents_are_skipped() -> None:
    records = [
        tombstone(0),
        doc(0, 0),
        doc(1, 2),
        SampleRecord(doc(2, 1).meta.with_tombstone(), None),
        doc(3, []),
    ]
    rows = pack_flat(records, 4, pad_token_id=PAD)
    assert [ids(r) for r in rows] == [[2000, 2001, 0, 0]]
    assert refs(rows[0]) == [(1, (0,), True)]
    assert pack_flat([], 4, pad_token_id=PAD) == []


def test_payload_kinds_fields_and_names() -> None:
    meta = doc(0, 1).meta
    arrays = [
        SampleRecord(meta, [5, 6]),
        SampleRecord(meta, np.array([7], np.int32)),
        SampleRecord(meta, torch.tensor([8])),
    ]
    rows = pack_flat(arrays, 4, pad_token_id=9, emit_positions=False)
    assert list(rows[0].payload) == ["input_ids"] and ids(rows[0]) == [5, 6, 7, 8]
    tokens = [SampleRecord(meta, {"tokens": torch.tensor([5, 6]), "text": "ab", "weights": np.array([0.5, 1.0]),
                                  "positions": [7, 7], "scalar": 3, "pair": [[1, 2], [3, 4]]})]  # fmt: skip
    with pytest.raises(ValueError, match="'positions' starts at 7; the packer keeps a document's segments"):
        pack_flat(tokens, 3, pad_token_id=9)  # input positions are the document's segments: never dropped
    tokens[0].payload["positions"] = [0, 1]
    (row,) = pack_flat(tokens, 3, pad_token_id=9)
    assert list(row.payload) == ["tokens", "weights", "positions"]
    assert row.payload["tokens"].tolist() == [5, 6, 9]
    assert row.payload["weights"].tolist() == [0.5, 1.0, 0.0] and row.payload["weights"].dtype == np.float64
    assert row.payload["positions"].tolist() == [0, 1, 0]
    # a field is packed only when every document has one entry per token in it
    mixed = [doc(0, 2, w=[1, 2], v=[1, 2]), doc(1, 3, w=[1, 2, 3], v=[1])]
    assert list(pack_flat(mixed, 5, pad_token_id=0)[0].payload) == ["input_ids", "w", "positions"]
    assert list(pack_flat(mixed, 5, pad_token_id=0, fields=())[0].payload) == ["input_ids", "positions"]
    tokens[0].payload["positions"] = [7, 7]
    (row,) = pack_flat(tokens, 3, pad_token_id=9, emit_positions=False, fields=["positions"])
    assert row.payload["positions"].tolist() == [7, 7, 0]


def test_base_lineage_and_component_split() -> None:
    (row,) = pack_flat([doc(0, 7, comp={0: 2, 1: 1}, lineage=(3, 1))], 8, pad_token_id=PAD)
    assert row.meta.component_token_counts == {0: 5, 1: 2}
    assert row.meta.component_sample_counts == {0: 2, 1: 1}
    assert refs(row) == [(0, (3, 1, 0), True)] and row.meta.lineage == (3, 1, 0)
    (row,) = pack_flat([doc(0, 3, comp={})], 3, pad_token_id=PAD)
    assert row.meta.component_token_counts == {} and row.meta.component_sample_counts == {}


def test_outputs_are_fresh_arrays() -> None:
    tokens = np.arange(10, 14)
    mask = np.ones(4, np.int8)
    records = [SampleRecord(doc(0, 1).meta, {"input_ids": tokens, "loss_mask": mask})]
    (row,) = pack_flat(records, 4, pad_token_id=PAD)
    assert not np.shares_memory(row.payload["input_ids"], tokens)
    assert not np.shares_memory(row.payload["loss_mask"], mask)
    row.payload["input_ids"][:] = -1
    assert tokens.tolist() == [10, 11, 12, 13]


def test_list_and_stream_agree_and_generators_work() -> None:
    records = [doc(i, n) for i, n in enumerate([3, 9, 1, 4, 4, 2, 7])]
    for strategy, size in (("greedy", 1), ("best_fit", 3)):
        listed = pack_flat(iter(records), 4, pad_token_id=PAD, strategy=strategy, buffer_size=size)
        packer = FlatPacker(4, pad_token_id=PAD, strategy=strategy, buffer_size=size)
        assert_rows_equal(listed, list(packer.pack(records)))
        assert packer.records_consumed == len(records) and packer.rows_emitted == len(listed)
        batched = pack_flat(SampleBatch(records), 4, pad_token_id=PAD, strategy=strategy, buffer_size=size)
        assert_rows_equal(listed, batched)


def test_stream_yields_rows_before_the_input_ends() -> None:
    def endless() -> Any:
        for i in itertools.count():
            yield doc(i, 3)

    rows = list(itertools.islice(FlatPacker(6, pad_token_id=PAD).pack(endless()), 5))
    assert [r.meta.padding_length for r in rows] == [0] * 5
    packer = FlatPacker(6, pad_token_id=PAD, strategy="best_fit", buffer_size=4)
    assert len(list(itertools.islice(packer.pack(endless()), 5))) == 5
    assert packer.records_consumed == 12


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"seq_len": 0}, ValueError, "seq_len must be an int >= 1"),
        ({"seq_len": 2.0}, TypeError, "seq_len"),
        ({"seq_len": True}, TypeError, "seq_len"),
        ({"pad_token_id": -1}, ValueError, "pad_token_id must be an int >= 0"),
        ({"pad_token_id": "0"}, TypeError, "pad_token_id"),
        ({"strategy": "first_fit"}, ValueError, "strategy must be 'greedy' or 'best_fit'"),
        ({"overflow": "drop"}, ValueError, "overflow must be 'auto', 'split' or 'truncate'"),
        ({"buffer_size": 0}, ValueError, "buffer_size"),
        ({"emit_positions": 1}, TypeError, "emit_positions"),
        ({"tokens_field": None}, TypeError, "tokens_field"),
        ({"fields": "loss_mask"}, TypeError, "fields must be None or a sequence"),
        ({"fields": ["positions"]}, ValueError, "emit_positions=False"),
        ({"fields": ["a", "a"]}, ValueError, "twice"),
    ],
)
def test_bad_options(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    options = {"seq_len": 4, "pad_token_id": 0, **kwargs}
    with pytest.raises(error, match=match):
        pack_flat([doc(0, 2)], **options)
    options.setdefault("buffer_size", 8)
    with pytest.raises(error, match=match):
        FlatPacker(**options)


@pytest.mark.parametrize(
    ("records", "kwargs", "error", "match"),
    [
        (
            [doc(0, 2), SampleRecord(doc(1, 1).meta, "text")],
            {},
            TypeError,
            r"record 1 \(sample_id \(0, 0, 1\)\).*payload",
        ),
        ([SampleRecord(doc(0, 1).meta, None)], {}, TypeError, "record 0.*payload must be a dict"),
        ([doc(0, [1.0, 2.0])], {}, TypeError, "record 0.*'input_ids'.*integer token ids"),
        ([doc(0, [True])], {}, TypeError, "'input_ids'.*integer token ids"),
        (
            [SampleRecord(doc(0, 1).meta, {"input_ids": [[1, 2]]})],
            {},
            ValueError,
            r"'input_ids' has shape \(1, 2\): a batch of one row",
        ),
        ([doc(0, 2, loss_mask=[1])], {}, ValueError, "record 0.*'loss_mask'"),
        ([doc(0, 2, loss_mask=[1, 1]), doc(1, 2)], {}, ValueError, "record 0.*loss_mask.*record 1.*has none"),
        (
            [doc(0, 2, w=[1, 2]), doc(1, 2, w=[1])],
            {"fields": ["w"]},
            ValueError,
            "record 1.*'w' has 1 entries",
        ),
        ([doc(0, 2), doc(1, 2)], {"fields": ["w"]}, ValueError, "record 0.*lacks field 'w'"),
        ([doc(0, 2, w=["a", "b"])], {"fields": ["w"]}, TypeError, "'w' has dtype"),
        ([doc(0, 2)], {"tokens_field": "tokens"}, ValueError, "record 0.*no tokens field 'tokens'"),
        (
            [doc(0, 2), SampleRecord(doc(1, 1).meta, {"tokens": [1]})],
            {},
            ValueError,
            "record 1.*tokens_field",
        ),
        (
            [doc(0, 2), "doc"],
            {},
            TypeError,
            r"item 1 must be a SampleRecord, a payload dict or a token array",
        ),
        (
            [doc(0, 2), SampleRecord(doc(1, 1).meta, [1])],
            {"fields": ["x"]},
            ValueError,
            "record 0.*lacks field 'x'",
        ),
        (
            [doc(0, 2, x=[1, 2])],
            {"fields": ["input_ids", "x"]},
            ValueError,
            "tokens field 'input_ids' is also",
        ),
    ],
)
def test_bad_records(records: list[Any], kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        pack_flat(records, 4, pad_token_id=0, **kwargs)


def test_stream_errors_name_the_stream_index() -> None:
    packer = FlatPacker(4, pad_token_id=0)
    with pytest.raises(ValueError, match=r"record 2.*lacks field 'w'"):
        list(packer.pack([doc(0, 2, w=[1, 2]), flush(), doc(1, 2)]))
    with pytest.raises(ValueError, match=r"record 1.*'loss_mask' but earlier records have none"):
        list(FlatPacker(4, pad_token_id=0).pack([doc(0, 2), doc(1, 2, loss_mask=[1, 1])]))
    with pytest.raises(ValueError, match=r"record 1.*array payload holds only its token row"):
        list(
            FlatPacker(4, pad_token_id=0).pack(
                [doc(0, 2, loss_mask=[1, 1]), SampleRecord(doc(1, 1).meta, [3])]
            )
        )
    with pytest.raises(TypeError, match="FlatPacker: item 1 must be a SampleRecord"):
        list(FlatPacker(4, pad_token_id=0).pack([doc(0, 2), 7]))
    with pytest.raises(TypeError, match="records must be a list of SampleRecord"):
        pack_flat(doc(0, 2), 4, pad_token_id=0)  # type: ignore[arg-type]


def test_load_state_dict_rejects_other_options_and_garbage() -> None:
    state = FlatPacker(4, pad_token_id=0).state_dict()
    with pytest.raises(ValueError, match="seq_len: saved 4, here 5"):
        FlatPacker(5, pad_token_id=0).load_state_dict(state)
    with pytest.raises(ValueError, match="not a version-1 FlatPacker state"):
        FlatPacker(4, pad_token_id=0).load_state_dict({"version": 1})
    with pytest.raises(TypeError, match="state must be a dict"):
        FlatPacker(4, pad_token_id=0).load_state_dict([])  # type: ignore[arg-type]


# ---------------------------------------------------------------- properties against a reference model

Layout = list[list[tuple[int, int, int, bool]]]  # rows of (doc index, piece index, length, closes)


def reference_layout(
    items: list[Any], seq_len: int, strategy: str, overflow: str, buffer_size: int
) -> Layout:
    """The rows, worked out naively from the rules in pack_flat's docstring."""
    rows: Layout = []
    pending: list[tuple[int, int, int, bool]] = []

    def close() -> None:
        nonlocal pending
        if strategy == "greedy":
            rows.extend([pending] if pending else [])
        else:
            opened: Layout = []
            for piece in sorted(pending, key=lambda p: -p[2]):
                fits = [r for r in opened if seq_len - sum(p[2] for p in r) >= piece[2]]
                if fits:
                    min(fits, key=lambda r: (seq_len - sum(p[2] for p in r), opened.index(r))).append(piece)
                else:
                    opened.append([piece])
            rows.extend(opened)
        pending = []

    for i, item in enumerate(items):
        if item == "flush":
            close()
        if not isinstance(item, int) or item == 0:
            continue
        count = 1 if overflow == "truncate" else -(-item // seq_len)
        for k in range(count):
            piece = (i, k, min(seq_len, item - k * seq_len), k == count - 1)
            if strategy == "greedy" and sum(p[2] for p in pending) + piece[2] > seq_len:
                close()
            pending.append(piece)
            if strategy == "best_fit" and len(pending) == buffer_size:
                close()
    close()
    return [row for row in rows if row]


def make_records(items: list[Any]) -> list[SampleRecord]:
    records = []
    for i, item in enumerate(items):
        if item == "flush":
            records.append(flush(i))
        elif item == "tomb":
            records.append(tombstone(i))
        else:
            tokens = np.arange(item, dtype=np.int32) + 1000 * (i + 1)
            fields = {"loss_mask": (tokens % 3 != 0).astype(np.int8), "weight": tokens / 7.0, "note": "x"}
            records.append(doc(i, 0, comp=i % 3, **fields))
            records[-1].payload["input_ids"] = tokens if i % 2 else tokens.tolist()
    return records


def check_rows(rows: list[SampleRecord], items: list[Any], records: list[SampleRecord], layout: Layout,
               seq_len: int) -> None:  # fmt: skip
    assert len(rows) == len(layout)
    seen = {i: [] for i, item in enumerate(items) if isinstance(item, int) and item}
    totals: dict[int, list[int]] = {}
    for row, expected in zip(rows, layout, strict=True):
        payload, meta = row.payload, row.meta
        assert all(v.shape == (seq_len,) for v in payload.values())
        assert list(payload) == ["input_ids", "loss_mask", "weight", "positions"]
        assert [
            (r.cursor.sample_id[2], r.cursor.lineage[-1], r.is_last_child) for r in meta.contributors
        ] == [(i, k, closes) for i, k, _, closes in expected]
        used = sum(p[2] for p in expected)
        assert meta.padding_length == seq_len - used
        assert (payload["input_ids"][used:] == PAD).all() and (payload["loss_mask"][used:] == 0).all()
        assert (payload["weight"][used:] == 0).all()
        starts, offset = [], 0
        for i, k, length, closes in expected:
            source = np.asarray(records[i].payload["input_ids"])[k * seq_len : k * seq_len + length]
            np.testing.assert_array_equal(payload["input_ids"][offset : offset + length], source)
            np.testing.assert_array_equal(payload["loss_mask"][offset : offset + length], source % 3 != 0)
            np.testing.assert_allclose(payload["weight"][offset : offset + length], source / 7.0)
            seen[i].append((k, closes))
            starts.append(offset)
            offset += length
        starts += [used] if used < seq_len else []
        positions = payload["positions"]
        assert positions[0] == 0 and np.flatnonzero(positions == 0).tolist() == starts
        steps = np.diff(positions)
        assert ((steps == 1) | (positions[1:] == 0)).all()
        assert sum(meta.component_token_counts.values()) == used
        for cid, count in meta.component_sample_counts.items():
            totals.setdefault(cid, []).append(count)
        assert meta.cursor == meta.contributors[0].cursor
    for pieces in seen.values():  # every document once, pieces in order, exactly one closing piece: the last
        assert [k for k, _ in pieces] == list(range(len(pieces)))
        assert [closes for _, closes in pieces] == [False] * (len(pieces) - 1) + [True]
    expected_counts = {}
    for i in seen:
        expected_counts[i % 3] = expected_counts.get(i % 3, 0) + 1
    assert {cid: sum(v) for cid, v in totals.items() if sum(v)} == expected_counts


ITEMS = st.lists(st.one_of(st.integers(0, 30), st.sampled_from(["flush", "tomb"])), max_size=24)


@FAST
@given(items=ITEMS, seq_len=st.integers(1, 12), strategy=st.sampled_from(["greedy", "best_fit"]),
       overflow=st.sampled_from(["split", "truncate"]), buffer_size=st.integers(1, 8))  # fmt: skip
def test_rows_match_the_reference(
    items: list[Any], seq_len: int, strategy: str, overflow: str, buffer_size: int
) -> None:
    records = make_records(items)
    before = snapshot(records)
    rows = pack_flat(
        records, seq_len, pad_token_id=PAD, strategy=strategy, overflow=overflow, buffer_size=buffer_size
    )
    check_rows(
        rows, items, records, reference_layout(items, seq_len, strategy, overflow, buffer_size), seq_len
    )
    assert snapshot(records) == before, "inputs unchanged"
    if overflow == "split":  # every token exactly once
        nonpad = np.concatenate(
            [r.payload["input_ids"][: seq_len - r.meta.padding_length] for r in rows] or [[]]
        )
        every = [np.asarray(r.payload["input_ids"]) for r in records if not r.meta.is_sentinel]
        assert sorted(nonpad.tolist()) == sorted(np.concatenate(every or [[]]).tolist())
    again = FlatPacker(
        seq_len, pad_token_id=PAD, strategy=strategy, overflow=overflow, buffer_size=buffer_size
    )
    assert_rows_equal(rows, list(again.pack(records)))


@FAST
@given(items=ITEMS, seq_len=st.integers(1, 12), strategy=st.sampled_from(["greedy", "best_fit"]),
       overflow=st.sampled_from(["split", "truncate"]), buffer_size=st.integers(1, 8), data=st.data())  # fmt: skip
def test_save_and_restore_mid_stream(
    items: list[Any], seq_len: int, strategy: str, overflow: str, buffer_size: int, data: st.DataObject
) -> None:
    records = make_records(items)
    options = {"pad_token_id": PAD, "strategy": strategy, "overflow": overflow, "buffer_size": buffer_size}
    full = list(FlatPacker(seq_len, **options).pack(records))
    cut = data.draw(st.integers(0, len(full)), label="rows before the save")
    packer = FlatPacker(seq_len, **options)
    head = list(itertools.islice(packer.pack(iter(records)), cut))
    state = pickle.loads(pickle.dumps(packer.state_dict()))
    resumed = FlatPacker(seq_len, **options)
    resumed.load_state_dict(state)
    tail = list(resumed.pack(records[state["records_consumed"] :]))
    assert_rows_equal(head + tail, full)
    assert resumed.rows_emitted == len(full)


def test_state_is_plain_data() -> None:
    packer = FlatPacker(8, pad_token_id=PAD, strategy="best_fit", buffer_size=4, overflow="split")
    list(itertools.islice(packer.pack(make_records([3, 20, 2, 5, 1])), 1))
    state = packer.state_dict()
    plain = (dict, list, tuple, str, int, float, bool, type(None), np.ndarray, np.generic)

    def walk(value: Any) -> None:
        assert isinstance(value, plain), type(value)
        if isinstance(value, dict):
            for key, item in value.items():
                walk(key)
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(state)
    assert state["records_consumed"] == 2 and state["rows_emitted"] == 1 and len(state["ready"]) == 2


# ---------------------------------------------------------------- to_training integration


@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("strategy", ["greedy", "best_fit"])
def test_to_training_labels_stay_inside_documents(flatten: bool, strategy: str) -> None:
    rng = np.random.default_rng(7)
    seq_len = 16
    documents = []
    for i in range(40):
        content = rng.integers(10, 100, size=int(rng.integers(0, 22))).tolist()
        documents.append(doc(i, [BOS, *content, EOS]))
    rows = pack_flat(documents, seq_len, pad_token_id=PAD, strategy=strategy, buffer_size=16)
    batch = SampleBatch(rows)
    out = batch.to_training(return_labels=True, eos_mask_loss=True, eos_token_id=EOS,
                            return_cu_seqlens=True, flatten=flatten)  # fmt: skip
    assert isinstance(out["labels"], torch.Tensor) and out["labels"].dim() == (1 if flatten else 2)
    width = seq_len - 1
    labels = out["labels"].numpy().reshape(len(rows), width)
    unmasked = batch.to_training(return_labels=True)["labels"].numpy()
    crossings = 0
    lengths = {r.meta.sample_id[2]: len(r.payload["input_ids"]) for r in documents}
    flat_starts = []
    for r, row in enumerate(rows):
        tokens = row.payload["input_ids"]
        segment = np.zeros(seq_len, np.int64)  # segment number of each token, from the contributors alone
        starts, offset = [], 0
        for ref in row.meta.contributors:
            piece = ref.cursor.lineage[-1]
            length = min(seq_len, lengths[ref.cursor.sample_id[2]] - piece * seq_len)
            starts.append(offset)
            segment[offset:] += 1
            offset += length
            if ref.is_last_child and offset < seq_len:
                assert tokens[offset - 1] == EOS
                if offset - 1 < width:  # EOS -> next document's BOS (or padding) is never a target
                    assert labels[r, offset - 1] == -100
        if offset < seq_len:
            starts.append(offset)
            segment[offset:] += 1
        assert (labels[r, offset - 1 :] == -100).all(), "labels of padding are ignored"
        for j in range(width):
            if labels[r, j] != -100:
                assert segment[j] == segment[j + 1], "a supervised label crosses a document boundary"
                assert labels[r, j] == tokens[j + 1]
            crossings += int(unmasked[r, j] != -100 and segment[j] != segment[j + 1])
        inside = [s for s in starts if s < width]
        if flatten:
            flat_starts += [r * width + s for s in inside]
        else:
            boundaries = out["cu_seqlens"][r].tolist()
            assert boundaries[: len(inside) + 1] == [*inside, width]
            assert set(boundaries[len(inside) :]) == {width}
    if flatten:
        assert out["cu_seqlens"].tolist() == [*flat_starts, len(rows) * width]
    assert crossings > 0, "without eos_mask_loss, EOS -> BOS labels cross documents"


def test_plain_payload_dicts_pack_as_the_collator_wraps_them():
    """pack_flat and FlatPacker take plain payloads too, with the Collator's documented metadata:
    sample_id (0, 0, i), lane 0, chunk 0, chunk_offset i."""
    payloads = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, [6, 7, 8, 9]]
    wrapped = [SampleRecord(SampleMeta((0, 0, i), 0, 0, i), p) for i, p in enumerate(payloads)]
    rows = pack_flat(payloads, 5, pad_token_id=0)
    assert [r.payload["input_ids"].tolist() for r in rows] == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    assert [r.meta for r in rows] == [r.meta for r in pack_flat(wrapped, 5, pad_token_id=0)]
    assert [ref.cursor.sample_id for ref in rows[0].meta.contributors] == [(0, 0, 0), (0, 0, 1)]
    streamed = list(FlatPacker(5, pad_token_id=0).pack(iter(payloads)))
    assert [r.meta for r in streamed] == [r.meta for r in rows]
    assert payloads[0] == {"input_ids": [1, 2, 3]}  # inputs are never changed


def test_best_fit_without_buffer_size_is_one_round_over_every_piece():
    """buffer_size=None runs best fit over the whole list, counted in pieces: a 6-token document
    split at seq_len=4 is two pieces, so three pieces [4, 2, 2] fill two rows, not three."""
    docs = [
        SampleRecord(SampleMeta((0, 0, i), 0, 0, i), {"input_ids": list(range(1, n + 1))})
        for i, n in enumerate((6, 2))
    ]
    rows = pack_flat(docs, 4, pad_token_id=0, strategy="best_fit", overflow="split")
    assert [r.payload["input_ids"].tolist() for r in rows] == [[1, 2, 3, 4], [5, 6, 1, 2]]
    streamed = FlatPacker(4, pad_token_id=0, strategy="best_fit", overflow="split", buffer_size=3).pack(docs)
    assert [r.payload["input_ids"].tolist() for r in streamed] == [[1, 2, 3, 4], [5, 6, 1, 2]]


@pytest.mark.parametrize("fields", [(), ("w",)])
def test_overflow_auto_reads_the_loss_mask_even_when_it_is_not_packed(fields):
    """overflow='auto' refuses to cut a document with a prompt whatever fields= packs: the
    loss_mask says where the prompt is even when it is not among the packed fields."""
    chat = {"input_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [0, 0, 1, 1, 1, 1], "w": [1] * 6}
    docs = [SampleRecord(SampleMeta((0, 0, 0), 0, 0, 0), chat)]
    with pytest.raises(ValueError, match=r"record 0 .*more than seq_len=4, and a prompt .*overflow='split'"):
        pack_flat(docs, 4, pad_token_id=0, fields=fields)
    with pytest.raises(ValueError, match="more than seq_len=4, and a prompt"):
        list(FlatPacker(4, pad_token_id=0, fields=fields).pack(docs))
    rows = pack_flat(docs, 4, pad_token_id=0, fields=fields, overflow="split")  # the explicit choice
    assert [r.payload["input_ids"].tolist() for r in rows] == [[1, 2, 3, 4], [5, 6, 0, 0]]
    plain = [SampleRecord(SampleMeta((0, 0, 0), 0, 0, 0), {**chat, "loss_mask": [1] * 6})]
    assert len(pack_flat(plain, 4, pad_token_id=0, fields=fields)) == 2  # no prompt: split as before
    bad = [SampleRecord(SampleMeta((0, 0, 0), 0, 0, 0), {**chat, "loss_mask": [0, 2, 1, 1, 1, 1]})]
    with pytest.raises(ValueError, match="loss_mask"):
        pack_flat(bad, 4, pad_token_id=0, fields=fields)


@pytest.mark.parametrize(
    ("positions", "overflow", "pieces"),
    [
        ([0, 1, 2, 3, 4, 0, 2, 4], "split", [[0, 1, 2, 3, 4], [0, 1, 2]]),
        ([0, 2, 4, 0, 1, 2, 3, 4], "split", [[0, 1, 2, 0, 1], [0, 1, 2]]),  # its gaps were kept here
        ([0, 2, 4, 0, 1, 2, 3, 4], "truncate", [[0, 1, 2, 0, 1]]),  # and here
        ([0, 2, 4, 6, 8, 10, 12], "split", [[0, 1, 2, 3, 4], [0, 1]]),
    ],
)
def test_a_cut_documents_segments_are_numbered_afresh_wherever_the_cut_falls(positions, overflow, pieces):
    """A document's own positions with gaps, cut: every segment of every piece counts 0, 1, ... (a segment
    kept its gaps where the piece held two of them, and lost them where it held one)."""
    document = {"input_ids": list(range(10, 10 + len(positions))), "positions": positions}
    record = SampleRecord(SampleMeta((0, 0, 0), 0, 0), document)
    rows = pack_flat([record], 5, pad_token_id=0, overflow=overflow)
    assert [r.payload["positions"].tolist()[: 5 - r.meta.padding_length] for r in rows] == pieces
