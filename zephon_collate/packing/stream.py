"""PackedStream: packed rows from a record source, as an IterableDataset that resumes mid-epoch.

Its state is plain data and tensors, so ``torch.load(weights_only=True)`` reads it (docs/distributed.md).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from zephon_collate.core.checks import is_zero_d, keywords
from zephon_collate.core.records import SampleCursor, SampleRecord
from zephon_collate.core.text import shown
from zephon_collate.packing.balanced import BalancedSteps, check_balance_state
from zephon_collate.packing.packer import FlatPacker
from zephon_collate.packing.reader import REQUIRED, STREAM_BUFFER_SIZE, StreamOptions
from zephon_collate.packing.source import Source, cursor_key, restored, saveable, shard_records
from zephon_collate.packing.state import check_count, check_saved, corrupt
from zephon_collate.parallel.balance import BalanceOptions
from zephon_collate.parallel.schedule import BalanceSchedule
from zephon_collate.read.arrow import is_columnar

__all__ = ["STATE_VERSION", "PackedStream", "Source"]

STATE_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class _StreamKeywords(StreamOptions):
    """``PackedStream``'s keywords: the packer's, and where this stream's shard and balance come from."""

    rank: int | None = None
    world_size: int | None = None
    balance: BalanceOptions | None = None


