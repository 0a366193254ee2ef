"""Tests of the data model: every sentence of ``zephon.types.txt`` (data-model part) and of
DECISIONS.md ("Where things live", "Data model") gets a test naming or quoting it.

Expected values are worked out by hand in the tests, never computed by the code under test.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import pickle
import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zephon_collate
import zephon_collate.types as types_mod
from zephon_collate.types import (
    ContributorRef,
    SampleBatch,
    SampleCursor,
    SampleMeta,
    SampleRecord,
)

# DECISIONS.md, "Where things live", verbatim
PAGE_NAMES_LINE = """ChunkId ChunkOffset ComponentId DatasetId LaneId LineageIndex LocalSampleId
  ShardId SamplePayloadArray SamplePayload ContributorRef SampleCursor SampleMeta
  SampleRecord SampleBatch"""
PAGE_NAMES = PAGE_NAMES_LINE.split()

INT_ALIASES = (
    "ChunkId",
    "ChunkOffset",
    "ComponentId",
    "DatasetId",
    "LaneId",
    "LineageIndex",
    "LocalSampleId",
    "ShardId",
)


def meta(**kwargs: Any) -> SampleMeta:
    base: dict[str, Any] = {"sample_id": (1, 2, 3), "lane_id": 4, "chunk_id": 5, "chunk_offset": 6}
    base.update(kwargs)
    return SampleMeta(**base)


def cursor(chunk_id=5, chunk_offset=6, sample_id=(1, 2, 3), lineage=()) -> SampleCursor:
    return SampleCursor(chunk_id, chunk_offset, sample_id, lineage)


# ---------------------------------------------------------------------------------------------------------
# "Where things live"
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PAGE_NAMES)
def test_types_module_holds_the_pages_names_exactly_as_spelled(name):
    """Decisions: "`zephon_collate.types` holds the page's names exactly as spelled there"."""
    assert hasattr(types_mod, name)
    assert name in types_mod.__all__


@pytest.mark.parametrize("name", PAGE_NAMES)
def test_zephon_collate_re_exports_all_of_them(name):
    """Decisions: "`zephon_collate` re-exports all of them" (the very same objects)."""
    assert getattr(zephon_collate, name) is getattr(types_mod, name)
    assert name in zephon_collate.__all__


@pytest.mark.parametrize("name", INT_ALIASES)
def test_id_aliases_are_alias_of_int(name):
    """Page: "ChunkId / ChunkOffset / ... / ShardId — alias of int"."""
    assert getattr(types_mod, name) is int


def test_sample_payload_array_is_alias_of_any():
    """Page: "SamplePayloadArray — alias of Any"."""
    assert types_mod.SamplePayloadArray is Any


def test_sample_payload_alias_lists_the_pages_members():
    """Page: "payload: bytes | memoryview | str | int | float | complex | Any | list[SamplePayload] |
    dict[Any, SamplePayload]"."""
    text = repr(types_mod.SamplePayload)
    for member in ("bytes", "memoryview", "str", "int", "float", "complex", "Any", "list", "dict"):
        assert member in text


def _params(cls) -> list[tuple[str, Any]]:
    return [(p.name, p.default) for p in inspect.signature(cls).parameters.values()]


def test_sample_cursor_signature():
    """Decisions: "`SampleCursor(chunk_id, chunk_offset, sample_id, lineage=())`"."""
    E = inspect.Parameter.empty
    assert _params(SampleCursor) == [
        ("chunk_id", E),
        ("chunk_offset", E),
        ("sample_id", E),
        ("lineage", ()),
    ]
    assert SampleCursor(0, 0, (0, 0, 0)).lineage == ()


def test_sample_meta_signature_and_defaults():
    """Decisions: "`SampleMeta(sample_id, lane_id, chunk_id, chunk_offset=0, component_sample_counts={},
    component_token_counts=None, lineage=(), tags={})`"."""
    names = [name for name, _ in _params(SampleMeta)]
    assert names == [
        "sample_id",
        "lane_id",
        "chunk_id",
        "chunk_offset",
        "component_sample_counts",
        "component_token_counts",
        "lineage",
        "tags",
    ]
    m = SampleMeta((7, 8, 9), 1, 2)
    assert m.chunk_offset == 0
    assert m.component_sample_counts == {}
    assert m.component_token_counts is None
    assert m.lineage == ()
    assert m.tags == {}
    # positional order is the page's
    m2 = SampleMeta((7, 8, 9), 1, 2, 3, {0: 1}, {0: 10}, (4,), {"k": "v"})
    assert (m2.sample_id, m2.lane_id, m2.chunk_id, m2.chunk_offset) == ((7, 8, 9), 1, 2, 3)
    assert m2.component_sample_counts == {0: 1}
    assert m2.component_token_counts == {0: 10}
    assert m2.lineage == (4,)
    assert m2.tags == {"k": "v"}


def test_sample_meta_fresh_containers_per_instance():
    """Decisions: "(fresh containers per instance)": default dicts are never shared between metas."""
    a = SampleMeta((0, 0, 0), 0, 0)
    b = SampleMeta((0, 0, 0), 0, 0)
    assert a.tags is not b.tags
    assert a.component_sample_counts is not b.component_sample_counts


def test_contributor_ref_signature():
    """Decisions: "`ContributorRef(cursor, is_last_child=True)`"."""
    assert _params(ContributorRef) == [("cursor", inspect.Parameter.empty), ("is_last_child", True)]
    c = cursor()
    assert ContributorRef(c).is_last_child is True
    assert ContributorRef(c, False).is_last_child is False
    assert ContributorRef(c).cursor == SampleCursor(5, 6, (1, 2, 3))


def test_sample_record_and_batch_signatures():
    """Decisions: "`SampleRecord(meta, payload)`, `SampleBatch(records)`"."""
    E = inspect.Parameter.empty
    assert _params(SampleRecord) == [("meta", E), ("payload", E)]
    assert _params(SampleBatch) == [("records", E)]


# ---------------------------------------------------------------------------------------------------------
# SampleCursor
# ---------------------------------------------------------------------------------------------------------


