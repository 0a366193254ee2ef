"""pack_flat: pack tokenized records into flat rows of exactly ``seq_len`` tokens.

Documents are laid end to end in rows; each document (or piece of one) is a
segment whose ``positions`` restart at 0, and the trailing padding is a segment
of its own, so ``to_training(return_cu_seqlens=True)`` finds every document
boundary and padding never joins a document. :func:`pack_flat` packs a list;
:class:`zephon_collate.packing.packer.FlatPacker` packs an endless stream with a
bounded buffer and a resumable state. Both give the same rows for the same
input and options, and neither changes its input records. Tokens are handled
with NumPy slicing and concatenation: Python loops run over documents only.
Options and documents are checked and read by :mod:`zephon_collate.packing.reader`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import numpy as np

from zephon_collate.collate.sample_batch import SampleBatch
from zephon_collate.core.checks import keywords
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
    """The per-token fields every document with tokens shares, read through the door at once;
    ``loss_mask`` in only some: ``ValueError``."""
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
    if carried.size and not carried.all():
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
    """Pack tokenized records into flat rows of exactly ``seq_len`` tokens.

    Each row's payload is a dict of NumPy arrays of length ``seq_len``: the
    tokens (int64, under the input's token field name; ``"input_ids"`` for
    array payloads), every packed per-token field (``loss_mask`` and the
    fields with one entry per token in every document, in NumPy's common dtype
    of the row's pieces) and, with ``emit_positions``, int64 ``"positions"``
    restarting at 0 on every segment. The trailing padding (``pad_token_id``,
    0 in other fields) is a segment of its own, so its positions restart too;
    ``meta.padding_length`` (the ``"_padding_length"`` tag) is its length, 0
    when the row is full. A record's own ``positions`` are its segment
    structure, kept (with ``emit_positions``): a record holding a chosen and a
    rejected sequence, whose positions restart at 0 between them, stays two
    segments (positions must then start at 0 and give one per token); with
    ``emit_positions=False`` they are packed as data only when listed in
    ``fields``. ``float_fields`` (:mod:`zephon_collate.read.fields`) are packed in
    their float dtype (float32 by default; bfloat16 is held as float32, which
    NumPy can hold), a per-document value broadcast to its tokens when declared
    ``FloatField(name, align="sequence", broadcast=True)``.

    Groups: with ``group_key``, consecutive records with the same value of that
    payload field (an int or a str: a preference pair, the completions of one
    prompt) form a group that no strategy separates: its records go into one
    row, in order (chosen before rejected, as given). A group longer than
    ``seq_len`` raises by default (``overflow="auto"``); ``"truncate"`` cuts
    each record to its head, the longest first and to equal length, until the
    group fits; ``"split"`` lays it over consecutive rows, each record whole
    while it fits in a row. Every row records its segments, in order
    (``meta.tags["_segments"]``, read with
    :func:`~zephon_collate.packing.rows.row_segments`): the ``sample_id`` each
    came from and its side, its place among its group's segments (chosen 0,
    rejected 1).

    Layout: ``strategy="greedy"`` keeps arrival order and starts a new row when
    the next document does not fit. ``"best_fit"`` collects ``buffer_size``
    pieces (``None``: the whole list), sorts them by length, longest first
    (ties in arrival order), puts each in the row with the least space left
    that fits it (ties: the earliest row) or in a new row, and emits those rows
    in the order they were opened. A document longer than ``seq_len`` is cut
    into ``seq_len`` pieces and a shorter last piece (``overflow="split"``,
    each piece a segment) or keeps its first ``seq_len`` tokens
    (``"truncate"``). The default, ``"auto"``, splits a document unless its
    ``loss_mask`` has a 0 (a prompt, which a cut would part from its
    response; so does a prompt in a supervising field listed in ``fields``):
    that raises ``ValueError`` naming ``overflow=``. Documents
    without tokens and tombstones are skipped and appear in no row; a flush
    sentinel closes every pending row (padded) and is not emitted.

    Metadata of a row: ``sample_id``, ``lane_id``, ``chunk_id``,
    ``chunk_offset`` and ``lineage`` are those of its first contributor, one
    ``ContributorRef`` per piece with cursor ``base.cursor.child(piece_index)``
    (pieces count from 0, an unsplit document is piece 0) and
    ``is_last_child=True`` on the piece that closes its document.
    ``component_sample_counts`` adds each document's counts on its closing
    piece (other components in the row appear with 0);
    ``component_token_counts`` gives a document's tokens to its only
    component, or splits them in proportion to its sample counts (largest
    remainder). A record with no components counts in neither.

    Supervision is read as ``loss_mask`` only. A document that spells it
    otherwise, as Hugging Face and TRL do (``labels`` with -100 on a prompt,
    ``assistant_masks`` / ``assistant_mask`` / ``completion_mask`` with 0s, an
    ``attention_mask`` with 0s on padding), is refused (``ValueError`` naming
    it, the field and the fix: ``loss_mask = [int(l != -100) for l in labels]``,
    or ``trl.pack_dataset`` with ``Collator.for_transformers``), as the
    Collator would refuse the rows; such a field that changes nothing (labels
    equal to the tokens, a mask of ones or equal to the ``loss_mask``) is
    accepted and not packed. Listed in ``fields``, the field is packed as data
    (the Collator reads it with ``extra_fields``, else refuses it), and
    ``overflow="auto"`` reads its prompt as a ``loss_mask``'s.

    Documents given as columns (a ``pyarrow.Table`` of ``input_ids`` and
    ``loss_mask`` lists, say, or a dict of ``(values, offsets)`` pairs) are
    read and checked at once and packed as the same documents given as plain
    payloads would be: document ``i`` is named ``example i`` and has
    ``SampleMeta((0, 0, i), 0, 0, i)``. :func:`~zephon_collate.packing.columns.pack_columns`
    packs them into arrays instead of records, vectorised.

    Parameters:
        records: the records (dict payloads or token arrays; sentinels allowed), a SampleBatch,
            or a columnar batch of documents.
        seq_len: tokens per row, an int >= 1.
        pad_token_id: the padding token, an int >= 0.
        emit_positions: write segment-restarting ``"positions"``.
        tokens_field: the token field, or ``"auto"``: the first of input_ids, tokens,
            token_ids, ids that every dict payload has.
        strategy: ``"greedy"`` or ``"best_fit"``.
        overflow: what happens to a document longer than ``seq_len``: ``"split"``,
            ``"truncate"``, or ``"auto"`` (split, but raise for one with a prompt).
        buffer_size: pieces per best-fit round (int >= 1), or ``None`` for all.
        fields: the per-token fields to pack, or ``None`` for those all documents share
            (``loss_mask`` in only some documents is then an error; supervising fields under
            other names are never found, only listed).
        float_fields: float fields to pack (names, or :class:`~zephon_collate.FloatField` specs).
        group_key: the payload field holding each record's group id, or ``None`` (no groups).

    Returns:
        The rows, a list of :class:`SampleRecord`.

    Raises:
        TypeError: for an option of the wrong type, an item that is not a SampleRecord, a
            payload that is neither a dict nor an array, or non-integer token ids.
        ValueError: for an option out of range, a missing tokens field, per-token fields
            of the wrong length or shape, ``loss_mask`` in only some documents, supervision
            under another name (``labels``, ``assistant_masks``, ...) not listed in ``fields``, positions
            that do not start at 0, a float field that is not finite, a missing group key,
            or (with ``overflow="auto"``) a document with a prompt or several segments, or a
            group, that is longer than ``seq_len``.

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
        >>> [(ref.cursor.sample_id, ref.cursor.lineage) for ref in rows[0].meta.contributors]
        [((0, 0, 0), (0,)), ((0, 0, 1), (0,))]
        >>> rows[0].meta.component_sample_counts, rows[0].meta.component_token_counts
        ({0: 2}, {0: 5})
    """
    checked = PackOptions.create("pack_flat", *args, **options)
    columns = columns_of(records)
    if columns is not None:
        checked.check_columnar("pack_flat")
        size = checked.buffer_size or INT64_MAX  # None: one best-fit round over every piece
        return list(FlatPacker(**{**vars(checked), "buffer_size": size}).pack([records]))
    if isinstance(records, (str, bytes, Mapping)) or not isinstance(records, (Iterable, SampleBatch)):
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
    size = checked.buffer_size or INT64_MAX  # None: one best-fit round over every piece, however many
    settings = {**vars(checked), "tokens_field": tokens_name, "buffer_size": size, "fields": shared}
    return list(FlatPacker(**settings).pack(records))
