"""The records: the bottom of the data model (cursors, metadata, records), re-exported by ``types``."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import total_ordering
from typing import Any, TypeAlias, TypeGuard, Union

from zephon_collate.core.text import shown

__all__ = [
    "CONTRIBUTORS_TAG",
    "FLUSH_TAG",
    "PADDING_LENGTH_TAG",
    "SEGMENTS_TAG",
    "TOMBSTONE_TAG",
    "ChunkId",
    "ChunkOffset",
    "ComponentId",
    "ContributorRef",
    "DatasetId",
    "LaneId",
    "LineageIndex",
    "LocalSampleId",
    "SampleCursor",
    "SampleMeta",
    "SamplePayload",
    "SamplePayloadArray",
    "SampleRecord",
    "ShardId",
]

ChunkId: TypeAlias = int
ChunkOffset: TypeAlias = int
ComponentId: TypeAlias = int
DatasetId: TypeAlias = int
LaneId: TypeAlias = int
LineageIndex: TypeAlias = int
LocalSampleId: TypeAlias = int
ShardId: TypeAlias = int
SamplePayloadArray: TypeAlias = Any
SamplePayload: TypeAlias = Union[  # noqa: UP007 (a recursive alias needs the string form)
    bytes,
    memoryview,
    str,
    int,
    float,
    complex,
    SamplePayloadArray,
    list["SamplePayload"],
    dict[Any, "SamplePayload"],
]

CONTRIBUTORS_TAG = "_contributors"
TOMBSTONE_TAG = "_tombstone"
FLUSH_TAG = "_flush"
PADDING_LENGTH_TAG = "_padding_length"
SEGMENTS_TAG = "_segments"
"""A packed row's segments, in order: where each came from (written by ``pack_flat``)."""

_CursorKey: TypeAlias = tuple[int, int, tuple[int, ...], tuple[int, int, int]]


def _is_int(value: object) -> TypeGuard[int]:
    """True for an integer that is not a bool (NumPy integers included)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(owner: str, name: str, value: object, *, nonnegative: bool = False) -> int:
    if not _is_int(value):
        raise TypeError(f"{owner}.{name} must be an int, got {shown(value)} ({type(value).__name__})")
    if nonnegative and value < 0:
        raise ValueError(f"{owner}.{name} must be >= 0, got {shown(value)}")
    return int(value)


def _check_sample_id(owner: str, value: object) -> tuple[int, int, int]:
    if (
        isinstance(value, (str, bytes))
        or not isinstance(value, Sequence)
        or len(value) != 3
        or not all(_is_int(part) for part in value)
    ):
        raise TypeError(
            f"{owner}.sample_id must be three ints (dataset, shard, local id), got {shown(value)}"
        )
    return (int(value[0]), int(value[1]), int(value[2]))


def _check_lineage(owner: str, value: object) -> tuple[int, ...]:
    path = None if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) else tuple(value)
    if path is None or not all(_is_int(index) for index in path):
        raise TypeError(f"{owner}.lineage must be a sequence of ints, got {shown(value)}")
    return tuple(int(index) for index in path)


def _check_counts(owner: str, name: str, value: object) -> dict[int, int]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{owner}.{name} must be a dict of component id -> count, got {shown(value)}")
    for key, count in value.items():
        if not _is_int(key) or not _is_int(count) or count < 0:
            raise ValueError(
                f"{owner}.{name} must map int component ids to counts >= 0, got {shown(key)}: {shown(count)}"
            )
    return {int(key): int(count) for key, count in value.items()}


@total_ordering
@dataclass(frozen=True, eq=True)
class SampleCursor:
    """Stable ordering key that survives fan-out, ordered by :meth:`as_key`.

    Parameters:
        chunk_id: the chunk the base sample was read from.
        chunk_offset: the base sample's offset in that chunk (``>= 0``).
        sample_id: ``(dataset_id, shard_id, local_sample_id)``, three ints.
        lineage: child indices taken since the base sample, outermost first.

    Example:
        >>> base = SampleCursor(3, 7, (0, 1, 42))
        >>> base.child(0) < base.child(1), base.child(1).as_key()
        (True, (3, 7, (1,), (0, 1, 42)))
    """

    chunk_id: int
    chunk_offset: int
    sample_id: tuple[int, int, int]
    lineage: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        owner = "SampleCursor"
        put = object.__setattr__
        put(self, "chunk_id", _check_int(owner, "chunk_id", self.chunk_id))
        put(self, "chunk_offset", _check_int(owner, "chunk_offset", self.chunk_offset, nonnegative=True))
        put(self, "sample_id", _check_sample_id(owner, self.sample_id))
        put(self, "lineage", _check_lineage(owner, self.lineage))

    @staticmethod
    def from_key(key: Sequence[Any]) -> SampleCursor:
        """A cursor from :meth:`as_key`'s tuple, or the same shape with lists (as read from JSON)."""
        if isinstance(key, (str, bytes)) or not isinstance(key, Sequence) or len(key) != 4:
            raise TypeError(
                "SampleCursor.from_key expects (chunk_id, chunk_offset, lineage, sample_id), got "
                f"{shown(key)}"
            )
        chunk_id, chunk_offset, lineage, sample_id = key
        return SampleCursor(chunk_id, chunk_offset, sample_id, lineage)

    def child(self, index: int) -> SampleCursor:
        """Return the cursor for the ``index``-th child of this element (``index`` appended to lineage)."""
        index = _check_int("SampleCursor.child", "index", index)
        return SampleCursor(self.chunk_id, self.chunk_offset, self.sample_id, (*self.lineage, index))

    def as_key(self) -> _CursorKey:
        """Return the canonical tuple key used in checkpoints and comparisons."""
        return (self.chunk_id, self.chunk_offset, self.lineage, self.sample_id)

    @property
    def base_offset(self) -> tuple[int, int]:
        """Return ``(chunk_id, chunk_offset)`` for eviction/base-offset accounting."""
        return (self.chunk_id, self.chunk_offset)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, SampleCursor):
            return NotImplemented
        return self.as_key() < other.as_key()


