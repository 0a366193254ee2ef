"""SampleBatch and to_training: the reference page's batch, and its conversion to training tensors.

:class:`SampleBatch` sits above the records (:mod:`zephon_collate.records`) and
the collate path it calls; :mod:`zephon_collate.types` re-exports it with them.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tensordict import TensorDict

from zephon_collate.collate.options import options_for, signature_with_options
from zephon_collate.collate.stack import stack_batch
from zephon_collate.collate.training import training_outputs
from zephon_collate.read import as_record_tuple
from zephon_collate.records import SampleRecord
from zephon_collate.text import shown

__all__ = ["SampleBatch", "to_training"]


@dataclass(frozen=True)
class SampleBatch:
    """A batch of :class:`SampleRecord`.

    Example:
        >>> from zephon_collate import SampleMeta, SampleRecord
        >>> metas = [SampleMeta((0, 0, i), lane_id=i % 2, chunk_id=4) for i in range(3)]
        >>> batch = SampleBatch([SampleRecord(m, {"input_ids": [1, 2]}) for m in metas])
        >>> batch.lane_ids, batch.chunk_ids
        ((0, 1, 0), (4, 4, 4))
        >>> batch.ids[2]
        (0, 0, 2)
    """

    records: tuple[SampleRecord, ...]
    lane_ids: tuple[int, ...] = field(init=False)
    chunk_ids: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.records, (str, bytes, Mapping)) or not isinstance(self.records, Iterable):
            raise TypeError(
                f"SampleBatch.records must be a sequence of SampleRecord, got {shown(self.records)}"
            )
        records = tuple(self.records)
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

    def to_tensordict(self, *args: Any, **kwargs: Any) -> TensorDict:
        """Stack the payloads into a TensorDict; see :func:`zephon_collate.stack_batch`."""
        return stack_batch(self, *args, **kwargs)

    def to_training(self, **options: Any) -> dict[str, Any]:
        """Convert batch to training-ready format with optional LM label generation.

        The full reference, parameter by parameter, is ``docs/to_training.md``
        (the reference page); the keyword arguments are those of
        :class:`~zephon_collate.TrainingOptions`, in the page's order and with its
        defaults. In short: the payloads are stacked once, a chain of transforms
        (``PaddingMask -> TokenShift -> EosMask -> LossMask -> CuSeqlens ->
        Positions``, each only when asked for) runs on them, then fields are
        renamed, excluded and flattened, and converted to torch tensors
        (``dtype="auto"`` or a torch dtype), NumPy arrays (a NumPy dtype) or
        Python lists (``None``).

        A ``"loss_mask"`` payload field is recognized automatically, like
        ``"positions"``. With ``return_labels=True`` it is consumed: labels whose
        mask entry (``mask[:, 1:]``) is 0 are set to ``ignore_index``.

        Returns:
            A dict with ``"ids"``, ``"texts"``, ``"input_ids"`` and, as asked for,
            ``"labels"``, ``"positions"``, extra fields, ``"num_valid_tokens"``,
            ``"loss_mask"``, ``"cu_seqlens"``, ``"max_seqlen"``, ``"padding_mask"``.

        Raises:
            TypeError: if payloads are neither dicts nor arrays, or
                ``exclude_fields`` is a string instead of a sequence of field names.
            ValueError: for the argument and data errors listed in ``docs/to_training.md``.

        Warns:
            UserWarning: if ``eos_token_id`` is supplied with ``eos_mask_loss=False``.

        Example:
            >>> from zephon_collate import SampleMeta, SampleRecord
            >>> meta = SampleMeta((0, 0, 0), 0, 0)
            >>> batch = SampleBatch([SampleRecord(meta, {"input_ids": [1, 10, 2, 1, 11, 2]})])
            >>> out = batch.to_training(return_labels=True, eos_mask_loss=True, eos_token_id=2)
            >>> out["input_ids"].tolist(), out["labels"].tolist()
            ([[1, 10, 2, 1, 11]], [[10, 2, -100, 11, 2]])
        """
        return training_outputs(self.records, options_for(options))


def to_training(batch: SampleBatch | Sequence[SampleRecord], **options: Any) -> dict[str, Any]:
    """Convert a batch to training-ready format; the reference is :meth:`SampleBatch.to_training`.

    ``batch`` is a :class:`SampleBatch` or a sequence of :class:`SampleRecord`.

    Example:
        >>> from zephon_collate import SampleMeta, SampleRecord
        >>> record = SampleRecord(SampleMeta((0, 0, 0), 0, 0), {"input_ids": [5, 6, 7]})
        >>> to_training([record], return_labels=True)["labels"].tolist()
        [[6, 7]]
    """
    checked = options_for(options)
    return training_outputs(as_record_tuple(batch, "to_training"), checked)


_SELF = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
_BATCH = inspect.Parameter("batch", inspect.Parameter.POSITIONAL_OR_KEYWORD)
SampleBatch.to_training.__signature__ = signature_with_options(SampleBatch.to_training, [_SELF])  # type: ignore[attr-defined]
to_training.__signature__ = signature_with_options(to_training, [_BATCH])  # type: ignore[attr-defined]