def test_cursor_fields():
    """Page: "chunk_id: int / chunk_offset: int / sample_id: tuple[int, int, int] /
    lineage: tuple[int, ...]"."""
    c = SampleCursor(3, 7, [0, 1, 42], [2, 5])
    assert c.chunk_id == 3
    assert c.chunk_offset == 7
    assert c.sample_id == (0, 1, 42)
    assert type(c.sample_id) is tuple
    assert c.lineage == (2, 5)
    assert type(c.lineage) is tuple


def test_cursor_is_hashable():
    """Decisions: "`SampleCursor` is hashable"."""
    a = SampleCursor(3, 7, (0, 1, 42), (1,))
    b = SampleCursor(3, 7, (0, 1, 42), [1])
    assert hash(a) == hash(b)
    assert len({a, b, SampleCursor(3, 7, (0, 1, 42))}) == 2
    assert {a: "x"}[b] == "x"


def test_as_key_is_chunk_offset_lineage_sample_id_with_tuples_inside():
    """Decisions: "`as_key()` is `(chunk_id, chunk_offset, lineage, sample_id)` with tuples inside"."""
    key = SampleCursor(3, 7, [0, 1, 42], [1, 2]).as_key()
    assert key == (3, 7, (1, 2), (0, 1, 42))
    assert type(key) is tuple
    assert type(key[2]) is tuple
    assert type(key[3]) is tuple


def test_as_key_is_the_canonical_tuple_used_in_checkpoints():
    """Page: as_key "Return the canonical tuple key used in checkpoints and comparisons" (JSON-able)."""
    key = SampleCursor(3, 7, (0, 1, 42), (1,)).as_key()
    assert json.dumps(key) == "[3, 7, [1], [0, 1, 42]]"


def test_cursor_ordered_by_as_key_lineage_before_sample_id():
    """Decisions: "totally ordered by `as_key()`": a smaller lineage but a larger sample_id sorts first."""
    small_lineage = SampleCursor(0, 0, (9, 9, 9), (0,))
    big_lineage = SampleCursor(0, 0, (0, 0, 0), (1,))
    assert small_lineage < big_lineage
    assert big_lineage > small_lineage
    assert small_lineage <= big_lineage
    assert big_lineage >= small_lineage
    assert sorted([big_lineage, small_lineage]) == [small_lineage, big_lineage]


def test_cursor_ordering_field_priority_hand_worked():
    """Ordering by `(chunk_id, chunk_offset, lineage, sample_id)`: each field outranks the next."""
    expected = [
        SampleCursor(0, 9, (9, 9, 9), (9,)),  # chunk 0 first, whatever follows
        SampleCursor(1, 0, (9, 9, 9), (9,)),  # offset 0 before offset 1
        SampleCursor(1, 1, (9, 9, 9), ()),  # empty lineage before (0,)
        SampleCursor(1, 1, (0, 0, 0), (0,)),  # lineage (0,) before (0, 0)
        SampleCursor(1, 1, (0, 0, 1), (0,)),  # equal lineage: sample_id decides
        SampleCursor(1, 1, (0, 0, 0), (0, 0)),
        SampleCursor(1, 1, (0, 0, 0), (1,)),
    ]
    shuffled = expected[:]
    random.Random(0).shuffle(shuffled)
    assert sorted(shuffled) == expected
    for i, a in enumerate(expected):
        for j, b in enumerate(expected):
            assert (a < b) == (i < j)
            assert (a <= b) == (i <= j)
            assert (a > b) == (i > j)
            assert (a >= b) == (i >= j)
            assert (a == b) == (i == j)


def test_cursor_comparison_with_other_types():
    """Total order is among cursors; comparing with a plain tuple is a TypeError, never equal."""
    c = SampleCursor(0, 0, (0, 0, 0))
    assert c != (0, 0, (), (0, 0, 0))
    with pytest.raises(TypeError):
        _ = c < (0, 0, (), (0, 0, 0))


def test_from_key_accepts_the_tuple():
    """Decisions: "`SampleCursor.from_key(key)` accepts that tuple"; page: "static from_key(key) →
    SampleCursor"."""
    c = SampleCursor.from_key((3, 7, (1,), (0, 1, 42)))
    assert isinstance(c, SampleCursor)
    assert (c.chunk_id, c.chunk_offset, c.lineage, c.sample_id) == (3, 7, (1,), (0, 1, 42))
    assert isinstance(inspect.getattr_static(SampleCursor, "from_key"), staticmethod)


def test_from_key_accepts_lists_as_read_back_from_json():
    """Decisions: "or the same shape with lists (as read back from JSON)"."""
    c = SampleCursor(3, 7, (0, 1, 42), (1, 0))
    loaded = json.loads(json.dumps(c.as_key()))
    assert loaded == [3, 7, [1, 0], [0, 1, 42]]
    back = SampleCursor.from_key(loaded)
    assert back == c
    assert back.lineage == (1, 0)
    assert back.sample_id == (0, 1, 42)
    assert hash(back) == hash(c)


def test_from_key_of_as_key_round_trips():
    """Decisions: "`from_key(c.as_key()) == c`"."""
    for c in (SampleCursor(0, 0, (0, 0, 0)), SampleCursor(-2, 3, (4, 5, 6), (7, 8, 9))):
        assert SampleCursor.from_key(c.as_key()) == c


@pytest.mark.parametrize("bad", [(1, 2, 3), "abcd", 5, None, (1, 2, (), (0, 0, 0), 9)])
def test_from_key_rejects_malformed_keys(bad):
    """from_key only takes the 4-item `as_key()` shape; anything else is a TypeError naming the key."""
    with pytest.raises(TypeError, match="from_key"):
        SampleCursor.from_key(bad)


def test_cursor_child_appends_index_to_lineage():
    """Decisions: "`child(index)` appends `index` to `lineage`" (cursor); page: "the cursor for the
    index-th child"."""
    base = SampleCursor(3, 7, (0, 1, 42), (2,))
    kid = base.child(5)
    assert isinstance(kid, SampleCursor)
    assert kid == SampleCursor(3, 7, (0, 1, 42), (2, 5))
    assert kid.child(0).lineage == (2, 5, 0)


