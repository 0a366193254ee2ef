"""Pure tensor kernels: what the transforms compute, callable on their own.

Each function is torch code only, the specification of its result: it takes
tensors and returns new tensors, writes into none of its inputs, loops over no
token in Python, gives one answer for every integer dtype on every device, and
synchronises with the device only in :func:`cu_seqlens_rows` /
:func:`cu_seqlens_flat` when they are not given a fixed boundary count (their
output size then depends on the data). :data:`KERNELS` lists them by name.

- :mod:`~zephon_collate.functional.labels`: the shift, padding, label and loss masks.
- :mod:`~zephon_collate.functional.segments`: the segment-start rule, ``cu_seqlens``, segment ids,
  each sequence's last token.
- :mod:`~zephon_collate.functional.attention`: document masks for FlexAttention and SDPA.
- :mod:`~zephon_collate.functional.context_parallel`: the load-balanced CP token layout.
"""

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
    "segment_ids_from_positions",
    "segment_starts",
    "sequence_positions",
    "shift_tokens",
    "trailing_mask",
]
