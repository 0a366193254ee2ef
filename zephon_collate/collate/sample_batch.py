"""``SampleBatch`` and ``to_training``: the reference page's batch and its training tensors."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from zephon_collate.core.checks import check_field_names, is_zero_d, keywords
from zephon_collate.core.keys import PADDING_LENGTH
from zephon_collate.core.records import SampleRecord
from zephon_collate.core.text import shown
from zephon_collate.layouts.base import Settings
from zephon_collate.layouts.native import Native
from zephon_collate.layouts.training import TrainingOptions, options_for
from zephon_collate.read.rows import as_record_tuple, records_of

__all__ = ["SampleBatch", "stack_batch", "to_training"]


@functools.lru_cache(maxsize=256)
def _layout(options: TrainingOptions) -> Native:
    """The page's layout for ``options``, one per option set (it caches its plans)."""
    return Native(options)


@dataclass(frozen=True)
class SampleBatch:
    """A batch of :class:`SampleRecord`.

    Example:
        >>> from zephon_collate import SampleMeta, SampleRecord
        >>> metas = [SampleMeta((0, 0, i), lane_id=i % 2, chunk_id=4) for i in range(3)]
        >>> batch = SampleBatch([SampleRecord(m, {"input_ids": [1, 2]}) for m in metas])
        >>> batch.lane_ids, batch.chunk_ids, batch.ids[2]
        ((0, 1, 0), (4, 4, 4), (0, 0, 2))
    """

    records: tuple[SampleRecord, ...]
    lane_ids: tuple[int, ...] = field(init=False)
    chunk_ids: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        given = self.records
        if is_zero_d(given) or isinstance(given, (str, bytes, Mapping)) or not isinstance(given, Iterable):
            raise TypeError(f"SampleBatch.records must be a sequence of SampleRecord, got {shown(given)}")
        records = tuple(given)
        for index, record in enumerate(records):
            if not isinstance(record, SampleRecord):
                raise TypeError(
                    f"SampleBatch.records[{index}] must be a SampleRecord, got {type(record).__name__}"
                )
        object.__setattr__(self, "records", records)
        object.__setattr__(self, "lane_ids", tuple(r.meta.lane_id for r in records))
        object.__setattr__(self, "chunk_ids", tuple(r.meta.chunk_id for r in records))

    def __len__(self) -> int:
        return len(self.records)

    @property
    def ids(self) -> tuple[tuple[int, int, int], ...]:
        """The records' ``sample_id`` tuples, in order."""
        return tuple(r.meta.sample_id for r in self.records)

    @property
    def lineage_paths(self) -> tuple[tuple[int, ...], ...]:
        """The records' lineages, in order."""
        return tuple(r.meta.lineage for r in self.records)

    def to_tensordict(
        self,
        *,
        tokens_field: str = "auto",
        extra_fields: Sequence[str] = (),
        dtype: torch.dtype = torch.long,
        pin_memory: bool = False,
    ) -> TensorDict:
        """Stack the payloads into a TensorDict; see :func:`zephon_collate.stack_batch`."""
        return stack_batch(
            self, tokens_field=tokens_field, extra_fields=extra_fields, dtype=dtype, pin_memory=pin_memory
        )

    @keywords(TrainingOptions, "to_training")
    def to_training(self, **options: Any) -> dict[str, Any]:
        """The batch as training tensors: ``"ids"``, ``"texts"``, ``"input_ids"``, then those asked for.

        Parameters:
            **options: :class:`~zephon_collate.TrainingOptions`' fields (``docs/to_training.md``).

        Example:
            >>> from zephon_collate import SampleMeta, SampleRecord
            >>> meta = SampleMeta((0, 0, 0), 0, 0)
            >>> batch = SampleBatch([SampleRecord(meta, {"input_ids": [1, 10, 2, 1, 11, 2]})])
            >>> out = batch.to_training(return_labels=True, eos_mask_loss=True, eos_token_id=2)
            >>> out["input_ids"].tolist(), out["labels"].tolist()
            ([[1, 10, 2, 1, 11]], [[10, 2, -100, 11, 2]])
        """
        return _layout(options_for(options)).collate(self.records)


