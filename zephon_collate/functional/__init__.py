"""Pure tensor kernels: what the transforms compute, callable on their own (:data:`KERNELS` lists them)."""

from zephon_collate.functional import attention
from zephon_collate.functional._registry import KERNELS
from zephon_collate.functional.context_parallel import cp_partition_index
from zephon_collate.functional.labels import (
    align_mask,
    apply_loss_mask,
    as_float,
    eos_label_mask,
    mask_labels,
    padding_from_length,
    predicted_labels,
    sequence_positions,
    shift_tokens,
    trailing_mask,
)
from zephon_collate.functional.segments import (
    PADDING_SEGMENT,
    cu_seqlens_flat,
    cu_seqlens_rows,
    flatten_segment_ids,
    last_token_index,
    segment_ids_from_positions,
    segment_starts,
    sequence_map,
)

__all__ = [
    "KERNELS",
    "PADDING_SEGMENT",
    "align_mask",
    "apply_loss_mask",
    "as_float",
    "attention",
    "cp_partition_index",
    "cu_seqlens_flat",
    "cu_seqlens_rows",
    "eos_label_mask",
    "flatten_segment_ids",
    "last_token_index",
    "mask_labels",
    "padding_from_length",
    "predicted_labels",
    "segment_ids_from_positions",
    "segment_starts",
    "sequence_map",
    "sequence_positions",
    "shift_tokens",
    "trailing_mask",
]
