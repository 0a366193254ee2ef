"""Packed rows from documents: cut each document into pieces (plain data, so a state can hold them),
place the pieces in rows, build each row."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise
from typing import NamedTuple

import numpy as np

from zephon_collate.core.fit import best_fit_rows, greedy_breaks
from zephon_collate.core.keys import LABELS, LOSS_MASK, POSITIONS
from zephon_collate.core.records import (
    CONTRIBUTORS_TAG,
    PADDING_LENGTH_TAG,
    SEGMENTS_TAG,
    ContributorRef,
    SampleCursor,
    SampleMeta,
    SampleRecord,
)
from zephon_collate.core.text import shown
from zephon_collate.packing.reader import (
    PROMPT_FIELDS,
    Document,
    PackOptions,
    as_array,
    check_loss_mask,
    prompt_entries,
)
from zephon_collate.read.arrow import Columns
from zephon_collate.read.columns import Names, Ragged, Spread, filled, row_any
from zephon_collate.read.rows import describe_record
from zephon_collate.read.rules import check_zero_one

__all__ = [
    "CONTINUES",
    "OPENS_ROW",
    "OPENS_UNIT",
    "Base",
    "Engine",
    "Piece",
    "Segment",
    "build_row",
    "document_piece",
    "group_pieces",
    "refuse_cut_columns",
    "refuse_cut_prompt",
    "row_segments",
    "split_document",
    "units",
]


class Base(NamedTuple):
    """The base record a piece comes from (plain data)."""

    sample_id: tuple[int, int, int]
    lane_id: int
    chunk_id: int
    chunk_offset: int
    lineage: tuple[int, ...]
    counts: dict[int, int]

    @classmethod
    def of(cls, meta: SampleMeta) -> Base:
        """The base of a record with metadata ``meta``."""
        counts = dict(meta.component_sample_counts)
        return cls(meta.sample_id, meta.lane_id, meta.chunk_id, meta.chunk_offset, meta.lineage, counts)


OPENS_UNIT, OPENS_ROW, CONTINUES = 2, 1, 0
"""How a piece starts (:attr:`Piece.opens`): a placement unit of its own (a document, or a group's first
piece), a new row of its unit (a group laid over several rows), or it continues its unit's row."""


class Piece(NamedTuple):
    """A document, or one piece of a split one: at most ``seq_len`` tokens and their fields.

    ``positions``: its own segments (``None``: one); ``side``: its first segment's place in its group;
    ``opens``: how it starts (the engine never separates the pieces of one unit).
    """

    tokens: np.ndarray
    fields: dict[str, np.ndarray]
    base: Base
    part: int  # which piece of its document, from 0 (the cursor's lineage child index)
    closes: bool
    positions: np.ndarray | None = None
    side: int = 0
    opens: int = OPENS_UNIT


def _segment_count(piece: Piece) -> int:
    return 1 if piece.positions is None else int(np.count_nonzero(piece.positions == 0))


def document_piece(record: SampleRecord, document: Document) -> Piece:
    """A whole document as one piece (its record's metadata as the base)."""
    return Piece(document.tokens, document.fields, Base.of(record.meta), 0, True, document.positions)


def _cut(piece: Piece, cut: slice, part: int, closes: bool) -> Piece:
    """``piece`` (a whole document) cut to ``cut``: each of its segments numbered 0, 1, ... afresh, gaps
    dropped, wherever the cut falls (a segment the cut enters restarts at 0)."""
    positions = None
    side = piece.side
    if piece.positions is not None:
        given = piece.positions[cut]
        starts = given == 0
        starts[:1] = True  # the continuation of a segment starts a segment of its own
        if int(np.count_nonzero(starts)) > 1:  # one segment: numbered by the packer, as a plain document
            first = np.flatnonzero(starts)
            positions = np.arange(given.size, dtype=np.int64) - first[np.cumsum(starts) - 1]
        side += int(np.count_nonzero(piece.positions[: (cut.start or 0) + 1] == 0)) - 1
    fields = {name: values[cut] for name, values in piece.fields.items()}
    return Piece(piece.tokens[cut], fields, piece.base, part, closes, positions, side, piece.opens)