@keywords(TrainingOptions, "to_training")
def to_training(batch: SampleBatch | Sequence[SampleRecord], **options: Any) -> dict[str, Any]:
    """Convert a batch to training tensors; the reference is :meth:`SampleBatch.to_training`.

    Parameters:
        batch: a :class:`SampleBatch` or a sequence of :class:`SampleRecord`.
        **options: :class:`~zephon_collate.TrainingOptions`' fields.

    Example:
        >>> from zephon_collate import SampleMeta, SampleRecord
        >>> record = SampleRecord(SampleMeta((0, 0, 0), 0, 0), {"input_ids": [5, 6, 7]})
        >>> to_training([record], return_labels=True)["labels"].tolist()
        [[6, 7]]
    """
    records = as_record_tuple(batch, "to_training")  # the batch is checked before the options
    return _layout(options_for(options)).collate(records)


def stack_batch(
    batch: SampleBatch | Sequence[SampleRecord],
    *,
    tokens_field: str = "auto",
    extra_fields: Sequence[str] = (),
    dtype: torch.dtype = torch.long,
    pin_memory: bool = False,
) -> TensorDict:
    """Stack a batch's payloads into a ``TensorDict`` with ``batch_size=[B]``: the chain's input.

    Parameters:
        batch: a :class:`~zephon_collate.SampleBatch` or a sequence of records.
        tokens_field: the token field, or ``"auto"`` (input_ids, tokens, token_ids, ids).
        extra_fields: further per-record fields to stack.
        dtype: integer dtype for every stacked field.
        pin_memory: pin the stacked CPU tensors (for ``non_blocking`` copies to CUDA).

    Example:
        >>> from zephon_collate import SampleBatch, SampleMeta, SampleRecord
        >>> meta = SampleMeta((0, 0, 0), 0, 0, tags={"_padding_length": 1})
        >>> batch = SampleBatch([SampleRecord(meta, {"input_ids": [5, 6, 0], "positions": [0, 1, 0]})])
        >>> td = batch.to_tensordict()
        >>> sorted(td.keys()), td["input_ids"].tolist(), td["padding_length"].tolist()
        (['input_ids', 'padding_length', 'positions'], [[5, 6, 0]], [1])
    """
    owner = "stack_batch"
    if not isinstance(tokens_field, str) or not tokens_field:
        raise TypeError(f"{owner}: tokens_field must be a field name or 'auto', got {shown(tokens_field)}")
    extras = check_field_names("extra_fields", extra_fields, owner=owner)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{owner}: dtype must be a torch dtype such as torch.long, got {shown(dtype)}")
    if dtype not in (torch.int8, torch.int16, torch.int32, torch.int64):
        raise ValueError(f"{owner}: dtype must be a signed integer dtype such as torch.long, got {dtype}")
    if not isinstance(pin_memory, bool):
        raise TypeError(f"{owner}: pin_memory must be a bool, got {shown(pin_memory)}")
    if pin_memory and not torch.accelerator.is_available():
        raise ValueError(f"{owner}: pin_memory=True needs an accelerator, and none is available here")
    records = as_record_tuple(batch, owner)
    if not records:
        empty = {name: torch.empty((0, 0), dtype=dtype) for name in ("input_ids", *extras)}
        return TensorDict({**empty, PADDING_LENGTH: torch.empty(0, dtype=torch.int64)}, batch_size=[0])
    options = TrainingOptions(tokens_field=tokens_field, dtype=dtype, extra_fields=extras)
    layout = Native(options, Settings(chain=()))  # the stacked batch as a chain of yours gets it
    data = layout.lay_out(records_of(records, tokens_field, owner))[0].data
    tensors = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in data.items()}
    td = TensorDict(tensors, batch_size=[len(records)], device=tensors["input_ids"].device)
    return td.pin_memory() if pin_memory else td
