"""PackedStream's balanced mode: each rank reads the whole stream, plans every window as its peers do,
and packs its own micro-batches (docs/distributed.md, "Streams").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from zephon_collate.core.keys import INPUT_IDS
from zephon_collate.core.records import SampleRecord
from zephon_collate.packing.reader import PackOptions, Reader
from zephon_collate.packing.rows import Piece, build_row, split_document
from zephon_collate.packing.source import Source, cursor_key, restored, saveable, shard_records
from zephon_collate.packing.state import changed_options, check_count, corrupt, piece_from_state, piece_state
from zephon_collate.parallel.schedule import BalanceSchedule

if TYPE_CHECKING:  # types only: at run time packing reads the options it is given, parallel is beside it
    from zephon_collate.parallel.balance import BalanceOptions, BalancePlan

__all__ = ["BalancedSteps", "check_balance_state"]

_OWNER = "PackedStream.load_state_dict"
_STATE_KEYS = (
    "options",
    "ranks",
    "records_consumed",
    "next_key",
    "steps",
    "schedule",
    "waiting",
    "tokens_field",
    "fields",
)

_Step = list[list[SampleRecord]]


class BalancedSteps:
    """One pass of a balanced stream: this rank's micro-batches of this worker's steps, one step per item."""

    def __init__(
        self,
        source: Source,
        options: PackOptions,
        balance: BalanceOptions,
        placement: tuple[int, int, int, int],
        epoch: int,
        state: Mapping[str, Any] | None,
    ) -> None:
        self.source, self.options, self.balance = source, options, balance
        self.rank, self.ranks, self.worker, self.workers = placement
        self.epoch = epoch
        self.schedule = BalanceSchedule(balance, self.ranks)
        self.reader = Reader.of(options)  # no group_key: a balanced stream refuses it
        self.pieces: dict[int, Piece] = {}
        self.consumed = self.next_key = self.steps = 0
        self.last_cursor: Any = None
        if state is not None:
            self._restore(state)
        self._steps: Iterator[_Step] | None = None

    def __iter__(self) -> BalancedSteps:
        return self

    def __next__(self) -> _Step:
        if self._steps is None:
            self._steps = self._run()
        return next(self._steps)

    def state_dict(self) -> dict[str, Any]:
        """The ``balance`` entry of the stream's state (arrays as tensors)."""
        waiting = [piece_state(self.pieces[key]) for key in self.schedule.waiting]
        state: dict[str, Any] = saveable(
            {
                "options": _options(self.options, self.balance),
                "ranks": self.ranks,
                "records_consumed": self.consumed,
                "next_key": self.next_key,
                "steps": self.steps,
                "schedule": self.schedule.state_dict(),
                "waiting": waiting,
                "tokens_field": self.reader.tokens_name,
                "fields": None if self.reader.fields is None else list(self.reader.fields),
            }
        )
        return state

    def _restore(self, state: Mapping[str, Any]) -> None:
        balance = check_balance_state(state["balance"], self.options, self.balance, self.ranks)
        self.consumed, self.next_key = balance["records_consumed"], balance["next_key"]
        self.steps = balance["steps"]
        self.last_cursor = cursor_key(state["last_cursor"])
        self.schedule.load_state_dict(balance["schedule"])
        if len(self.schedule.waiting) != len(balance["pieces"]):
            raise corrupt(
                "state['balance']['waiting']", "does not match the schedule's waiting documents", _OWNER
            )
        self.pieces = dict(zip(self.schedule.waiting, balance["pieces"], strict=True))
        self.reader.tokens_name, self.reader.fields = balance["tokens_field"], balance["fields"]

    def _run(self) -> Iterator[_Step]:
        records = shard_records(self.source, 0, 1, self.epoch, self.consumed, self.last_cursor)
        ended = False
        while not ended:
            keys: list[int] = []
            tokens, room = 0, self.schedule.room()
            while tokens < room:
                record = next(records, None)
                if record is None:
                    ended = True
                    break
                for piece in self._read(record):
                    self.pieces[self.next_key] = piece
                    keys.append(self.next_key)
                    self.next_key += 1
                    tokens += piece.tokens.size
            if not keys and not self.schedule.waiting:
                return
            plan = self.schedule.plan(keys, [self.pieces[key].tokens.size for key in keys], final=ended)
            built = None
            if plan.num_slots:  # none: the epoch's tail, too small for every rank, was dropped
                step, self.steps = self.steps, self.steps + 1
                built = self._build(plan) if step % self.workers == self.worker else None
            waiting = set(self.schedule.waiting)
            self.pieces = {key: piece for key, piece in self.pieces.items() if key in waiting}
            if built is not None:
                yield built

    def _read(self, record: Any) -> list[Piece]:
        """The pieces of one record (none for a sentinel, a tombstone or an empty document)."""
        index = self.consumed
        self.consumed += 1
        if not isinstance(record, SampleRecord):
            raise TypeError(
                f"PackedStream: item {index} of the stream must be a SampleRecord, "
                f"got {type(record).__name__}"
            )
        self.last_cursor = record.meta.as_cursor_key()
        if record.meta.is_sentinel:
            return []  # a flush means nothing here: every window is planned whole
        document = self.reader.read(record, index)
        return [] if document is None else split_document(record, index, document, self.options)

    def _build(self, plan: BalancePlan) -> _Step:
        """This rank's micro-batches of ``plan``: fixed rows as planned, or one padding-free row each."""
        tokens_name = self.reader.tokens_name or INPUT_IDS
        fields = self.reader.packed
        if plan.rows is not None:
            return [
                [
                    build_row([self.pieces[key] for key in row], self.options, tokens_name, fields)
                    for row in cell
                ]
                for cell in (slot[self.rank] for slot in plan.rows)
            ]
        step: _Step = []
        for cell in plan.for_rank(self.rank):
            pieces = [self.pieces[key] for key in cell]
            size = sum(piece.tokens.size for piece in pieces)
            options = dataclasses.replace(self.options, seq_len=size)  # exactly its documents: no padding
            step.append([build_row(pieces, options, tokens_name, fields)])
        return step


