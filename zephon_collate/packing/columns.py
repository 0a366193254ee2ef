"""pack_columns: documents given as columns packed into arrays of ``pack_flat``'s rows, vectorised."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon_collate.core.checks import keywords
from zephon_collate.core.fit import best_fit_rows, greedy_breaks
from zephon_collate.core.keys import INPUT_IDS, INT32_MAX, INT64_MAX, POSITIONS, SEQ_LENGTHS
from zephon_collate.core.records import PADDING_LENGTH_TAG
from zephon_collate.packing.reader import REQUIRED, PackOptions, Reader
from zephon_collate.packing.rows import refuse_cut_columns
from zephon_collate.read.arrow import ColumnarBatch, ColumnBatch, columns_of
from zephon_collate.read.columns import filled
from zephon_collate.read.rows import example_names

__all__ = ["PackedColumns", "pack_columns"]


@dataclass(frozen=True)
class PackedColumns:
    """Packed rows as arrays, and where each piece of each row came from; a map-style dataset of columnar
    batches for the :class:`~zephon_collate.Collator` (docs/columns.md).

    Attributes:
        fields: each packed field (and ``"positions"``): ``[R, seq_len]``; a value field ``[R, seq_len, ...]``
        padding_length: ``[R]`` each row's trailing padding.
        offsets: row ``r``'s pieces are ``[offsets[r]:offsets[r + 1]]`` of the arrays below.
        documents: each piece's document (its row in the input batch).
        parts: each piece's place among its document's pieces (from 0).
        closes: whether each piece is its document's last.
        sizes: each piece's tokens. Rows packed without positions carry them as ``seq_lengths``, so
            the ``Collator`` finds their documents (and refuses labels that would cross them).

    Example:
        >>> import numpy as np
        >>> from zephon_collate import Collator, TensorField
        >>> offsets = np.array([0, 2, 3])
        >>> documents = {"input_ids": (np.array([5, 6, 7]), offsets), "top": (np.eye(3)[:, :2], offsets)}
        >>> specs = [TensorField("top", align="label", fill=-1.0, shape=(2,))]
        >>> packed = pack_columns(documents, 4, pad_token_id=0, float_fields=specs)
        >>> Collator(return_labels=True, float_fields=specs)(packed.__getitems__([0]))["top"].tolist()
        [[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]]
    """

    fields: dict[str, np.ndarray]
    padding_length: np.ndarray
    offsets: np.ndarray
    documents: np.ndarray
    parts: np.ndarray
    closes: np.ndarray
    sizes: np.ndarray

    def __len__(self) -> int:
        return len(self.padding_length)

    def __getitems__(self, indices: Sequence[int]) -> list[ColumnBatch]:
        """Rows ``indices`` as ``[batch]`` (copies), each field's values ``[len(indices) * seq_len, ...]``."""
        rows = np.arange(len(self))[np.asarray(indices, dtype=np.int64).reshape(-1)]  # -1: the last
        width = next(iter(self.fields.values())).shape[1] if self.fields else 0
        offsets = np.arange(len(rows) + 1, dtype=np.int64) * width
        batch: dict[str, Any] = {  # [rows * seq_len, ...]: each token's value shape (K, ...) kept
            name: (values[rows].reshape(len(rows) * width, *values.shape[2:]), offsets)
            for name, values in self.fields.items()
        }
        batch[PADDING_LENGTH_TAG] = self.padding_length[rows]
        if POSITIONS not in self.fields:  # the documents, where no positions restart at them
            batch[SEQ_LENGTHS] = self.seq_lengths(rows)
        return [ColumnBatch(batch)]

    def seq_lengths(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``rows``' pieces' sizes as ``(values, offsets)``: TRL's ``seq_lengths`` of each row."""
        counts = np.diff(self.offsets)[rows]
        starts = (
            np.repeat(self.offsets[rows], counts)
            + np.arange(int(counts.sum()))
            - np.repeat(np.cumsum(counts) - counts, counts)
        )
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        return self.sizes[starts], offsets

    def __getitem__(self, index: int) -> list[ColumnBatch]:
        """Row ``index`` as a batch of one row: ``[batch]``."""
        return self.__getitems__([index])


def _pieces(lengths: np.ndarray, seq_len: int, truncate: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(documents, parts, sizes)`` of every piece, documents in order."""
    counts = np.where(lengths > 0, 1 if truncate else -(-lengths // seq_len), 0)
    documents = np.repeat(np.arange(len(lengths), dtype=np.int64), counts)
    firsts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=firsts[1:])
    parts = np.arange(len(documents), dtype=np.int64) - np.repeat(firsts[:-1], counts)
    sizes = np.minimum(lengths[documents] - parts * seq_len, seq_len)
    return documents, parts, sizes


def _rows(sizes: np.ndarray, seq_len: int, best_fit: bool, buffer_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(order, offsets)``: the pieces of row ``r`` are ``order[offsets[r]:offsets[r + 1]]``."""
    lengths = sizes.tolist()
    if not best_fit:
        bounds = [0, *greedy_breaks(lengths, seq_len), len(lengths)] if lengths else [0]
        return np.arange(len(lengths), dtype=np.int64), np.array(bounds, dtype=np.int64)
    rows: list[list[int]] = []
    for start in range(0, len(lengths), buffer_size):  # the streaming packer's rounds
        rows += [
            [start + i for i in row] for row in best_fit_rows(lengths[start : start + buffer_size], seq_len)
        ]
    order = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=len(lengths))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(row) for row in rows], out=offsets[1:])
    return order, offsets


