"""BalancedBatchSampler: balanced micro-batches of a map-style dataset, each rank its own index lists.

Every rank builds the same sampler and computes the same plans (docs/distributed.md, "Map-style data").
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

import numpy as np
import numpy.typing as npt
import torch.distributed as dist
from torch.utils.data import Sampler
from torch.utils.data import dataloader as _dataloader

from zephon_collate.core.checks import check_int
from zephon_collate.core.text import shown
from zephon_collate.parallel.balance import BalanceOptions, BalancePlan, as_counts
from zephon_collate.parallel.placement import Ints
from zephon_collate.parallel.schedule import BalanceSchedule

__all__ = ["STATE_VERSION", "BalancedBatchSampler", "Ints"]

STATE_VERSION = 1

_NEXT_INDEX = getattr(getattr(_dataloader, "_BaseDataLoaderIter", None), "_next_index", None)
_PREFETCHING = getattr(_dataloader, "_MultiProcessingDataLoaderIter", None)
"""torch internals: the method drawing an index list, the iterator drawing ahead (``None`` if absent)."""
_CALLER_DEPTH = 8
"""Frames searched above the sampler for the DataLoader iterator drawing from it (wrappers included)."""


class BalancedBatchSampler(Sampler[list[int]]):
    """Index lists of balanced micro-batches for this rank, ``micro_batches`` per step.

    Parameters:
        lengths: the token count of each dataset item, ints >= 1.
        options: the :class:`~zephon_collate.parallel.balance.BalanceOptions` (``micro_batches`` required).
        num_replicas, rank: world size and this rank (default: torch.distributed's, or 1 and 0).
        groups: an int key >= 0 per item; equal keys share a micro-batch.
        shuffle: draw the epoch's order (of groups, when given) from ``(seed, epoch)``; else index order.
        seed: the order's seed, the same on every rank.
        extra_costs: cost units (ints >= 0) per item added to its cost (``options.cost.vision_costs``).
        costs: each item's cost (ints >= 0) in place of the model's (``options.cost.tree_costs``).

    Example:
        >>> from zephon_collate.parallel.cost import CostModel
        >>> options = BalanceOptions(cost=CostModel(linear=1, quadratic=1), max_tokens=8, micro_batches=2)
        >>> lengths = [8, 1, 6, 2, 5, 3, 4, 4, 7, 1]
        >>> [list(BalancedBatchSampler(lengths, options, num_replicas=2, rank=r, shuffle=False))
        ...  for r in range(2)]  # two slots, then the last window's one; document 1 waited a window
        [[[0], [4, 5], [8]], [[2, 3], [6, 7], [1, 9]]]
    """

    def __init__(
        self,
        lengths: Sequence[int] | npt.ArrayLike,
        options: BalanceOptions,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        groups: Sequence[int] | npt.ArrayLike | None = None,
        shuffle: bool = True,
        seed: int = 0,
        extra_costs: Sequence[int] | npt.ArrayLike | None = None,
        costs: Sequence[int] | npt.ArrayLike | None = None,
    ) -> None:
        owner = "BalancedBatchSampler"
        self.lengths = as_counts(lengths, "lengths", 1, owner)
        self.groups = self._per_item(groups, "groups", "")
        self.extra_costs = self._per_item(extra_costs, "extra_costs", " (one per item)")
        self.costs = self._per_item(costs, "costs", " (one per item)")
        if not isinstance(options, BalanceOptions):
            raise TypeError(f"{owner}: options must be BalanceOptions, got {type(options).__name__}")
        self.options = options
        BalanceSchedule(options, 1)  # checks micro_batches now
        initialised = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if initialised else 1
        if rank is None:
            rank = dist.get_rank() if initialised else 0
        self.num_replicas = check_int(owner, "num_replicas", num_replicas, 1)
        self.rank = check_int(owner, "rank", rank, 0, self.num_replicas - 1)
        if not isinstance(shuffle, bool):
            raise TypeError(f"{owner}: shuffle must be a bool, got {shown(shuffle)}")
        self.shuffle = shuffle
        self.seed = check_int(owner, "seed", seed, 0)
        self.epoch = 0
        self._pending: dict[str, Any] | None = None
        self._finished = False  # whether the pending state was saved at its epoch's end
        self._progress = self._start(self.epoch)
        self._drawn_ahead_by: str | None = None  # the prefetching loader iterating, if one is

    def _per_item(self, values: object, name: str, note: str) -> Ints | None:
        """``values`` checked as ints >= 0, one per item; ``None`` stays ``None``."""
        if values is None:
            return None
        array = as_counts(values, name, 0, "BalancedBatchSampler")
        if array.size != self.lengths.size:
            raise ValueError(
                f"BalancedBatchSampler: {name} has {array.size} entries for {self.lengths.size} lengths{note}"
            )
        return array

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch whose order the next ``iter()`` draws (a mid-epoch state loaded wins once)."""
        self.epoch = check_int("BalancedBatchSampler.set_epoch", "epoch", epoch, 0)
        if self._pending is not None and self._finished and self.epoch > self._pending["epoch"]:
            self._pending = None  # a state saved at its epoch's end: nothing left of it to win
        if self._pending is None:
            self._progress = self._start(self.epoch)
            self._drawn_ahead_by = None  # the new epoch's start: nothing of it drawn yet

    def order(self, epoch: int) -> Ints:
        """The epoch's order of dataset indices (groups kept together), the same on every rank."""
        count = self.lengths.size
        if self.groups is None:
            if not self.shuffle:
                return np.arange(count, dtype=np.int64)
            return np.random.default_rng([self.seed, epoch]).permutation(count).astype(np.int64)
        _, first, inverse = np.unique(self.groups, return_index=True, return_inverse=True)
        place = np.argsort(np.argsort(first, kind="stable"), kind="stable")  # groups by first appearance
        if self.shuffle:
            place = np.random.default_rng([self.seed, epoch]).permutation(first.size)[place]
        return np.lexsort((np.arange(count), place[inverse.reshape(-1)])).astype(np.int64)

    def plans(self) -> Iterator[BalancePlan]:
        """The current epoch's plans (dataset indices), from the start or a loaded state's window."""
        start = self._pending or self._start(self.epoch)
        for plan, _ in self._windows(start):
            yield plan

    def __iter__(self) -> Iterator[list[int]]:
        self._drawn_ahead_by = _prefetching_loader(inspect.currentframe())
        start, self._pending = self._pending or self._start(self.epoch), None
        self._progress = dict(start)  # a pass that hands out nothing still stands where it started
        skip = int(start["slots_done"])
        for plan, window in self._windows(start):
            cells = plan.for_rank(self.rank)
            for slot in range(skip, len(cells)):
                self._progress = {**window, "slots_done": slot + 1}  # before the yield: what was handed out
                yield list(cells[slot])
            skip = 0

    def state_dict(self) -> dict[str, Any]:
        """Where the iteration stands, and what must match on resume (plain ints, strings and lists).

        Raises:
            ValueError: while a plain ``DataLoader`` with ``num_workers > 0`` iterates the sampler.
        """
        if self._pending is not None:
            return dict(self._pending)
        if self._drawn_ahead_by is not None:
            raise ValueError(
                f"BalancedBatchSampler.state_dict: a torch DataLoader with num_workers > 0 "
                f"({self._drawn_ahead_by}) is iterating this sampler; it draws prefetch_factor x "
                "num_workers micro-batches ahead of the training loop, so the sampler's position is past "
                "what was trained, and resuming from it would skip the micro-batches drawn but not yet "
                "trained. Use torchdata.stateful_dataloader.StatefulDataLoader (it snapshots the sampler "
                "with each micro-batch) and save loader.state_dict(), or num_workers=0 and save "
                "sampler.state_dict()"
            )
        return dict(self._progress)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` at the next ``iter()`` (``ValueError`` if saved with other settings)."""
        owner = "BalancedBatchSampler.load_state_dict"
        if not isinstance(state, Mapping):
            raise TypeError(f"{owner}: state must be a dict, got {type(state).__name__}")
        expected = self._start(0)
        missing = sorted(key for key in expected if key not in state)
        if missing or state["version"] != STATE_VERSION:
            raise ValueError(
                f"{owner}: not a version-{STATE_VERSION} BalancedBatchSampler state (missing {missing})"
            )
        for key in ("data", "options", "num_replicas", "seed", "shuffle"):
            if state[key] != expected[key]:
                raise ValueError(
                    f"{owner}: the state was saved with another {key} ({shown(state[key])}, here "
                    f"{shown(expected[key])}); resume with the same dataset lengths, groups, costs and "
                    "extra costs, options, world size, seed and shuffle"
                )
        checked = dict(state)
        for key, limit in (("epoch", None), ("cursor", self.lengths.size), ("slots_done", None)):
            value = check_int(owner, f"state[{key!r}]", state[key], 0)
            if limit is not None and value > limit:
                raise ValueError(f"{owner}: state[{key!r}] is {value}, beyond the {limit} items")
            checked[key] = value
        BalanceSchedule(self.options, self.num_replicas).load_state_dict(state["waiting"])  # its checks
        self._drawn_ahead_by = None
        self._finished = not self._remaining(checked)  # saved at its epoch's end
        if self._finished and self.epoch > checked["epoch"]:  # a later epoch set first (torchdata loads
            self._pending = None  # the state inside iter(), after the loop's set_epoch): it starts
            self._progress = self._start(self.epoch)
            return
        self._pending = checked
        self.epoch = checked["epoch"]

    def _remaining(self, start: Mapping[str, Any]) -> bool:
        """Whether this rank has micro-batches left from ``start`` (a state saved mid-epoch)."""
        skip = int(start["slots_done"])
        for plan, _ in self._windows(dict(start)):
            if len(plan.for_rank(self.rank)) > skip:
                return True
            skip = 0
        return False

    def _start(self, epoch: int) -> dict[str, Any]:
        """The state at the start of ``epoch``."""
        digest = hashlib.sha256(self.lengths.tobytes())
        if self.groups is not None:
            digest.update(self.groups.tobytes())
        if self.extra_costs is not None:  # other extra costs, other plans
            digest.update(b"extra_costs" + self.extra_costs.tobytes())
        if self.costs is not None:  # other costs, other plans
            digest.update(b"costs" + self.costs.tobytes())
        return {
            "version": STATE_VERSION,
            "data": digest.hexdigest()[:16],
            "options": repr(self.options),
            "num_replicas": self.num_replicas,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": epoch,
            "cursor": 0,
            "waiting": BalanceSchedule(self.options, self.num_replicas).state_dict(),
            "slots_done": 0,
        }

    def _windows(self, start: Mapping[str, Any]) -> Iterator[tuple[BalancePlan, dict[str, Any]]]:
        """Each window's plan from ``start`` on, with the state at the window's start."""
        epoch = int(start["epoch"])
        order = self.order(epoch)
        lengths = self.lengths[order]
        groups = None if self.groups is None else self.groups[order]
        ends = np.cumsum(lengths)
        schedule = BalanceSchedule(self.options, self.num_replicas, self.extra_costs, self.costs)
        schedule.load_state_dict(start["waiting"])
        cursor = int(start["cursor"])
        while cursor < order.size or schedule.waiting:
            window = {**start, "epoch": epoch, "cursor": cursor, "waiting": schedule.state_dict()}
            taken = int(ends[cursor - 1]) if cursor else 0
            end = min(order.size, int(np.searchsorted(ends, taken + schedule.room(), side="left")) + 1)
            if groups is not None:  # finish the group the window ends in
                while 0 < end < order.size and groups[end] == groups[end - 1]:
                    end += 1
            final = end >= order.size
            keys = order[cursor:end].tolist()
            plan = schedule.plan(
                keys,
                lengths[cursor:end].tolist(),
                None if groups is None else groups[cursor:end].tolist(),
                final=final,
            )
            cursor = end
            yield plan, window
            if final:
                return


def _prefetching_loader(frame: FrameType | None) -> str | None:
    """The class name of a DataLoader iterator drawing ahead from the generator in ``frame``, else None."""
    # The caller is whoever resumed the generator: torch's ``_next_index`` (maybe under wrapping
    # samplers). torchdata's iterators snapshot the sampler with each list: not that class.
    caller = frame.f_back if frame is not None else None
    code = getattr(_NEXT_INDEX, "__code__", None)
    for _ in range(_CALLER_DEPTH):
        if caller is None or code is None or _PREFETCHING is None:
            return None
        if caller.f_code is code:
            owner = caller.f_locals.get("self")
            return type(owner).__name__ if isinstance(owner, _PREFETCHING) else None
        caller = caller.f_back
    return None
