"""Placing items into (slot, rank) cells, numbered ``slot * ranks + rank``: a longest-first seed, then
bounded pairwise swaps (docs/distributed.md, "The planner").
"""

from __future__ import annotations

import bisect

import numpy as np
import numpy.typing as npt

__all__ = ["TOLERANCE_DENOMINATOR", "UNPLACED", "Ints", "pack_rows", "place_items", "place_rows"]

UNPLACED = -1
"""The cell of an item that did not fit."""

TOLERANCE_DENOMINATOR = 1000
"""A slot stops refining once its max/mean cost is within ``1 + 1 / TOLERANCE_DENOMINATOR``."""

_MIN_GAIN_DENOMINATOR = 100_000
"""A slot stops refining after a round that lowered its maximum by less than ``1 / _MIN_GAIN_DENOMINATOR``."""

Ints = npt.NDArray[np.int64]


def _slots_of_tiers(count: int, ranks: int, slots: int) -> Ints:
    """The slot of each position of the sorted order: tiers of ``ranks`` dealt to slots in snake order."""
    tier = np.arange(count, dtype=np.int64) // ranks
    lap, position = np.divmod(tier, slots)
    return np.where(lap % 2 == 0, position, slots - 1 - position)


def _cost_order(costs: Ints) -> Ints:
    """Items by cost, descending; ties by index."""
    return np.lexsort((np.arange(costs.size), -costs)).astype(np.int64)


def place_items(
    lengths: Ints,
    costs: Ints,
    must: npt.NDArray[np.bool_],
    *,
    ranks: int,
    slots: int,
    max_tokens: int,
    rounds: int,
) -> Ints:
    """The cell of each item (``UNPLACED`` if none has room), each cell holding at most ``max_tokens``.

    Example:
        >>> lengths = np.array([6, 5, 4, 3, 2, 2])
        >>> cells = place_items(lengths, lengths * lengths, np.zeros(6, bool), ranks=2, slots=1,
        ...                     max_tokens=12, rounds=8)
        >>> cells.tolist()  # rank 0: 6 and 2 (cost 40), rank 1: 5, 4, 2 (cost 45)
        [0, 1, 1, 0, 1, 0]
    """
    cells = np.full(lengths.size, UNPLACED, np.int64)
    total_cells = ranks * slots
    cost, used = [0] * total_cells, [0] * total_cells
    count = [0] * total_cells  # ties in cost go to the cell of fewer items: units of cost 0 spread too
    lengths_list, costs_list = lengths.tolist(), costs.tolist()

    def put(item: int, candidates: range) -> bool:
        """Put ``item`` in the cheapest (then emptiest) cell of ``candidates`` with room; False if none."""
        size = lengths_list[item]
        fits = [cell for cell in candidates if used[cell] + size <= max_tokens]
        if not fits:
            return False
        best = min(fits, key=lambda cell: (cost[cell], count[cell]))
        cells[item], cost[best], used[best] = best, cost[best] + costs_list[item], used[best] + size
        count[best] += 1
        return True

    order = _cost_order(costs)
    left = []
    for item, slot in zip(order.tolist(), _slots_of_tiers(order.size, ranks, slots).tolist(), strict=True):
        if not put(item, range(slot * ranks, slot * ranks + ranks)):
            left.append(item)
    for item in left:  # no room in its own slot: the cheapest cell of any slot with room
        put(item, range(total_cells))
    for item in np.flatnonzero((cells == UNPLACED) & must).tolist():
        if put(item, range(total_cells)):  # room an earlier item's swap freed
            continue
        out = _take_place(item, cells, lengths, must, np.array(used, np.int64), max_tokens)
        if out >= 0:
            cell = int(cells[item])
            used[cell] += lengths_list[item] - lengths_list[out]
            cost[cell] += costs_list[item] - costs_list[out]
    for slot in range(slots):
        _refine(cells, lengths, costs, slot, ranks, max_tokens, rounds, count_cap=None)
    return cells


def place_rows(row_costs: Ints, *, ranks: int, slots: int, rows_per_cell: int, rounds: int) -> Ints:
    """The cell of each row, at most ``rows_per_cell`` rows per cell (``len(row_costs)`` must fit).

    Example:
        >>> costs = np.array([9, 8, 5, 4, 3, 1])
        >>> place_rows(costs, ranks=2, slots=1, rows_per_cell=3, rounds=8).tolist()  # 8+4+3 | 9+5+1
        [1, 0, 1, 0, 0, 1]
    """
    count = row_costs.size
    cells = np.full(count, UNPLACED, np.int64)
    cost = [0] * (ranks * slots)
    held = [0] * (ranks * slots)
    order = _cost_order(row_costs)
    slot_of = _slots_of_tiers(count, ranks, slots)
    # A slot whose snake share exceeds its room gives the excess to the next slot with room.
    share = np.bincount(slot_of, minlength=slots).tolist()
    costs_list = row_costs.tolist()
    for item, slot in zip(order.tolist(), slot_of.tolist(), strict=True):
        if share[slot] > ranks * rows_per_cell:
            share[slot] -= 1
            slot = next(s for s in range(slots) if share[s] < ranks * rows_per_cell)
            share[slot] += 1
        best = -1
        for cell in range(slot * ranks, slot * ranks + ranks):
            if held[cell] < rows_per_cell and (
                best < 0 or (cost[cell], held[cell]) < (cost[best], held[best])
            ):
                best = cell
        cells[item], cost[best], held[best] = best, cost[best] + costs_list[item], held[best] + 1
    ones = np.ones(count, np.int64)
    for slot in range(slots):
        _refine(cells, ones, row_costs, slot, ranks, rows_per_cell, rounds, count_cap=rows_per_cell)
    return cells


