"""Ray Data stages: the collator on Arrow batches, packing as ``map_batches``, a rank's balanced plan.

Needs the ``ray`` extra; pipelines, ranks and resume: docs/engines.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray
from ray.data.collate_fn import ArrowBatchCollateFn

from zephon_collate.core.keys import POSITIONS, SEQ_LENGTHS
from zephon_collate.core.records import PADDING_LENGTH_TAG
from zephon_collate.packing.columns import pack_columns
from zephon_collate.packing.pack_flat import pack_flat
from zephon_collate.packing.reader import PackOptions
from zephon_collate.packing.rows import row_segments
from zephon_collate.parallel.sampler import BalancedBatchSampler

__all__ = ["ArrowCollateFn", "PackBatches", "balanced_micro_batches"]

_MICRO_BATCH = "_micro_batch"  # a balanced micro-batch's place in the rank's plan


class ArrowCollateFn(ArrowBatchCollateFn):
    """A collator as ``iter_torch_batches``' ``collate_fn``: each Arrow batch read through the columnar door
    (a :func:`balanced_micro_batches` row as its documents).

    Parameters:
        collator: the :class:`~zephon_collate.Collator` (any preset that reads columns).

    Example:
        >>> import pyarrow as pa
        >>> from zephon_collate import Collator
        >>> table = pa.table({"input_ids": [[5, 6, 7], [8, 9]], "positions": [[0, 1, 2], [0, 1]]})
        >>> ArrowCollateFn(Collator(pad_token_id=0))(table)["input_ids"].tolist()
        [[5, 6, 7], [8, 9, 0]]
    """

    def __init__(self, collator: Callable[[Any], Any]) -> None:
        super().__init__()
        self.collator = collator

    def __call__(self, batch: pa.Table) -> Any:
        if _MICRO_BATCH in batch.column_names:
            batch = _documents_of(batch)
        return self.collator(batch)


class PackBatches:
    """A ``map_batches`` stage: each Arrow batch of documents packed into rows of ``seq_len`` tokens, one
    Arrow row each (:func:`~zephon_collate.pack_columns`' rows; with ``group_key``, one input row per
    group: docs/engines.md).

    Parameters:
        *args, **options: the packer options (``seq_len``, ``pad_token_id``, ``strategy``,
            ``group_key``, ...), as for :func:`~zephon_collate.pack_flat`.
        id_column: a column naming each row in errors (your dataset's id), not packed.

    Example:
        >>> import pyarrow as pa
        >>> rows = PackBatches(seq_len=4, pad_token_id=0)(pa.table({"input_ids": [[1, 2], [3], [4, 5, 6]]}))
        >>> rows.column("input_ids").to_pylist(), rows.column("positions").to_pylist()
        ([[1, 2, 3, 0], [4, 5, 6, 0]], [[0, 1, 0, 0], [0, 1, 2, 0]])
    """

    def __init__(self, *args: Any, id_column: str | None = None, **options: Any) -> None:
        PackOptions.create("PackBatches", *args, **options)  # checks the options now, not in a worker
        self.args, self.options = args, dict(options)
        self.group_key = self.options.pop("group_key", None)
        self.id_column = id_column

    def __call__(self, batch: pa.Table) -> pa.Table:
        if self.id_column is not None and self.id_column not in batch.column_names:
            raise ValueError(
                f"PackBatches: id_column {self.id_column!r} is no column of the Ray batch (its columns: "
                f"{batch.column_names}); give each row its id, or leave id_column out"
            )
        if self.group_key is not None and self.group_key not in batch.column_names:
            raise ValueError(
                f"PackBatches: group_key {self.group_key!r} is no column of the Ray batch (its columns: "
                f"{batch.column_names}); give each group row its key"
            )
        try:
            return self._packed(batch)
        except (TypeError, ValueError) as error:
            # Find the first row that fails alone, and give its own message (it is example 0 there).
            for row in range(len(batch)):
                alone = self._error(batch.slice(row, 1))
                if alone is not None:
                    named = f"row {row} of a Ray batch of {len(batch)}"
                    if self.id_column is not None:
                        named = f"{self.id_column}={batch.column(self.id_column)[row].as_py()!r} ({named})"
                    message = str(alone).removeprefix("example 0: ")
                    raise type(error)(f"PackBatches: {named}: {message}") from None
            raise type(error)(f"PackBatches: a Ray batch of {len(batch)} rows: {error}") from None

    def _error(self, batch: pa.Table) -> Exception | None:
        """The packer's ``TypeError``/``ValueError`` on ``batch``, or ``None`` if it packs."""
        try:
            self._packed(batch)
        except (TypeError, ValueError) as error:
            return error
        return None

    def _packed(self, batch: pa.Table) -> pa.Table:
        documents = batch if self.id_column is None else batch.drop_columns([self.id_column])
        if self.group_key is None:
            packed = pack_columns(documents, *self.args, **self.options)
            unplaced = POSITIONS not in packed.fields  # the documents, where no positions restart at them
            sizes = packed.seq_lengths(np.arange(len(packed))) if unplaced else None
            return _rows_table(packed.fields, packed.padding_length, sizes)
        members = _group_members(documents, self.group_key)
        rows = pack_flat(members, *self.args, group_key=self.group_key, **self.options)
        payloads = [cast(dict[str, np.ndarray], row.payload) for row in rows]
        fields = (
            {name: np.stack([payload[name] for payload in payloads]) for name in payloads[0]} if rows else {}
        )
        seq_lengths = None
        if fields and POSITIONS not in fields:
            lengths = [[segment.length for segment in row_segments(row)] for row in rows]
            values = np.array([length for row in lengths for length in row], dtype=np.int64)
            seq_lengths = (values, np.cumsum([0, *map(len, lengths)]))
        return _rows_table(
            fields, np.array([row.meta.padding_length for row in rows], dtype=np.int64), seq_lengths
        )


def balanced_micro_batches(documents: pa.Table, sampler: BalancedBatchSampler) -> ray.data.Dataset:
    """This rank's micro-batches of ``documents`` from ``sampler``'s current position, one Ray row each
    (every column a list of the documents' values); read with ``iter_torch_batches(batch_size=1, ...)``.

    Parameters:
        documents: the documents, one Arrow row each, in the sampler's order of lengths.
        sampler: this rank's :class:`~zephon_collate.BalancedBatchSampler`.

    Example (on a running Ray cluster)::

        sampler = BalancedBatchSampler(lengths, options, num_replicas=world_size, rank=rank, seed=0)
        sampler.load_state_dict(saved)  # optional: resume the plan where it stopped
        micro_batches = balanced_micro_batches(documents, sampler)
        for batch in micro_batches.iter_torch_batches(batch_size=1, collate_fn=ArrowCollateFn(Collator())):
            ...
    """
    if len(documents) != sampler.lengths.size:
        raise ValueError(
            f"balanced_micro_batches: documents has {len(documents)} rows, the sampler plans "
            f"{sampler.lengths.size} lengths; give the sampler one length per document"
        )
    plan = [{_MICRO_BATCH: place, "indices": indices} for place, indices in enumerate(sampler)]
    gather = cast(Any, _gather)  # Ray's hints take a one-argument function; fn_args gives the second
    micro_batches = ray.data.from_items(plan).map_batches(
        gather, fn_args=(ray.put(documents),), batch_format="pyarrow"
    )
    micro_batches.context.execution_options.preserve_order = True  # the plan's order: ranks step together
    return micro_batches


def _gather(batch: pa.Table, documents: Any) -> pa.Table:
    """Each micro-batch row's documents, taken from the table: every column one list per document."""
    if isinstance(documents, ray.ObjectRef):  # the table, put in the object store once
        documents = ray.get(documents)
    indices = batch.column("indices").combine_chunks()
    taken = documents.take(indices.flatten())
    columns: dict[str, Any] = {_MICRO_BATCH: batch.column(_MICRO_BATCH)}
    for name in taken.column_names:
        columns[name] = pa.ListArray.from_arrays(indices.offsets, taken.column(name).combine_chunks())
    return pa.table(columns)


def _documents_of(batch: pa.Table) -> pa.Table:
    """The documents of a micro-batch row: each list column flattened one level (no copy)."""
    if len(batch) != 1:  # two planned steps in one batch would break the plan's token budget
        places = batch.column(_MICRO_BATCH).to_pylist()
        raise ValueError(
            f"ArrowCollateFn: a Ray batch of {len(batch)} balanced micro-batches (places {places}); each "
            "is one step of the plan: read balanced_micro_batches with iter_torch_batches(batch_size=1, ...)"
        )
    names = [name for name in batch.column_names if name != _MICRO_BATCH]
    return pa.table({name: batch.column(name).combine_chunks().flatten() for name in names})


def _group_members(batch: pa.Table, group_key: str) -> list[dict[str, Any]]:
    """One payload per member of each group row, the row's place under ``group_key``: each row its own
    group, also where consecutive rows hold the same key."""
    names = [name for name in batch.column_names if name != group_key]
    lengths = [pc.list_value_length(batch.column(name)).to_numpy(zero_copy_only=False) for name in names]
    if any(not np.array_equal(lengths[0], other) for other in lengths[1:]):
        bad = next(i for i in range(len(batch)) if len({int(length[i]) for length in lengths}) > 1)
        raise ValueError(
            f"PackBatches: group row {bad} has columns of different member counts "
            f"({dict(zip(names, (int(length[bad]) for length in lengths), strict=True))}); with group_key "
            "each row is one group, every list column one list per member"
        )
    columns = {name: _members(batch.column(name)) for name in names}
    return [
        {group_key: row, **{name: columns[name][row][member] for name in names}}
        for row in range(len(batch))
        for member in range(int(lengths[0][row]) if names else 0)
    ]


def _members(column: Any) -> list[Any]:
    """A ``list<list<T>>`` column as each row's members, each a NumPy array of ``T`` (the dtype kept, as
    ``pack_flat`` keeps it); with a null anywhere, Python lists (``pack_flat`` names the null)."""
    inner = pc.list_flatten(column)
    values = (
        pc.list_flatten(inner) if pa.types.is_list(inner.type) or pa.types.is_large_list(inner.type) else None
    )
    kinds = (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean)
    numbers = values is not None and any(kind(values.type) for kind in kinds)
    if values is None or not numbers or column.null_count or inner.null_count or values.null_count:
        return list(column.to_pylist())
    flat = values.to_numpy(zero_copy_only=False)
    sizes = pc.list_value_length(inner).to_numpy(zero_copy_only=False).astype(np.int64)
    members = np.split(flat, np.cumsum(sizes)[:-1]) if sizes.size else []
    counts = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)])
    return [members[int(starts[row]) : int(starts[row + 1])] for row in range(len(counts))]


