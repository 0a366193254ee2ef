"""``StackedBatch``, what a DataLoader worker sends: its CPU tensors as one narrow byte buffer, inline up
to :data:`PIPE_LIMIT` bytes, else through shared memory (``docs/training_loop.md``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from zephon_collate.core.records import SampleMeta

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
    """The narrowest dtype that holds an array's values exactly (``uint8`` for floats of 0.0 and 1.0)."""
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


def pack(
    tensors: Mapping[str, torch.Tensor] | TensorDictBase, dtypes: Mapping[str, torch.dtype] | None = None
) -> tuple[torch.Tensor, tuple[Field, ...]]:
    """One ``uint8`` buffer holding every tensor of ``tensors`` in its narrowest exact dtype, and its layout.

    Parameters:
        tensors: the CPU tensors to pack.
        dtypes: the dtype a field is to have on arrival, where the tensor holds it narrower.

    Example:
        >>> buffer, fields = pack({"ids": torch.tensor([[1, 300]]), "mask": torch.tensor([[0, 1]])})
        >>> [(f.key, f.wire, f.nbytes) for f in fields], buffer.numel()
        ([('ids', 'int16', 4), ('mask', 'uint8', 2)], 16)
        >>> unpack_tensors(buffer, fields)["ids"]
        tensor([[  1, 300]])
    """
    arrays: dict[str, np.ndarray] = {key: cast(torch.Tensor, value).numpy() for key, value in tensors.items()}
    fields, offset = [], 0
    for key, array in arrays.items():
        wire = _wire_dtype(array)
        nbytes = array.size * wire.itemsize
        dtype = tensors[key].dtype if dtypes is None else dtypes.get(key, tensors[key].dtype)
        fields.append(Field(key, dtype, wire.name, array.shape, offset, nbytes))
        offset += -(-nbytes // 8) * 8  # keep every field 8-byte aligned
    buffer = np.empty(offset, dtype=np.uint8)
    for entry in fields:
        target = buffer[entry.offset : entry.offset + entry.nbytes].view(entry.wire).reshape(entry.shape)
        np.copyto(target, arrays[entry.key], casting="unsafe")  # exact: the values fit (_wire_dtype)
    return torch.from_numpy(buffer), tuple(fields)


def unpack_tensors(
    buffer: torch.Tensor, fields: tuple[Field, ...], *, widen: bool = True
) -> dict[str, torch.Tensor]:
    """The tensors that :func:`pack` packed: each in its own dtype, or as it travelled (``widen=False``)."""
    data = {}
    for entry in fields:
        if entry.nbytes == 0:
            data[entry.key] = torch.empty(entry.shape, dtype=entry.dtype)
            continue
        raw = buffer[entry.offset : entry.offset + entry.nbytes]
        values = raw.view(getattr(torch, entry.wire)).view(entry.shape)
        data[entry.key] = values if values.dtype == entry.dtype or not widen else values.to(entry.dtype)
    return data


def unpack(buffer: torch.Tensor, fields: tuple[Field, ...], batch_size: torch.Size) -> TensorDict:
    """The TensorDict that :func:`pack` packed, each field back in its own dtype."""
    return TensorDict(unpack_tensors(buffer, fields), batch_size=batch_size, device="cpu")


class WireOutputs(dict[str, Any]):
    """A collated output dict leaving a DataLoader worker: its CPU tensors pickle as one buffer, and it
    arrives as a plain ``dict`` with the same keys, values and dtypes."""

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
    """A worker's output: the stacked CPU TensorDict (``None`` for an empty batch) and the per-record lists.

    Example:
        >>> import pickle
        >>> td = TensorDict(input_ids=torch.tensor([[5, 300]]), batch_size=[1], device="cpu")
        >>> arrived = pickle.loads(pickle.dumps(StackedBatch(td, {"ids": [(0, 0, 0)], "texts": [None]})))
        >>> arrived.td["input_ids"].dtype, arrived.dtypes, arrived.widened().td["input_ids"].dtype  # narrow
        (torch.int16, {'input_ids': torch.int64}, torch.int64)
    """

    td: TensorDictBase | None
    per_record: dict[str, list[Any]]
    metas: tuple[SampleMeta, ...] = ()
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.per_record["ids"])

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self.td is None or not packable(self.td):
            return StackedBatch, (self.td, self.per_record, self.metas, self.dtypes)
        buffer, fields = pack(self.td, self.dtypes)
        return _unpack_batch, (_to_wire(buffer), fields, self.td.batch_size, self.per_record, self.metas)

    def widened(self) -> StackedBatch:
        """The batch with every field in its stacked dtype (on the tensors' device: widen after moving)."""
        if not self.dtypes or self.td is None:
            return self
        td = self.td.copy()
        for key, dtype in self.dtypes.items():
            td[key] = td[key].to(dtype)
        return StackedBatch(td, self.per_record, self.metas)

    def pin_memory(self, device: str | torch.device | None = None) -> StackedBatch:
        """Pin the tensors in page-locked memory (called by the DataLoader's pinning thread)."""
        if self.td is None:
            return self
        pinned = self.td.pin_memory() if device is None else cast(Any, self.td).pin_memory(device=device)
        return replace(self, td=pinned)

    def to(self, device: str | torch.device, non_blocking: bool = False) -> StackedBatch:
        if self.td is None:
            return self
        return replace(self, td=self.td.to(device, non_blocking=non_blocking))


def _unpack_batch(
    wire: torch.Tensor | bytes,
    fields: tuple[Field, ...],
    batch_size: torch.Size,
    per_record: dict[str, list[Any]],
    metas: tuple[SampleMeta, ...],
) -> StackedBatch:
    data = unpack_tensors(_from_wire(wire), fields, widen=False)
    td = TensorDict(data, batch_size=batch_size, device="cpu")
    dtypes = {f.key: f.dtype for f in fields if data[f.key].dtype != f.dtype}
    return StackedBatch(td, per_record, metas, dtypes)
