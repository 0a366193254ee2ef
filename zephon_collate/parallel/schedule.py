"""Consecutive balanced steps: windows of documents planned one after another, waiting documents carried.

Resume and holding: docs/distributed.md, "Windows and steps".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from zephon_collate.core.checks import check_int, scalar
from zephon_collate.core.text import shown
from zephon_collate.parallel.balance import BalanceOptions, BalancePlan, plan_balance

__all__ = ["STATE_VERSION", "BalanceSchedule"]

STATE_VERSION = 1
_NO_GROUP = -1
"""The group key stored for a document without one (each is its own unit)."""


class BalanceSchedule:
    """Plans consecutive windows into steps, carrying the documents each plan holds back.

    Parameters:
        options: the :class:`~zephon_collate.parallel.balance.BalanceOptions` (``micro_batches`` required).
        ranks: the number of data-parallel ranks.
        extra_costs: each key's extra cost (``extra_costs[key]``), added in every plan.
        costs: each key's modelled cost (``costs[key]``), in place of the cost model's.

    Example:
        >>> from zephon_collate.parallel.cost import CostModel
        >>> options = BalanceOptions(cost=CostModel(linear=1, quadratic=1), max_tokens=10, micro_batches=1)
        >>> schedule = BalanceSchedule(options, ranks=2)
        >>> plan = schedule.plan([11, 12, 13, 14], [9, 8, 2, 4])  # 23 tokens: one must wait
        >>> plan.cells, plan.held, schedule.room()
        ((((11,), (12, 13)),), (14,), 16)
        >>> schedule.plan([15], [5]).cells  # the waiting document comes first
        (((15,), (14,)),)
    """

    def __init__(
        self,
        options: BalanceOptions,
        ranks: int,
        extra_costs: npt.NDArray[np.int64] | None = None,
        costs: npt.NDArray[np.int64] | None = None,
    ) -> None:
        if not isinstance(options, BalanceOptions):
            raise TypeError(f"BalanceSchedule: options must be BalanceOptions, got {type(options).__name__}")
        if options.micro_batches is None:
            raise ValueError(
                "BalanceSchedule: options need micro_batches (micro-batch slots per step): it sets how "
                "many documents a window takes"
            )
        self.options = options
        self.ranks = check_int("BalanceSchedule", "ranks", ranks, 1)
        self.extra_costs = extra_costs
        self.costs = costs
        self._keys: list[int] = []
        self._lengths: list[int] = []
        self._groups: list[int] = []
        self._waited: list[int] = []
        self.dropped = 0
        """Documents left out of the epoch so far (a final window's tail slot with fewer units than ranks)."""

    @property
    def waiting(self) -> tuple[int, ...]:
        """The keys of the documents waiting for the next window."""
        return tuple(self._keys)

    def room(self) -> int:
        """Tokens the next window should take from new documents: the step's capacity, less the waiting."""
        return max(0, self.options.step_tokens(self.ranks) - sum(self._lengths))

    def plan(
        self,
        keys: Sequence[int],
        lengths: Sequence[int],
        groups: Sequence[int] | None = None,
        *,
        final: bool = False,
    ) -> BalancePlan:
        """Plan the next window: the waiting documents, then ``keys`` (their ``lengths``, ``groups``).

        Returns the plan with ``keys`` for window positions; what it holds waits for the next call. With
        ``final`` everything is placed, and a tail slot with fewer units than ranks is dropped.
        """
        if len(keys) != len(lengths) or (groups is not None and len(groups) != len(keys)):
            raise ValueError(
                f"BalanceSchedule.plan: keys, lengths and groups differ in length "
                f"({len(keys)}, {len(lengths)}, {None if groups is None else len(groups)})"
            )
        new_groups = [_NO_GROUP] * len(keys) if groups is None else _ids("groups", groups, None)
        all_keys = self._keys + _ids("keys", keys, self._costs_size())
        all_lengths = self._lengths + [int(length) for length in lengths]
        all_groups = self._groups + new_groups
        waited = self._waited + [0] * len(keys)
        plan = plan_balance(
            np.array(all_lengths, np.int64),
            self.options,
            ranks=self.ranks,
            groups=_unit_keys(all_keys, all_groups),
            waited=np.array(waited, np.int64),
            final=final,
            extra_costs=None if self.extra_costs is None else self.extra_costs[np.array(all_keys, np.int64)],
            costs=None if self.costs is None else self.costs[np.array(all_keys, np.int64)],
        )
        plan = plan.without_sparse_slots(hold=not final)  # no rank gets an empty micro-batch
        held = plan.held
        self._keys = [all_keys[i] for i in held]
        self._lengths = [all_lengths[i] for i in held]
        self._groups = [all_groups[i] for i in held]
        self._waited = [waited[i] + 1 for i in held]
        self.dropped += len(plan.dropped)
        return plan.with_keys(all_keys)

    def _costs_size(self) -> int | None:
        """How many keys ``extra_costs`` / ``costs`` cover (``None``: no per-key array, any key)."""
        sizes = [len(array) for array in (self.extra_costs, self.costs) if array is not None]
        return min(sizes) if sizes else None

    def state_dict(self) -> dict[str, Any]:
        """The waiting documents: ``version`` and the lists ``keys``, ``lengths``, ``groups``, ``waited``."""
        return {
            "version": STATE_VERSION,
            "keys": list(self._keys),
            "lengths": list(self._lengths),
            "groups": list(self._groups),
            "waited": list(self._waited),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (``ValueError`` for one that is not a schedule's)."""
        if not isinstance(state, Mapping):
            raise TypeError(
                f"BalanceSchedule.load_state_dict: state must be a dict, got {type(state).__name__}"
            )
        names = ("keys", "lengths", "groups", "waited")
        if state.get("version") != STATE_VERSION or any(name not in state for name in names):
            raise ValueError(
                f"BalanceSchedule.load_state_dict: not a version-{STATE_VERSION} BalanceSchedule state "
                f"(keys {shown(sorted(map(str, state)))})"
            )
        lists = {name: _int_list(state[name], name) for name in names}
        if len({len(values) for values in lists.values()}) != 1:
            raise ValueError(
                "BalanceSchedule.load_state_dict: keys, lengths, groups and waited differ in length"
            )
        self._keys, self._lengths = lists["keys"], lists["lengths"]
        self._groups, self._waited = lists["groups"], lists["waited"]


def _unit_keys(keys: list[int], groups: list[int]) -> list[int] | None:
    """Group keys for plan_balance: a grouped document's group, else a key of its own (never shared)."""
    if all(group == _NO_GROUP for group in groups):
        return None
    # Groups as 2g (even), lone documents as 2k + 1 (odd): the two never collide.
    return [2 * group if group != _NO_GROUP else 2 * key + 1 for key, group in zip(keys, groups, strict=True)]


def _ids(name: str, values: Sequence[int], size: int | None) -> list[int]:
    """``keys`` or ``groups`` of :meth:`BalanceSchedule.plan` as ints: ints >= 0 (a key below ``size``)."""
    out = []
    for index, item in enumerate(values):
        value = scalar(item)  # a NumPy int or a 0-d tensor as the int it holds
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"BalanceSchedule.plan: {name}[{index}] must be an int, got {shown(item)}")
        if value < 0 or (size is not None and value >= size):
            within = "an int >= 0" if size is None else f"a key of the cost arrays (0 to {size - 1})"
            fix = " (a document of no group: pass groups=None)" if name == "groups" else ""
            raise ValueError(f"BalanceSchedule.plan: {name}[{index}] is {int(value)}, not {within}{fix}")
        out.append(int(value))
    return out


def _int_list(values: object, name: str) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"BalanceSchedule.load_state_dict: state[{name!r}] must be a list of ints")
    out = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(
                f"BalanceSchedule.load_state_dict: state[{name!r}] holds {shown(value)}, not an int; the "
                "state is corrupt: restore a state_dict() saved by BalanceSchedule"
            )
        out.append(int(value))
    return out
