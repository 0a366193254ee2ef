"""The kernel registry (:data:`KERNELS`, every public kernel by name) and the input checks kernels share."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

__all__ = ["KERNELS", "as_rows", "check_tensor", "flex_block_mask", "kernel"]

F = TypeVar("F", bound=Callable[..., Any])

KERNELS: dict[str, Callable[..., Any]] = {}
"""Every public kernel of :mod:`zephon_collate.functional`, by name."""


def kernel(function: F) -> F:
    """Register ``function`` in :data:`KERNELS` under its name (returned unchanged)."""
    KERNELS[function.__name__] = function
    return function


def check_tensor(kernel: str, name: str, value: object, min_dim: int = 0, max_dim: int = 64) -> torch.Tensor:
    """``value`` if a tensor of ``min_dim`` to ``max_dim`` dims; else ``TypeError`` / ``ValueError``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{kernel}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if not min_dim <= value.dim() <= max_dim:
        raise ValueError(
            f"{kernel}: {name} has shape {tuple(value.shape)}; it needs {min_dim} to {max_dim} dims"
        )
    return value


def as_rows(
    ids: torch.Tensor, name: str = "segment ids", forms: str = " (per row) or [N] (flattened)"
) -> torch.Tensor:
    """``ids`` as ``[B, S]`` rows (``[N]``: one row); else ``ValueError`` naming ``name``."""
    if ids.dim() == 1:
        return ids.unsqueeze(0)
    if ids.dim() != 2:
        raise ValueError(f"{name} must be [B, S]{forms}, got shape {tuple(ids.shape)}")
    return ids


def flex_block_mask(
    mod: Callable[..., torch.Tensor],
    ids: torch.Tensor,
    device: torch.device | str,
    size: int | tuple[int, int],
    compile: bool,
) -> BlockMask:
    """The ``BlockMask`` of ``mod`` over ``[B, S]`` ``ids``."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows, length = ids.shape
    return create_block_mask(
        mod, rows, None, length, length, device=device, BLOCK_SIZE=size, _compile=compile
    )
