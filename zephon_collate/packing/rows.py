"""Packed rows from documents: cut each document into pieces, place the pieces in rows, build each row.

:func:`split_document` cuts a document into pieces of at most ``seq_len``
tokens (``overflow="split"``) or keeps its head (``"truncate"``); by default
(``"auto"``) a document with a prompt (a 0 in its ``loss_mask``) is never cut.
:class:`Engine` places pieces into rows, greedily in arrival order or by
best-fit-decreasing over a bounded buffer, and :func:`build_row` lays a row's
pieces end to end with a padding segment and writes its new metadata. Pieces
hold plain data only, so :class:`zephon_collate.packing.packer.FlatPacker` can
save and restore them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from zephon_collate._read import describe_record
from zephon_collate.keys import LOSS_MASK, POSITIONS
from zephon_collate.packing._plan import best_fit_rows, greedy_breaks
from zephon_collate.packing.reader import PackOptions
from zephon_collate.records import (
    CONTRIBUTORS_TAG,
    PADDING_LENGTH_TAG,
    ContributorRef,
    SampleCursor,
    SampleMeta,
    SampleRecord,
)

__all__ = ["Base", "Engine", "Piece", "build_row", "cut_document", "refuse_cut_prompt", "split_document"]


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
    part: int  # which piece of its document, from 0 (the cursor's lineage child index)
    closes: bool


def split_document(
    record: SampleRecord, index: int, tokens: np.ndarray, fields: dict[str, np.ndarray], options: PackOptions
) -> list[Piece]:
    """The pieces of one document: itself, or ``seq_len`` slices (split) or its head (truncate).

    Raises:
        ValueError: with ``overflow="auto"``, for a document longer than ``seq_len`` whose
            ``loss_mask`` has a 0: cut, its response would be trained without its prompt.
    """
    meta = record.meta
    base = Base(
        meta.sample_id,
        meta.lane_id,
        meta.chunk_id,
        meta.chunk_offset,
        meta.lineage,
        dict(meta.component_sample_counts),
    )
    return cut_document(base, lambda: describe_record(index, record), tokens, fields, options)


def refuse_cut_prompt(where: str, length: int, seq_len: int) -> ValueError:
    """The error of ``overflow="auto"`` for a document of ``length`` tokens with a prompt."""
    return ValueError(
        f"{where}: has {length} tokens, more than seq_len={seq_len}, and a prompt (0s in its loss_mask); "
        "cut, its response would be trained without its prompt. Drop or shorten such documents, raise "
        "seq_len, or pass overflow='truncate' (keep the head) or overflow='split' (cut into segments)"
    )


def cut_document(
    base: Base,
    where: Callable[[], str],
    tokens: np.ndarray,
    fields: dict[str, np.ndarray],
    options: PackOptions,
) -> list[Piece]:
    """:func:`split_document` of a document known by its ``base`` (``where()`` names it in errors)."""
    size = options.seq_len
    overflow = options.overflow
    if overflow == "auto" and tokens.size > size:
        mask = fields.get(LOSS_MASK)
        if mask is not None and not mask.all():
            raise refuse_cut_prompt(where(), tokens.size, size)
    count = 1 if overflow == "truncate" else -(-tokens.size // size)
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

    def push(self, pieces: Sequence[Piece]) -> None:
        if self.best_fit:
            for piece in pieces:
                self.pending.append(piece)
                if len(self.pending) >= self.buffer_size:
                    self.flush()
            return
        lengths = [piece.tokens.size for piece in pieces]
        start = 0
        for end in greedy_breaks(lengths, self.seq_len, self.used):  # each break closes the open row
            self.pending.extend(pieces[start:end])
            self.flush()
            start = end
        self.pending.extend(pieces[start:])
        self.used += sum(lengths[start:])
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
        rows = best_fit_rows([piece.tokens.size for piece in pieces], self.seq_len)
        return [[pieces[index] for index in row] for row in rows]


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
        {CONTRIBUTORS_TAG: tuple(refs), PADDING_LENGTH_TAG: padding},
    )
    return SampleRecord(meta, payload)