def _refine(
    cells: Ints,
    sizes: Ints,
    costs: Ints,
    slot: int,
    ranks: int,
    budget: int,
    rounds: int,
    count_cap: int | None,
) -> None:
    """Bounded pairwise swaps (and moves) out of the slot's costliest cell, in place on ``cells``."""
    first = slot * ranks
    members = np.flatnonzero((cells >= first) & (cells < first + ranks))
    if members.size < 2 or ranks < 2:
        return
    where = cells[members] - first
    item_cost, item_size = costs[members], sizes[members]
    cost = np.zeros(ranks, np.int64)
    np.add.at(cost, where, item_cost)
    used = np.zeros(ranks, np.int64)
    np.add.at(used, where, item_size)
    count = np.bincount(where, minlength=ranks)
    total = int(cost.sum())
    for _ in range(rounds):
        top = int(np.argmax(cost))
        if int(cost[top]) * ranks * TOLERANCE_DENOMINATOR <= total * (TOLERANCE_DENOMINATOR + 1):
            break  # max/mean within 1 + 1/TOLERANCE_DENOMINATOR: good enough, stop early
        mine = np.flatnonzero(where == top)
        swap = None
        for other in np.argsort(cost, kind="stable").tolist():
            if cost[other] >= cost[top]:
                break
            theirs = np.flatnonzero(where == other)
            swap = _best_swap(
                mine, theirs, item_cost, item_size, cost, used, count, top, other, budget, count_cap
            )
            if swap is not None:
                break
        if swap is None:
            break
        give, take, other = swap
        before = int(cost[top])
        where[give] = other
        moved_cost, moved_size = int(item_cost[give]), int(item_size[give])
        if take >= 0:
            where[take] = top
            moved_cost -= int(item_cost[take])
            moved_size -= int(item_size[take])
        else:
            count[top], count[other] = count[top] - 1, count[other] + 1
        cost[top], cost[other] = cost[top] - moved_cost, cost[other] + moved_cost
        used[top], used[other] = used[top] - moved_size, used[other] + moved_size
        if (before - int(cost.max())) * _MIN_GAIN_DENOMINATOR < before:
            break  # the round lowered the slot's maximum by less than 1 / _MIN_GAIN_DENOMINATOR: stop
    cells[members] = where + first


def _best_swap(
    mine: Ints,
    theirs: Ints,
    item_cost: Ints,
    item_size: Ints,
    cost: Ints,
    used: Ints,
    count: Ints,
    top: int,
    other: int,
    budget: int,
    count_cap: int | None,
) -> tuple[int, int, int] | None:
    """``(item given, item taken or -1 for a move, other cell)`` of the best improving swap, or None."""
    can_move = count_cap is None or count[other] < count_cap
    partner_cost = np.concatenate([item_cost[theirs], [0]]) if can_move else item_cost[theirs]
    partner_size = np.concatenate([item_size[theirs], [0]]) if can_move else item_size[theirs]
    moved = item_cost[mine][:, None] - partner_cost[None, :]  # cost leaving the top cell
    grown = item_size[mine][:, None] - partner_size[None, :]
    new_other = cost[other] + moved
    ok = (moved > 0) & (new_other < cost[top])
    ok &= (used[top] - grown <= budget) & (used[other] + grown <= budget)
    if not ok.any():
        return None
    score = np.where(ok, np.maximum(cost[top] - moved, new_other), np.iinfo(np.int64).max)
    row, column = divmod(int(np.argmin(score)), partner_cost.size)
    take = int(theirs[column]) if column < theirs.size else -1
    return int(mine[row]), take, other


def _take_place(
    item: int, cells: Ints, sizes: Ints, must: npt.NDArray[np.bool_], used: Ints, budget: int
) -> int:
    """Put an item that may not wait in place of the waitable one leaving the least room; that one, or -1."""
    placed = np.flatnonzero((cells != UNPLACED) & ~must)
    room_after = budget - used[cells[placed]] + sizes[placed] - sizes[item]
    fits = room_after >= 0
    if not fits.any():
        return -1
    out = int(placed[fits][np.argmin(room_after[fits])])
    cells[item], cells[out] = cells[out], UNPLACED
    return out


def pack_rows(lengths: Ints, seq_len: int) -> list[list[int]]:
    """Items (each at most ``seq_len``) packed into rows best-fit-decreasing; ties by index.

    Example:
        >>> pack_rows(np.array([3, 5, 2, 4, 1]), 6)
        [[1, 4], [3, 2], [0]]
    """
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, row), sorted: tightest, then earliest row first
    for item in np.argsort(-lengths, kind="stable").tolist():
        size = int(lengths[item])
        slot = bisect.bisect_left(free, (size, -1))
        if slot == len(free):
            rows.append([item])
            left, row = seq_len - size, len(rows) - 1
        else:
            space, row = free.pop(slot)
            rows[row].append(item)
            left = space - size
        if left:
            bisect.insort(free, (left, row))
    return rows
