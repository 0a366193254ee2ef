"""FlatPacker: :func:`~zephon_collate.packing.pack_flat` over an endless stream, resumable.

The packer reads records one at a time, keeps a bounded buffer (the open row
for ``"greedy"``, ``buffer_size`` pieces for ``"best_fit"``) and yields each
row as soon as it is closed, so it runs inside an ``IterableDataset`` that
never ends. :meth:`FlatPacker.state_dict` captures the buffer and counters as
plain Python/NumPy data; a packer restored from it and fed the rest of the
stream emits exactly the rows an uninterrupted run would have emitted next.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

from zephon_collate._checks import suggest_options
from zephon_collate._columns import ColumnarBatch, Columns, columns_of, example_names
from zephon_collate._text import shown
from zephon_collate.keys import INPUT_IDS
from zephon_collate.packing.reader import REQUIRED, STREAM_BUFFER_SIZE, PackOptions, Reader
from zephon_collate.packing.rows import Base, Engine, build_row, cut_document, split_document
from zephon_collate.packing.state import check_count, corrupt, piece_state, pieces_from_state, same_value
from zephon_collate.records import SampleRecord

__all__ = ["STATE_VERSION", "FlatPacker"]

STATE_VERSION = 1


class FlatPacker:
    """Pack a stream of tokenized records into flat rows of exactly ``seq_len`` tokens.

    Rows, layout, metadata, sentinels and options are those of
    :func:`~zephon_collate.packing.pack_flat`: ``pack_flat(records, ...)`` equals
    ``list(FlatPacker(..., buffer_size=len(records)).pack(records))`` (or the
    ``buffer_size`` given) when the documents agree on their per-token fields.
    Differences:

    * ``buffer_size`` (default 1024) bounds the best-fit buffer: a round of
      best-fit-decreasing runs whenever it holds that many pieces, at a flush
      sentinel and at the end of the input. Greedy holds only the open row.
    * With ``fields=None`` the packed per-token fields are those of the first
      document with tokens (``loss_mask`` and each numeric 1-D field with one
      entry per token); a later document lacking one of them, or carrying a
      ``loss_mask`` when the first had none, raises ``ValueError``. With
      ``tokens_field="auto"`` the first document fixes the token field name
      too (``"input_ids"`` if it is an array payload).
    * The packer keeps views of the input arrays until their row is emitted;
      do not write into them in the meantime. Run one :meth:`pack` at a time,
      and restore a state before calling it.
    * The stream may hold columnar batches of documents (a ``pyarrow.Table``,
      a dict of ``(values, offsets)`` pairs, ...: see ``Collator``), as
      ``dataset.with_format("arrow").iter(batch_size)`` yields them: each is read
      and checked at once, then packed document by document. Document ``i`` of
      the stream (counting every record and every row of every batch) is named
      ``example i`` and has ``SampleMeta((0, 0, i), 0, 0, i)``, as a plain payload
      at that place would; ``records_consumed`` counts documents.

    Parameters:
        seq_len, pad_token_id, emit_positions, tokens_field, strategy, overflow, fields:
            as for :func:`~zephon_collate.packing.pack_flat`.
        buffer_size: pieces per best-fit round, an int >= 1.

    Raises:
        TypeError, ValueError: for a bad option (at construction) or a bad record (while
            packing), naming the record's index in the stream, the field and the fix.

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

    @suggest_options("FlatPacker", REQUIRED)
    def __init__(
        self,
        seq_len: int,
        *,
        pad_token_id: int,
        emit_positions: bool = True,
        tokens_field: str = "auto",
        strategy: Literal["greedy", "best_fit"] = "greedy",
        overflow: Literal["auto", "split", "truncate"] = "auto",
        buffer_size: int = STREAM_BUFFER_SIZE,
        fields: Sequence[str] | None = None,
    ) -> None:
        self.options = PackOptions.create("FlatPacker", **PackOptions.arguments(locals()))
        self._reset()

    def _reset(self) -> None:
        options = self.options
        tokens_name = None if options.tokens_field == "auto" else options.tokens_field
        fields = None if options.fields is None else tuple(options.fields)
        self._reader = Reader(tokens_name, fields, strict=fields is None)
        self._engine = Engine(options.seq_len, options.strategy == "best_fit", options.buffer_size or 1)
        self._consumed = 0
        self._emitted = 0

    @property
    def records_consumed(self) -> int:
        """Input records read so far (sentinels included): where the input resumes after a restore."""
        return self._consumed

    @property
    def rows_emitted(self) -> int:
        """Rows yielded so far."""
        return self._emitted

    def pack(self, records: Iterable[SampleRecord | ColumnarBatch]) -> Iterator[SampleRecord]:
        """Yield packed rows from ``records``, as soon as each is closed; the end of ``records`` flushes.

        Rows already closed (from a restored state) come first. Each record
        is validated when it is read.
        """
        if isinstance(records, (str, bytes, Mapping)) or not isinstance(records, Iterable):
            raise TypeError(
                f"FlatPacker.pack: records must be an iterable of SampleRecord, got {type(records).__name__}"
            )
        yield from self._drain()
        for record in records:
            if not isinstance(record, SampleRecord):
                columns = columns_of(record)
                if columns is None:
                    raise TypeError(
                        f"FlatPacker: item {self._consumed} of the stream must be a SampleRecord or a "
                        f"columnar batch of documents (a pyarrow.Table, ...), got {type(record).__name__}"
                    )
                yield from self._pack_columns(columns)
                continue
            if record.meta.is_flush_sentinel:
                self._engine.flush()
            elif not record.meta.tombstone and (document := self._reader.read(record, self._consumed)):
                self._engine.push(split_document(record, self._consumed, *document, self.options))
            self._consumed += 1
            yield from self._drain()
        self._engine.flush()
        yield from self._drain()

    def _pack_columns(self, columns: Columns) -> Iterator[SampleRecord]:
        """The documents of a columnar batch, read at once, then pushed one by one."""
        first = self._consumed
        tokens, fields = self._reader.read_columns(columns, first)
        starts, ends = tokens.offsets[:-1].tolist(), tokens.offsets[1:].tolist()
        values = tokens.host
        hosts = {name: field.host for name, field in fields.items()}
        for row, (start, end) in enumerate(zip(starts, ends, strict=True)):
            index = first + row
            if end > start:
                base = Base((0, 0, index), 0, 0, index, (), {})
                piece_fields = {name: field[start:end] for name, field in hosts.items()}
                where = lambda index=index: example_names(index)  # noqa: E731
                self._engine.push(cut_document(base, where, values[start:end], piece_fields, self.options))
            self._consumed += 1
            yield from self._drain()

    def _drain(self) -> Iterator[SampleRecord]:
        ready = self._engine.ready
        while ready:
            pieces = ready.popleft()
            self._emitted += 1
            yield build_row(
                pieces, self.options, self._reader.tokens_name or INPUT_IDS, self._reader.fields or ()
            )

    def state_dict(self) -> dict[str, Any]:
        """The packer's state as plain, picklable Python/NumPy data (copies, not views).

        Keys: ``version``, ``options``, ``tokens_field`` and ``fields`` (as fixed by
        the first document, or ``None``), ``records_consumed``, ``rows_emitted``,
        ``pending`` (pieces of the open row or best-fit buffer) and ``ready``
        (closed rows not yet yielded). Save it between rows; resume the input
        at ``records_consumed``.
        """
        engine = self._engine
        return {
            "version": STATE_VERSION,
            "options": copy.deepcopy(vars(self.options)),
            "tokens_field": self._reader.tokens_name,
            "fields": None if self._reader.fields is None else list(self._reader.fields),
            "records_consumed": self._consumed,
            "rows_emitted": self._emitted,
            "pending": [piece_state(piece) for piece in engine.pending],
            "ready": [[piece_state(piece) for piece in row] for row in engine.ready],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` taken from a packer with the same options.

        Raises:
            TypeError: if ``state`` is not a mapping.
            ValueError: if it is not a FlatPacker state of this version, or its options differ.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"FlatPacker.load_state_dict: state must be a dict, got {type(state).__name__}")
        keys = (
            "version",
            "options",
            "tokens_field",
            "fields",
            "records_consumed",
            "rows_emitted",
            "pending",
            "ready",
        )
        missing = [key for key in keys if key not in state]
        if missing or not same_value(state["version"], STATE_VERSION):
            raise ValueError(
                f"FlatPacker.load_state_dict: not a version-{STATE_VERSION} FlatPacker state "
                f"(missing keys {missing}, version {shown(state.get('version'))})"
            )
        if not isinstance(state["options"], Mapping):
            raise ValueError(
                "FlatPacker.load_state_dict: the state is corrupt (its options are not a dict); "
                "restore a state_dict() saved by FlatPacker, unchanged"
            )
        saved, mine = dict(state["options"]), vars(self.options)
        differ = sorted(
            key for key in mine.keys() | saved.keys() if not same_value(saved.get(key), mine.get(key))
        )
        if differ:
            detail = ", ".join(
                f"{key}: saved {shown(saved.get(key))}, here {shown(mine.get(key))}" for key in differ
            )
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
        pending, rows = pieces_from_state(
            state["pending"], state["ready"], opts.seq_len, fields or (), opts.strategy == "greedy"
        )
        ready = deque(rows)
        self._reset()
        self._reader.tokens_name, self._reader.fields = tokens_name, fields
        self._consumed, self._emitted = consumed, emitted
        engine = self._engine
        engine.pending, engine.ready = pending, ready
        engine.used = sum(piece.tokens.size for piece in engine.pending)