def test_cursor_survives_fan_out():
    """Page: "Stable ordering key that survives fan-out": children keep the base offset and sort
    after their base, in child order, and before the next base offset."""
    base = SampleCursor(3, 7, (0, 1, 42))
    nxt = SampleCursor(3, 8, (0, 1, 43))
    kids = [base.child(i) for i in range(3)]
    grandkids = [kids[1].child(i) for i in range(2)]
    expected = [base, kids[0], kids[1], grandkids[0], grandkids[1], kids[2], nxt]
    scrambled = [nxt, grandkids[1], kids[2], base, kids[0], grandkids[0], kids[1]]
    assert sorted(scrambled) == expected
    assert {k.base_offset for k in kids + grandkids} == {(3, 7)}


def test_cursor_base_offset():
    """Page: "base_offset: Return (chunk_id, chunk_offset) for eviction/base-offset accounting"."""
    assert SampleCursor(3, 7, (0, 1, 42), (1, 2)).base_offset == (3, 7)


def test_cursor_is_frozen():
    """Decisions: "Metadata objects are immutable values": assigning a cursor field raises."""
    c = cursor()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.chunk_id = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.lineage = (1,)  # type: ignore[misc]


def test_cursor_accepts_numpy_ints_as_plain_ints():
    """Integer-like ids (NumPy ints) are accepted and stored as plain ints, so keys stay JSON-able."""
    c = SampleCursor(np.int64(3), np.int32(7), (np.int64(0), 1, 2), [np.int64(4)])
    assert c == SampleCursor(3, 7, (0, 1, 2), (4,))
    assert type(c.chunk_id) is int
    assert json.dumps(c.as_key()) == "[3, 7, [4], [0, 1, 2]]"


# ---------------------------------------------------------------------------------------------------------
# Bad construction arguments
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad", [(1, 2), (1, 2, 3, 4), (1, 2, "3"), "123", 7, None, (1, 2, 3.0), (True, 0, 0)]
)
def test_sample_id_not_three_ints_raises_type_error(bad):
    """`sample_id: tuple[int, int, int]`: anything else is a TypeError naming the field and the value."""
    with pytest.raises(TypeError, match=r"sample_id") as info:
        SampleCursor(0, 0, bad)
    assert repr(bad) in str(info.value)
    with pytest.raises(TypeError, match=r"SampleMeta\.sample_id") as info:
        SampleMeta(bad, 0, 0)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("bad", [-1, -100])
def test_negative_chunk_offset_raises_value_error(bad):
    """A negative `chunk_offset` is a ValueError naming the field and the value."""
    with pytest.raises(ValueError, match=rf"SampleCursor\.chunk_offset.*{bad}"):
        SampleCursor(0, bad, (0, 0, 0))
    with pytest.raises(ValueError, match=rf"SampleMeta\.chunk_offset.*{bad}"):
        SampleMeta((0, 0, 0), 0, 0, bad)


@pytest.mark.parametrize("bad", [1.0, "3", None, (1,)])
def test_non_int_chunk_offset_raises_type_error(bad):
    """`chunk_offset: int`: a non-int is a TypeError naming the field and the value."""
    with pytest.raises(TypeError, match=r"SampleCursor\.chunk_offset") as info:
        SampleCursor(0, bad, (0, 0, 0))
    assert repr(bad) in str(info.value)
    with pytest.raises(TypeError, match=r"SampleMeta\.chunk_offset") as info:
        SampleMeta((0, 0, 0), 0, 0, bad)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"chunk_id": True}, "chunk_id"),
        ({"chunk_offset": False}, "chunk_offset"),
        ({"lane_id": True}, "lane_id"),
        ({"chunk_id": 1.5}, "chunk_id"),
        ({"lane_id": "0"}, "lane_id"),
    ],
)
def test_bool_or_non_int_where_int_expected_raises_type_error(kwargs, field):
    """`lane_id: int`, `chunk_id: int`, `chunk_offset: int`: bool is not an int here; TypeError
    naming the field and the value."""
    with pytest.raises(TypeError, match=rf"SampleMeta\.{field}") as info:
        meta(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value)
    if field != "lane_id":
        args = {"chunk_id": 0, "chunk_offset": 0, **kwargs}
        with pytest.raises(TypeError, match=rf"SampleCursor\.{field}"):
            SampleCursor(args["chunk_id"], args["chunk_offset"], (0, 0, 0))


@pytest.mark.parametrize("bad", [5, "12", b"12", None, (1, "2"), [1.0], (True,), [None]])
def test_lineage_not_a_sequence_of_ints_raises_type_error(bad):
    """`lineage: tuple[int, ...]`: anything else is a TypeError naming the field and the value."""
    with pytest.raises(TypeError, match=r"SampleCursor\.lineage") as info:
        SampleCursor(0, 0, (0, 0, 0), bad)
    assert repr(bad) in str(info.value)
    with pytest.raises(TypeError, match=r"SampleMeta\.lineage") as info:
        SampleMeta((0, 0, 0), 0, 0, lineage=bad)
    assert repr(bad) in str(info.value)
    with pytest.raises(TypeError, match=r"with_lineage"):
        meta().with_lineage(bad)


@pytest.mark.parametrize("bad", [1.0, True, "0", None])
def test_child_index_must_be_an_int(bad):
    """`child(index)`: `LineageIndex` is an int; anything else (bool included) is a TypeError."""
    with pytest.raises(TypeError, match=r"child\.index") as info:
        cursor().child(bad)
    assert repr(bad) in str(info.value)
    with pytest.raises(TypeError, match=r"child\.index"):
        meta().child(bad)


def test_bad_counts_raise_naming_the_field():
    """`component_sample_counts: dict[int, int]`, `component_token_counts: dict[int, int] | None`."""
    with pytest.raises(ValueError, match=r"component_sample_counts.*-1"):
        meta(component_sample_counts={0: -1})
    with pytest.raises(ValueError, match=r"component_token_counts.*-5"):
        meta(component_token_counts={1: -5})
    with pytest.raises(TypeError, match=r"component_sample_counts.*\[1, 2\]"):
        meta(component_sample_counts=[1, 2])
    with pytest.raises(TypeError, match=r"component_token_counts.*7"):
        meta(component_token_counts=7)


