"""Columnar input (Arrow columns, ``(values, offsets)`` pairs; docs/columns.md) read into :class:`Columns`."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any, TypeAlias

import numpy as np
import torch

from zephon_collate.core.text import shown, shown_fields
from zephon_collate.read.columns import Batch, Kind, Names, Ragged, Row, as_numpy, row_of, to_row
from zephon_collate.read.rows import example_names

__all__ = [
    "ARROW_EXTRA",
    "ColumnBatch",
    "ColumnarBatch",
    "Columns",
    "arrow",
    "columns_of",
    "is_columnar",
    "read_by_rows",
]

ColumnarBatch: TypeAlias = Any
"""A columnar batch (docs/columns.md): a ``pyarrow.Table`` or ``RecordBatch``, a list of them, an
object with ``__arrow_c_stream__``, or a dict of Arrow columns, ``(values, offsets)`` pairs and 1-D arrays."""

ARROW_EXTRA = "pip install 'zephon_collate[arrow]'"
"""How to install what Arrow input needs (quoted by the error raised without ``pyarrow``)."""


class ColumnBatch(Mapping[str, Any]):
    """A columnar batch as a read-only mapping of field name to column; not a ``dict``: wrappers pass it on.

    Example:
        >>> batch = ColumnBatch({"input_ids": (np.array([5, 6, 7]), np.array([0, 2, 3]))})
        >>> list(batch), isinstance(batch, dict), is_columnar([batch])
        (['input_ids'], False, True)
    """

    __slots__ = ("_columns",)

    def __init__(self, columns: Mapping[str, Any]) -> None:
        self._columns = dict(columns)

    def __getitem__(self, name: str) -> Any:
        return self._columns[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._columns)

    def __len__(self) -> int:
        return len(self._columns)

    def __repr__(self) -> str:
        return f"ColumnBatch({', '.join(self._columns)})"


def read_by_rows(owner: str, what: str) -> ValueError:
    """The refusal, for a columnar batch, of an option read example by example (``what``)."""
    return ValueError(
        f"{owner}: {what} are read example by example, not from columns; give the batch as a list of "
        "examples (records or payload dicts), or drop the option"
    )


def arrow() -> ModuleType:
    """The ``pyarrow`` module, or ``ImportError`` naming the extra that installs it."""
    module = sys.modules.get("pyarrow")
    if module is not None:
        return module
    try:
        return importlib.import_module("pyarrow")
    except ImportError:
        raise ImportError(
            f"this batch is Arrow data (a pyarrow or Arrow C stream object), which needs pyarrow: "
            f"{ARROW_EXTRA} (or pip install pyarrow); without it, give each field as a "
            "(values, offsets) pair of NumPy arrays, or the examples as dicts"
        ) from None


def _from_arrow(value: object) -> bool:
    """True for an object of ``pyarrow``'s types or their subclasses (``datasets``' extension arrays), known
    without importing it."""
    return any(kind.__module__.partition(".")[0] == "pyarrow" for kind in type(value).__mro__[:-1])


def _nested_extension(kind: Any) -> bool:
    """True for ``datasets``' ``Array2D``-like extension types, whose storage keeps each value's nesting
    (Arrow's own ``fixed_shape_tensor`` stores a tensor flat: it is left as it is, and refused)."""
    return hasattr(kind, "storage_type") and type(kind).__module__.partition(".")[0] == "datasets"


def _stored(chunk: Any) -> Any:
    """A ``datasets`` extension array (``Array2D``) as its storage array; anything else as it is."""
    return chunk.storage if hasattr(chunk, "storage") and _nested_extension(chunk.type) else chunk


def _storage_table(table: Any) -> Any:
    """``table`` with each ``datasets`` extension column as its storage (a view: nothing is copied)."""
    for index, field in enumerate(table.schema):
        if _nested_extension(field.type):
            column = table.column(index)
            if getattr(column, "num_chunks", None) is None:  # a RecordBatch's column: one array
                stored = _stored(column)
            else:
                stored = arrow().chunked_array(
                    [_stored(chunk) for chunk in column.chunks], field.type.storage_type
                )
            table = table.set_column(index, field.name, stored)
    return table


def _is_pair(value: object) -> bool:
    """True for a ``(values, offsets)`` pair: a tuple of two NumPy arrays or tensors."""
    return (
        type(value) is tuple
        and len(value) == 2
        and all(isinstance(part, (np.ndarray, torch.Tensor)) for part in value)
    )


def _is_table(value: object) -> bool:
    """True for an Arrow table-like batch: a ``pyarrow`` object, or one with the Arrow C stream."""
    return _from_arrow(value) or (
        hasattr(type(value), "__arrow_c_stream__") and not isinstance(value, (Mapping, Sequence))
    )


def is_columnar(batch: object) -> bool:
    """True if ``batch`` is a columnar batch; cheap for row-wise input.

    Example:
        >>> is_columnar({"input_ids": (np.array([5, 6, 7]), np.array([0, 2, 3]))})
        True
    """
    kind = type(batch)
    if kind is list or kind is tuple:
        first = batch[0] if batch else None  # type: ignore[index]  # a list or tuple
        if first is None or type(first) is dict:  # the common case: examples or payloads
            return False
        return type(first) is ColumnBatch or _is_table(first)
    if isinstance(batch, Mapping):
        return any(_from_arrow(value) or _is_pair(value) for value in batch.values())
    return kind is not dict and _is_table(batch)


def columns_of(batch: object, owner: str = "Collator") -> Columns | None:
    """``batch`` as :class:`Columns`, or ``None`` (``ImportError`` for Arrow data without ``pyarrow``)."""
    if not is_columnar(batch):
        return None
    if type(batch) in (list, tuple) and type(batch[0]) is ColumnBatch:  # type: ignore[index]
        return _joined_batches(list(batch), owner)  # type: ignore[call-overload]
    if isinstance(batch, Mapping):
        sources = dict(batch)
        if any(_from_arrow(value) for value in sources.values()):
            arrow()
        return Columns(sources, owner=owner)
    pa = arrow()
    tables = list(batch) if type(batch) in (list, tuple) else [batch]  # type: ignore[call-overload]
    read = []
    for index, table in enumerate(tables):
        if isinstance(table, (pa.Array, pa.ChunkedArray)):
            raise TypeError(
                f"got a list of Arrow columns without their names (item {index} is a "
                f"{type(table).__name__}): what iterating a pyarrow.Table gives, as transformers.Trainer's "
                "RemoveColumnsCollator does; "
                "hand the collator the table itself, or a list of tables (ColumnarDataset does), or pass "
                "TrainingArguments(remove_unused_columns=False)"
            )
        if not _is_table(table):
            raise TypeError(
                f"a list of Arrow tables holds {type(table).__name__} at item {index}; give tables or "
                "record batches only (their rows one after the other), or a list of example dicts"
            )
        if not isinstance(table, (pa.Table, pa.RecordBatch)):
            table = pa.table(table)  # the Arrow C stream interface (polars, DuckDB, ...)
        read.append(_storage_table(table))
    names = read[0].schema.names
    for index, table in enumerate(read[1:], start=1):
        if table.schema.names != names:
            raise TypeError(
                f"Arrow table {index} has columns {table.schema.names}, table 0 {names}; give tables of "
                "one schema"
            )
    return Columns(tables=read, owner=owner)


def _ids(rows: int) -> list[Any]:
    return [(0, 0, index) for index in range(rows)]


def _joined_batches(batches: list[Any], owner: str) -> Columns:
    """A list of :class:`ColumnBatch` as one batch: their rows one after the other."""
    for index, batch in enumerate(batches):
        if type(batch) is not ColumnBatch or list(batch) != list(batches[0]):
            raise TypeError(
                f"a list of ColumnBatch holds a {type(batch).__name__} of other fields at item {index}; give "
                "batches of the same fields only"
            )
    if len(batches) == 1:
        sources = dict(batches[0])
    else:
        sources = {name: _joined_column([batch[name] for batch in batches]) for name in batches[0]}
    if any(_from_arrow(batch[name]) for batch in batches for name in batch):
        arrow()
    return Columns(sources, owner=owner)


def _joined_column(parts: list[Any]) -> Any:
    """One field of several :class:`ColumnBatch`: 1-D arrays joined, anything else as its chunks."""
    if all(isinstance(part, np.ndarray) and part.ndim == 1 for part in parts):
        return np.concatenate(parts)
    if all(isinstance(part, torch.Tensor) and part.ndim == 1 for part in parts):
        return torch.cat(parts)
    return parts


class Columns(Batch):
    """The fields of a columnar batch, each read when asked for.

    Parameters:
        sources: field name to column: Arrow arrays, a ``(values, offsets)`` pair, a 1-D array (else unread).
        tables: instead, Arrow tables or record batches of one schema, their rows one after the other.

    Example:
        >>> columns = Columns({"input_ids": (np.array([5, 6, 7, 8]), np.array([0, 3, 4]))})
        >>> columns.rows, columns.get("input_ids", "ids").offsets.tolist()
        (2, [0, 3, 4])
    """

    def __init__(
        self, sources: Mapping[str, Any] | None = None, *, tables: Sequence[Any] = (), owner: str = "Collator"
    ) -> None:
        self._chunks: dict[str, list[Any]] = {}
        self._tables = list(tables)
        if self._tables:
            self._sources: dict[str, Any] = {}
            self._order = tuple(self._tables[0].schema.names)
            count = sum(table.num_rows for table in self._tables)
            super().__init__(count, example_names, frozenset(self._order), _ids(count), owner=owner)
            return
        self._sources = dict(sources or {})
        self._order = tuple(self._sources)
        rows: int | None = None
        first = ""
        for name, source in self._sources.items():
            chunks = _chunks_of(source)
            if chunks is None:
                continue  # not a column: a field no entry point reads (text kept as lists, say)
            self._chunks[name] = chunks
            count = sum(_rows_in(chunk, name) for chunk in chunks)
            if rows is None:
                rows, first = count, name
            elif count != rows:
                raise ValueError(
                    f"the columns of the batch differ in length: {shown(first)} holds {rows} rows, "
                    f"{shown(name)} {count}; give every field one entry per example"
                )
        super().__init__(rows or 0, example_names, frozenset(self._order), _ids(rows or 0), owner=owner)

    @property
    def order(self) -> tuple[str, ...]:
        """The columns in the input's order."""
        return self._order

    # -- the Batch interface: a column is carried by every row (a null entry is refused when read) --

    def carried(self, name: str) -> np.ndarray:
        return np.full(self.rows, name in self.fields, dtype=bool)

    def lacking(self, name: str) -> int | None:
        return None if name in self.fields or not self.rows else 0  # known without an array

    def _lacks(self, index: int, name: str) -> str:
        return f"payload lacks field {shown(name)} (its fields: {shown_fields(dict.fromkeys(self.order))})"

    def _read(self, name: str, kind: Kind) -> Ragged:
        return self.ragged(name, kind)

    def _per_row(self, name: str, kind: Kind) -> list[Row]:
        found = self.per_record(name, kind)
        return list(found) if isinstance(found, np.ndarray) else found

    def objects(self, name: str) -> list[Any]:
        return self.pylist(name)

    def _chunk_list(self, name: str) -> list[Any] | None:
        """The chunks of column ``name`` (looked up in the tables once), or ``None`` if it is no column."""
        chunks = self._chunks.get(name)
        if chunks is None and self._tables and name in self.order:
            chunks = []
            for table in self._tables:
                column = table.column(name)
                count = getattr(column, "num_chunks", None)  # a RecordBatch's columns are arrays
                chunks += [column] if count is None else [column.chunk(i) for i in range(count)]
            self._chunks[name] = chunks
        return chunks

    def one_value_row(self, name: str) -> int | None:
        if name not in self:
            return None
        self._column(name)  # a field that is not a column: TypeError, naming it
        if self.is_list(name):  # a row per example, from the schema: no value is read
            return None
        carried = np.flatnonzero(self.carried(name))
        return int(carried[0]) if carried.size else 0

    def is_list(self, name: str) -> bool:
        """True if ``name`` is a list column (a row of values per example), False for one value per row."""
        if self._tables:
            return (
                name in self.order
                and _list_type(arrow(), self._tables[0].schema.field(name).type) is not None
            )
        chunks = self._chunks.get(name)
        if not chunks:
            return False
        chunk = chunks[0]
        if _is_pair(chunk):
            return True
        if isinstance(chunk, (np.ndarray, torch.Tensor)):
            return False
        return bool(_list_type(arrow(), chunk.type))

    def stored_dtype(self, name: str) -> np.dtype[Any] | None:
        chunks = self._chunk_list(name)
        if not chunks:
            return None
        chunk = chunks[0]
        if _is_pair(chunk) or isinstance(chunk, (np.ndarray, torch.Tensor)):
            return as_numpy(chunk[0] if _is_pair(chunk) else chunk).dtype
        pa, kind = arrow(), chunk.type
        while _list_type(pa, kind) is not None:  # the values inside the lists
            kind = kind.value_type
        found = _type(pa, kind)  # a number type's name is NumPy's
        return None if found is None else np.dtype(found)

    def example(self) -> dict[str, Any]:
        """A stand-in for every example's fields: each name to ``()`` (a list column) or ``0`` (a value)."""
        if self._tables:
            return {name: () if self.is_list(name) else 0 for name in self.order}
        return {name: () if self.is_list(name) or name not in self._chunks else 0 for name in self.order}

    def ragged(self, name: str, kind: Kind) -> Ragged:
        """List column ``name`` as a :class:`Ragged`, viewing the input where the layout allows."""
        chunks = self._column(name)
        names = self.names
        pieces: list[tuple[Row, np.ndarray]] = []
        first = 0
        for chunk in chunks:
            if _is_pair(chunk):
                pieces.append(_pair(chunk, name, first, names))
            elif isinstance(chunk, (np.ndarray, torch.Tensor)):
                raise TypeError(
                    f"field {shown(name)} is given as one value per example (a 1-D array), but it is read "
                    "as a row of values per example; give it as a (values, offsets) pair or a list column"
                )
            else:
                pieces.append(_arrow_list(arrow(), chunk, name, first, names, nested=kind == "values"))
            first += len(pieces[-1][1]) - 1
        values: Row
        if not pieces:  # a table of no chunks (a filter that kept nothing): no rows
            values, offsets = np.empty(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
        elif len(pieces) == 1:
            values, offsets = pieces[0]
        else:  # chunk by chunk: one copy joins the values, each chunk's offsets shifted
            values = _joined(_same_value_shape([values for values, _ in pieces], name))
            offsets = np.zeros(first + 1, dtype=np.int64)
            row, total = 0, 0
            for _, part_offsets in pieces:
                count = len(part_offsets) - 1
                offsets[row + 1 : row + count + 1] = part_offsets[1:] + total
                row, total = row + count, total + int(part_offsets[-1])
        checked = to_row(values, names(0), name, kind)  # the reader's dtype rules, on every value at once
        return Ragged(_host(checked), offsets)

    def values(self, name: str, kind: Kind) -> np.ndarray:
        """Scalar column ``name``: ``[B]`` (one value per row), read-only where it is a view."""
        parts = []
        first = 0
        names = self.names
        for chunk in self._column(name):
            if _is_pair(chunk):
                raise TypeError(
                    f"field {shown(name)} is a (values, offsets) pair, a row of values per example, but it "
                    "is read as one value per example; give a 1-D array"
                )
            if isinstance(chunk, (np.ndarray, torch.Tensor)):
                part = _read_only(as_numpy(chunk))
            else:
                part = _arrow_values(arrow(), chunk, name, first, names)
            parts.append(part)
            first += len(part)
        if len(parts) == 1:
            joined = parts[0]
        else:  # chunk by chunk (none: a table of no chunks, no rows)
            joined = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return as_numpy(to_row(joined, names(0), name, kind))

    def per_record(self, name: str, kind: Kind) -> np.ndarray | list[Row]:
        """Field ``name`` one entry per example: ``[B]`` values, ``[B, L, ...]`` rows, or each row."""
        if not self.is_list(name):
            return self.values(name, kind)
        field = self.ragged(name, kind)
        lengths = field.lengths
        if field.rows and bool((lengths == lengths[0]).all()):
            return np.asarray(field.values).reshape(field.rows, int(lengths[0]), *field.values.shape[1:])
        return [field.row(index) for index in range(field.rows)]

    def pylist(self, name: str) -> list[Any]:
        """Field ``name`` as one Python object per row (for ``texts``)."""
        chunks = self._chunk_list(name)
        if chunks is None:
            return list(self._sources[name])
        return [item for chunk in chunks for item in _pylist(chunk)]

    def _column(self, name: str) -> list[Any]:
        chunks = self._chunk_list(name)
        if chunks is not None:
            return chunks
        if name not in self._sources:
            raise ValueError(
                f"{self.names(0)}: the batch has no field {shown(name)} (its fields: "
                f"{shown_fields(dict.fromkeys(self.order))})"
            )
        raise TypeError(
            f"field {shown(name)} is a {type(self._sources[name]).__name__}, while the batch's other "
            "fields are columns; give it as a column too (a pyarrow array, a (values, offsets) pair or a "
            "1-D array), or give every field as rows"
        )


def _chunks_of(source: Any) -> list[Any] | None:
    """The chunks of one column, or ``None`` for a value that is not a column."""
    if _is_pair(source):
        return [source]
    if isinstance(source, (np.ndarray, torch.Tensor)):
        return [source] if source.ndim == 1 else None
    if isinstance(source, list) and source and all(_from_arrow(item) or _is_pair(item) for item in source):
        return [chunk for item in source for chunk in _chunks_of(item) or ()]
    if not _from_arrow(source):
        return None
    count = getattr(source, "num_chunks", None)  # a ChunkedArray: its chunks, each read as it is
    if count is None:
        return [_stored(source)]
    chunk = getattr(source, "chunk", None)
    return [
        _stored(chunk(index)) if chunk is not None else _stored(source.chunks[index])
        for index in range(count)
    ]


def _rows_in(chunk: Any, name: str) -> int:
    if _is_pair(chunk):
        return len(_offsets_of(chunk[1], name)) - 1
    return len(chunk)


def _offsets_of(given: Any, name: str) -> np.ndarray:
    """A pair's offsets as int64, checked to be a 1-D integer array of one entry per row plus one."""
    offsets = as_numpy(given) if isinstance(given, torch.Tensor) else given
    if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or not offsets.size:
        raise TypeError(
            f"field {shown(name)}: the offsets of a (values, offsets) pair must be a 1-D integer array of "
            f"one entry per example plus one, got dtype {offsets.dtype} and shape {tuple(offsets.shape)}"
        )
    return np.asarray(offsets.astype(np.int64, copy=False))


def _read_only(values: np.ndarray) -> np.ndarray:
    """A read-only view of ``values`` (the input's own flags are left as they are)."""
    if not values.flags.writeable:
        return values
    view = values.view()
    view.flags.writeable = False
    return view


def _host(values: Row) -> np.ndarray | torch.Tensor:
    """Host data as a read-only NumPy view, a device tensor copied where it is."""
    if isinstance(values, np.ndarray):
        return values
    if values.device.type == "cpu":
        return _read_only(as_numpy(values))
    return values.detach().clone()


def _same_value_shape(parts: list[Row], name: str) -> list[Row]:
    """The chunks' values, an empty chunk's given the others' value shape (else ``ValueError``)."""
    shapes = {tuple(part.shape[1:]) for part in parts if part.shape[0]}
    if len(shapes) > 1:
        raise ValueError(
            f"field {shown(name)} holds values of shapes {sorted(shapes)} per token in different chunks of "
            "the batch; give every token the same value shape (pad a ragged top-k with its fill)"
        )
    if not shapes:
        return parts
    shape = next(iter(shapes))
    return [part if part.shape[0] else part.reshape(0, *shape) for part in parts]


def _joined(parts: Sequence[Row]) -> np.ndarray | torch.Tensor:
    """Chunks' values end to end (a copy, owned by the batch)."""
    if all(isinstance(part, np.ndarray) for part in parts):
        return np.concatenate(parts)
    return torch.cat([torch.as_tensor(part) for part in parts])


def _pair(pair: tuple[Any, Any], name: str, first: int, names: Names) -> tuple[Row, np.ndarray]:
    """A ``(values, offsets)`` pair as values from its first offset to its last, offsets from 0."""
    values, given = pair
    offsets = _offsets_of(given, name)
    if values.ndim == 0:
        raise TypeError(f"field {shown(name)}: the values of a (values, offsets) pair must be an array")
    steps = offsets[1:] - offsets[:-1]
    if offsets[0] < 0 or (steps < 0).any() or offsets[-1] > values.shape[0]:
        bad = np.flatnonzero(steps < 0)
        where = names(first + int(bad[0])) if bad.size else names(first)
        raise ValueError(
            f"{where}: field {shown(name)}: the offsets of its (values, offsets) pair must rise from >= 0 to "
            f"at most the {values.shape[0]} values (row b is values[offsets[b]:offsets[b + 1]]), got "
            f"{shown(offsets[:8].tolist())}{' ...' if offsets.size > 8 else ''}"
        )
    start, end = int(offsets[0]), int(offsets[-1])
    view = values[start:end] if start or end != values.shape[0] else values
    if isinstance(view, np.ndarray):
        view = _read_only(view)
    return view, offsets - start if start else offsets


_TYPES: dict[int, str] = {}
"""Arrow type id to what this module makes of it: ``"list"``, ``"large_list"``, ``"fixed_size_list"``,
``"bool"``, or a NumPy dtype name (integers and floats, whose values buffer NumPy reads as it is)."""


def _type(pa: ModuleType, kind: Any) -> str | None:
    """What Arrow type ``kind`` is here (see :data:`_TYPES`), or ``None`` for anything else."""
    if not _TYPES:
        _TYPES[pa.list_(pa.int8()).id] = "list"
        _TYPES[pa.large_list(pa.int8()).id] = "large_list"
        _TYPES[pa.list_(pa.int8(), 1).id] = "fixed_size_list"
        _TYPES[pa.bool_().id] = "bool"
        for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"):
            _TYPES[getattr(pa, name)().id] = name
        for name in ("float16", "float32", "float64"):  # Arrow's names are NumPy's
            _TYPES[getattr(pa, name)().id] = name
    return _TYPES.get(kind.id)


def _list_type(pa: ModuleType, kind: Any) -> str | None:
    """``"list"``, ``"large_list"`` or ``"fixed_size_list"`` for those Arrow types, else ``None``."""
    found = _type(pa, kind)
    return found if found in ("list", "large_list", "fixed_size_list") else None


def _first_null(array: Any) -> int:
    return int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])