@dataclass(frozen=True)
class ContributorRef:
    """A contributing child of a base sample; ``is_last_child`` closes that base offset for eviction.

    Example:
        >>> ref = ContributorRef(SampleCursor(0, 5, (0, 0, 5)))
        >>> ref.is_last_child, ref.cursor.base_offset
        (True, (0, 5))
    """

    cursor: SampleCursor
    is_last_child: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.cursor, SampleCursor):
            raise TypeError(f"ContributorRef.cursor must be a SampleCursor, got {shown(self.cursor)}")
        if not isinstance(self.is_last_child, bool):
            raise TypeError(f"ContributorRef.is_last_child must be a bool, got {shown(self.is_last_child)}")


@dataclass(frozen=True, eq=True)
class SampleMeta:
    """Metadata that identifies a sample in a shard; immutable (``with_*`` and ``child`` return new ones).

    Parameters:
        sample_id: ``(dataset_id, shard_id, local_sample_id)``, three ints.
        lane_id, chunk_id: where the sample comes from.
        chunk_offset: its offset in the chunk (``>= 0``).
        component_sample_counts: component id to the number of original samples.
        component_token_counts: component id to tokens, or ``None`` until packing.
        lineage: child indices taken after fan-out (operators call :meth:`child` in emission order).
        tags: the flags (``"_contributors"``, ``"_tombstone"``, ``"_flush"``, ``"_padding_length"``); copied.

    Example:
        >>> meta = SampleMeta((0, 0, 9), lane_id=1, chunk_id=2, chunk_offset=9)
        >>> meta.child(0).child(3).lineage, meta.with_tombstone().is_sentinel, meta.is_sentinel
        ((0, 3), True, False)
    """

    sample_id: tuple[int, int, int]
    lane_id: int
    chunk_id: int
    chunk_offset: int = 0
    component_sample_counts: dict[int, int] = field(default_factory=dict)
    component_token_counts: dict[int, int] | None = None
    lineage: tuple[int, ...] = ()
    tags: dict[str, Any] = field(default_factory=dict)

    __hash__ = None  # type: ignore[assignment]  # holds dicts: a value, but not hashable

    def __post_init__(self) -> None:
        owner = "SampleMeta"
        put = object.__setattr__
        put(self, "sample_id", _check_sample_id(owner, self.sample_id))
        put(self, "lane_id", _check_int(owner, "lane_id", self.lane_id))
        put(self, "chunk_id", _check_int(owner, "chunk_id", self.chunk_id))
        put(self, "chunk_offset", _check_int(owner, "chunk_offset", self.chunk_offset, nonnegative=True))
        samples, tokens = self.component_sample_counts, self.component_token_counts
        put(self, "component_sample_counts", _check_counts(owner, "component_sample_counts", samples))
        if tokens is not None:
            put(self, "component_token_counts", _check_counts(owner, "component_token_counts", tokens))
        put(self, "lineage", _check_lineage(owner, self.lineage))
        if not isinstance(self.tags, Mapping):
            raise TypeError(f"SampleMeta.tags must be a dict, got {shown(self.tags)}")
        put(self, "tags", dict(self.tags))

    def with_lineage(self, path: Iterable[int]) -> SampleMeta:
        """Return a new SampleMeta whose lineage is ``tuple(path)``."""
        return replace(self, lineage=_check_lineage("SampleMeta.with_lineage", path))

    def child(self, index: int) -> SampleMeta:
        """Return metadata for the ``index``-th child emitted from this sample."""
        index = _check_int("SampleMeta.child", "index", index)
        return replace(self, lineage=(*self.lineage, index))

    @property
    def cursor(self) -> SampleCursor:
        """Return a SampleCursor ordering key for this metadata."""
        return SampleCursor(self.chunk_id, self.chunk_offset, self.sample_id, self.lineage)

    def as_cursor_key(self) -> _CursorKey:
        """Convenience helper returning the tuple form used for persistence."""
        return self.cursor.as_key()

    def contribution_refs(self) -> tuple[ContributorRef, ...]:
        """Contributor references for eviction/progress (none set: its own cursor, ``is_last_child=True``)."""
        return self.contributors or (ContributorRef(self.cursor, True),)

    def contribution_cursors(self) -> tuple[SampleCursor, ...]:
        return tuple(ref.cursor for ref in self.contribution_refs())

    @property
    def contributors(self) -> tuple[ContributorRef, ...]:
        """The stored contributor tuple, or ``()``."""
        return tuple(self.tags.get(CONTRIBUTORS_TAG, ()))

    @property
    def tombstone(self) -> bool:
        """True if the ``"_tombstone"`` tag is set."""
        return bool(self.tags.get(TOMBSTONE_TAG, False))

    @property
    def is_sentinel(self) -> bool:
        """True if this record is a control signal (tombstone, flush, etc.)."""
        return self.tombstone or self.is_flush_sentinel

    @property
    def is_flush_sentinel(self) -> bool:
        """True if this record is a flush sentinel (triggers accumulator flush)."""
        return bool(self.tags.get(FLUSH_TAG, False))

    @property
    def padding_length(self) -> int | None:
        """Trailing pad-token count of a flat ``pack_flat`` record, else ``None``."""
        return self.tags.get(PADDING_LENGTH_TAG)

    def with_contributors(self, value: Iterable[ContributorRef] | None) -> SampleMeta:
        """Return a new SampleMeta with contributors set (or cleared by ``None`` / ``()``)."""
        tags = dict(self.tags)
        refs = () if value is None else tuple(value)
        for index, ref in enumerate(refs):
            if not isinstance(ref, ContributorRef):
                raise TypeError(
                    f"SampleMeta.with_contributors: item {index} must be a ContributorRef, got {shown(ref)}"
                )
        if refs:
            tags[CONTRIBUTORS_TAG] = refs
        else:
            tags.pop(CONTRIBUTORS_TAG, None)
        return replace(self, tags=tags)

    def with_tombstone(self, value: bool = True) -> SampleMeta:
        """Return a new SampleMeta with the tombstone marker set (or cleared by ``False``)."""
        tags = dict(self.tags)
        if value:
            tags[TOMBSTONE_TAG] = True
        else:
            tags.pop(TOMBSTONE_TAG, None)
        return replace(self, tags=tags)


@dataclass(frozen=True)
class SampleRecord:
    """Sample payload bundled with its metadata for transport through stages.

    Example:
        >>> SampleRecord(SampleMeta((0, 0, 1), 0, 0), {"input_ids": [1, 2, 3]}).meta.sample_id
        (0, 0, 1)
    """

    meta: SampleMeta
    payload: SamplePayload

    def __post_init__(self) -> None:
        if not isinstance(self.meta, SampleMeta):
            raise TypeError(f"SampleRecord.meta must be a SampleMeta, got {type(self.meta).__name__}")
