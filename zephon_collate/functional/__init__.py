"""Pure tensor kernels: what the transforms compute, callable on their own.

Each function takes tensors and returns new tensors; none writes into its
inputs, none loops over tokens in Python, and none synchronises with the device
except :func:`cu_seqlens_rows` / :func:`cu_seqlens_flat` when they are not given
a fixed boundary count (their output size then depends on the data).

On plain CPU tensors in eager mode the comparison-heavy kernels run NumPy twins
registered beside them (:mod:`~zephon_collate.functional.dispatch`): same
results, several times faster there; :func:`use_cpu_twins` switches them off.

- :mod:`~zephon_collate.functional.labels`: the shift, padding, label and loss masks.
- :mod:`~zephon_collate.functional.segments`: the segment-start rule, ``cu_seqlens``, segment ids.
- :mod:`~zephon_collate.functional.attention`: document masks for FlexAttention and SDPA.
- :mod:`~zephon_collate.functional.context_parallel`: the load-balanced CP token layout.
"""

from zephon_collate.functional import attention
from zephon_collate.functional.context_parallel import cp_partition_index
from zephon_collate.functional.dispatch import use_cpu_twins
from zephon_collate.functional.labels import (
    align_mask,
    apply_loss_mask,
    as_float,
    contiguous,
    eos_label_mask,
    mask_labels,
    padding_from_length,
    sequence_positions,
    shift_tokens,
    trailing_mask,
)
from zephon_collate.functional.segments import (
    cu_seqlens_flat,
    cu_seqlens_rows,
    flatten_segment_ids,
    segment_ids_from_positions,
    segment_starts,
)

__all__ = [
    "align_mask",
    "apply_loss_mask",
    "as_float",
    "attention",
    "contiguous",
    "cp_partition_index",
    "cu_seqlens_flat",
    "cu_seqlens_rows",
    "eos_label_mask",
    "flatten_segment_ids",
    "mask_labels",
    "padding_from_length",
    "segment_ids_from_positions",
    "segment_starts",
    "sequence_positions",
    "shift_tokens",
    "trailing_mask",
    "use_cpu_twins",
]