class PackedStream(IterableDataset[SampleRecord]):
    """Rows of ``seq_len`` tokens packed from a record source, resumable mid-epoch (docs/distributed.md).

    Each ``iter(stream)`` starts the epoch over (the first after :meth:`load_state_dict` resumes); run one
    iterator at a time.

    Parameters:
        source: a sequence of :class:`SampleRecord` (read ``shard, shard + num_shards, ...``), or a callable
            ``source(shard, num_shards, epoch)`` giving the same records for the same arguments.
        seq_len, pad_token_id, emit_positions, tokens_field, strategy, overflow, buffer_size, fields,
        float_fields, group_key: the :class:`FlatPacker` options.
        rank, world_size: this rank and the number of ranks (default: torch.distributed's, or 0 and 1).
        balance: a :class:`~zephon_collate.parallel.balance.BalanceOptions`: every rank reads the whole
            source, and each item is one step, this rank's micro-batches (lists of rows).

    Example:
        >>> from zephon_collate import SampleMeta
        >>> docs = [SampleRecord(SampleMeta((0, 0, i), 0, 0, i), [i + 1] * 3) for i in range(5)]
        >>> stream = PackedStream(docs, seq_len=4, pad_token_id=0)
        >>> rows = iter(stream)
        >>> next(rows).payload["input_ids"].tolist()
        [1, 1, 1, 0]
        >>> state = stream.state_dict()  # after one row
        >>> state["last_cursor"]  # the cursor key of the last record read
        (0, 1, (), (0, 0, 1))
        >>> [row.payload["input_ids"].tolist() for row in rows]
        [[2, 2, 2, 0], [3, 3, 3, 0], [4, 4, 4, 0], [5, 5, 5, 0]]
        >>> resumed = PackedStream(docs, seq_len=4, pad_token_id=0)
        >>> resumed.load_state_dict(state)
        >>> [row.payload["input_ids"].tolist() for row in resumed]
        [[2, 2, 2, 0], [3, 3, 3, 0], [4, 4, 4, 0], [5, 5, 5, 0]]
    """

    @keywords(_StreamKeywords, "PackedStream", REQUIRED)
    def __init__(self, source: Source, *args: Any, **options: Any) -> None:
        super().__init__()
        rank, world_size = options.pop("rank", None), options.pop("world_size", None)
        balance = options.pop("balance", None)
        given = {**dict(zip(("seq_len",), args, strict=False)), **options}
        defaults = {f.name: f.default for f in fields(StreamOptions) if f.default is not MISSING}
        self.packer_options = {**defaults, **given}
        FlatPacker(**self.packer_options)  # checks the options now
        seq_len = self.packer_options["seq_len"]
        if balance is not None:
            _check_balance(balance, seq_len, self.packer_options)
        self.balance = balance
        sequence = hasattr(source, "__len__") and hasattr(source, "__getitem__")
        one = hasattr(source, "keys") or is_zero_d(source)  # a payload dict, a 0-d array
        if not callable(source) and (not sequence or one):
            raise TypeError(
                "PackedStream: source must be a sequence of SampleRecord or a callable "
                f"(shard, num_shards, epoch) -> records, got {type(source).__name__}"
            )
        if (rank is None) != (world_size is None):
            raise ValueError("PackedStream: give both rank and world_size, or neither")
        if world_size is not None:
            for name, value in (("rank", rank), ("world_size", world_size)):
                if not isinstance(value, int) or isinstance(value, bool):
                    raise TypeError(f"PackedStream: {name} must be an int, got {shown(value)}")
            if world_size < 1 or not 0 <= rank < world_size:
                raise ValueError(
                    f"PackedStream: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
                )
        self.source = source
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self._pending: dict[str, Any] | None = None
        self._latest: _Iterator | _BalancedIterator | None = None
        # Set by an iterator started in a DataLoader worker; shared memory, so this process sees it.
        self._in_workers = cast(Any, torch.zeros(1, dtype=torch.int8)).share_memory_()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_latest"] = None  # a running generator does not pickle (DataLoader workers get copies)
        return state

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch passed to a callable source; a loaded state's epoch wins for the pass it resumes."""
        self.epoch = int(epoch)

    def shard(self) -> tuple[int, int]:
        """``(shard, num_shards)`` of the calling process (and DataLoader worker)."""
        rank, world, worker, workers = self.placement()
        return rank * workers + worker, world * workers

    def placement(self) -> tuple[int, int, int, int]:
        """``(rank, world_size, worker, num_workers)`` of the calling process and DataLoader worker."""
        if self.world_size is not None:
            rank, world = int(self.rank or 0), self.world_size
        elif dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = 0, 1
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return rank, world, worker, workers

    def __iter__(self) -> Iterator[Any]:
        if get_worker_info() is not None:
            self._in_workers.fill_(1)
        state, self._pending = self._pending, None
        self._latest = _Iterator(self, state) if self.balance is None else _BalancedIterator(self, state)
        return self._latest

    def state_dict(self) -> dict[str, Any]:
        """The position of the latest iterator (take it between rows): ``version``, ``epoch``, ``shard``,
        ``num_shards``, ``packer`` (``None`` before the first row) and ``last_cursor``."""
        if self._latest is None and get_worker_info() is None and bool(self._in_workers):
            raise ValueError(
                "PackedStream.state_dict: this stream is iterated in DataLoader worker processes, whose "
                "progress this process cannot see; saving here would replay every batch already seen. "
                "Use torchdata.stateful_dataloader.StatefulDataLoader and save loader.state_dict(), or "
                "num_workers=0"
            )
        if self._pending is not None:
            return dict(self._pending)
        if self._latest is not None:
            return self._latest.state_dict()
        shard, num_shards = self.shard() if self.balance is None else self.placement()[2:]
        return _state(self.epoch, shard, num_shards, None, None)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict`) at the next ``iter()``."""
        keys = ("version", "epoch", "shard", "num_shards", "packer", "last_cursor")
        check_saved(state, "PackedStream", keys, STATE_VERSION)
        self._pending = self._checked(state)
        self._latest = None

    def _checked(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` as a dict, each entry checked as strictly as a record; the packer's state too."""
        owner = "PackedStream.load_state_dict"
        checked = dict(state)
        checked["epoch"] = check_count(state["epoch"], "state['epoch']", owner)
        if (state["shard"] is None) != (state["num_shards"] is None):
            raise corrupt("state['shard'] and state['num_shards']", "must both be ints or both None", owner)
        if state["shard"] is not None:
            shard = check_count(state["shard"], "state['shard']", owner)
            num_shards = check_count(state["num_shards"], "state['num_shards']", owner)
            if shard >= num_shards:
                raise corrupt("state['shard']", f"is {shard}, not below num_shards={num_shards}", owner)
        balance = state.get("balance")
        if (balance is not None and self.balance is None) or (state["packer"] is not None and self.balance):
            raise ValueError(
                f"{owner}: the state was saved by a {'balanced' if balance is not None else 'packed'} "
                "stream; resume with the same balance= option"
            )
        if state["packer"] is not None:  # its own checks name the packer's keys
            FlatPacker(**self.packer_options).load_state_dict(restored(state["packer"]))
        if balance is not None:
            check_balance_state(balance, FlatPacker(**self.packer_options).options, self.balance, None)
        if state["last_cursor"] is not None:
            try:
                checked["last_cursor"] = SampleCursor.from_key(cursor_key(state["last_cursor"])).as_key()
            except (TypeError, ValueError) as error:
                raise corrupt("state['last_cursor']", f"is not a cursor key ({error})", owner) from None
        return checked