def test_bad_tags_raise_naming_the_field():
    """`tags: dict[str, Any]`: a non-mapping is a TypeError naming the field and the value."""
    with pytest.raises(TypeError, match=r"SampleMeta\.tags.*\['x'\]"):
        meta(tags=["x"])


def test_bad_contributor_ref_fields():
    """`ContributorRef.cursor: SampleCursor`, `is_last_child: bool`: wrong types raise TypeError."""
    with pytest.raises(TypeError, match=r"ContributorRef\.cursor.*\(0, 0, \(\), \(0, 0, 0\)\)"):
        ContributorRef((0, 0, (), (0, 0, 0)))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ContributorRef\.is_last_child.*1"):
        ContributorRef(cursor(), 1)  # type: ignore[arg-type]


def test_sample_record_meta_must_be_sample_meta():
    """`SampleRecord.meta: SampleMeta`: a TypeError naming the field and what was given."""
    with pytest.raises(TypeError, match=r"SampleRecord\.meta.*dict"):
        SampleRecord({"sample_id": (0, 0, 0)}, {})  # type: ignore[arg-type]


def test_sample_batch_record_not_a_sample_record_names_its_index():
    """`SampleBatch.records: tuple[SampleRecord, ...]`: a non-SampleRecord raises TypeError naming
    its index."""
    good = SampleRecord(meta(), {"input_ids": [1]})
    with pytest.raises(TypeError, match=r"SampleBatch\.records\[2\].*dict"):
        SampleBatch([good, good, {"input_ids": [1]}])
    with pytest.raises(TypeError, match=r"SampleBatch\.records\[0\].*SampleMeta"):
        SampleBatch([meta()])


@pytest.mark.parametrize("bad", [None, 3, "abc", {"a": 1}])
def test_sample_batch_records_not_a_sequence(bad):
    """`SampleBatch(records)` needs a sequence of records: a TypeError naming the field and the value."""
    with pytest.raises(TypeError, match=r"SampleBatch\.records") as info:
        SampleBatch(bad)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("bad", [[cursor()], [(cursor(), True)], ["x"], [ContributorRef(cursor()), None]])
def test_with_contributors_rejects_non_contributor_refs(bad):
    """Decisions: "`"_contributors"` (a tuple of `ContributorRef`)": other items are a TypeError naming
    the item."""
    m = meta()
    before = copy.deepcopy(m)
    with pytest.raises(TypeError, match=r"with_contributors.*item \d.*ContributorRef"):
        m.with_contributors(bad)
    assert m == before


# ---------------------------------------------------------------------------------------------------------
# SampleMeta
# ---------------------------------------------------------------------------------------------------------


def test_meta_fields():
    """Page: "sample_id: tuple[int, int, int] / lane_id: int / chunk_id: int / chunk_offset: int /
    component_sample_counts: dict[int, int] / component_token_counts: dict[int, int] | None /
    lineage: tuple[int, ...] / tags: dict[str, Any]"."""
    m = SampleMeta([0, 1, 2], 3, 4, 5, {0: 3, 1: 2}, {0: 300, 1: 200}, [6, 7], {"k": 1})
    assert m.sample_id == (0, 1, 2) and type(m.sample_id) is tuple
    assert (m.lane_id, m.chunk_id, m.chunk_offset) == (3, 4, 5)
    assert m.component_sample_counts == {0: 3, 1: 2}
    assert m.component_token_counts == {0: 300, 1: 200}
    assert m.lineage == (6, 7) and type(m.lineage) is tuple
    assert m.tags == {"k": 1} and type(m.tags) is dict


def test_component_sample_counts_examples_from_the_page():
    """Page: "For a regular sample this is {cid: 1}. For a packed sample combining 3 from component 0
    and 2 from component 1: {0: 3, 1: 2}"; "component_token_counts ... None until packing occurs after
    tokenization ... e.g., {0: 300, 1: 200}"."""
    regular = meta(component_sample_counts={4: 1})
    assert regular.component_sample_counts == {4: 1}
    assert regular.component_token_counts is None
    packed = meta(component_sample_counts={0: 3, 1: 2}, component_token_counts={0: 300, 1: 200})
    assert packed.component_sample_counts == {0: 3, 1: 2}
    assert packed.component_token_counts == {0: 300, 1: 200}
    # derived metas keep the component tracking
    for derived in (packed.child(0), packed.with_lineage([1]), packed.with_tombstone(),
                    packed.with_contributors([ContributorRef(cursor())])):  # fmt: skip
        assert derived.component_sample_counts == {0: 3, 1: 2}
        assert derived.component_token_counts == {0: 300, 1: 200}


def test_dicts_are_copied_on_construction():
    """Metas are immutable values: the caller's dicts are copied, so later changes don't reach the meta."""
    tags = {"k": 1}
    counts = {0: 1}
    tokens = {0: 10}
    m = SampleMeta((0, 0, 0), 0, 0, component_sample_counts=counts, component_token_counts=tokens, tags=tags)
    assert m.tags is not tags
    assert m.component_sample_counts is not counts
    assert m.component_token_counts is not tokens
    tags["_tombstone"] = True
    counts[1] = 5
    tokens[0] = 99
    assert m.tags == {"k": 1}
    assert m.tombstone is False
    assert m.component_sample_counts == {0: 1}
    assert m.component_token_counts == {0: 10}


def test_meta_is_frozen():
    """Decisions: "Metadata objects are immutable values": assigning a meta field raises."""
    m = meta()
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.lineage = (1,)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.tags = {}  # type: ignore[misc]


def test_meta_equality_is_by_value():
    """Metadata objects are values: equal fields give equal metas."""
    assert meta(lineage=[1], tags={"a": 1}) == meta(lineage=(1,), tags={"a": 1})
    assert meta(lineage=[1]) != meta(lineage=[2])
    assert meta(tags={"a": 1}) != meta(tags={"a": 2})