@keywords(PackOptions, "pack_columns", REQUIRED)
def pack_columns(documents: ColumnarBatch, *args: Any, **given: Any) -> PackedColumns:
    """Pack documents given as columns into ``[rows, seq_len]`` arrays: ``pack_flat``'s rows, vectorised.

    Parameters:
        documents: a columnar batch (a ``pyarrow.Table``, a dict of ``(values, offsets)`` pairs, ...).
        seq_len, pad_token_id, emit_positions, tokens_field, strategy, overflow, buffer_size, fields,
        float_fields: as for :func:`~zephon_collate.pack_flat`; ``group_key`` must be ``None``.

    Example:
        >>> import numpy as np
        >>> ids = (np.array([5, 6, 7, 8, 9, 1, 2, 3, 4]), np.array([0, 3, 5, 9]))
        >>> packed = pack_columns({"input_ids": ids}, 5, pad_token_id=0)
        >>> packed.fields["input_ids"].tolist(), packed.padding_length.tolist()
        ([[5, 6, 7, 8, 9], [1, 2, 3, 4, 0]], [0, 1])
    """
    options = PackOptions.create("pack_columns", *args, **given)
    options.check_columnar("pack_columns")
    columns = columns_of(documents)
    if columns is None:
        raise TypeError(
            f"pack_columns: documents must be a columnar batch (a pyarrow.Table, a dict of (values, offsets) "
            f"pairs, ...), got {type(documents).__name__}; pack records with pack_flat"
        )
    reader = Reader.of(options)  # no group_key: refused by check_columnar
    tokens, values = reader.read_columns(columns, 0)
    size = options.seq_len
    lengths = tokens.lengths
    refuse_cut_columns(columns, tokens, options, example_names)
    pieces, parts, sizes = _pieces(lengths, size, options.overflow == "truncate")
    best_fit = options.strategy == "best_fit"
    # buffer_size=None: as pack_flat, one best-fit round over every piece, however many.
    order, offsets = _rows(sizes, size, best_fit, options.buffer_size or INT64_MAX)
    pieces, parts, sizes = pieces[order], parts[order], sizes[order]
    rows = len(offsets) - 1
    used = np.add.reduceat(sizes, offsets[:-1]) if rows else np.zeros(0, dtype=np.int64)
    # Segments, in row-major order: each row's pieces, then its padding (where it has some).
    padded = np.flatnonzero(used < size)
    ends = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=ends[1:])
    within = ends[:-1] - np.repeat(ends[offsets[:-1]], np.diff(offsets))  # each piece's start in its row
    row_of = np.repeat(np.arange(rows, dtype=np.int64), np.diff(offsets))
    place = np.concatenate([row_of * size + within, padded * size + used[padded]])
    source = np.concatenate([tokens.offsets[pieces] + parts * size, np.zeros(len(padded), dtype=np.int64)])
    length = np.concatenate([sizes, size - used[padded]])
    pad = np.concatenate([np.zeros(len(sizes), dtype=bool), np.ones(len(padded), dtype=bool)])
    by_place = np.argsort(place, kind="stable")
    place, source, length, pad = place[by_place], source[by_place], length[by_place], pad[by_place]
    # One gather: slot j of a segment takes input token source + (j - place).
    total = rows * size
    narrow = np.int32 if max(total, int(tokens.offsets[-1])) < INT32_MAX else np.int64  # faster repeats
    slots = np.arange(total, dtype=np.int64)
    index = slots + np.repeat((source - place).astype(narrow), length)
    pad_slots = np.repeat(place[pad] - np.cumsum(length[pad]) + length[pad], length[pad])
    pad_slots += np.arange(pad_slots.size, dtype=np.int64)  # the slots of the trailing padding
    out: dict[str, np.ndarray] = {}
    fills = {spec.name: spec.fill for spec in options.floats}  # value fields pad with their own fill
    for field_name, field in [(reader.tokens_name or INPUT_IDS, tokens), *values.items()]:
        host = field.host
        dtype = np.dtype(np.int64) if field is tokens else host.dtype  # token ids widened here, once
        trailing = host.shape[1:]
        gathered = (
            host.take(index, axis=0, mode="clip").astype(dtype, copy=False)
            if host.size
            else np.zeros((index.size, *trailing), dtype)
        )
        fill = options.pad_token_id if field is tokens else fills.get(field_name, 0)
        gathered[pad_slots] = filled((pad_slots.size, *trailing), fill, dtype, at=pad_slots % max(size, 1))
        out[field_name] = gathered.reshape(rows, size, *trailing)
    if options.emit_positions:  # each slot's place in its segment, computed in the slots' buffer
        slots -= np.repeat(place.astype(narrow), length)
        out[POSITIONS] = slots.reshape(rows, size)
    last = np.zeros_like(lengths) if options.overflow == "truncate" else -(-lengths // size) - 1
    return PackedColumns(out, size - used, offsets, pieces, parts, parts == last[pieces], sizes)