def _options(options: PackOptions, balance: BalanceOptions) -> dict[str, Any]:
    """What a resume must share with the run that saved: the packing options and the balance ones."""
    return {**options.plain(), "balance": repr(balance)}


def check_balance_state(
    state: Any, options: PackOptions, balance: BalanceOptions, ranks: int | None
) -> dict[str, Any]:
    """A saved ``balance`` entry, checked as strictly as a record; pieces read back under ``"pieces"``."""
    if not isinstance(state, Mapping) or any(key not in state for key in _STATE_KEYS):
        raise corrupt("state['balance']", f"must be a dict with the keys {list(_STATE_KEYS)}", _OWNER)
    checked = {key: state[key] for key in _STATE_KEYS}
    saved, mine = state["options"], _options(options, balance)
    if not isinstance(saved, Mapping):
        raise corrupt("state['balance']['options']", "must be a dict", _OWNER)
    detail = changed_options(saved, mine)
    if detail:
        raise ValueError(
            f"{_OWNER}: the state was saved with other options ({detail}); resume with the same ones"
        )
    for key in ("ranks", "records_consumed", "next_key", "steps"):
        checked[key] = check_count(state[key], f"state['balance'][{key!r}]", _OWNER)
    if ranks is not None and checked["ranks"] != ranks:
        raise ValueError(
            f"{_OWNER}: the state was saved for {checked['ranks']} ranks, this run has {ranks}; resume a "
            "balanced stream with the same world size"
        )
    fields = state["fields"]
    if fields is not None and (not isinstance(fields, list) or not all(isinstance(f, str) for f in fields)):
        raise corrupt("state['balance']['fields']", "must be a list of field names or None", _OWNER)
    checked["fields"] = None if fields is None else tuple(fields)
    if state["tokens_field"] is not None and not isinstance(state["tokens_field"], str):
        raise corrupt("state['balance']['tokens_field']", "must be a field name or None", _OWNER)
    waiting = state["waiting"]
    if not isinstance(waiting, list):
        raise corrupt("state['balance']['waiting']", "must be a list of pieces", _OWNER)
    packed = (*(checked["fields"] or ()), *(spec.name for spec in options.floats))
    checked["pieces"] = [
        piece_from_state(restored(piece), f"state['balance']['waiting'][{i}]", options.seq_len, packed)
        for i, piece in enumerate(waiting)
    ]
    return checked