def test_meta_child_appends_index_to_lineage():
    """Decisions: "`child(index)` appends `index` to `lineage` (cursor and meta alike)"; page: "Return
    metadata for
    the index-th child emitted from this sample"."""
    m = meta(lineage=(2,), tags={"k": "v"})
    kid = m.child(5)
    assert isinstance(kid, SampleMeta)
    assert kid.lineage == (2, 5)
    assert kid.child(0).lineage == (2, 5, 0)
    # everything else is carried over
    assert (kid.sample_id, kid.lane_id, kid.chunk_id, kid.chunk_offset) == ((1, 2, 3), 4, 5, 6)
    assert kid.tags == {"k": "v"}


def test_with_lineage_replaces_with_tuple_of_path():
    """Decisions: "`with_lineage(path)` replaces it with `tuple(path)`"; page: "Return a new SampleMeta
    where the
    lineage is replaced by path"."""
    m = meta(lineage=(9, 9))
    assert m.with_lineage([1, 2]).lineage == (1, 2)
    assert m.with_lineage(iter([3])).lineage == (3,)
    assert m.with_lineage(x for x in (4, 5)).lineage == (4, 5)
    assert m.with_lineage(range(3)).lineage == (0, 1, 2)
    assert m.with_lineage(()).lineage == ()
    assert type(m.with_lineage([1]).lineage) is tuple
    assert m.with_lineage([1, 2]).child(7).lineage == (1, 2, 7)


def test_children_in_emission_order_sort_in_emission_order():
    """Page: "Operators that split inputs must call child() in the order elements are emitted so
    downstream consumers observe an ordering identical to the single-threaded execution"."""
    parents = [meta(chunk_offset=o, sample_id=(0, 0, o)) for o in (0, 1)]
    emitted = [p.child(i) for p in parents for i in range(3)]
    expected_keys = [(5, o, (i,), (0, 0, o)) for o in (0, 1) for i in range(3)]
    assert [m.as_cursor_key() for m in emitted] == expected_keys
    scrambled = [emitted[i] for i in (4, 0, 5, 2, 3, 1)]
    assert [m.as_cursor_key() for m in sorted(scrambled, key=lambda m: m.cursor)] == expected_keys


def test_meta_cursor():
    """Decisions: "`SampleMeta.cursor` is `SampleCursor(chunk_id, chunk_offset, sample_id, lineage)`"."""
    m = meta(sample_id=(7, 8, 9), chunk_id=1, chunk_offset=2, lineage=(3, 4), tags={"_tombstone": True})
    assert m.cursor == SampleCursor(1, 2, (7, 8, 9), (3, 4))
    assert isinstance(m.cursor, SampleCursor)


def test_as_cursor_key():
    """Decisions: "`as_cursor_key()` is `cursor.as_key()`"; page: "the tuple form used for persistence"."""
    m = meta(sample_id=(7, 8, 9), chunk_id=1, chunk_offset=2, lineage=(3, 4))
    assert m.as_cursor_key() == (1, 2, (3, 4), (7, 8, 9))
    assert SampleCursor.from_key(json.loads(json.dumps(m.as_cursor_key()))) == m.cursor


def test_tag_keys_are_the_documented_strings():
    """Decisions: "Tags keys: `"_contributors"` (a tuple of `ContributorRef`), `"_tombstone"` (`True`),
    `"_flush"`
    (`True`, a flush sentinel), `"_padding_length"` (an int written by `pack_flat`)"."""
    ref = ContributorRef(cursor(lineage=(0,)), False)
    m = meta().with_contributors([ref]).with_tombstone()
    assert m.tags == {"_contributors": (ref,), "_tombstone": True}
    assert type(m.tags["_contributors"]) is tuple
    assert m.tags["_tombstone"] is True
    assert meta(tags={"_flush": True}).is_flush_sentinel is True
    assert meta(tags={"_padding_length": 3}).padding_length == 3


def test_unset_means_absent_from_tags():
    """Decisions: "Unset means absent from `tags`"."""
    m = meta()
    assert m.tags == {}
    assert m.with_tombstone(False).tags == {}
    assert m.with_contributors(None).tags == {}
    assert m.with_contributors(()).tags == {}
    assert m.with_tombstone().with_tombstone(False).tags == {}
    ref = ContributorRef(cursor())
    assert m.with_contributors([ref]).with_contributors(None).tags == {}


def test_contributor_and_tombstone_flags_are_stored_inside_tags():
    """Page: "Contributor and tombstone flags are stored inside tags under "_contributors" and
    "_tombstone"" — so a meta built from such tags reads them back."""
    ref = ContributorRef(cursor(lineage=(1,)), True)
    m = meta(tags={"_contributors": (ref,), "_tombstone": True})
    assert m.contributors == (ref,)
    assert m.tombstone is True


def test_contributors_empty_when_unset():
    """Decisions: "`contributors` is the stored tuple, or `()`"."""
    assert meta().contributors == ()
    refs = (ContributorRef(cursor(lineage=(0,)), False), ContributorRef(cursor(lineage=(1,)), True))
    m = meta().with_contributors(list(refs))
    assert m.contributors == refs
    assert type(m.contributors) is tuple


def test_with_contributors_none_and_empty_clear():
    """Decisions: "`with_contributors(None)` and `with_contributors(())` clear it"; page: "set/cleared in
    tags"."""
    ref = ContributorRef(cursor())
    m = meta().with_contributors([ref])
    assert m.contributors == (ref,)
    for cleared in (m.with_contributors(None), m.with_contributors(()), m.with_contributors([])):
        assert cleared.contributors == ()
        assert "_contributors" not in cleared.tags


def test_with_contributors_accepts_any_iterable():
    """`with_contributors(value)` stores `tuple(value)`."""
    refs = [ContributorRef(cursor(lineage=(i,)), i == 2) for i in range(3)]
    assert meta().with_contributors(iter(refs)).contributors == tuple(refs)
    assert meta().with_contributors(r for r in refs).tags["_contributors"] == tuple(refs)


