"""Where pieces go: the one rule of each packing strategy, over a list of piece lengths.

The streaming packer (:class:`~zephon_collate.packing.rows.Engine`), the
columnar packer (:func:`~zephon_collate.packing.columns.pack_columns`) and the
tree layout place pieces with these functions, so they pack the same documents
into the same rows. Lengths are ints from 1 to ``seq_len`` (a longer document is cut
into pieces first). Neither function touches a token: greedy steps row by
row (one binary search over the running total each), best-fit-decreasing
piece by piece (a sequential rule, one binary search over the open rows each).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

__all__ = ["best_fit_rows", "greedy_breaks"]

_ROW_BITS = 32  # best fit keys an open row as (space left) << 32 | (row index): one int, compared fast


def greedy_breaks(lengths: Sequence[int], seq_len: int, used: int = 0) -> list[int]:
    """Greedy: the pieces that start a new row, in arrival order.

    Pieces fill the open row (which holds ``used`` tokens already) in arrival
    order; a piece that does not fit in what is left closes the row and starts
    the next one. Row ``k`` holds the pieces from break ``k - 1`` (or the
    first piece) up to break ``k``.

    Example:
        >>> greedy_breaks([3, 2, 4, 1], 5), greedy_breaks([3, 2, 4, 1], 5, used=3)
        ([2], [0, 2])
    """
    ends = list(itertools.accumulate(lengths))  # tokens up to and including each piece
    breaks: list[int] = []
    start = bisect.bisect_right(ends, seq_len - used)  # the first piece the open row cannot take
    while start < len(ends):
        breaks.append(start)
        start = bisect.bisect_right(ends, ends[start] - lengths[start] + seq_len, lo=start + 1)
    return breaks


def best_fit_rows(
    lengths: Sequence[int],
    seq_len: int,
    *,
    order: Sequence[int] | None = None,
    fresh: Sequence[bool] | None = None,
) -> list[list[int]]:
    """Best-fit-decreasing: the pieces of each row (indices into ``lengths``), rows in the order opened.

    Pieces are taken longest first (ties in arrival order); each goes into the
    open row with the least space left that fits it (ties: the earliest row),
    or opens a new row. A row lists its pieces in the order they were placed.
    ``order`` ranks the pieces instead of their lengths (a group is taken by its
    whole size), and a piece marked ``fresh`` always opens a new row (the last
    row of a group laid over several).

    Example:
        >>> best_fit_rows([3, 2, 4, 1], 5)
        [[2, 3], [0, 1]]
        >>> best_fit_rows([3, 2, 4, 1], 5, fresh=[False, False, False, True])
        [[2], [0, 1], [3]]
    """
    rank = lengths if order is None else order
    sequence = sorted(range(len(lengths)), key=rank.__getitem__, reverse=True)  # stable: ties keep order
    rows: list[list[int]] = []
    free: list[int] = []  # open rows with space left, sorted: least space, then earliest row, first
    mask, shift = (1 << _ROW_BITS) - 1, _ROW_BITS
    find, insert, take = bisect.bisect_left, bisect.insort, free.pop
    for index in sequence:
        size = lengths[index]
        slot = len(free) if fresh is not None and fresh[index] else find(free, size << shift)
        if slot == len(free):
            row, left = len(rows), seq_len - size
            rows.append([index])
        else:
            key = take(slot)
            row, left = key & mask, (key >> shift) - size
            rows[row].append(index)
        if left:
            insert(free, left << shift | row)
    return rows