def _split(piece: Piece, where: str, options: PackOptions) -> list[Piece]:
    """The pieces of one whole document: itself, or ``seq_len`` slices (split) or its head (truncate)."""
    size = options.seq_len
    tokens = piece.tokens
    overflow = options.overflow
    if overflow == "auto" and tokens.size > size:
        mask = piece.fields.get(LOSS_MASK)
        if mask is not None and not mask.all():
            raise refuse_cut_prompt(where, tokens.size, size)
        for name in PROMPT_FIELDS:
            values = piece.fields.get(name)
            if values is not None and prompt_entries(name, values).any():
                raise refuse_cut_prompt(where, tokens.size, size, name)
        if (segments := _segment_count(piece)) > 1:
            raise ValueError(
                f"{where}: has {tokens.size} tokens, more than seq_len={size}, in {segments} "
                "segments (its positions restart at 0); cut, one of them would be trained apart from the "
                "others (a chosen side without its rejected one). Drop or shorten such documents, raise "
                "seq_len, or pass overflow='truncate' or overflow='split'"
            )
    if tokens.size <= size:
        return [piece]
    count = 1 if overflow == "truncate" else -(-tokens.size // size)
    pieces = [_cut(piece, slice(i * size, (i + 1) * size), i, i == count - 1) for i in range(count)]
    return [p._replace(opens=OPENS_UNIT) for p in pieces]


def split_document(record: SampleRecord, index: int, document: Document, options: PackOptions) -> list[Piece]:
    """The pieces of one document, each a placement unit of its own (:func:`_split`'s rules)."""
    where = describe_record(index, record)
    payload = record.payload
    if (
        options.overflow == "auto"
        and document.tokens.size > options.seq_len
        and LOSS_MASK not in document.fields
        and isinstance(payload, Mapping)
        and LOSS_MASK in payload
    ):  # not packed (fields=() or others), but it still says where the prompt is: read it
        mask = as_array(payload[LOSS_MASK], where, LOSS_MASK, ids=False)
        check_loss_mask(mask, where)
        if not mask.all():
            raise refuse_cut_prompt(where, document.tokens.size, options.seq_len)
    return _split(document_piece(record, document), where, options)


def refuse_cut_prompt(where: str, length: int, size: int, name: str = LOSS_MASK) -> ValueError:
    """The ``ValueError`` of ``overflow="auto"`` for a document with a prompt (in ``name``)."""
    mark = "-100" if name == LABELS else "0s"
    marks = "0s in its loss_mask" if name == LOSS_MASK else f"{mark} in its {shown(name)}"
    return ValueError(
        f"{where}: has {length} tokens, more than seq_len={size}, "
        f"and a prompt ({marks}); cut, its response would be trained without its "
        "prompt. Drop or shorten such documents, raise seq_len, or pass overflow='truncate' "
        "(keep the head) or overflow='split' (cut into segments)"
    )


def refuse_cut_columns(columns: Columns, tokens: Ragged, options: PackOptions, names: Names) -> None:
    """:func:`split_document`'s ``overflow="auto"`` refusal over a columnar batch, every document at once."""
    listed = [name for name in PROMPT_FIELDS if name in (options.fields or ()) and name in columns]
    if options.overflow != "auto" or not (LOSS_MASK in columns or listed):
        return
    longer = tokens.lengths > options.seq_len
    if not longer.any():
        return
    found = []  # (first document cut, the field's rank, field)
    for rank, name in enumerate([LOSS_MASK, *listed] if LOSS_MASK in columns else listed):
        field = columns.ragged(name, "values")
        if name == LOSS_MASK:
            check_zero_one(field, LOSS_MASK, names, "1 for supervised tokens, 0 for the rest")
        cut = np.flatnonzero(longer & row_any(prompt_entries(name, field.host), field.offsets))
        if cut.size:
            found.append((int(cut[0]), rank, name))
    if found:
        row, _, name = min(found)
        raise refuse_cut_prompt(names(row), int(tokens.lengths[row]), options.seq_len, name)


def _water_filled(sizes: list[int], room: int) -> list[int]:
    """Head lengths for ``sizes`` that fill at most ``room``: the longest cut first, to equal length."""
    order = sorted(sizes)
    keep, rest, cap = 0, len(order), 0
    for size in order:  # the largest cap c with sum(min(size, c)) <= room
        if keep + size * rest <= room:
            keep += size
            rest -= 1
            continue
        cap = (room - keep) // rest
        break
    else:
        return list(sizes)
    heads = [min(size, cap) for size in sizes]
    spare = room - sum(heads)
    for index, size in enumerate(sizes):  # the remainder to the first members that were cut
        if spare and size > cap:
            heads[index] += 1
            spare -= 1
    return heads


def group_pieces(members: list[Piece], where: str, key: object, options: PackOptions) -> list[Piece]:
    """The pieces of a group (records with one group key, in order): one unit the engine never separates."""
    side = 0
    placed = []
    for member in members:
        placed.append(member._replace(side=side))
        side += _segment_count(member)
    size = options.seq_len
    total = sum(member.tokens.size for member in placed)
    if len(placed) == 1 and total > size and options.overflow != "split":
        # a lone record: a document's rules (its pieces stay a unit)
        placed = _split(placed[0], where, options)
        total = sum(piece.tokens.size for piece in placed)
        if len(placed) > 1:
            return [p._replace(opens=OPENS_UNIT if i == 0 else OPENS_ROW) for i, p in enumerate(placed)]
    if total > size and options.overflow == "auto":
        raise ValueError(
            f"{where}: starts a group of {len(placed)} records (group key {shown(key)}) with {total} tokens, "
            f"more than seq_len={size}; a group stays in one row. Drop or shorten such groups, raise "
            "seq_len, or pass overflow='truncate' (cut each record's tail, the longest first) or "
            "overflow='split' (lay the group over consecutive rows)"
        )
    if total > size and options.overflow == "truncate":
        if len(placed) > size:
            raise ValueError(
                f"{where}: starts a group of {len(placed)} records (group key {shown(key)}), more than "
                f"seq_len={size} tokens can hold one each; raise seq_len"
            )
        heads = _water_filled([member.tokens.size for member in placed], size)
        placed = [
            _cut(member, slice(0, head), 0, True) if head < member.tokens.size else member
            for member, head in zip(placed, heads, strict=True)
        ]
        total = size
    if total <= size:
        return [member._replace(opens=OPENS_UNIT if i == 0 else CONTINUES) for i, member in enumerate(placed)]
    pieces: list[Piece] = []
    used = 0
    for member in placed:
        for piece in _split(member, where, options) if member.tokens.size > size else [member]:
            opens = CONTINUES
            if used + piece.tokens.size > size:
                opens, used = OPENS_ROW, 0
            pieces.append(piece._replace(opens=opens))
            used += piece.tokens.size
    return [pieces[0]._replace(opens=OPENS_UNIT), *pieces[1:]]


def units(pieces: Iterable[Piece]) -> list[list[list[Piece]]]:
    """Pieces in placement units, each a list of rows (lists of pieces), from their ``opens`` marks."""
    found: list[list[list[Piece]]] = []
    for piece in pieces:
        if piece.opens == OPENS_UNIT or not found:
            found.append([[piece]])
        elif piece.opens == OPENS_ROW:
            found[-1].append([piece])
        else:
            found[-1][-1].append(piece)
    return found


def _size(row: Sequence[Piece]) -> int:
    return sum(piece.tokens.size for piece in row)


class Engine:
    """Places pieces into rows: ``pending`` is the open row (greedy) or the buffer (best fit), ``ready``
    the closed rows in emission order; a unit is never separated.
    """

    def __init__(self, seq_len: int, best_fit: bool, buffer_size: int) -> None:
        self.seq_len, self.best_fit, self.buffer_size = seq_len, best_fit, buffer_size
        self.pending: list[Piece] = []
        self.used = 0
        self.ready: deque[list[Piece]] = deque()

    def push(self, pieces: Iterable[Piece]) -> None:
        found = units(pieces)
        if self.best_fit:
            for unit in found:
                self.pending.extend(piece for row in unit for piece in row)
                if len(self.pending) >= self.buffer_size:
                    self.flush()
            return
        run: list[list[Piece]] = []  # consecutive one-row units, placed by the greedy rule at once
        for unit in found:
            if len(unit) > 1:  # a group laid over rows: its own rows, one after another
                self._greedy(run)
                self.flush()
                self.ready.extend(unit[:-1])
                run = []
            run.append(unit[-1])
        self._greedy(run)

    def _greedy(self, rows: list[list[Piece]]) -> None:
        """Each of ``rows`` into the open row, or a new one where it does not fit."""
        sizes = [_size(row) for row in rows]
        start = 0
        for end in greedy_breaks(sizes, self.seq_len, self.used):
            self.pending.extend(piece for row in rows[start:end] for piece in row)
            self.flush()
            start = end
        self.pending.extend(piece for row in rows[start:] for piece in row)
        self.used += sum(sizes[start:])
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
        """The buffer's units placed by :func:`~zephon_collate.core.fit.best_fit_rows`."""
        found = units(pieces)
        placed = best_fit_rows(
            [_size(unit[-1]) for unit in found],
            self.seq_len,
            order=[sum(_size(row) for row in unit) for unit in found],
            fresh=[len(unit) > 1 for unit in found],
        )
        rows: list[list[Piece]] = []
        for members in placed:
            rows.extend(list(row) for row in found[members[0]][:-1])  # a fresh unit opens its row
            rows.append([piece for member in members for piece in found[member][-1]])
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


class Segment(NamedTuple):
    """One segment of a packed row: the record it came from, its side in its group, where it lies."""

    sample_id: tuple[int, int, int]
    side: int
    start: int
    length: int


def row_segments(row: SampleRecord) -> tuple[Segment, ...]:
    """The segments of a packed row (``pack_flat``'s), in order; the padding is not one of them.

    Example:
        >>> from zephon_collate import pack_flat
        >>> docs = [SampleRecord(SampleMeta((0, 0, i), 0, 0, i), {"input_ids": [5] * n, "pair": 0})
        ...         for i, n in enumerate([2, 3])]
        >>> [tuple(s) for s in row_segments(pack_flat(docs, 8, pad_token_id=0, group_key="pair")[0])]
        [((0, 0, 0), 0, 0, 2), ((0, 0, 1), 1, 2, 3)]
    """
    return tuple(row.meta.tags.get(SEGMENTS_TAG, ()))


def build_row(
    pieces: list[Piece], options: PackOptions, tokens_name: str, fields: Sequence[str]
) -> SampleRecord:
    """One packed row: pieces end to end, then the padding segment, and its new metadata."""
    size = options.seq_len
    lengths = [piece.tokens.size for piece in pieces]
    used = sum(lengths)
    padding = size - used
    tokens = np.empty(size, np.int64)
    np.concatenate([piece.tokens for piece in pieces], out=tokens[:used])
    tokens[used:] = options.pad_token_id
    payload: dict[str, np.ndarray] = {tokens_name: tokens}
    fills = {spec.name: spec.fill for spec in options.floats}  # value fields pad with their own fill
    jagged = {spec.name for spec in options.floats if spec.shape == (None,)}
    for name in fields:
        parts = [piece.fields[name] for piece in pieces]
        shapes = {part.shape[1:] for part in parts}
        if len(shapes) > 1 and name in jagged:  # each document's K: the row's largest, with the fill
            width = max(shape[0] for shape in shapes)
            parts = [_widened(part, width, fills[name]) for part in parts]
            shapes = {part.shape[1:] for part in parts}
        if len(shapes) > 1:
            raise ValueError(
                f"pack: field {shown(name)} holds values of shapes {sorted(shapes)} in the documents of one "
                "row; give every document the same value shape (pad a ragged K with the fill)"
            )
        dtype = np.result_type(*{part.dtype for part in parts})
        values = filled((size, *parts[0].shape[1:]), fills.get(name, 0), dtype)
        np.concatenate(parts, out=values[:used])
        payload[name] = values
    segments: list[Segment] = []
    offset = 0
    for piece, length in zip(pieces, lengths, strict=True):  # a piece's positions start at 0
        starts = [0] if piece.positions is None else np.flatnonzero(piece.positions == 0).tolist()
        for k, (start, end) in enumerate(pairwise([*starts, length])):
            segments.append(Segment(piece.base.sample_id, piece.side + k, offset + start, end - start))
        offset += length
    if options.emit_positions:  # each piece's own positions (0, 1, ... for one segment), then the padding's
        sizes = np.array([*lengths, padding] if padding else lengths, np.int64)
        positions = np.arange(size, dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        for piece, start in zip(pieces, np.cumsum(sizes)[: len(pieces)] - sizes[: len(pieces)], strict=True):
            if piece.positions is not None:
                positions[start : start + piece.positions.size] = piece.positions
        payload[POSITIONS] = positions
    samples: dict[int, int] = {}
    tokens_per: dict[int, int] = {}
    refs = []
    for piece in pieces:
        base = piece.base
        for key, count in _token_split(base.counts, piece.tokens.size).items():
            tokens_per[key] = tokens_per.get(key, 0) + count
            samples[key] = samples.get(key, 0) + (base.counts[key] if piece.closes else 0)
        cursor = SampleCursor(base.chunk_id, base.chunk_offset, base.sample_id, (*base.lineage, piece.part))
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
        {CONTRIBUTORS_TAG: tuple(refs), PADDING_LENGTH_TAG: padding, SEGMENTS_TAG: tuple(segments)},
    )
    return SampleRecord(meta, payload)


def _widened(part: np.ndarray, width: int, fill: int | float | Spread) -> np.ndarray:
    """``part`` ``[n, k]`` as ``[n, width]``, the added entries ``fill`` (a jagged top-k's)."""
    if part.shape[1] == width:
        return part
    out = filled((part.shape[0], width), fill, part.dtype)
    out[:, : part.shape[1]] = part
    return out
