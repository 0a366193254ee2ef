"""Balanced data-parallel steps: which documents each rank gets in each lockstep micro-batch slot.

How the planner works: docs/distributed.md, "The planner".
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from zephon_collate.core.checks import check_int
from zephon_collate.core.keys import INT64_MAX
from zephon_collate.core.text import shown
from zephon_collate.parallel.cost import COST_LIMIT, CostModel
from zephon_collate.parallel.placement import UNPLACED, Ints, pack_rows, place_items, place_rows

__all__ = ["BalanceOptions", "BalancePlan", "Floats", "Ints", "as_counts", "plan_balance"]

Floats = npt.NDArray[np.float64]
_Cell = tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class BalanceOptions:
    """How a step is planned: the cost model, the micro-batch budget and the slots per step.

    Parameters:
        cost: the :class:`~zephon_collate.parallel.cost.CostModel` balanced across ranks.
        micro_batches: lockstep micro-batch slots per step; ``None``: as few as the window needs.
        max_tokens: padding-free budget, the most tokens one micro-batch holds.
        rows, seq_len: fixed-row budget instead: ``rows`` rows of ``seq_len`` tokens per micro-batch.
        hold_back: windows an outlier may wait so that outliers come ``ranks`` at a time (WLB-LLM).
        swap_rounds: pairwise swaps per slot after the longest-first seed.

    Example:
        >>> options = BalanceOptions(cost=CostModel(linear=1, quadratic=0), max_tokens=8)
        >>> options.micro_batch_tokens, options.fixed_rows
        (8, False)
    """

    cost: CostModel
    micro_batches: int | None = None
    max_tokens: int | None = None
    rows: int | None = None
    seq_len: int | None = None
    hold_back: int = 0
    swap_rounds: int = 16

    def __post_init__(self) -> None:
        owner = "BalanceOptions"
        if not isinstance(self.cost, CostModel):
            raise TypeError(f"{owner}: cost must be a CostModel, got {type(self.cost).__name__}")
        if self.micro_batches is not None:
            object.__setattr__(
                self, "micro_batches", check_int(owner, "micro_batches", self.micro_batches, 1)
            )
        if (self.rows is None) != (self.seq_len is None):
            raise ValueError(f"{owner}: give rows and seq_len together (fixed rows), or max_tokens alone")
        if (self.max_tokens is None) == (self.rows is None):
            raise ValueError(
                f"{owner}: give exactly one budget: max_tokens=N (padding-free) or rows=R, seq_len=S "
                f"(fixed rows), got max_tokens={shown(self.max_tokens)}, rows={shown(self.rows)}"
            )
        for name in ("max_tokens", "rows", "seq_len"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_int(owner, name, getattr(self, name), 1))
        object.__setattr__(self, "hold_back", check_int(owner, "hold_back", self.hold_back, 0))
        object.__setattr__(self, "swap_rounds", check_int(owner, "swap_rounds", self.swap_rounds, 0))

    @property
    def fixed_rows(self) -> bool:
        """True for fixed rows (``rows`` x ``seq_len``), False for a padding-free token budget."""
        return self.rows is not None

    @property
    def micro_batch_tokens(self) -> int:
        """The token budget of one micro-batch: ``max_tokens`` or ``rows * seq_len``."""
        if self.max_tokens is not None:
            return self.max_tokens
        return int(self.rows or 0) * int(self.seq_len or 0)  # both set in fixed-row mode

    def step_tokens(self, ranks: int) -> int:
        """Tokens one step holds over ``ranks`` ranks: ``micro_batches * ranks * micro_batch_tokens``."""
        if self.micro_batches is None:
            raise ValueError("BalanceOptions.step_tokens: needs micro_batches (slots per step)")
        return self.micro_batches * ranks * self.micro_batch_tokens


@dataclass(frozen=True, kw_only=True, eq=False)
class BalancePlan:
    """One step: for each micro-batch slot and rank, the documents it gets, and what that costs.

    Attributes:
        cells: ``cells[slot][rank]``, the documents (indices into the window) of that micro-batch.
        rows: fixed rows: ``rows[slot][rank]``, the micro-batch's rows (next-fit over its cell), else None.
        held: documents left for the next window.
        dropped: documents left out for good (:meth:`without_sparse_slots`).
        costs: ``[slots, ranks]`` modelled cost of each micro-batch (padding included).
        tokens: ``[slots, ranks]`` document tokens; ``computed``: tokens including padding.
        largest: ``[slots]`` the costliest unit (document or group) of each slot.
        extra_slots: slots beyond ``micro_batches`` for documents that may not wait longer.
        seq_len: the row length in fixed-row mode, else ``None``.

    Example:
        >>> plan = plan_balance([5, 4, 3, 3, 2, 1], BalanceOptions(cost=CostModel(linear=0, quadratic=1),
        ...                     max_tokens=10, micro_batches=1), ranks=2)
        >>> plan.cells  # one slot, two ranks: 25 + 9 = 34 against 16 + 9 + 4 + 1 = 30 (no split gives 32)
        (((0, 3), (1, 2, 4, 5)),)
        >>> plan.costs.tolist(), plan.imbalance().tolist(), plan.lower_bound().tolist()
        ([[34, 30]], [1.0625], [1.0])
    """

    cells: tuple[tuple[_Cell, ...], ...]
    rows: tuple[tuple[tuple[_Cell, ...], ...], ...] | None
    held: _Cell
    costs: Ints
    tokens: Ints
    computed: Ints
    largest: Ints
    extra_slots: int = 0
    seq_len: int | None = field(default=None)
    dropped: _Cell = ()

    @property
    def num_slots(self) -> int:
        """Micro-batch slots in the step (the same for every rank)."""
        return len(self.cells)

    @property
    def num_ranks(self) -> int:
        """Data-parallel ranks the step is planned for."""
        return int(self.costs.shape[1])

    def for_rank(self, rank: int) -> tuple[_Cell, ...]:
        """``rank``'s micro-batches, in slot order: one tuple of documents each."""
        rank = check_int("BalancePlan.for_rank", "rank", rank, 0, self.num_ranks - 1)
        return tuple(cells[rank] for cells in self.cells)

    def with_keys(self, keys: Sequence[int]) -> BalancePlan:
        """The same plan with each window position ``i`` replaced by ``keys[i]`` (e.g. dataset indices)."""
        table = [int(key) for key in keys]

        def swap(cell: _Cell) -> _Cell:
            return tuple(table[i] for i in cell)

        rows = None
        if self.rows is not None:
            rows = tuple(tuple(tuple(swap(row) for row in cell) for cell in slot) for slot in self.rows)
        return replace(
            self,
            cells=tuple(tuple(swap(cell) for cell in slot) for slot in self.cells),
            rows=rows,
            held=swap(self.held),
            dropped=swap(self.dropped),
        )

    def without_sparse_slots(self, *, hold: bool = False) -> BalancePlan:
        """The plan without the slots in which some rank got no document; theirs go to ``dropped``.

        ``hold``: to ``held`` instead, to wait for the next window.

        Example:
            >>> options = BalanceOptions(cost=CostModel(linear=1, quadratic=0), max_tokens=4)
            >>> plan = plan_balance([4, 4, 4], options, ranks=2)  # 2 slots; the second holds one document
            >>> plan.cells, plan.without_sparse_slots().cells, plan.without_sparse_slots().dropped
            ((((0,), (1,)), ((2,), ())), (((0,), (1,)),), (2,))
        """
        keep = [slot for slot in range(self.num_slots) if all(self.cells[slot])]
        if len(keep) == self.num_slots:
            return self
        gone = sorted(doc for slot in self.cells if not all(slot) for cell in slot for doc in cell)
        return replace(
            self,
            cells=tuple(self.cells[slot] for slot in keep),
            rows=None if self.rows is None else tuple(self.rows[slot] for slot in keep),
            held=tuple(sorted((*self.held, *gone))) if hold else self.held,
            costs=self.costs[keep],
            tokens=self.tokens[keep],
            computed=self.computed[keep],
            largest=self.largest[keep],
            extra_slots=max(0, self.extra_slots - (self.num_slots - len(keep))),
            dropped=self.dropped if hold else tuple(sorted((*self.dropped, *gone))),
        )

    def imbalance(self) -> Floats:
        """``[slots]``: the costliest rank's cost over the mean rank cost (1.0 is perfect)."""
        return _spread(self.costs)

    def lower_bound(self) -> Floats:
        """``[slots]``: ``max(largest unit, total / ranks) / (total / ranks)``, the best any split reaches."""
        mean = self.costs.sum(axis=1) / self.num_ranks
        return _ratio(np.maximum(self.largest, mean), mean)

    def padding_fraction(self) -> float:
        """Padding tokens over computed tokens (0 padding-free)."""
        computed = int(self.computed.sum())
        return (computed - int(self.tokens.sum())) / computed if computed else 0.0

    def token_spread(self) -> Floats:
        """``[slots]``: the most document tokens on a rank over the mean."""
        return _spread(self.tokens)

    def memory_spread(self) -> Floats:
        """``[slots]``: the most computed tokens (padding included) on a rank over the mean."""
        return _spread(self.computed)

    def digest(self) -> str:
        """A SHA-256 of the cells, rows and held documents: equal plans give equal digests."""
        text = repr((self.cells, self.rows, self.held)).encode()
        return hashlib.sha256(text).hexdigest()

    def summary(self) -> str:
        """A readable table: per slot, documents, the token, memory and cost spreads, the lower bound."""
        documents = sum(len(cell) for slot in self.cells for cell in slot)
        mode = f"rows of {self.seq_len}" if self.seq_len is not None else "padding-free"
        held = f"{len(self.held)} held" + (f", {len(self.dropped)} dropped" if self.dropped else "")
        lines = [
            f"BalancePlan: {self.num_slots} slot{'s' * (self.num_slots != 1)} x {self.num_ranks} "
            f"rank{'s' * (self.num_ranks != 1)} ({mode}), {documents} documents ({held}), "
            f"{int(self.tokens.sum()):,} tokens, padding {self.padding_fraction():.2%}",
            "| slot | documents | tokens max/mean | memory max/mean | cost max/mean | lower bound |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        columns = (self.token_spread(), self.memory_spread(), self.imbalance(), self.lower_bound())
        for slot in range(self.num_slots):
            count = sum(len(cell) for cell in self.cells[slot])
            values = " | ".join(f"{column[slot]:.4f}" for column in columns)
            lines.append(f"| {slot} | {count} | {values} |")
        if self.num_slots > 1:
            means = " | ".join(f"{column.mean():.4f}" for column in columns)
            lines.append(f"| mean | {documents / self.num_slots:.1f} | {means} |")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _spread(values: Ints) -> Floats:
    """Per row: max over mean (1.0 where the row is all zeros)."""
    return _ratio(values.max(axis=1), values.mean(axis=1))


def _ratio(top: npt.NDArray[np.generic], mean: Floats) -> Floats:
    """``top / mean``, 1.0 where ``mean`` is 0."""
    return np.where(mean > 0, top / np.where(mean > 0, mean, 1.0), 1.0)


def as_counts(values: object, name: str, minimum: int, owner: str = "plan_balance") -> Ints:
    """``values`` as a 1-D int64 array of ints from ``minimum`` to 2**63 - 1, checked as given."""
    array = np.asarray(values)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise TypeError(
            f"{owner}: {name} must be a 1-D sequence of ints, got {shown(values)} "
            f"(dtype {array.dtype}, {array.ndim} dims)"
        )
    bad = np.flatnonzero((array < minimum) | (array > INT64_MAX))
    if bad.size:
        position = int(bad[0])
        raise ValueError(
            f"{owner}: {name}[{position}] is {int(array[position])}; every entry must be an int from "
            f"{minimum} to 2**63 - 1"
        )
    return array.astype(np.int64)


def plan_balance(
    lengths: npt.ArrayLike,
    options: BalanceOptions,
    *,
    ranks: int,
    groups: npt.ArrayLike | None = None,
    waited: npt.ArrayLike | None = None,
    final: bool = False,
    extra_costs: npt.ArrayLike | None = None,
    costs: npt.ArrayLike | None = None,
) -> BalancePlan:
    """Plan one step: the window's documents over ``micro_batches`` slots x ``ranks`` ranks, balanced.

    Parameters:
        lengths: ``[n]`` token counts of the window's documents (ints >= 1).
        options: the :class:`BalanceOptions`.
        ranks: the number of data-parallel ranks.
        groups: ``[n]`` integer keys; equal keys stay in one micro-batch (and row).
        waited: ``[n]`` windows each document has waited already (default 0).
        final: place everything (the epoch's last window).
        extra_costs: ``[n]`` cost units added to each document's cost (``options.cost.vision_costs``).
        costs: ``[n]`` each document's cost in place of the model's (``options.cost.tree_costs``).

    Example:
        >>> cost = CostModel(linear=1, quadratic=1)
        >>> options = BalanceOptions(cost=cost, rows=2, seq_len=8, micro_batches=1)
        >>> plan = plan_balance([8, 6, 5, 3, 2, 2, 1], options, ranks=2)
        >>> plan.rows  # rank 0: rows [8] and [2, 1] (5 padding); rank 1: [6, 2] and [5, 3]
        ((((0,), (5, 6)), ((1, 4), (2, 3))),)
        >>> plan.costs.tolist(), plan.held, plan.padding_fraction()  # cost: L + L**2 per segment
        ([[110, 90]], (), 0.15625)
    """
    ranks = check_int("plan_balance", "ranks", ranks, 1)
    if not isinstance(options, BalanceOptions):
        raise TypeError(f"plan_balance: options must be BalanceOptions, got {type(options).__name__}")
    sizes = as_counts(lengths, "lengths", 1)
    count = sizes.size
    waits = _per_document(waited, "waited", count, "")
    waits = np.zeros(count, np.int64) if waits is None else waits
    extras = _per_document(extra_costs, "extra_costs", count, " (one per document)")
    modelled = _per_document(
        costs,
        "costs",
        count,
        " (one per document; for trees, options.cost.tree_costs(positions) with one positions array per "
        "document)",
    )
    units, first = _units(groups, count)
    unit_count = first.size
    costs = options.cost.costs(sizes) if modelled is None else modelled
    if extras is None and modelled is None:
        too_costly = float(costs.astype(np.float64).sum()) > COST_LIMIT
    else:  # Python ints: exact (given costs may be near int64's top), so the sums below stay within int64
        too_costly = sum(costs.tolist()) + (0 if extras is None else sum(extras.tolist())) > COST_LIMIT
    if too_costly:
        given = [name for name, array in (("costs", modelled), ("extra_costs", extras)) if array is not None]
        raise ValueError(
            "plan_balance: the window's total cost exceeds 2**62; use coarser CostModel coefficients "
            + (f"(and {' and '.join(given)}) " if given else "")
            + "or a smaller window"
        )
    if extras is not None:
        costs = costs + extras  # within 2**62 in all (checked above), so exact in int64
    unit_size = np.zeros(unit_count, np.int64)
    np.add.at(unit_size, units, sizes)
    unit_cost = np.zeros(unit_count, np.int64)
    np.add.at(unit_cost, units, costs)
    unit_wait = np.zeros(unit_count, np.int64)
    np.maximum.at(unit_wait, units, waits)
    limit = options.seq_len if options.seq_len is not None else options.micro_batch_tokens
    too_long = np.flatnonzero(unit_size > limit)
    if too_long.size:
        _raise_too_long(int(too_long[0]), first, unit_size, limit, options, groups is not None)
    step_slots = None if final else options.micro_batches  # None: as few slots as needed, nothing held
    must = np.full(unit_count, step_slots is None) | (unit_wait >= max(options.hold_back, 1))
    held = np.zeros(unit_count, np.bool_)
    if step_slots is not None and options.hold_back:
        held = _outliers_to_hold(unit_cost, must, ranks, step_slots)
    place = _place_fixed if options.fixed_rows else _place_free
    unit_cell, slots, extra, layout = place(unit_size, unit_cost, must, held, options, ranks, step_slots)
    if held.any() and np.bincount(unit_cell[unit_cell != UNPLACED], minlength=slots * ranks).min() == 0:
        # Holding the outliers left a micro-batch empty (too few units left, or extra slots
        # for units that may not wait): they fill it rather than wait.
        unit_cell, slots, extra, layout = place(
            unit_size, unit_cost, must, np.zeros(unit_count, np.bool_), options, ranks, step_slots
        )
    return _build(sizes, costs, units, unit_cost, unit_cell, slots, ranks, extra, layout, options)


def _per_document(values: npt.ArrayLike | None, name: str, count: int, note: str) -> Ints | None:
    """``values`` checked as ints >= 0, one per document; ``None`` stays ``None``."""
    if values is None:
        return None
    array = as_counts(values, name, 0)
    if array.size != count:
        raise ValueError(f"plan_balance: {name} has {array.size} entries for {count} documents{note}")
    return array


def _units(groups: npt.ArrayLike | None, count: int) -> tuple[Ints, Ints]:
    """The unit of each document (units numbered by first appearance) and each unit's first document."""
    if groups is None:
        identity = np.arange(count, dtype=np.int64)
        return identity, identity
    keys = np.asarray(groups)
    if keys.ndim != 1 or (keys.size and keys.dtype.kind not in "iu"):
        raise TypeError(f"plan_balance: groups must be a 1-D sequence of int keys, got {shown(groups)}")
    if keys.size != count:
        raise ValueError(f"plan_balance: groups has {keys.size} entries for {count} documents")
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    by_appearance = np.argsort(first, kind="stable")
    rank_of = np.empty(first.size, np.int64)
    rank_of[by_appearance] = np.arange(first.size)
    return rank_of[inverse.reshape(-1)], first[by_appearance].astype(np.int64)


def _raise_too_long(
    unit: int, first: Ints, unit_size: Ints, limit: int, options: BalanceOptions, grouped: bool
) -> None:
    what = f"the group of document {int(first[unit])}" if grouped else f"document {int(first[unit])}"
    if options.fixed_rows:
        raise ValueError(
            f"plan_balance: {what} has {int(unit_size[unit])} tokens, more than seq_len={limit}; in "
            "fixed-row mode a document (or group) must fit one row: split long documents first "
            "(PackedStream and pack_flat do with overflow='split'), raise seq_len, or plan padding-free "
            "with max_tokens"
        )
    raise ValueError(
        f"plan_balance: {what} has {int(unit_size[unit])} tokens, more than max_tokens={limit}; raise "
        "max_tokens or split long documents first"
    )


def _outliers_to_hold(
    unit_cost: Ints, must: npt.NDArray[np.bool_], ranks: int, slots: int
) -> npt.NDArray[np.bool_]:
    """Outliers (costing more than a micro-batch's mean share) beyond the last whole tier of ``ranks``."""
    held = np.zeros(unit_cost.size, np.bool_)
    share = int(unit_cost.sum()) // (ranks * slots)  # cost > share  <=>  cost * cells > total (integers)
    outliers = np.flatnonzero(unit_cost > share)
    surplus = outliers.size % ranks
    waitable = outliers[~must[outliers]]
    if surplus and waitable.size:
        cheapest = waitable[np.lexsort((-waitable, unit_cost[waitable]))]  # cheapest, then latest
        held[cheapest[:surplus]] = True
    return held


def _place_free(
    unit_size: Ints,
    unit_cost: Ints,
    must: npt.NDArray[np.bool_],
    held: npt.NDArray[np.bool_],
    options: BalanceOptions,
    ranks: int,
    step_slots: int | None,
) -> tuple[Ints, int, int, None]:
    """Padding-free: each unit's cell (``UNPLACED`` if held), the slots used, the extra slots, no rows."""
    budget = options.micro_batch_tokens
    candidates = np.flatnonzero(~held)
    sizes, costs, musts = unit_size[candidates], unit_cost[candidates], must[candidates]
    start = slots = max(1, -(-int(sizes.sum()) // (ranks * budget))) if step_slots is None else step_slots
    while True:
        cells = place_items(
            sizes, costs, musts, ranks=ranks, slots=slots, max_tokens=budget, rounds=options.swap_rounds
        )
        if not ((cells == UNPLACED) & musts).any():
            break
        slots += 1  # a unit that may not wait did not fit: one more slot for every rank
    unit_cell = np.full(unit_size.size, UNPLACED, np.int64)
    unit_cell[candidates] = cells
    return unit_cell, slots, slots - start if step_slots is not None else 0, None


def _place_fixed(
    unit_size: Ints,
    unit_cost: Ints,
    must: npt.NDArray[np.bool_],
    held: npt.NDArray[np.bool_],
    options: BalanceOptions,
    ranks: int,
    step_slots: int | None,
) -> tuple[Ints, int, int, list[list[list[int]]]]:
    """Fixed rows: the cell of each unit, the slots, the extra slots and each cell's rows (unit lists)."""
    per_cell, seq_len = int(options.rows or 0), int(options.seq_len or 0)  # both set in fixed-row mode
    candidates = np.flatnonzero(~held)
    rows = [[int(candidates[i]) for i in row] for row in pack_rows(unit_size[candidates], seq_len)]
    per_slot = ranks * per_cell
    start = slots = max(1, -(-len(rows) // per_slot)) if step_slots is None else step_slots
    while len(rows) > slots * per_slot:
        kept, stuck = _keep_fullest(rows, slots * per_slot, unit_size, must, seq_len)
        if not stuck:
            rows = kept
            break
        # Units that may not wait found no place: extra slots for their rows, and the rows that
        # may wait fill what those leave (kept again, fullest first, in the larger step).
        slots = -(-(len(kept) + len(stuck)) // per_slot)
    sizes, costs = unit_size.tolist(), unit_cost.tolist()
    rows = _split_rows(rows, slots * ranks, sizes, costs, options.cost, seq_len)
    row_costs = np.array([_row_cost(row, sizes, costs, options.cost, seq_len) for row in rows], np.int64)
    row_cells = place_rows(
        row_costs, ranks=ranks, slots=slots, rows_per_cell=per_cell, rounds=options.swap_rounds
    )
    unit_cell = np.full(unit_size.size, UNPLACED, np.int64)
    layout: list[list[list[int]]] = [[] for _ in range(slots * ranks)]
    for row, cell in zip(rows, row_cells.tolist(), strict=True):
        unit_cell[row] = cell
        layout[cell].append(row)
    return unit_cell, slots, slots - start if step_slots is not None else 0, layout


def _row_cost(row: list[int], sizes: list[int], costs: list[int], cost_model: CostModel, seq_len: int) -> int:
    """A row's cost: its units' costs, plus its padding as a segment of its own."""
    pad = seq_len - sum(sizes[u] for u in row)
    return sum(costs[u] for u in row) + cost_model.linear * pad + cost_model.quadratic * pad * pad


def _split_rows(
    rows: list[list[int]],
    cells: int,
    sizes: list[int],
    costs: list[int],
    cost_model: CostModel,
    seq_len: int,
) -> list[list[int]]:
    """At least ``cells`` rows where the units allow (so no rank of a small window lacks a row)."""
    rows = [list(row) for row in rows]

    def cost(units: list[int]) -> int:
        return _row_cost(units, sizes, costs, cost_model, seq_len)

    while len(rows) < cells:
        splittable = [r for r, row in enumerate(rows) if len(row) > 1]
        if not splittable:
            break  # fewer units than micro-batches: some rank gets none (a sparse slot)
        row = rows[max(splittable, key=lambda r: (cost(rows[r]), -r))]
        out = min(range(len(row)), key=lambda i: (max(cost(row[:i] + row[i + 1 :]), cost([row[i]])), i))
        rows.append([row.pop(out)])
    return rows


def _keep_fullest(
    rows: list[list[int]], capacity: int, unit_size: Ints, must: npt.NDArray[np.bool_], seq_len: int
) -> tuple[list[list[int]], list[list[int]]]:
    """The ``capacity`` fullest rows, units that may not wait swapped in; and the rows of those stuck."""
    sizes = unit_size.tolist()
    fill = np.array([sum(sizes[u] for u in row) for row in rows], np.int64)
    order = np.lexsort((np.arange(len(rows)), -fill)).tolist()
    kept = [list(rows[r]) for r in order[:capacity]]
    waiting = [unit for r in order[capacity:] for unit in rows[r] if must[unit]]
    if not waiting:
        return kept, []
    units = np.array([unit for row in kept for unit in row], np.int64)
    row_of = np.array([k for k, row in enumerate(kept) for _ in row], np.int64)
    free = seq_len - np.array([sum(sizes[u] for u in row) for row in kept], np.int64)
    movable = ~must[units]
    stuck: list[list[int]] = []
    for unit in waiting:
        room = np.flatnonzero(free >= unit_size[unit])
        if room.size:  # room a swap freed: the tightest such row
            row = int(room[np.argmin(free[room])])
            kept[row].append(unit)
            free[row] -= unit_size[unit]
            units, row_of = np.append(units, unit), np.append(row_of, row)
            movable = np.append(movable, False)
            continue
        slack = free[row_of] + unit_size[units] - unit_size[unit]
        fits = movable & (slack >= 0)
        if not fits.any():
            stuck.append([unit])
            continue
        pick = int(np.flatnonzero(fits)[np.argmin(slack[fits])])
        row, out = int(row_of[pick]), int(units[pick])
        kept[row][kept[row].index(out)] = unit
        free[row] = int(slack[pick])
        units[pick], movable[pick] = unit, False
    return kept, stuck


def _build(
    sizes: Ints,
    costs: Ints,
    units: Ints,
    unit_cost: Ints,
    unit_cell: Ints,
    slots: int,
    ranks: int,
    extra: int,
    layout: list[list[list[int]]] | None,
    options: BalanceOptions,
) -> BalancePlan:
    """The plan: each cell's documents (and rows), its exact cost, tokens and computed tokens."""
    cost_model, seq_len = options.cost, options.seq_len
    doc_cell = unit_cell[units]
    cell_count = slots * ranks
    costs_out, tokens, computed = (np.zeros(cell_count, np.int64) for _ in range(3))
    placed = doc_cell != UNPLACED
    np.add.at(tokens, doc_cell[placed], sizes[placed])
    np.add.at(costs_out, doc_cell[placed], costs[placed])
    members: list[list[int]] = [[] for _ in range(unit_cost.size)]
    for doc, unit in enumerate(units.tolist()):
        members[unit].append(doc)
    if layout is None:
        computed[:] = tokens
        by_cell: list[list[int]] = [[] for _ in range(cell_count)]
        for doc in np.lexsort((np.arange(units.size), units)).tolist():  # unit order, members together
            if doc_cell[doc] != UNPLACED:
                by_cell[int(doc_cell[doc])].append(doc)
        cells = [tuple(docs) for docs in by_cell]
        rows_out = None
    else:
        row_len = int(seq_len or 0)  # a layout exists in fixed-row mode only
        doc_sizes = sizes.tolist()
        member_sizes = [sum(doc_sizes[doc] for doc in docs) for docs in members]
        cells, rows_out = [], []
        for cell, cell_rows in enumerate(layout):
            order = _next_fit_order(cell_rows, members, doc_sizes, member_sizes)
            final_rows = _next_fit(order, doc_sizes, row_len)
            cells.append(tuple(doc for unit in order for doc in unit))
            rows_out.append(tuple(tuple(row) for row in final_rows))
            computed[cell] = len(final_rows) * row_len
            padding = [row_len - sum(doc_sizes[doc] for doc in row) for row in final_rows]
            costs_out[cell] += sum(
                cost_model.linear * pad + cost_model.quadratic * pad * pad for pad in padding
            )
    largest = np.zeros(slots, np.int64)  # costs are >= 0: 0 in a slot without units
    on = unit_cell != UNPLACED
    np.maximum.at(largest, unit_cell[on] // ranks, unit_cost[on])
    shape = (slots, ranks)
    return BalancePlan(
        cells=tuple(tuple(cells[s * ranks : (s + 1) * ranks]) for s in range(slots)),
        rows=None
        if rows_out is None
        else tuple(tuple(rows_out[s * ranks : (s + 1) * ranks]) for s in range(slots)),
        held=tuple(np.flatnonzero(~placed).tolist()),
        costs=costs_out.reshape(shape),
        tokens=tokens.reshape(shape),
        computed=computed.reshape(shape),
        largest=largest,
        extra_slots=int(extra),
        seq_len=seq_len,
    )


def _next_fit_order(
    rows: list[list[int]], members: list[list[int]], sizes: list[int], unit_sizes: list[int]
) -> list[list[int]]:
    """A cell's units (each its documents) in the order a next-fit packs back into these rows."""
    # Fullest rows first, longest unit and document first: next-fit closes rows where the plan does.
    order: list[list[int]] = []
    filled = sorted(rows, key=lambda row: (-sum(unit_sizes[u] for u in row), min(row)))
    for row in filled:
        for unit in sorted(row, key=lambda u: (-unit_sizes[u], u)):
            docs = members[unit]
            order.append(docs if len(docs) == 1 else sorted(docs, key=lambda doc: (-sizes[doc], doc)))
    return order


def _next_fit(order: list[list[int]], sizes: list[int], seq_len: int) -> list[list[int]]:
    """Next-fit rows over the units of ``order``, a group whole in one row, as
    ``pack_flat(strategy="greedy", group_key=...)`` packs documents."""
    rows: list[list[int]] = []
    used = seq_len
    for unit in order:
        size = sum(sizes[doc] for doc in unit)
        if used + size > seq_len:
            rows.append([])
            used = 0
        rows[-1].extend(unit)
        used += size
    return rows