def test_contribution_refs_default_is_own_cursor_last_child():
    """Decisions: "`contribution_refs()` is ... `(ContributorRef(self.cursor, True),)`"; page: "Operators
    that don't
    set contributors (1:1 outputs) are treated as emitting a single contributor with is_last_child=True
    using their own cursor"."""
    m = meta(sample_id=(7, 8, 9), chunk_id=1, chunk_offset=2, lineage=(3,))
    expected = (ContributorRef(SampleCursor(1, 2, (7, 8, 9), (3,)), True),)
    assert m.contribution_refs() == expected
    assert m.with_contributors(()).contribution_refs() == expected


def test_contribution_refs_is_contributors_when_non_empty():
    """Decisions: "`contribution_refs()` is `contributors` when non-empty"."""
    refs = (
        ContributorRef(SampleCursor(0, 1, (0, 0, 1), (0,)), False),
        ContributorRef(SampleCursor(0, 2, (0, 0, 2), ()), True),
    )
    m = meta().with_contributors(refs)
    assert m.contribution_refs() == refs


def test_contribution_cursors():
    """Decisions: "`contribution_cursors()` is the cursors of `contribution_refs()`"."""
    m = meta(sample_id=(7, 8, 9), chunk_id=1, chunk_offset=2, lineage=(3,))
    assert m.contribution_cursors() == (SampleCursor(1, 2, (7, 8, 9), (3,)),)
    a = SampleCursor(0, 1, (0, 0, 1), (0,))
    b = SampleCursor(0, 2, (0, 0, 2))
    m2 = m.with_contributors([ContributorRef(a, False), ContributorRef(b)])
    assert m2.contribution_cursors() == (a, b)


def test_contributor_ref_cursor_pinpoints_base_offset_and_lineage():
    """Page: "cursor pinpoints the base offset and lineage; is_last_child=True denotes the sole
    contributor (or tombstone) that closes that base offset"."""
    ref = ContributorRef(SampleCursor(4, 11, (0, 0, 11), (2, 1)))
    assert ref.cursor.base_offset == (4, 11)
    assert ref.cursor.lineage == (2, 1)
    assert ref.is_last_child is True
    # a tombstone closing its base offset contributes its own cursor as last child
    tomb = meta(chunk_id=4, chunk_offset=11, sample_id=(0, 0, 11)).with_tombstone()
    assert tomb.contribution_refs() == (ContributorRef(SampleCursor(4, 11, (0, 0, 11)), True),)


def test_contributor_ref_value_semantics():
    """ContributorRef is a frozen value: equal by fields, hashable, assignment raises."""
    a = ContributorRef(cursor(), False)
    assert a == ContributorRef(cursor(), False)
    assert a != ContributorRef(cursor(), True)
    assert len({a, ContributorRef(cursor(), False)}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.is_last_child = True  # type: ignore[misc]


def test_tombstone():
    """Decisions: "`tombstone` is `tags.get("_tombstone", False)`; `with_tombstone(False)` clears it"; page:
    "with_tombstone(value=True) Return a new SampleMeta with tombstone marker set/cleared in tags"."""
    m = meta()
    assert m.tombstone is False
    t = m.with_tombstone()
    assert t.tombstone is True
    assert t.tags["_tombstone"] is True
    assert m.with_tombstone(True).tombstone is True
    cleared = t.with_tombstone(False)
    assert cleared.tombstone is False
    assert "_tombstone" not in cleared.tags
    assert meta(tags={"_tombstone": True}).tombstone is True


def test_is_flush_sentinel():
    """Decisions: "`is_flush_sentinel` is `tags.get("_flush", False)`"; page: "True if this record is a
    flush sentinel"."""
    assert meta().is_flush_sentinel is False
    assert meta(tags={"_flush": True}).is_flush_sentinel is True
    assert meta(tags={"_flush": False}).is_flush_sentinel is False


@pytest.mark.parametrize(
    ("tags", "expected"),
    [
        ({}, False),
        ({"_tombstone": True}, True),
        ({"_flush": True}, True),
        ({"_tombstone": True, "_flush": True}, True),
        ({"_padding_length": 4}, False),
        ({"_contributors": ()}, False),
        ({"other": True}, False),
    ],
)
def test_is_sentinel(tags, expected):
    """Decisions: "`is_sentinel` is `tombstone or is_flush_sentinel`"; page: "True if this record is a
    control signal
    (tombstone, flush, etc.)"."""
    assert meta(tags=tags).is_sentinel is expected


def test_padding_length():
    """Decisions: "`padding_length` is `tags.get("_padding_length")` (an int or `None`)"; page: "Trailing
    pad-token
    count of a flat pack_flat record, else None"."""
    assert meta().padding_length is None
    assert meta(tags={"_padding_length": 0}).padding_length == 0
    assert meta(tags={"_padding_length": 7}).padding_length == 7
    assert meta(tags={"_padding_length": 7}).child(0).padding_length == 7


def _every_meta_call(m: SampleMeta) -> list[Any]:
    ref = ContributorRef(SampleCursor(0, 0, (0, 0, 0)), False)
    return [
        m.with_lineage([1, 2]),
        m.child(0),
        m.cursor,
        m.as_cursor_key(),
        m.contribution_refs(),
        m.contribution_cursors(),
        m.contributors,
        m.tombstone,
        m.is_sentinel,
        m.is_flush_sentinel,
        m.padding_length,
        m.with_contributors([ref]),
        m.with_contributors(None),
        m.with_contributors(()),
        m.with_tombstone(),
        m.with_tombstone(False),
    ]


def test_with_and_child_never_change_the_receiver():
    """Decisions: "`with_*` and `child` return new objects and never change the receiver, its `tags` dict
    included"."""
    ref = ContributorRef(cursor(lineage=(0,)), True)
    m = meta(
        lineage=(1,),
        component_sample_counts={0: 2},
        component_token_counts={0: 20},
        tags={"_contributors": (ref,), "_tombstone": True, "_flush": True, "_padding_length": 2, "u": [1]},
    )
    before = copy.deepcopy(m)
    tags_obj = m.tags
    derived = [
        m.with_lineage([]),
        m.child(3),
        m.with_contributors(None),
        m.with_contributors(()),
        m.with_contributors([ContributorRef(cursor(), False)]),
        m.with_tombstone(),
        m.with_tombstone(False),
    ]
    _every_meta_call(m)
    assert m == before
    assert m.tags is tags_obj
    assert m.tags == before.tags
    for d in derived:
        assert d is not m
        assert d.tags is not m.tags
        assert d.component_sample_counts is not m.component_sample_counts
    # mutating a derived meta's dicts does not reach the receiver either
    derived[1].tags["u2"] = 1
    derived[1].component_sample_counts[9] = 9
    assert m == before


def test_cursor_methods_never_change_the_receiver():
    """Decisions: "Metadata objects are immutable values": `child` returns a new cursor, the receiver is
    unchanged."""
    c = SampleCursor(3, 7, (0, 1, 42), (1,))
    before = copy.deepcopy(c)
    kid = c.child(2)
    c.as_key()
    _ = c.base_offset
    assert kid is not c
    assert c == before
    assert c.lineage == (1,)


# ---------------------------------------------------------------------------------------------------------
# SampleRecord, SampleBatch
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [b"ab", memoryview(b"ab"), "text", 3, 1.5, 2j, [1, 2], {"input_ids": [1, 2]}, np.arange(3)],
)
def test_sample_record_holds_any_sample_payload(payload):
    """Page: "SampleRecord(meta, payload) ... payload: bytes | memoryview | str | int | float | complex |
    Any | list[SamplePayload] | dict[Any, SamplePayload]" — stored as given."""
    m = meta()
    r = SampleRecord(m, payload)
    assert r.meta is m
    assert r.payload is payload