def _rows_table(
    fields: Mapping[str, np.ndarray],
    padding_length: np.ndarray,
    seq_lengths: tuple[np.ndarray, np.ndarray] | None,
) -> pa.Table:
    """Packed rows as an Arrow table: each ``[R, S, ...]`` field a list column sharing its values buffer;
    rows without positions carry their documents' ``seq_lengths`` ``(values, offsets)``."""
    columns: dict[str, Any] = {}
    for name, values in fields.items():
        rows, width = values.shape[:2]
        if values.ndim > 2:
            raise ValueError(
                f"PackBatches: field {name!r} holds a value per token of shape {values.shape[2:]}; "
                "Ray's Arrow rows carry one number per token: pack it as separate fields"
            )
        flat = pa.array(np.ascontiguousarray(values).reshape(-1))
        offsets = pa.array(np.arange(rows + 1, dtype=np.int64) * width)
        columns[name] = pa.LargeListArray.from_arrays(offsets, flat)
    columns[PADDING_LENGTH_TAG] = pa.array(padding_length.astype(np.int64, copy=False))
    if seq_lengths is not None:
        values, offsets = seq_lengths
        columns[SEQ_LENGTHS] = pa.LargeListArray.from_arrays(
            pa.array(offsets.astype(np.int64)), pa.array(values)
        )
    return pa.table(columns)
