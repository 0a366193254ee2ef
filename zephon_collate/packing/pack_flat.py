"""pack_flat: pack a list of tokenized records into flat rows of exactly ``seq_len`` tokens."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import numpy as np

from zephon_collate.collate.sample_batch import SampleBatch
from zephon_collate.core.checks import is_zero_d, keywords
from zephon_collate.core.keys import INT64_MAX, LOSS_MASK
from zephon_collate.core.records import SampleRecord
from zephon_collate.core.text import shown
from zephon_collate.packing.packer import FlatPacker
from zephon_collate.packing.reader import REQUIRED, PackOptions, Reader, candidates
from zephon_collate.read.arrow import ColumnarBatch, columns_of
from zephon_collate.read.columns import tokens_field_of
from zephon_collate.read.rows import as_record, describe_record, records_of

__all__ = ["pack_flat"]


def _shared_fields(
    records: Sequence[SampleRecord], tokens_name: str, skipped: Sequence[str]
) -> tuple[str, ...]:
    """The per-token fields every document with tokens shares (``loss_mask`` in only some: ``ValueError``)."""
    data = [
        (i, r) for i, r in enumerate(records) if not r.meta.is_sentinel and isinstance(r.payload, Mapping)
    ]
    data = [(i, r) for i, r in data if tokens_name in cast(Mapping[str, Any], r.payload)]
    if not data:
        return ()
    places = [i for i, _ in data]
    batch = records_of([r for _, r in data], tokens_name, "pack_flat", places=places, resolve=False)
    tokens = Reader(tokens_name, None, strict=True).tokens(batch)
    with_tokens = tokens.lengths > 0
    carried = batch.carried(LOSS_MASK)[with_tokens] if LOSS_MASK in batch else np.zeros(0, bool)
    if carried.any() and not carried.all():
        rows = np.flatnonzero(with_tokens)
        first_with, first_without = rows[np.flatnonzero(carried)[0]], rows[np.flatnonzero(~carried)[0]]
        raise ValueError(
            f"{describe_record(*data[first_with])} has a 'loss_mask' but "
            f"{describe_record(*data[first_without])} has none; give every record a loss_mask "
            "(1 = supervised), or pass fields=(...) to choose the packed fields"
        )
    return candidates(batch, tokens_name, tokens, skipped)


@keywords(PackOptions, "pack_flat", REQUIRED)
def pack_flat(
    records: Iterable[SampleRecord] | SampleBatch | ColumnarBatch, *args: Any, **options: Any
) -> list[SampleRecord]:
    """Pack tokenized records into flat rows of exactly ``seq_len`` tokens (docs/packing.md).

    Parameters:
        records: records (dict payloads or token arrays; sentinels allowed), a SampleBatch, or columns.
        seq_len: tokens per row, an int >= 1.
        pad_token_id: the padding token, an int >= 0.
        emit_positions: write segment-restarting ``"positions"``.
        tokens_field: the token field, or ``"auto"``: the first of input_ids, tokens, token_ids, ids.
        strategy: ``"greedy"`` (arrival order) or ``"best_fit"`` (best-fit-decreasing per buffer).
        overflow: a document over ``seq_len``: ``"split"``, ``"truncate"`` or ``"auto"`` (docs/packing.md).
        buffer_size: pieces per best-fit round (int >= 1), or ``None`` for all.
        fields: the per-token fields to pack, or ``None`` for those all documents share.
        float_fields: float fields to pack (names, or :class:`~zephon_collate.FloatField` specs).
        group_key: the payload field holding each record's group id, or ``None`` (no groups).

    Example:
        >>> from zephon_collate.types import SampleMeta
        >>> metas = [SampleMeta((0, 0, i), 0, 0, i, component_sample_counts={0: 1}) for i in range(3)]
        >>> docs = [SampleRecord(m, {"input_ids": list(range(10 * i, 10 * i + n))})
        ...         for i, (m, n) in enumerate(zip(metas, [3, 2, 4]))]
        >>> rows = pack_flat(docs, 5, pad_token_id=0)
        >>> [row.payload["input_ids"].tolist() for row in rows]
        [[0, 1, 2, 10, 11], [20, 21, 22, 23, 0]]
        >>> rows[1].payload["positions"].tolist(), rows[1].meta.padding_length
        ([0, 1, 2, 3, 0], 1)
    """
    checked = PackOptions.create("pack_flat", *args, **options)
    size = checked.buffer_size or INT64_MAX  # None: one best-fit round over every piece, however many
    columns = columns_of(records)
    if columns is not None:
        checked.check_columnar("pack_flat")
        return list(FlatPacker(**{**vars(checked), "buffer_size": size}).pack([records]))
    zero_d = is_zero_d(records)
    if (
        isinstance(records, (str, bytes, Mapping))
        or not isinstance(records, (Iterable, SampleBatch))
        or zero_d
    ):
        raise TypeError(f"pack_flat: records must be a list of SampleRecord, got {type(records).__name__}")
    given = records.records if isinstance(records, SampleBatch) else records
    records = [as_record(record, index, "pack_flat") for index, record in enumerate(given)]
    payloads = [None if record.meta.is_sentinel else record.payload for record in records]
    tokens_name = tokens_field_of(payloads, checked.tokens_field, lambda i: describe_record(i, records[i]))
    if tokens_name in (checked.fields or ()):
        raise ValueError(
            f"pack_flat: the tokens field {shown(tokens_name)} is also listed in fields; drop it from fields"
        )
    floats = [spec.name for spec in checked.floats] + ([checked.group_key] if checked.group_key else [])
    shared = _shared_fields(records, tokens_name, floats) if checked.fields is None else checked.fields
    settings = {**vars(checked), "tokens_field": tokens_name, "buffer_size": size, "fields": shared}
    return list(FlatPacker(**settings).pack(records))