def test_sample_record_is_frozen():
    """Page: "Sample payload bundled with its metadata for transport through stages": a frozen bundle."""
    r = SampleRecord(meta(), {"input_ids": [1]})
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.payload = {}  # type: ignore[misc]


def _batch() -> SampleBatch:
    metas = [
        SampleMeta((0, 0, 10), lane_id=2, chunk_id=7, lineage=(1,)),
        SampleMeta((0, 1, 11), lane_id=0, chunk_id=3, lineage=()),
        SampleMeta((1, 0, 12), lane_id=2, chunk_id=3, lineage=(0, 4)),
    ]
    return SampleBatch([SampleRecord(m, {"input_ids": [i, i + 1]}) for i, m in enumerate(metas)])


def test_sample_batch_records_is_a_tuple():
    """Decisions: "`SampleBatch.records` is a tuple"; page: "records: tuple[SampleRecord, ...]"."""
    b = _batch()
    assert type(b.records) is tuple
    assert [r.payload for r in b.records] == [
        {"input_ids": [0, 1]},
        {"input_ids": [1, 2]},
        {"input_ids": [2, 3]},
    ]
    gen = SampleBatch(r for r in b.records)
    assert gen.records == b.records


def test_sample_batch_lane_ids_and_chunk_ids():
    """Decisions: "`lane_ids` and `chunk_ids` are tuples taken from each record's meta, in order"."""
    b = _batch()
    assert b.lane_ids == (2, 0, 2)
    assert b.chunk_ids == (7, 3, 3)
    assert type(b.lane_ids) is tuple and type(b.chunk_ids) is tuple


def test_sample_batch_ids():
    """Decisions: "`ids` is the tuple of `sample_id`s"; page: "property ids: tuple[tuple[int, int, int],
    ...]"."""
    assert _batch().ids == ((0, 0, 10), (0, 1, 11), (1, 0, 12))


def test_sample_batch_lineage_paths():
    """Decisions: "`lineage_paths` the tuple of `lineage`s"; page: "property lineage_paths:
    tuple[tuple[int, ...], ...]"."""
    assert _batch().lineage_paths == ((1,), (), (0, 4))


def test_sample_batch_len_and_empty():
    """Page: "A batch of SampleRecord": its length is its number of records; an empty batch is valid."""
    assert len(_batch()) == 3
    empty = SampleBatch([])
    assert len(empty) == 0
    assert empty.records == () and empty.lane_ids == () and empty.chunk_ids == ()
    assert empty.ids == () and empty.lineage_paths == ()


def test_sample_batch_lane_and_chunk_ids_are_not_constructor_arguments():
    """Decisions: "`SampleBatch(records)`": `lane_ids` and `chunk_ids` are derived, not passed."""
    with pytest.raises(TypeError):
        SampleBatch((), lane_ids=())  # type: ignore[call-arg]


# ---------------------------------------------------------------------------------------------------------
# Pickling
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_everything_pickles(protocol):
    """Metadata, cursors, ContributorRef, records and batches pickle (DataLoader workers send them)."""
    ref = ContributorRef(SampleCursor(1, 2, (3, 4, 5), (6,)), False)
    m = SampleMeta(
        (3, 4, 5), 1, 1, 2, {0: 3, 1: 2}, {0: 300, 1: 200}, (6,),
        {"_contributors": (ref,), "_tombstone": True, "_flush": True, "_padding_length": 4},
    )  # fmt: skip
    objects = [
        SampleCursor(1, 2, (3, 4, 5), (6, 7)),
        ref,
        m,
        SampleRecord(m, {"input_ids": [1, 2]}),
        _batch(),
    ]
    for obj in objects:
        back = pickle.loads(pickle.dumps(obj, protocol=protocol))
        assert type(back) is type(obj)
        assert back == obj
    back_meta = pickle.loads(pickle.dumps(m, protocol=protocol))
    assert back_meta.contributors == (ref,)
    assert back_meta.tombstone and back_meta.is_flush_sentinel and back_meta.padding_length == 4
    back_cursor = pickle.loads(pickle.dumps(objects[0], protocol=protocol))
    assert hash(back_cursor) == hash(objects[0])
    back_batch = pickle.loads(pickle.dumps(objects[-1], protocol=protocol))
    assert back_batch.lane_ids == (2, 0, 2)
    assert back_batch.chunk_ids == (7, 3, 3)


# ---------------------------------------------------------------------------------------------------------
# Hypothesis properties
# ---------------------------------------------------------------------------------------------------------

