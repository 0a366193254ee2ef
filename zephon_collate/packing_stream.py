"""FlatPacker: :func:`~zephon_collate.packing.pack_flat` over an endless stream, resumable.

The packer reads records one at a time, keeps a bounded buffer (the open row
for ``"greedy"``, ``buffer_size`` pieces for ``"best_fit"``) and yields each
row as soon as it is closed, so it runs inside an ``IterableDataset`` that
never ends. :meth:`FlatPacker.state_dict` captures the buffer and counters as
plain Python/NumPy data; a packer restored from it and fed the rest of the
stream emits exactly the rows an uninterrupted run would have emitted next.
"""

from __future__ import annotations

import bisect
import copy
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from zephon_collate.packing import POSITIONS, PackOptions, Reader
from zephon_collate.types import (
    CONTRIBUTORS_TAG,
    PADDING_LENGTH_TAG,
    ContributorRef,
    SampleCursor,
    SampleMeta,
    SampleRecord,
)

__all__ = ["FlatPacker"]

STATE_VERSION = 1


class Base(NamedTuple):
    """The base record a piece comes from (plain data)."""

    sample_id: tuple[int, int, int]
    lane_id: int
    chunk_id: int
    chunk_offset: int
    lineage: tuple[int, ...]
    counts: dict[int, int]


class Piece(NamedTuple):
    """A document, or one piece of a split one: at most ``seq_len`` tokens and their fields."""

    tokens: np.ndarray
    fields: dict[str, np.ndarray]
    base: Base
    index: int
    closes: bool


