"""NumPy twins of the comparison-heavy kernels, for CPU tensors in eager mode.

On the CPU, torch's elementwise comparisons over integer tensors run several
times slower than NumPy's (an ``int64 == scalar`` over 65,536 tokens: ~39 us
against ~9 us on a 2-core AMD EPYC, one thread), and the label, mask and
boundary kernels are made of them. :mod:`zephon_collate.functional` hands a
kernel to its twin here when :func:`applies` holds: every tensor argument a
plain CPU tensor of a NumPy dtype, outside ``torch.compile``, without autograd.
Each twin views the tensors as arrays (no copy), computes, and wraps its
results with ``torch.from_numpy``: same values, dtypes and shapes as the torch
kernel (the tests compare the two on random inputs). Inputs are only read.

Set ``zephon_collate.numpy_kernels.ENABLED = False`` to run the torch kernels
everywhere (for example to compare the two, or to profile torch itself).
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = [
    "ENABLED",
    "applies",
    "apply_loss_mask",
    "contiguous",
    "cu_seqlens_flat",
    "cu_seqlens_rows",
    "eos_label_mask",
    "mask_labels",
    "trailing_mask",
]

ENABLED = True

_NUMPY_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
    }
)


def applies(*tensors: torch.Tensor) -> bool:
    """True when the NumPy twin may stand in for a kernel called on ``tensors``."""
    if not ENABLED or torch.compiler.is_compiling():
        return False
    for t in tensors:  # a plain loop: this runs a dozen times per to_training call
        if type(t) is not torch.Tensor or not t.is_cpu or t.dtype not in _NUMPY_DTYPES or t.requires_grad:
            return False  # a subclass (Parameter, FakeTensor, ...), another device or dtype, autograd
    return True


def contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.contiguous()``; NumPy copies strided rows faster."""
    if tensor.is_contiguous() or not applies(tensor):
        return tensor.contiguous()
    return torch.from_numpy(np.ascontiguousarray(tensor.numpy()))


def _trailing(padding_length: np.ndarray, length: int) -> np.ndarray:
    narrow = padding_length.dtype.kind in "biu" and padding_length.dtype != np.int64
    if narrow:  # a Python int minus a narrow unsigned array would overflow
        padding_length = padding_length.astype(np.int64)
    return np.arange(length) >= (length - padding_length)[:, None]


def _aligned(mask: np.ndarray, like: np.ndarray) -> np.ndarray:
    return mask.reshape(*mask.shape, *([1] * (like.ndim - mask.ndim)))


def _masked(labels: np.ndarray, drop: np.ndarray, ignore_index: int) -> np.ndarray:
    out = labels.copy()
    np.copyto(out, np.asarray(ignore_index).astype(out.dtype), where=_aligned(drop, out))
    return out


def trailing_mask(padding_length: torch.Tensor, length: int) -> torch.Tensor:
    return torch.from_numpy(_trailing(padding_length.numpy(), length))


def mask_labels(labels: torch.Tensor, mask: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return torch.from_numpy(_masked(labels.numpy(), mask.numpy(), ignore_index))


def eos_label_mask(inputs: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    return torch.from_numpy(np.asarray(inputs.numpy() == eos_token_id))


def apply_loss_mask(
    labels: torch.Tensor,
    supervision: torch.Tensor | None,
    padding_length: torch.Tensor | None,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values = labels.numpy()
    drop = None
    if supervision is not None:
        drop = supervision.numpy() == 0
    if padding_length is not None:
        padding = _trailing(padding_length.numpy(), values.shape[1])
        drop = padding if drop is None else drop | _aligned(padding, drop)
    if drop is not None:
        values = _masked(values, drop, ignore_index)
    loss_mask = (values != ignore_index).view(np.uint8).astype(np.float32)
    return torch.from_numpy(values), torch.from_numpy(loss_mask), torch.from_numpy(_row_counts(loss_mask))


def _row_counts(ones: np.ndarray) -> np.ndarray:
    """Per-row number of ones in a float32 0/1 array, as int64."""
    per_row = ones.reshape(ones.shape[0], math.prod(ones.shape[1:]))
    if per_row.shape[1] < 2**24:  # float32 sums of 0/1 are exact below 2**24; a BLAS matrix-vector
        return (per_row @ np.ones(per_row.shape[1], np.float32)).astype(np.int64)  # product is ~5x faster
    return np.count_nonzero(per_row, axis=1).astype(np.int64)


def _longest(boundaries: np.ndarray) -> np.ndarray:
    """Each row's longest segment (the torch kernel's first difference is 0, and none is negative)."""
    if boundaries.shape[-1] < 2:
        return np.zeros(boundaries.shape[:-1], dtype=boundaries.dtype)
    return np.asarray((boundaries[..., 1:] - boundaries[..., :-1]).max(axis=-1))


def cu_seqlens_rows(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    starts = np.flatnonzero(positions.numpy() == 0)  # flat indices: fast for bool, already row-sorted
    rows, length = positions.shape
    row_index = starts // max(length, 1)
    rank = np.arange(starts.size) - np.searchsorted(row_index, row_index)  # index within its row
    width = int(rank.max()) + 2 if starts.size else 1
    boundaries = np.full((rows, width), length, dtype=np.int32)
    boundaries[row_index, rank] = starts - row_index * length
    return torch.from_numpy(boundaries), torch.from_numpy(_longest(boundaries))


def cu_seqlens_flat(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    is_start = positions.numpy() == 0
    boundaries = np.append(np.flatnonzero(is_start), is_start.size).astype(np.int32)
    return torch.from_numpy(boundaries), torch.from_numpy(_longest(boundaries))
