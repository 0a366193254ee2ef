"""Where pieces go: each packing strategy's placement rule over piece lengths, shared by every packer."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

__all__ = ["best_fit_rows", "greedy_breaks"]

_ROW_BITS = 32  # best fit keys an open row as (space left) << 32 | (row index): one int, compared fast


def greedy_breaks(lengths: Sequence[int], seq_len: int, used: int = 0) -> list[int]:
    """Greedy: the pieces that start a new row, in arrival order (the open row holds ``used`` tokens already).

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
    """Best-fit-decreasing (docs/packing.md): the pieces of each row (indices into ``lengths``), rows in the
    order opened.

    Parameters:
        lengths, seq_len: the pieces' lengths (each from 1 to ``seq_len``) and the row length.
        order: ranks the pieces instead of their lengths (a group taken by its whole size).
        fresh: pieces that always open a new row.

    Example:
        >>> best_fit_rows([3, 2, 4, 1], 5)
        [[2, 3], [0, 1]]
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