def split_document(
    meta: SampleMeta, tokens: np.ndarray, fields: dict[str, np.ndarray], options: PackOptions
) -> list[Piece]:
    """The pieces of one document: itself, or ``seq_len`` slices (split) or its head (truncate)."""
    m = meta
    base = Base(
        m.sample_id, m.lane_id, m.chunk_id, m.chunk_offset, m.lineage, dict(m.component_sample_counts)
    )
    size = options.seq_len
    count = 1 if options.overflow == "truncate" else -(-tokens.size // size)
    cuts = [slice(i * size, (i + 1) * size) for i in range(count)]
    return [
        Piece(tokens[cut], {k: v[cut] for k, v in fields.items()}, base, i, i == count - 1)
        for i, cut in enumerate(cuts)
    ]


class Engine:
    """Places pieces into rows: ``pending`` is the open row (greedy) or the unplaced buffer (best fit);
    ``ready`` holds closed rows (lists of pieces) in emission order."""

    def __init__(self, seq_len: int, best_fit: bool, buffer_size: int) -> None:
        self.seq_len, self.best_fit, self.buffer_size = seq_len, best_fit, buffer_size
        self.pending: list[Piece] = []
        self.used = 0
        self.ready: deque[list[Piece]] = deque()

    def push(self, pieces: Iterable[Piece]) -> None:
        for piece in pieces:
            if self.best_fit:
                self.pending.append(piece)
                if len(self.pending) >= self.buffer_size:
                    self.flush()
                continue
            if self.used + piece.tokens.size > self.seq_len:
                self.flush()
            self.pending.append(piece)
            self.used += piece.tokens.size
            if self.used == self.seq_len:
                self.flush()

    def flush(self) -> None:
        """Close every pending row (best fit: place the buffer first)."""
        if self.best_fit and self.pending:
            self.ready.extend(self._best_fit_decreasing(self.pending))
        elif self.pending:
            self.ready.append(self.pending)
        self.pending, self.used = [], 0

    def _best_fit_decreasing(self, pieces: list[Piece]) -> list[list[Piece]]:
        rows: list[list[Piece]] = []
        free: list[tuple[int, int]] = []  # (space left, row index), sorted: least space, earliest row first
        for piece in sorted(pieces, key=lambda p: -p.tokens.size):
            size = piece.tokens.size
            slot = bisect.bisect_left(free, (size, -1))
            if slot == len(free):
                rows.append([piece])
                left, row = self.seq_len - size, len(rows) - 1
            else:
                space, row = free.pop(slot)
                rows[row].append(piece)
                left = space - size
            if left:
                bisect.insort(free, (left, row))
        return rows


def _token_split(counts: Mapping[int, int], size: int) -> dict[int, int]:
    """Split ``size`` tokens over the components of ``counts`` in proportion (largest remainder)."""
    if len(counts) <= 1:
        return {key: size for key in counts}
    total = sum(counts.values())
    weights = {key: (count if total else 1) for key, count in counts.items()}
    scale = sum(weights.values())
    shares = {key: size * weight // scale for key, weight in weights.items()}
    order = sorted(weights, key=lambda key: (-(size * weights[key] % scale), key))
    for key in order[: size - sum(shares.values())]:
        shares[key] += 1
    return shares


def build_row(
    pieces: list[Piece], options: PackOptions, tokens_name: str, fields: Sequence[str]
) -> SampleRecord:
    """One packed row: pieces end to end, then the padding segment; new meta (see :func:`pack_flat`)."""
    size = options.seq_len
    lengths = [piece.tokens.size for piece in pieces]
    used = sum(lengths)
    padding = size - used
    tokens = np.empty(size, np.int64)
    np.concatenate([piece.tokens for piece in pieces], out=tokens[:used])
    tokens[used:] = options.pad_token_id
    payload: dict[str, np.ndarray] = {tokens_name: tokens}
    for name in fields:
        parts = [piece.fields[name] for piece in pieces]
        values = np.zeros(size, np.result_type(*{part.dtype for part in parts}))
        np.concatenate(parts, out=values[:used])
        payload[name] = values
    if options.emit_positions:
        segments = np.array([*lengths, padding] if padding else lengths, np.int64)
        payload[POSITIONS] = np.arange(size, dtype=np.int64) - np.repeat(
            np.cumsum(segments) - segments, segments
        )
    samples: dict[int, int] = {}
    tokens_per: dict[int, int] = {}
    refs = []
    for piece in pieces:
        base = piece.base
        for key, count in _token_split(base.counts, piece.tokens.size).items():
            tokens_per[key] = tokens_per.get(key, 0) + count
            samples[key] = samples.get(key, 0) + (base.counts[key] if piece.closes else 0)
        cursor = SampleCursor(base.chunk_id, base.chunk_offset, base.sample_id, (*base.lineage, piece.index))
        refs.append(ContributorRef(cursor, piece.closes))
    first = pieces[0].base
    meta = SampleMeta(
        first.sample_id,
        first.lane_id,
        first.chunk_id,
        first.chunk_offset,
        dict(sorted(samples.items())),
        dict(sorted(tokens_per.items())),
        refs[0].cursor.lineage,
        {CONTRIBUTORS_TAG: tuple(refs), PADDING_LENGTH_TAG: padding},
    )
    return SampleRecord(meta, payload)


def _piece_state(piece: Piece) -> dict[str, Any]:
    base = piece.base._asdict()
    base["counts"] = dict(base["counts"])
    fields = {name: values.copy() for name, values in piece.fields.items()}
    state = {"tokens": piece.tokens.copy(), "fields": fields, "base": base}
    return {**state, "index": piece.index, "closes": piece.closes}


def _piece_from_state(state: Mapping[str, Any]) -> Piece:
    base = dict(state["base"])
    base["sample_id"], base["lineage"] = tuple(base["sample_id"]), tuple(base["lineage"])
    fields = {name: np.array(values) for name, values in state["fields"].items()}
    tokens = np.array(state["tokens"], dtype=np.int64)
    return Piece(tokens, fields, Base(**base), int(state["index"]), bool(state["closes"]))


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

    Parameters:
        seq_len, pad_token_id, emit_positions, tokens_field, strategy, overflow, fields:
            as for :func:`~zephon_collate.packing.pack_flat`.
        buffer_size: pieces per best-fit round, an int >= 1.

    Raises:
        TypeError, ValueError: for a bad option (at construction) or a bad record (while
            packing), naming the record's index in the stream, the field and the fix.

    Example:
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

    def __init__(
        self,
        seq_len: int,
        *,
        pad_token_id: int,
        emit_positions: bool = True,
        tokens_field: str = "auto",
        strategy: str = "greedy",
        overflow: str = "split",
        buffer_size: int = 1024,
        fields: Sequence[str] | None = None,
    ) -> None:
        self.options = PackOptions.create(
            "FlatPacker", seq_len=seq_len, pad_token_id=pad_token_id, emit_positions=emit_positions,
            tokens_field=tokens_field, strategy=strategy, overflow=overflow, buffer_size=buffer_size,
            fields=fields,
        )  # fmt: skip
        self._reset()

    def _reset(self) -> None:
        options = self.options
        tokens_name = None if options.tokens_field == "auto" else options.tokens_field
        self._reader = Reader(tokens_name, options.fields, strict=options.fields is None)
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

    def pack(self, records: Iterable[SampleRecord]) -> Iterator[SampleRecord]:
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
                raise TypeError(
                    f"FlatPacker: item {self._consumed} of the stream must be a SampleRecord, "
                    f"got {type(record).__name__}"
                )
            if record.meta.is_flush_sentinel:
                self._engine.flush()
            elif not record.meta.tombstone and (document := self._reader.read(record, self._consumed)):
                self._engine.push(split_document(record.meta, *document, self.options))
            self._consumed += 1
            yield from self._drain()
        self._engine.flush()
        yield from self._drain()

    def _drain(self) -> Iterator[SampleRecord]:
        ready = self._engine.ready
        while ready:
            pieces = ready.popleft()
            self._emitted += 1
            yield build_row(
                pieces, self.options, self._reader.tokens_name or "input_ids", self._reader.fields or ()
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
            "pending": [_piece_state(piece) for piece in engine.pending],
            "ready": [[_piece_state(piece) for piece in row] for row in engine.ready],
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
        if missing or state["version"] != STATE_VERSION:
            raise ValueError(
                f"FlatPacker.load_state_dict: not a version-{STATE_VERSION} FlatPacker state "
                f"(missing keys {missing}, version {state.get('version')!r})"
            )
        if not isinstance(state["options"], Mapping):
            raise ValueError(
                "FlatPacker.load_state_dict: the state is corrupt (its options are not a dict); "
                "restore a state_dict() saved by FlatPacker, unchanged"
            )
        saved, mine = dict(state["options"]), vars(self.options)
        differ = sorted(key for key in mine.keys() | saved.keys() if saved.get(key) != mine.get(key))
        if differ:
            detail = ", ".join(f"{key}: saved {saved.get(key)!r}, here {mine.get(key)!r}" for key in differ)
            raise ValueError(f"FlatPacker.load_state_dict: the state was saved with other options ({detail})")
        try:
            tokens_name = state["tokens_field"]
            fields = None if state["fields"] is None else tuple(state["fields"])
            consumed, emitted = int(state["records_consumed"]), int(state["rows_emitted"])
            pending = [_piece_from_state(piece) for piece in state["pending"]]
            ready = deque([_piece_from_state(piece) for piece in row] for row in state["ready"])
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(
                f"FlatPacker.load_state_dict: the state is corrupt ({type(error).__name__}: {error}); "
                "restore a state_dict() saved by FlatPacker, unchanged"
            ) from None
        self._reset()
        self._reader.tokens_name, self._reader.fields = tokens_name, fields
        self._consumed, self._emitted = consumed, emitted
        engine = self._engine
        engine.pending, engine.ready = pending, ready
        engine.used = sum(piece.tokens.size for piece in engine.pending)