def _state(
    epoch: int, shard: int, num_shards: int, packer: Any, cursor: Any, balance: Any = None
) -> dict[str, Any]:
    state = {
        "version": STATE_VERSION,
        "epoch": epoch,
        "shard": shard,
        "num_shards": num_shards,
        "packer": packer,
        "last_cursor": cursor,
    }
    if balance is not None:
        state["balance"] = balance
    return state


def _check_balance(balance: Any, seq_len: int, packer_options: Mapping[str, Any]) -> None:
    """``balance`` must be BalanceOptions that fit ``seq_len``."""
    if not isinstance(balance, BalanceOptions):
        raise TypeError(
            f"PackedStream: balance must be zephon_collate.BalanceOptions, got {type(balance).__name__}"
        )
    defaults = {"strategy": "greedy", "buffer_size": STREAM_BUFFER_SIZE, "group_key": None}
    given = sorted(name for name, default in defaults.items() if packer_options[name] != default)
    if given:
        raise ValueError(
            f"PackedStream: {', '.join(given)} do not apply with balance= (the plan packs the rows); "
            "drop them"
        )
    if balance.fixed_rows and balance.seq_len != seq_len:
        raise ValueError(
            f"PackedStream: balance has rows of seq_len={balance.seq_len}, the stream seq_len={seq_len}; "
            "give both the same row length"
        )
    if not balance.fixed_rows and seq_len > balance.micro_batch_tokens:
        raise ValueError(
            f"PackedStream: seq_len={seq_len} (the longest piece of a document) exceeds the micro-batch "
            f"budget max_tokens={balance.micro_batch_tokens}; lower seq_len or raise max_tokens"
        )
    BalanceSchedule(balance, 1)  # micro_batches is required: it sets the window's size


class _Pass:
    """One pass of a :class:`PackedStream`; starts reading on the first ``next()``."""

    def __init__(self, stream: PackedStream, state: dict[str, Any] | None) -> None:
        self.stream = stream
        self.state = state
        self.epoch = stream.epoch if state is None else int(state["epoch"])
        self.items: Iterator[Any] | None = None

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> Any:
        if self.items is None:
            self.items = self._start()
        return next(self.items)

    def _start(self) -> Iterator[Any]:
        raise NotImplementedError


