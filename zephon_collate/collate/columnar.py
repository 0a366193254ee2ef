"""``ColumnarDataset``: a ``datasets.Dataset`` handing a DataLoader whole batches of columns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from zephon_collate.core.text import shown
from zephon_collate.read.arrow import ColumnBatch, Columns
from zephon_collate.read.columns import gather_spans

__all__ = ["ColumnarDataset"]


class ColumnarDataset(torch.utils.data.Dataset[Any]):
    """A map-style dataset of columnar batches over a ``datasets.Dataset`` (``docs/columns.md``).

    Parameters:
        dataset: a ``datasets.Dataset`` (its indices mapping honoured) or a ``pyarrow.Table``; never changed.
        columns: the columns to hand over (default: ``set_format(columns=...)``'s, else all).

    Example:
        >>> import pyarrow as pa
        >>> from zephon_collate import Collator
        >>> dataset = ColumnarDataset(pa.table({"input_ids": [[5, 6, 7], [8, 9], [4]]}))
        >>> batch = dataset.__getitems__([2, 0])  # [one ColumnBatch]: each column (values, offsets)
        >>> Collator.for_transformers(padding_free=True)(batch)["input_ids"].tolist()
        [[4, 5, 6, 7]]
    """

    def __init__(self, dataset: Any, *, columns: Sequence[str] | None = None) -> None:
        table = _table_of(dataset)
        if table is None:
            raise TypeError(
                "ColumnarDataset: expected a datasets.Dataset or a pyarrow.Table, got "
                f"{type(dataset).__name__}"
            )
        _check_no_transform(dataset)
        names = list(table.schema.names)
        shown_columns = _format_columns(dataset) if table is not dataset else None
        if columns is None and shown_columns is not None:
            columns = [name for name in names if name in shown_columns]  # the table's order, as datasets
        if columns is not None:
            if isinstance(columns, str):
                raise TypeError(
                    f"ColumnarDataset: columns must be a list of names, not the str {shown(columns)}"
                )
            missing = [name for name in columns if name not in names]
            if missing:
                raise ValueError(
                    f"ColumnarDataset: the dataset has no column {shown(missing[0])} (its columns: {names})"
                )
        self.dataset = dataset
        self.columns = tuple(names if columns is None else columns)
        mapping = getattr(dataset, "_indices", None) if table is not dataset else None
        # Row i of the dataset is row indices[i] of the table (shuffle, select): one NumPy array.
        self._indices = None if mapping is None else mapping.column(0).to_numpy().astype(np.int64)
        self._rows = table.num_rows if self._indices is None else len(self._indices)
        self._read: dict[str, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Workers read the columns themselves (a memory-mapped dataset pickles as its files).
        return {
            "dataset": self.dataset,
            "columns": self.columns,
            "indices": self._indices,
            "rows": self._rows,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.dataset, self.columns = state["dataset"], state["columns"]
        self._indices, self._rows, self._read = state["indices"], state["rows"], None

    def __len__(self) -> int:
        return self._rows

    def _columns(self) -> dict[str, Any]:
        """Each column as ``(values, offsets)`` NumPy arrays or one Arrow array (text, nulls), read once."""
        if self._read is None:
            table = _table_of(self.dataset)
            columns = Columns(tables=[table])
            read: dict[str, Any] = {}
            for name in self.columns:
                try:
                    if columns.is_list(name):
                        field = columns.ragged(name, "values")
                        read[name] = (field.host, field.offsets)
                    else:
                        read[name] = (columns.values(name, "values"), None)
                except (TypeError, ValueError):
                    column = table.column(name)
                    read[name] = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
            self._read = read
        return self._read

    def __getitems__(self, indices: Sequence[int]) -> list[ColumnBatch]:
        """The rows at ``indices``, in that order, as ``[batch]``: one lookup, one gather per column."""
        _check_no_transform(self.dataset)
        given = np.asarray(indices).reshape(-1)
        if given.size and given.dtype.kind not in "iu":  # a float would be cut to a row silently
            raise TypeError(
                f"ColumnarDataset: indices must be ints (row numbers, as a sampler gives them), got "
                f"{shown(indices)}; pass the rows' integer indices"
            )
        outside = (given < -self._rows) | (given >= self._rows)  # in the given dtype: no wrap-around
        if outside.any():
            raise IndexError(
                f"ColumnarDataset: index {int(given[outside][0])} is out of range for {self._rows} rows"
            )
        rows = given.astype(np.int64)
        rows = np.where(rows < 0, rows + self._rows, rows)
        if self._indices is not None:
            rows = self._indices[rows]
        batch: dict[str, Any] = {}
        for name, column in self._columns().items():
            if type(column) is not tuple:
                batch[name] = column.take(rows)  # text and other columns: Arrow's gather
                continue
            values, offsets = column
            if offsets is None:  # one number per row
                batch[name] = values[rows]
                continue
            starts = offsets[rows]
            lengths = offsets[rows + 1] - starts
            out = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum(lengths, out=out[1:])
            batch[name] = (values[gather_spans(starts, lengths)], out)
        return [ColumnBatch(batch)]

    def __getitem__(self, index: int) -> list[ColumnBatch]:
        """Row ``index`` as a batch of one: ``[batch]``."""
        return self.__getitems__([index])

    def __repr__(self) -> str:
        shuffled = ", indices mapping" if self._indices is not None else ""
        return f"ColumnarDataset({self._rows} rows, columns {list(self.columns)}{shuffled})"


def _table_of(dataset: Any) -> Any:
    """The ``pyarrow.Table`` of a table or of a ``datasets.Dataset``, or ``None``."""
    for candidate in (dataset, getattr(getattr(dataset, "data", None), "table", None)):
        if type(candidate).__name__ == "Table" and type(candidate).__module__.partition(".")[0] == "pyarrow":
            return candidate
    return None


def _format_of(dataset: Any) -> Mapping[str, Any]:
    """A ``datasets.Dataset``'s ``format`` (type, format_kwargs, columns, output_all_columns), or ``{}``."""
    found = getattr(dataset, "format", None) if _table_of(dataset) is not dataset else None
    return found if isinstance(found, Mapping) else {}


def _format_columns(dataset: Any) -> list[str] | None:
    """The columns the dataset's format shows (``set_format(columns=...)``), or ``None`` for all."""
    found = _format_of(dataset)
    columns = found.get("columns")
    if found.get("output_all_columns") or not isinstance(columns, (list, tuple)):
        return None
    return [name for name in columns if isinstance(name, str)]


def _check_no_transform(dataset: Any) -> None:
    """``ValueError`` for a dataset with a ``set_transform``/``with_transform`` function, naming the fix."""
    found = _format_of(dataset)
    kwargs = found.get("format_kwargs")
    transform = kwargs.get("transform") if isinstance(kwargs, Mapping) else None
    if transform is None and found.get("type") != "custom":
        return
    name = getattr(transform, "__name__", None)
    called = name if isinstance(name, str) and name.isidentifier() else "transform"
    raise ValueError(
        f"ColumnarDataset: the dataset has a transform ({name or shown(transform)}, set by set_transform or "
        "with_transform), which datasets runs on the rows it hands over, but this wrapper hands over the "
        f"stored columns: it would never run. Apply it once with dataset = dataset.map({called}, "
        "batched=True) and wrap that, or give the dataset itself to the DataLoader (the collators read "
        "its rows), or drop it with dataset.reset_format()"
    )
