"""ColumnarDataset: a Hugging Face ``datasets.Dataset`` that hands a DataLoader whole batches of columns.

``datasets``' own ``__getitems__`` fetches a batch as columns, then splits it
into one Python dict per example, which a collator reads back one by one.
This wrapper keeps the batch as it is stored: ``__getitems__(indices)`` maps
the indices through the dataset's indices mapping (what ``shuffle``,
``select`` and ``train_test_split`` leave) with one NumPy lookup, gathers the
rows with one Arrow ``take``, and returns them as one Arrow table, which every
``Collator`` reads column by column (no loop over the examples).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from zephon_collate._text import shown

__all__ = ["ColumnarDataset"]


class ColumnarDataset(torch.utils.data.Dataset[Any]):
    """A map-style dataset of columnar batches over a ``datasets.Dataset`` (or a ``pyarrow.Table``).

    ``__getitems__(indices)`` returns the rows at ``indices`` as ``[table]``: a
    list holding one ``pyarrow.Table``, which the collators read as one batch.
    The list is what lets it through ``transformers.Trainer``: for a dataset
    that is not a ``datasets.Dataset``, ``Trainer``'s ``remove_unused_columns``
    wraps the collator in a ``RemoveColumnsCollator``, which drops the keys of
    example dicts that the model's ``forward`` does not name (``loss_mask``,
    ``assistant_masks``, ``seq_lengths``...) and passes any other item as it is:
    the table, with every column, reaches the collator. ``__getitem__(index)``
    returns one row the same way.

    Parameters:
        dataset: a ``datasets.Dataset`` (its indices mapping, if any, is honoured)
            or a ``pyarrow.Table``; read, never changed.
        columns: the columns to hand over (default: all), e.g. to leave text
            columns behind.

    Raises:
        TypeError: for anything else than a ``datasets.Dataset`` or a ``pyarrow.Table``.
        ValueError: for a column the dataset does not have.

    Example:
        >>> import pyarrow as pa
        >>> from zephon_collate import Collator
        >>> table = pa.table({"input_ids": [[5, 6, 7], [8, 9], [4]], "text": ["a", "b", "c"]})
        >>> dataset = ColumnarDataset(table, columns=["input_ids"])
        >>> batch = dataset.__getitems__([2, 0])
        >>> batch[0].column("input_ids").to_pylist()
        [[4], [5, 6, 7]]
        >>> Collator.for_transformers(padding_free=True)(batch)["input_ids"].tolist()
        [[4, 5, 6, 7]]
    """

    def __init__(self, dataset: Any, *, columns: Sequence[str] | None = None) -> None:
        table: Any = (
            dataset if _is_arrow_table(dataset) else getattr(getattr(dataset, "data", None), "table", None)
        )
        if not _is_arrow_table(table):
            raise TypeError(
                "ColumnarDataset: expected a datasets.Dataset or a pyarrow.Table, got "
                f"{type(dataset).__name__}"
            )
        names = list(table.schema.names)
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
        self._table: Any = None
        self._indices: np.ndarray | None = None
        self._rows = 0
        self._load()

    def _load(self) -> None:
        """The table of the chosen columns and the indices mapping as NumPy (once per process)."""
        dataset = self.dataset
        table = dataset if _is_arrow_table(dataset) else dataset.data.table
        self._table = table.select(list(self.columns))
        mapping = None if _is_arrow_table(dataset) else getattr(dataset, "_indices", None)
        if mapping is None:
            self._indices = None
            self._rows = table.num_rows
        else:  # shuffle / select: row i of the dataset is row indices[i] of the table
            self._indices = mapping.column(0).to_numpy().astype(np.int64)
            self._rows = len(self._indices)

    def __getstate__(self) -> dict[str, Any]:
        # Workers rebuild the table from the dataset (memory-mapped datasets pickle as their files).
        return {"dataset": self.dataset, "columns": self.columns}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.dataset = state["dataset"]
        self.columns = state["columns"]
        self._load()

    def __len__(self) -> int:
        return self._rows

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The rows at ``indices``, in that order, as ``[table]`` (one vectorised lookup and one ``take``).

        Raises:
            IndexError: for an index outside the dataset.
        """
        rows = np.asarray(indices, dtype=np.int64).reshape(-1)
        if rows.size and (int(rows.min()) < -self._rows or int(rows.max()) >= self._rows):
            bad = int(rows[(rows < -self._rows) | (rows >= self._rows)][0])
            raise IndexError(f"ColumnarDataset: index {bad} is out of range for {self._rows} rows")
        rows = np.where(rows < 0, rows + self._rows, rows)
        if self._indices is not None:
            rows = self._indices[rows]
        return [self._table.take(rows)]

    def __getitem__(self, index: int) -> list[Any]:
        """Row ``index`` as a batch of one: ``[table]``."""
        return self.__getitems__([index])

    def __repr__(self) -> str:
        shuffled = ", indices mapping" if self._indices is not None else ""
        return f"ColumnarDataset({self._rows} rows, columns {list(self.columns)}{shuffled})"


def _is_arrow_table(value: object) -> bool:
    return type(value).__name__ == "Table" and type(value).__module__.partition(".")[0] == "pyarrow"
