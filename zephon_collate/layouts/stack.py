"""Fields to stacked tensors: rows of one length as ``[B, S, ...]``, ragged rows padded on the right."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from zephon_collate.core.checks import check_int
from zephon_collate.core.keys import INT32_MAX, MAX_PAD_MULTIPLE
from zephon_collate.core.text import shown
from zephon_collate.read.columns import Names, Ragged, Row, Spread, Values, as_numpy, filled, places

__all__ = ["RowPadding", "dense", "row_places", "stack_rows"]


@dataclass(frozen=True)
class RowPadding:
    """Pad ragged rows on the right: to the longest row rounded up to ``multiple``, or to ``length``.

    Parameters:
        pad_token_id: the token id of padding (an int >= 0).
        multiple: round the length up to a multiple of this (at most :data:`MAX_PAD_MULTIPLE`), or ``None``.
        length: pad every row to exactly this many tokens, or ``None`` for the longest.

    Example:
        >>> RowPadding(0, 8).width(np.array([3, 13])), RowPadding(0, None).width(np.array([3, 13]))
        (16, 13)
    """

    pad_token_id: int
    multiple: int | None = None
    length: int | None = None

    @classmethod
    def create(
        cls, pad_token_id: object, multiple: object, owner: str = "Collator", length: object = None
    ) -> RowPadding | None:
        """The padding ``owner``'s ``pad_token_id`` / ``pad_to_multiple_of`` ask for, checked."""
        if pad_token_id is None:
            if multiple is not None:
                raise ValueError(f"{owner}: pad_to_multiple_of needs pad_token_id, the id to pad with")
            return None
        token = check_int(owner, "pad_token_id", pad_token_id, 0)
        step: int | None = None
        if multiple is not None:
            step = check_int(owner, "pad_to_multiple_of", multiple, 1, MAX_PAD_MULTIPLE)
        fixed = None if length is None else check_int(owner, "max_length", length, 1, INT32_MAX)
        if step is not None and fixed is not None and fixed % step:
            fixed = -(-fixed // step) * step  # as HF rounds max_length up to the multiple
        return cls(token, step, fixed)

    def width(self, lengths: np.ndarray) -> int:
        """The padded row length for rows of ``lengths``."""
        if self.length is not None:
            return self.length
        longest = int(lengths.max()) if lengths.size else 0
        return longest if self.multiple is None else -(-longest // self.multiple) * self.multiple


def dense(
    field: Ragged,
    width: int,
    fill: int | float | Spread,
    *,
    ramp_from: np.ndarray | None = None,
    left: bool = False,
) -> Values:
    """``[B, width, ...]``: each row's values, then ``fill`` up to ``width`` (with ``ramp_from``: place
    ``j`` of row ``b`` filled with ``j - ramp_from[b]``, positions counting on from the padding's start).

    A ``Spread`` fill is numbered by its place in the row (``left``: once ``LeftPadding`` moved it to the
    front). Rows already ``width`` long give a view (read-only columnar values: a copy).

    Example:
        >>> from zephon_collate.read.columns import concat
        >>> field = concat([np.array([5, 6, 7]), np.array([8])], "input_ids", str)
        >>> dense(field, 4, 0).tolist(), dense(field, 4, 0, ramp_from=np.array([3, 1])).tolist()
        ([[5, 6, 7, 0], [8, 0, 0, 0]], [[5, 6, 7, 0], [8, 0, 1, 2]])
    """
    values, lengths = field.values, field.lengths
    rows = len(lengths)
    trailing = tuple(values.shape[1:])
    # No row is longer than ``width``, so every row has it exactly when the values fill ``rows * width``:
    # known from the shape, no pass over the lengths.
    if rows and values.shape[0] == rows * width:
        if isinstance(values, np.ndarray) and not values.flags.writeable:
            return values.reshape(rows, width, *trailing).copy()
        return values.reshape(rows, width, *trailing)
    if ramp_from is not None:  # padding positions count on from where each row's padding starts
        base = np.arange(width, dtype=np.int64)[None] - ramp_from[:, None]
        base = base.reshape(rows, width, *([1] * len(trailing)))
        start: Values = np.broadcast_to(base, (rows, width, *trailing))
    elif isinstance(fill, Spread) and left:  # each padding place numbered where LeftPadding puts it
        at = np.maximum(np.arange(width, dtype=np.int64)[None] - lengths[:, None], 0).reshape(-1)
        spread = filled((rows * width, *trailing), fill, np.dtype(np.int64), at=at)
        start = spread.reshape(rows, width, *trailing)
    elif isinstance(fill, Spread):
        start = np.broadcast_to(
            filled((width, *trailing), fill, np.dtype(np.int64)), (rows, width, *trailing)
        )
    else:
        start = np.full((rows, width, *trailing), fill)
    if isinstance(values, np.ndarray):
        # In the values' dtype: np.full's array converted (or taken as it is), a broadcast copied.
        out = np.asarray(start).astype(values.dtype, copy=ramp_from is not None or isinstance(fill, Spread))
        # The rows' values end to end fill each row's first ``length`` places, in row-major order: one
        # boolean assignment (a scatter costs a repeat, a ramp and a sum of [N] indices more).
        out[np.arange(width) < lengths[:, None]] = values
        return out
    # The flat destination of every token: its row times the width, plus its place in the row.
    destination = np.repeat(np.arange(rows, dtype=np.int64) * width - field.offsets[:-1], lengths)
    destination += np.arange(values.shape[0], dtype=np.int64)
    tensor = torch.from_numpy(np.ascontiguousarray(start)).to(device=values.device, dtype=values.dtype)
    index = torch.from_numpy(destination).to(values.device)
    tensor.view(rows * width, *trailing).index_copy_(0, index, values)
    return tensor


def row_places(lengths: np.ndarray, width: int | None, *, left: bool = False) -> np.ndarray:
    """``[N]``: each value's place in its row: padded to ``width`` (on the left with ``left``), or end to end.

    Example:
        >>> lengths = np.array([3, 1])
        >>> row_places(lengths, 4).tolist(), row_places(lengths, 4, left=True).tolist()
        ([0, 1, 2, 0], [1, 2, 3, 3])
    """
    if width is None:
        return np.arange(int(lengths.sum()), dtype=np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    at = places(offsets)
    if left:
        at += np.repeat(width - lengths, lengths)
    return at


def stack_rows(rows: Sequence[Row] | np.ndarray, name: str, names: Names) -> torch.Tensor:
    """A per-record field's rows stacked as ``[B, ...]`` (copied, never padded; rows of one shape)."""
    if isinstance(rows, np.ndarray):
        return torch.from_numpy(np.array(rows))
    first = tuple(rows[0].shape)
    for index, row in enumerate(rows):
        if tuple(row.shape) != first:
            raise ValueError(
                f"cannot stack rows of field {shown(name)} of unequal shape into a tensor: the first payload "
                f"has shape {first}, {names(index)} has {tuple(row.shape)}; give every payload the same "
                "shape, or pass dtype=None for lists"
            )
    if all(not isinstance(row, torch.Tensor) or row.is_cpu for row in rows):
        return torch.from_numpy(np.stack([as_numpy(row) for row in rows]))
    return torch.stack([torch.as_tensor(row) for row in rows])
