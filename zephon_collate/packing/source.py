"""A stream's records and saved state: reading a source shard from a position, and state as plain data."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from zephon_collate.core.records import SampleRecord

__all__ = ["Source", "check_cursor", "cursor_key", "restored", "saveable", "shard_records"]

Source = Callable[[int, int, int], Iterable[SampleRecord]] | Any


def saveable(value: Any) -> Any:
    """NumPy data as tensors (dtype kept), so ``torch.load(weights_only=True)`` accepts the state."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value).copy())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {key: saveable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(saveable(item) for item in value)
    return value


def restored(value: Any) -> Any:
    """The inverse of :func:`saveable`: tensors back to NumPy arrays."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, Mapping):
        return {key: restored(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(restored(item) for item in value)
    return value


def cursor_key(value: Any) -> Any:
    """A cursor key with lists (as read back from JSON) turned into tuples, for comparisons."""
    return tuple(cursor_key(item) for item in value) if isinstance(value, (list, tuple)) else value


def shard_records(
    source: Source, shard: int, num_shards: int, epoch: int, start: int, expected: Any
) -> Iterator[SampleRecord]:
    """Shard ``shard``'s records from ``start`` on; ``ValueError`` unless the one before is ``expected``."""
    if callable(source):
        records = iter(source(shard, num_shards, epoch))
        for position in range(start):
            record = next(records, None)
            if record is None:
                raise ValueError(
                    f"PackedStream: the source of shard {shard} ended after {position} records, but the "
                    f"state had consumed {start}; the source changed since the state was saved"
                )
            if position == start - 1:
                check_cursor(record, expected, position, shard)
        return records
    indices = range(shard, len(source), num_shards)
    if start:
        if start > len(indices):
            raise ValueError(
                f"PackedStream: shard {shard} has {len(indices)} records, but the state had consumed "
                f"{start}; the source changed since the state was saved"
            )
        check_cursor(source[indices[start - 1]], expected, start - 1, shard)
    return (source[index] for index in indices[start:])


def check_cursor(record: Any, expected: Any, position: int, shard: int) -> None:
    """``ValueError`` unless ``record`` carries the cursor key ``expected`` (or nothing is expected)."""
    found = record.meta.as_cursor_key() if isinstance(record, SampleRecord) else None
    if expected is not None and found != expected:
        raise ValueError(
            f"PackedStream: record {position} of shard {shard} has cursor {found}, but the state was "
            f"saved after cursor {expected}; the source changed since the state was saved"
        )
