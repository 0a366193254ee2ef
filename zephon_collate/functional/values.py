"""Value reductions for the data checks: each reads one number back to the host.

The collate path checks values once per call before it builds any output
(negative token ids, masks outside 0/1, rows not starting at position 0).
These are the reductions it reads; NumPy twins stand in on plain CPU tensors.
"""

from __future__ import annotations

import numpy as np
import torch

from zephon_collate.functional.dispatch import kernel

__all__ = ["any_outside_zero_one", "first_nonzero", "first_true_row", "smallest"]


def _smallest_np(values: np.ndarray) -> float:
    return values.min().item()


@kernel(cpu=_smallest_np)
def smallest(values: torch.Tensor) -> float:
    """The smallest value of a non-empty tensor, as a Python number.

    Example:
        >>> smallest(torch.tensor([[3, -1], [2, 5]]))
        -1
    """
    return values.min().item()


def _outside_zero_one_np(array: np.ndarray) -> bool:
    if array.dtype.kind == "f":
        return bool(((array != 0) & (array != 1)).any())
    return bool(array.view(array.dtype.str.replace("i", "u")).max() > 1)  # as unsigned: 0, 1 are <= 1


@kernel(cpu=_outside_zero_one_np)
def any_outside_zero_one(mask: torch.Tensor) -> bool:
    """True if a non-empty, non-bool mask holds a value other than 0 and 1.

    Example:
        >>> any_outside_zero_one(torch.tensor([0, 1, 1])), any_outside_zero_one(torch.tensor([0.0, 0.5]))
        (False, True)
    """
    if mask.is_floating_point():
        return bool(((mask != 0) & (mask != 1)).any())
    low, high = torch.aminmax(mask)
    return bool(low < 0) or bool(high > 1)


def first_true_row(bad: torch.Tensor) -> int:
    """The index of the first row ``[B, ...]`` holding a True (``bad`` has at least one).

    Example:
        >>> first_true_row(torch.tensor([[False, False], [False, True]]))
        1
    """
    return int(bad.reshape(bad.shape[0], -1).any(dim=1).nonzero()[0, 0])


def _first_nonzero_np(values: np.ndarray) -> int | None:
    found = np.flatnonzero(values)
    return int(found[0]) if found.size else None


@kernel(cpu=_first_nonzero_np)
def first_nonzero(values: torch.Tensor) -> int | None:
    """The index of the first nonzero entry of a 1-D tensor, or ``None``.

    Example:
        >>> first_nonzero(torch.tensor([0, 0, 3, 1])), first_nonzero(torch.tensor([0, 0]))
        (2, None)
    """
    found = values.nonzero()
    return int(found[0, 0]) if found.numel() else None
