"""StackedBatch, what a DataLoader worker sends, and how it crosses to the main process.

A tensor leaving a worker travels through shared memory, and each one costs a
shared-memory segment, its page faults on both sides and a file descriptor
that the main process fetches from the (busy) worker in a round trip: on a
2-core machine, three ``[8, 8193]`` int64 tensors take ~2.9 ms per batch with
no other work, the same tokens as one 9-byte-per-token buffer ~1.2 ms.
So a :class:`StackedBatch` pickles its CPU tensors as **one byte buffer**,
each integer field in the narrowest integer dtype that holds all its values
exactly (``uint8``, ``int16`` or ``int32``), a float field of only 0.0 and 1.0
(a loss mask) as ``uint8``, other float and bool fields as they are,
and the receiving side rebuilds every field in its own dtype. The round trip is
exact: same keys, dtypes, shapes and values. A :class:`~zephon_collate.Collator` called in a
worker (``collate_fn=collator``, not the split) sends its output dict the same
way (:class:`WireOutputs`).

A buffer of up to :data:`PIPE_LIMIT` bytes goes inline, as ``bytes`` in the
pickle stream through the worker's pipe, with no round trip; a larger one as a
tensor, through shared memory, whose fixed cost a large buffer repays. With 2
workers on 2 cores (``python benchmarks/bench_transfer.py``), an 8 x 8,193
stacked batch (329 kB) arrives every 0.64-0.70 ms inline against 0.94-1.04 ms
through shared memory, the 525 kB output dict of the same batch 1.09-1.25x
faster inline, and at 8 x 32,769 tokens (1.3 MB) shared memory is 1.2-1.8x
faster: the two cost the same somewhere between, where the limit sits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from zephon_collate.records import SampleMeta

__all__ = [
    "PIPE_LIMIT",
    "Field",
    "StackedBatch",
    "WireOutputs",
    "pack",
    "packable",
    "unpack",
    "unpack_tensors",
]

_NARROW = (np.uint8, np.int16, np.int32)
PIPE_LIMIT = 768 * 1024
"""Largest buffer (bytes) pickled inline; larger ones travel as a shared-memory tensor."""


def _to_wire(buffer: torch.Tensor) -> torch.Tensor | bytes:
    """What a pickle carries: ``bytes`` up to :data:`PIPE_LIMIT`, else the tensor itself."""
    return buffer.numpy().tobytes() if buffer.numel() <= PIPE_LIMIT else buffer


def _from_wire(wire: torch.Tensor | bytes) -> torch.Tensor:
    """The ``uint8`` buffer :func:`_to_wire` sent (a writable copy of inline bytes)."""
    if isinstance(wire, torch.Tensor):
        return wire
    return torch.frombuffer(bytearray(wire), dtype=torch.uint8) if wire else torch.empty(0, dtype=torch.uint8)


class Field(NamedTuple):
    """Where one field lies in the buffer: ``nbytes`` from ``offset``, as ``wire`` values."""

    key: str
    dtype: torch.dtype
    wire: str  # a NumPy dtype name
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _zeros_and_ones(array: np.ndarray) -> bool:
    """True if every value of a float array is +0.0 or 1.0, bit for bit (no -0.0, no NaN)."""
    bits = array.view(f"u{array.itemsize}")
    one = np.ones((), array.dtype).view(bits.dtype)
    return bool(((bits == 0) | (bits == one)).all())


def _wire_dtype(array: np.ndarray) -> np.dtype:
    """The dtype an array travels in: the narrowest that holds its values exactly.

    For an integer array the narrowest of uint8, int16 and int32 that holds every
    value, for a float array of only 0.0 and 1.0 (a loss mask) uint8, else the
    array's own dtype.
    """
    if array.dtype.kind == "f" and array.size and _zeros_and_ones(array):
        return np.dtype(np.uint8)
    if array.dtype.kind not in "iu" or array.dtype.itemsize == 1 or array.size == 0:
        return array.dtype
    low, high = array.min(), array.max()
    for candidate in _NARROW:
        info = np.iinfo(candidate)
        if candidate().itemsize < array.dtype.itemsize and info.min <= low and high <= info.max:
            return np.dtype(candidate)
    return array.dtype


def _packable(tensor: object) -> bool:
    return (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and not tensor.requires_grad
        and tensor.dtype != torch.bfloat16
    )


def packable(td: TensorDictBase) -> bool:
    """True for a flat TensorDict of plain CPU tensors of NumPy dtypes (what a worker stacks)."""
    return td.device is not None and td.device.type == "cpu" and all(_packable(v) for v in td.values())


def pack(tensors: Mapping[str, torch.Tensor] | TensorDictBase) -> tuple[torch.Tensor, tuple[Field, ...]]:
    """One ``uint8`` buffer holding every tensor of ``tensors`` (see the module doc), and its layout.

    Example:
        >>> buffer, fields = pack({"ids": torch.tensor([[1, 300]]), "mask": torch.tensor([[0, 1]])})
        >>> [(f.key, f.wire, f.nbytes) for f in fields], buffer.numel()
        ([('ids', 'int16', 4), ('mask', 'uint8', 2)], 16)
        >>> unpack_tensors(buffer, fields)["ids"]
        tensor([[  1, 300]])
    """
    arrays = {key: value.numpy() for key, value in tensors.items()}
    fields, offset = [], 0
    for key, array in arrays.items():
        wire = _wire_dtype(array)
        nbytes = array.size * wire.itemsize
        fields.append(Field(key, tensors[key].dtype, wire.name, array.shape, offset, nbytes))
        offset += -(-nbytes // 8) * 8  # keep every field 8-byte aligned
    buffer = np.empty(offset, dtype=np.uint8)
    for field in fields:
        target = buffer[field.offset : field.offset + field.nbytes].view(field.wire).reshape(field.shape)
        np.copyto(target, arrays[field.key], casting="unsafe")  # exact: the values fit (_wire_dtype)
    return torch.from_numpy(buffer), tuple(fields)


def unpack_tensors(buffer: torch.Tensor, fields: tuple[Field, ...]) -> dict[str, torch.Tensor]:
    """The tensors that :func:`pack` packed, each back in its own dtype."""
    data = {}
    for field in fields:
        if field.nbytes == 0:
            data[field.key] = torch.empty(field.shape, dtype=field.dtype)
            continue
        raw = buffer[field.offset : field.offset + field.nbytes]
        values = raw.view(getattr(torch, field.wire)).view(field.shape)
        data[field.key] = values if values.dtype == field.dtype else values.to(field.dtype)
    return data


def unpack(buffer: torch.Tensor, fields: tuple[Field, ...], batch_size: torch.Size) -> TensorDict:
    """The TensorDict that :func:`pack` packed, each field back in its own dtype."""
    return TensorDict(unpack_tensors(buffer, fields), batch_size=batch_size, device="cpu")


class WireOutputs(dict):
    """A collated output dict leaving a DataLoader worker: it pickles its CPU tensors as one buffer.

    What arrives in the main process is a plain ``dict`` with the same keys in
    the same order, equal tensors of the same dtypes, and the other values
    (lists, ints) as they were.
    """

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        tensors = {key: value for key, value in self.items() if _packable(value)}
        others = {key: value for key, value in self.items() if key not in tensors}
        buffer, fields = pack(tensors)
        return _unpack_outputs, (_to_wire(buffer), fields, others, tuple(self))


def _unpack_outputs(
    wire: torch.Tensor | bytes, fields: tuple[Field, ...], others: dict[str, Any], order: tuple[str, ...]
) -> dict[str, Any]:
    values = {**unpack_tensors(_from_wire(wire), fields), **others}
    return {key: values[key] for key in order}


@dataclass(frozen=True)
class StackedBatch:
    """A worker's output: the stacked CPU TensorDict and the per-record lists.

    ``td`` is ``None`` for an empty batch; ``per_record`` holds the ``"ids"``
    and ``"texts"`` outputs and ``metas`` each record's metadata (the payloads
    stay in the worker: only the stacked tensors cross to the main process).
    ``pin_memory`` and ``to`` return new batches, so a DataLoader with
    ``pin_memory=True`` pins it. Pickled (as a worker sends it), the CPU
    tensors travel as one compact buffer (:func:`pack`) and come back exactly
    as they were.
    """

    td: TensorDictBase | None
    per_record: dict[str, list[Any]]
    metas: tuple[SampleMeta, ...] = ()

    def __len__(self) -> int:
        return len(self.per_record["ids"])

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self.td is None or not packable(self.td):
            return StackedBatch, (self.td, self.per_record, self.metas)
        buffer, fields = pack(self.td)
        return _unpack_batch, (_to_wire(buffer), fields, self.td.batch_size, self.per_record, self.metas)

    def pin_memory(self, device: str | torch.device | None = None) -> StackedBatch:
        """Pin the tensors in page-locked memory (called by the DataLoader's pinning thread)."""
        if self.td is None:
            return self
        pinned = self.td.pin_memory() if device is None else self.td.pin_memory(device=device)
        return StackedBatch(pinned, self.per_record, self.metas)

    def to(self, device: str | torch.device, non_blocking: bool = False) -> StackedBatch:
        """Move the tensors to ``device``."""
        if self.td is None:
            return self
        return StackedBatch(self.td.to(device, non_blocking=non_blocking), self.per_record, self.metas)


def _unpack_batch(
    wire: torch.Tensor | bytes,
    fields: tuple[Field, ...],
    batch_size: torch.Size,
    per_record: dict[str, list[Any]],
    metas: tuple[SampleMeta, ...],
) -> StackedBatch:
    return StackedBatch(unpack(_from_wire(wire), fields, batch_size), per_record, metas)