small = st.integers(min_value=-2, max_value=3)
nonneg = st.integers(min_value=0, max_value=3)
lineages = st.lists(nonneg, max_size=3)
sample_ids = st.tuples(nonneg, nonneg, nonneg)
cursors = st.builds(SampleCursor, small, nonneg, sample_ids, lineages)
refs = st.builds(ContributorRef, cursors, st.booleans())
counts = st.dictionaries(nonneg, st.integers(min_value=0, max_value=50), max_size=3)


@st.composite
def metas(draw) -> SampleMeta:
    tags: dict[str, Any] = {}
    if draw(st.booleans()):
        tags["_contributors"] = tuple(draw(st.lists(refs, min_size=1, max_size=3)))
    if draw(st.booleans()):
        tags["_tombstone"] = True
    if draw(st.booleans()):
        tags["_flush"] = True
    if draw(st.booleans()):
        tags["_padding_length"] = draw(nonneg)
    if draw(st.booleans()):
        tags["user"] = draw(st.lists(small, max_size=3))  # a mutable value
    return SampleMeta(
        draw(sample_ids),
        draw(nonneg),
        draw(small),
        draw(nonneg),
        draw(counts),
        draw(st.none() | counts),
        tuple(draw(lineages)),
        tags,
    )


PROPS = settings(max_examples=100, deadline=None)


@PROPS
@given(st.lists(cursors, max_size=8))
def test_prop_cursor_order_agrees_with_as_key_order(cs):
    """Decisions: "`SampleCursor` is ... totally ordered by `as_key()`": sorting cursors sorts their keys."""
    assert [c.as_key() for c in sorted(cs)] == sorted(c.as_key() for c in cs)


@PROPS
@given(cursors, cursors)
def test_prop_pairwise_comparisons_agree_with_as_key(a, b):
    """Decisions: "totally ordered by `as_key()`": every comparison operator agrees with the keys'."""
    ka, kb = a.as_key(), b.as_key()
    assert (a < b) == (ka < kb)
    assert (a <= b) == (ka <= kb)
    assert (a > b) == (ka > kb)
    assert (a >= b) == (ka >= kb)
    assert (a == b) == (ka == kb)
    assert (a != b) == (ka != kb)
    if a == b:
        assert hash(a) == hash(b)


@PROPS
@given(cursors)
def test_prop_from_key_round_trip_and_hash(c):
    """Decisions: "`from_key(c.as_key()) == c`", also through JSON, with equal hashes."""
    back = SampleCursor.from_key(c.as_key())
    assert back == c and hash(back) == hash(c)
    via_json = SampleCursor.from_key(json.loads(json.dumps(c.as_key())))
    assert via_json == c and hash(via_json) == hash(c)


@PROPS
@given(cursors, nonneg, nonneg)
def test_prop_cursor_child_composes(c, i, j):
    """Decisions: "`child(index)` appends `index` to `lineage`": c.child(i).child(j).lineage == c.lineage
    + (i, j)."""
    kid = c.child(i).child(j)
    assert kid.lineage == (*c.lineage, i, j)
    assert kid.base_offset == c.base_offset
    assert kid.sample_id == c.sample_id
    assert c < c.child(i) < c.child(i).child(j)


@PROPS
@given(metas(), lineages, nonneg, nonneg)
def test_prop_meta_child_and_with_lineage_compose(m, path, i, j):
    """Decisions: "`with_lineage(path)` replaces it with `tuple(path)`" and child appends:
    m.with_lineage(p).child(i).lineage == tuple(p) + (i,)."""
    assert m.with_lineage(path).child(i).lineage == (*path, i)
    assert m.child(i).child(j).lineage == (*m.lineage, i, j)
    assert m.child(i).with_lineage(path).lineage == tuple(path)
    assert m.child(i).cursor == m.cursor.child(i)
    assert m.with_lineage(path).cursor == SampleCursor(m.chunk_id, m.chunk_offset, m.sample_id, path)


@PROPS
@given(metas())
def test_prop_meta_methods_never_mutate(m):
    """Decisions: "never change the receiver, its `tags` dict included" (deep-copy comparison after every
    method)."""
    before = copy.deepcopy(m)
    tags_before = copy.deepcopy(m.tags)
    tags_obj = m.tags
    _every_meta_call(m)
    assert m == before
    assert m.tags is tags_obj
    assert m.tags == tags_before
    assert m.component_sample_counts == before.component_sample_counts
    assert m.component_token_counts == before.component_token_counts


@PROPS
@given(metas())
def test_prop_meta_properties_follow_tags(m):
    """The tag-backed properties read exactly the documented keys."""
    t = m.tags
    assert m.contributors == t.get("_contributors", ())
    assert m.tombstone == t.get("_tombstone", False)
    assert m.is_flush_sentinel == t.get("_flush", False)
    assert m.is_sentinel == (t.get("_tombstone", False) or t.get("_flush", False))
    assert m.padding_length == t.get("_padding_length")
    if t.get("_contributors"):
        assert m.contribution_refs() == t["_contributors"]
    else:
        assert m.contribution_refs() == (ContributorRef(m.cursor, True),)
    assert m.contribution_cursors() == tuple(r.cursor for r in m.contribution_refs())


@PROPS
@given(cursors)
def test_prop_cursor_methods_never_mutate(c):
    """Cursors are immutable values: no method changes the receiver."""
    before = copy.deepcopy(c)
    c.child(0)
    c.as_key()
    _ = c.base_offset
    hash(c)
    SampleCursor.from_key(c.as_key())
    assert c == before
    assert c.as_key() == before.as_key()


@PROPS
@given(st.lists(metas(), max_size=5))
def test_prop_batch_views_and_pickle(ms):
    """SampleBatch views are each record's meta fields in order, and the batch pickles."""
    b = SampleBatch([SampleRecord(m, {"input_ids": [1]}) for m in ms])
    assert len(b) == len(ms)
    assert b.lane_ids == tuple(m.lane_id for m in ms)
    assert b.chunk_ids == tuple(m.chunk_id for m in ms)
    assert b.ids == tuple(m.sample_id for m in ms)
    assert b.lineage_paths == tuple(m.lineage for m in ms)
    assert pickle.loads(pickle.dumps(b)) == b
