"""FlatPacker: :func:`~zephon_collate.packing.pack_flat` over an endless stream, resumable."""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, cast

from zephon_collate.core.checks import is_zero_d, keywords
from zephon_collate.core.keys import INPUT_IDS
from zephon_collate.core.records import SampleMeta, SampleRecord
from zephon_collate.core.text import shown
from zephon_collate.packing.reader import REQUIRED, Document, Reader, StreamOptions
from zephon_collate.packing.rows import (
    Engine,
    Piece,
    build_row,
    document_piece,
    group_pieces,
    refuse_cut_columns,
    split_document,
)
from zephon_collate.packing.state import (
    changed_options,
    check_count,
    check_saved,
    corrupt,
    piece_from_state,
    piece_state,
    pieces_from_state,
    same_value,
)
from zephon_collate.read.arrow import ColumnarBatch, Columns, columns_of
from zephon_collate.read.rows import as_record, describe_record, example_names

__all__ = ["STATE_VERSION", "FlatPacker"]

STATE_VERSION = 1


class FlatPacker:
    """Pack a stream of tokenized records into flat rows of exactly ``seq_len`` tokens, resumably.

    ``pack_flat``'s rows, each yielded as soon as it is closed; how a stream differs: docs/packing.md.

    Parameters:
        seq_len, pad_token_id, emit_positions, tokens_field, strategy, overflow, fields, float_fields,
        group_key: as for :func:`~zephon_collate.packing.pack_flat`.
        buffer_size: pieces per best-fit round, an int >= 1 (default 1024).

    Example:
        >>> from zephon_collate.types import SampleMeta
        >>> docs = [SampleRecord(SampleMeta((0, 0, i), 0, 0, i), [i + 1] * n)
        ...         for i, n in enumerate([3, 2, 4, 1])]
        >>> packer = FlatPacker(5, pad_token_id=0, strategy="best_fit", buffer_size=3)
        >>> [row.payload["input_ids"].tolist() for row in packer.pack(docs)]
        [[3, 3, 3, 3, 0], [1, 1, 1, 2, 2], [4, 0, 0, 0, 0]]
        >>> packer = FlatPacker(5, pad_token_id=0)
        >>> first = next(iter(packer.pack(docs)))
        >>> state = packer.state_dict()
        >>> resumed = FlatPacker(5, pad_token_id=0)
        >>> resumed.load_state_dict(state)
        >>> [row.payload["input_ids"].tolist() for row in resumed.pack(docs[state["records_consumed"] :])]
        [[3, 3, 3, 3, 4]]
    """

    @keywords(StreamOptions, "FlatPacker", REQUIRED)
    def __init__(self, *args: Any, **options: Any) -> None:
        self.options = StreamOptions.create("FlatPacker", *args, **options)
        self._reset()
        self._places: Callable[[int], int] | None = None  # where input records sit in their source

    def _reset(self) -> None:
        options = self.options
        self._reader = Reader.of(options)
        self._engine = Engine(options.seq_len, options.strategy == "best_fit", options.buffer_size or 1)
        self._consumed = self._emitted = 0
        self._group: _Group | None = None

    def _number_by(self, places: Callable[[int], int]) -> None:
        """Name the input's ``k``-th record (and id a plain payload) as the source's ``places(k)``-th: a
        stage over a worker's slice of the source (``PackedStream``, ``PackIterDataset``)."""
        self._places = places

    def _place(self, consumed: int) -> int:
        return consumed if self._places is None else self._places(consumed)

    @property
    def records_consumed(self) -> int:
        """Input records read so far (sentinels included): where the input resumes after a restore."""
        return self._consumed

    @property
    def rows_emitted(self) -> int:
        """Rows yielded so far."""
        return self._emitted

    def pack(self, records: Iterable[SampleRecord | ColumnarBatch]) -> Iterator[SampleRecord]:
        """Yield packed rows from ``records`` as each is closed (restored rows first); the end flushes."""
        zero_d = is_zero_d(records)
        if isinstance(records, (str, bytes, Mapping)) or not isinstance(records, Iterable) or zero_d:
            raise TypeError(
                f"FlatPacker.pack: records must be an iterable of SampleRecord, got {type(records).__name__}"
            )
        yield from self._drain()
        documents = self._read_all(records)
        for place, sample in enumerate(records):
            if not isinstance(sample, SampleRecord):
                columns = columns_of(sample)
                if columns is not None:
                    yield from self._pack_columns(columns)
                    continue
            at = self._place(self._consumed)  # the record's place in its source
            record = as_record(sample, at, "FlatPacker")
            if record.meta.is_flush_sentinel:
                self._close_group()
                self._engine.flush()
            elif not record.meta.tombstone and (
                document := self._reader.read(record, at) if documents is None else documents[place]
            ):
                if self.options.group_key is None:
                    self._engine.push(split_document(record, at, document, self.options))
                else:
                    if self._group is not None and not same_value(document.group, self._group.key):
                        self._close_group()
                    if self._group is None:
                        where = describe_record(at, record)
                        self._group = _Group(document.group, where, [])
                    self._group.members.append(document_piece(record, document))
            self._consumed += 1
            yield from self._drain()
        self._close_group()
        self._engine.flush()
        yield from self._drain()

    def _read_all(self, records: Iterable[object]) -> dict[int, Document | None] | None:
        """A list of records' documents by place, read as one batch; ``None``: read them as they come."""
        given = cast(Sequence[SampleRecord], records)
        if type(records) not in (list, tuple) or not all(isinstance(item, SampleRecord) for item in given):
            return None
        read = [
            (place, record)
            for place, record in enumerate(given)
            if not record.meta.is_flush_sentinel and not record.meta.tombstone
        ]
        if len(read) < 2:
            return None
        places = [self._place(self._consumed + place) for place, _ in read]
        found = self._reader.read_all([record for _, record in read], places)
        return None if found is None else {place: doc for (place, _), doc in zip(read, found, strict=True)}

    def _close_group(self) -> None:
        """Hand the group being read to the engine, as one unit."""
        group, self._group = self._group, None
        if group is not None:
            self._engine.push(group_pieces(group.members, group.where, group.key, self.options))

    def _pack_columns(self, columns: Columns) -> Iterator[SampleRecord]:
        """A columnar batch's documents, read and checked at once, then pushed one by one."""
        self.options.check_columnar("FlatPacker")
        self._close_group()
        first = self._consumed
        tokens, fields = self._reader.read_columns(columns, self._place(first))  # a stage's: one row
        refuse_cut_columns(columns, tokens, self.options, lambda row: example_names(self._place(first + row)))
        starts, ends = tokens.offsets[:-1].tolist(), tokens.offsets[1:].tolist()
        values = tokens.host
        hosts = {name: field.host for name, field in fields.items()}
        for row, (start, end) in enumerate(zip(starts, ends, strict=True)):
            index = self._place(first + row)
            if end > start:
                record = SampleRecord(SampleMeta((0, 0, index), 0, 0, index), {})
                piece_fields = {name: field[start:end] for name, field in hosts.items()}
                document = Document(values[start:end], piece_fields, None, None)
                self._engine.push(split_document(record, index, document, self.options))
            self._consumed += 1
            yield from self._drain()

    def _drain(self) -> Iterator[SampleRecord]:
        ready = self._engine.ready
        while ready:
            pieces = ready.popleft()
            self._emitted += 1
            yield build_row(pieces, self.options, self._reader.tokens_name or INPUT_IDS, self._reader.packed)

    def state_dict(self) -> dict[str, Any]:
        """The packer's state as plain, picklable data (copies); resume the input at ``records_consumed``."""
        engine = self._engine
        group = self._group
        return {
            "version": STATE_VERSION,
            "options": copy.deepcopy(self.options.plain()),
            "tokens_field": self._reader.tokens_name,
            "fields": None if self._reader.fields is None else list(self._reader.fields),
            "records_consumed": self._consumed,
            "rows_emitted": self._emitted,
            "pending": [piece_state(piece) for piece in engine.pending],
            "ready": [[piece_state(piece) for piece in row] for row in engine.ready],
            "group": None
            if group is None
            else {"key": group.key, "where": group.where, "members": [piece_state(p) for p in group.members]},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` taken from a packer with the same options."""
        keys = ("version", "options", "tokens_field", "fields", "records_consumed", "rows_emitted")
        check_saved(state, "FlatPacker", (*keys, "pending", "ready"), STATE_VERSION)
        if not isinstance(state["options"], Mapping):
            raise ValueError(
                "FlatPacker.load_state_dict: the state is corrupt (its options are not a dict); "
                "restore a state_dict() saved by FlatPacker, unchanged"
            )
        detail = changed_options(dict(state["options"]), self.options.plain())
        if detail:
            raise ValueError(f"FlatPacker.load_state_dict: the state was saved with other options ({detail})")
        tokens_name, fields = state["tokens_field"], state["fields"]
        if tokens_name is not None and not isinstance(tokens_name, str):
            raise corrupt("state['tokens_field']", f"must be a field name or None, got {shown(tokens_name)}")
        if fields is not None:
            if isinstance(fields, (str, bytes)) or not isinstance(fields, Sequence):
                raise corrupt(
                    "state['fields']", f"must be a list of field names or None, got {shown(fields)}"
                )
            fields = tuple(fields)
            if not all(isinstance(name, str) for name in fields):
                raise corrupt("state['fields']", f"must hold field names, got {shown(fields)}")
        consumed = check_count(state["records_consumed"], "state['records_consumed']")
        emitted = check_count(state["rows_emitted"], "state['rows_emitted']")
        opts = self.options
        packed = (*(fields or ()), *(spec.name for spec in opts.floats))
        pending, rows = pieces_from_state(
            state["pending"], state["ready"], opts.seq_len, packed, opts.strategy == "greedy"
        )
        group = _group_from_state(state.get("group"), opts.seq_len, packed)  # absent from older states
        ready = deque(rows)
        self._reset()
        self._group = group
        self._reader.tokens_name, self._reader.fields = tokens_name, fields
        self._consumed, self._emitted = consumed, emitted
        engine = self._engine
        engine.pending, engine.ready = pending, ready
        engine.used = sum(piece.tokens.size for piece in engine.pending)


class _Group(NamedTuple):
    """The group being read: its key, where it starts (for errors), its records as whole pieces."""

    key: Any
    where: str
    members: list[Piece]


def _group_from_state(state: object, seq_len: int, fields: Sequence[str]) -> _Group | None:
    if state is None:
        return None
    if not isinstance(state, Mapping) or set(state) != {"key", "where", "members"}:
        raise corrupt("state['group']", "must be None or a dict with the keys ['key', 'members', 'where']")
    key, where, members = state["key"], state["where"], state["members"]
    if isinstance(key, bool) or not isinstance(key, (int, str)) or not isinstance(where, str):
        raise corrupt(
            "state['group']", f"holds a key {shown(key)} or a place {shown(where)} of the wrong type"
        )
    if isinstance(members, (str, bytes, Mapping)) or not isinstance(members, Sequence) or not members:
        raise corrupt("state['group']['members']", "must be a non-empty list of records")
    pieces = [
        piece_from_state(
            member, f"state['group']['members'][{i}]", max(seq_len, _member_size(member)), fields
        )
        for i, member in enumerate(members)
    ]
    return _Group(key, where, pieces)


def _member_size(state: object) -> int:
    """The token count a saved group member claims (a whole record may be longer than a row)."""
    tokens: Any = state.get("tokens") if isinstance(state, Mapping) else None
    return len(tokens) if hasattr(tokens, "__len__") else 0