class _Iterator(_Pass):
    """A pass over this stream's shard: its packed rows."""

    packer: FlatPacker | None = None
    last_cursor: Any = None

    def state_dict(self) -> dict[str, Any]:
        if self.packer is None and self.state is not None:
            return dict(self.state)
        shard, num_shards = self.stream.shard()
        packer = None if self.packer is None else saveable(self.packer.state_dict())
        return _state(self.epoch, shard, num_shards, packer, self.last_cursor)

    def _start(self) -> Iterator[SampleRecord]:
        shard, num_shards = self.stream.shard()
        packer = FlatPacker(**self.stream.packer_options)
        start = 0
        state = self.state
        if state is not None:
            if state["shard"] is not None and (state["shard"], state["num_shards"]) != (shard, num_shards):
                raise ValueError(
                    f"PackedStream: the state was saved by shard {state['shard']} of {state['num_shards']} "
                    f"(rank x DataLoader worker), this is shard {shard} of {num_shards}; resume with the "
                    "same world size and num_workers, and save a worker's state through "
                    "torchdata.stateful_dataloader.StatefulDataLoader (a plain DataLoader cannot)"
                )
            if state["packer"] is not None:
                packer.load_state_dict(restored(state["packer"]))
                start, self.last_cursor = packer.records_consumed, cursor_key(state["last_cursor"])
        source = self.stream.source
        if num_shards > 1 and not callable(source) and self.stream.packer_options.get("group_key"):
            raise ValueError(
                f"PackedStream: group_key keeps consecutive records together, and shard {shard} of "
                f"{num_shards} (rank x DataLoader worker) reads records {shard}, {shard + num_shards}, ..., "
                "which would split each group across shards; give a callable source(shard, num_shards, "
                "epoch) that shards by group, or one shard (num_workers=0, one rank)"
            )
        if not callable(source):  # record k of the shard is the source's shard + k * num_shards
            packer._number_by(functools.partial(_strided, shard, num_shards))
        self.packer = packer
        records = shard_records(source, shard, num_shards, self.epoch, start, self.last_cursor)
        return packer.pack(self._tracked(records))

    def _tracked(self, records: Iterable[SampleRecord]) -> Iterator[SampleRecord]:
        for index, record in enumerate(records):
            # the cursor of the last record read: none for a plain payload (the resume checks no cursor)
            self.last_cursor = record.meta.as_cursor_key() if isinstance(record, SampleRecord) else None
            if is_columnar(record) and getattr(record, "num_rows", None) != 1:  # counted as one record
                raise TypeError(
                    f"PackedStream: item {index} of the source is a batch of columns (an Arrow table or "
                    "record batch of several rows); the stream's state counts items, so a resumed stream "
                    "would skip whole batches: give one document per item, or pack columns with FlatPacker"
                )
            yield record  # the packer names a record that is not a SampleRecord


class _BalancedIterator(_Pass):
    """A pass of a balanced stream: this rank's micro-batches, one step per item."""

    steps: BalancedSteps | None = None

    def state_dict(self) -> dict[str, Any]:
        if self.steps is None and self.state is not None:
            return dict(self.state)
        worker, workers = self.stream.placement()[2:]
        if self.steps is None:
            return _state(self.epoch, worker, workers, None, None)
        return _state(self.epoch, worker, workers, None, self.steps.last_cursor, self.steps.state_dict())

    def _start(self) -> BalancedSteps:
        placement = self.stream.placement()
        state = self.state
        saved_by = None if state is None else (state["shard"], state["num_shards"])
        if saved_by is not None and saved_by[0] is not None and saved_by != placement[2:]:
            raise ValueError(
                f"PackedStream: the state was saved by DataLoader worker {saved_by[0]} of {saved_by[1]}, "
                f"this is worker {placement[2]} of {placement[3]}; resume with the same num_workers "
                "through torchdata.stateful_dataloader.StatefulDataLoader"
            )
        options = FlatPacker(**self.stream.packer_options).options
        resume = state if state is not None and state.get("balance") is not None else None
        balance = self.stream.balance
        assert balance is not None  # this iterator exists for balanced streams only
        self.steps = BalancedSteps(self.stream.source, options, balance, placement, self.epoch, resume)
        return self.steps


def _strided(first: int, step: int, index: int) -> int:
    """The ``index``-th of ``first, first + step, ...``."""
    return first + index * step