def _number_type(pa: ModuleType, kind: Any) -> bool:
    found = _type(pa, kind)
    return found is not None and found not in ("list", "large_list", "fixed_size_list")


def _arrow_list(
    pa: ModuleType, array: Any, name: str, first: int, names: Names, *, nested: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """One Arrow list chunk as read-only values and offsets from 0 (``nested``: ``[N, ...]`` values)."""
    kind = array.type
    layout = _list_type(pa, kind)
    if layout is None:
        if _number_type(pa, array.type):
            raise TypeError(
                f"field {shown(name)} is a column of one {array.type} per example, but it is read as a row "
                "of values per example; give it as a list column (one list per example)"
            )
        raise TypeError(
            f"field {shown(name)} is an Arrow column of type {array.type}; it must be a list column of "
            "numbers (list<int64>, large_list<int32>, ...)"
        )
    value_type = kind.value_type
    leaf_type = value_type
    while nested and _list_type(pa, leaf_type):  # a tensor per token (top-k, routes): lists of lists
        leaf_type = leaf_type.value_type
    value_kind = _type(pa, leaf_type)
    if not _number_type(pa, leaf_type):
        what = "a list of lists" if _list_type(pa, value_type) else f"a list of {value_type}"
        raise TypeError(
            f"field {shown(name)} is {what} per example (Arrow type {array.type}); it must hold one list of "
            "numbers (or of equal-length lists of numbers) per example"
        )
    if array.null_count:
        raise ValueError(
            f"{names(first + _first_null(array))}: field {shown(name)} is null (a missing row); every "
            "example needs one: fill it (dataset.map) or drop the example (dataset.filter)"
        )
    rows = len(array)
    if layout == "fixed_size_list":
        size = array.type.list_size
        offsets = np.arange(rows + 1, dtype=np.int64) * size
        start = array.offset * size
    else:
        offsets = _view(
            array, 1, np.dtype(np.int32 if layout == "list" else np.int64), array.offset, rows + 1
        )
        if offsets is None:
            offsets = array.offsets.to_numpy()
        start = int(offsets[0])  # a slice's offsets start inside the buffer
        offsets = offsets.astype(np.int64, copy=False)
        offsets = offsets - start if start else offsets
    count = int(offsets[-1])

    def null_at(token: int) -> ValueError:
        row = row_of(offsets, token)
        return ValueError(
            f"{names(first + row)}: field {shown(name)} holds a null at {name}[{token - int(offsets[row])}]; "
            "give numbers only: fill the nulls (dataset.map) or drop the example (dataset.filter)"
        )

    child = array.values
    if child.null_count and child.slice(start, count).null_count:
        raise null_at(_first_null(child.slice(start, count)))
    shape: list[int] = []
    tokens = count
    while _list_type(pa, child.type):  # one level of a tensor per token: its size, then its values
        child, start, count, size = _inner(pa, child, start, count, name, first, offsets, names)
        shape.append(size)
    if shape and child.null_count and child.slice(start, count).null_count:  # a null number inside
        raise null_at(_first_null(child.slice(start, count)) // int(np.prod(shape)))
    values = None
    if value_kind != "bool":
        values = _view(child, 1, np.dtype(value_kind), child.offset + start, count)
    if values is None:  # bools (Arrow packs them in bits): unpacked, a copy
        values = child.slice(start, count).to_numpy(zero_copy_only=False)
    if shape:
        values = values.reshape(tokens, *shape)
    return values, offsets


def _inner(
    pa: ModuleType, child: Any, start: int, count: int, name: str, first: int, rows: np.ndarray, names: Names
) -> tuple[Any, int, int, int]:
    """One inner list level of a tensor-valued column: values, start, count and the lists' one size."""
    part = child.slice(start, count)
    if part.null_count:
        flat = _first_null(part)
        row = row_of(rows, flat)
        token = flat - int(rows[row])
        raise ValueError(
            f"{names(first + row)}: field {shown(name)} holds a null list at {name}[{token}]; give every "
            "token its values"
        )
    if _list_type(pa, child.type) == "fixed_size_list":
        size = int(child.type.list_size)
        return child.values, (child.offset + start) * size, count * size, size
    offsets = part.offsets.to_numpy().astype(np.int64)
    sizes = offsets[1:] - offsets[:-1]
    if sizes.size and bool((sizes != sizes[0]).any()):
        flat = int(np.flatnonzero(sizes != sizes[0])[0])
        row = row_of(rows, flat)
        token, given, first_size = flat - int(rows[row]), int(sizes[flat]), int(sizes[0])
        raise ValueError(
            f"{names(first + row)}: field {shown(name)} holds {given} values at {name}[{token}], but "
            f"{first_size} at {name}[0] of {names(first)}; give every token the same number (pad a ragged "
            "top-k with its fill, -inf for log-probs)"
        )
    size = int(sizes[0]) if sizes.size else 0
    return child.values, int(offsets[0]) if offsets.size else 0, count * size, size


def _view(array: Any, buffer: int, dtype: np.dtype, start: int, count: int) -> np.ndarray | None:
    """``count`` items of ``dtype`` from ``start`` of a buffer, read-only, or ``None`` where it lacks them."""
    data = array.buffers()[buffer]
    if data is None or data.size < (start + count) * dtype.itemsize:
        return None
    view: np.ndarray = np.frombuffer(data, dtype=dtype, count=count, offset=start * dtype.itemsize)
    view.flags.writeable = False  # this view only; a mutable Arrow buffer stays mutable for its owner
    return view


def _arrow_values(pa: ModuleType, array: Any, name: str, first: int, names: Names) -> np.ndarray:
    """One Arrow scalar chunk as ``[rows]`` values (a read-only view, bools unpacked)."""
    if not _number_type(pa, array.type):
        raise TypeError(
            f"field {shown(name)} is an Arrow column of type {array.type}; it must hold numbers, one per "
            "example"
        )
    if array.null_count:
        raise ValueError(
            f"{names(first + _first_null(array))}: field {shown(name)} is null (a missing value); every "
            "example needs one: fill it (dataset.map) or drop the example (dataset.filter)"
        )
    values: np.ndarray = array.to_numpy(zero_copy_only=False)
    return values


def _pylist(chunk: Any) -> list[Any]:
    if _is_pair(chunk):
        values, offsets = chunk
        return [values[int(offsets[i]) : int(offsets[i + 1])].tolist() for i in range(len(offsets) - 1)]
    if isinstance(chunk, (np.ndarray, torch.Tensor)):
        return list(chunk.tolist())
    return list(chunk.to_pylist())
