"""The shape checks the transforms share (shapes and dtypes only), each naming the transform and the key."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from zephon_collate.core.checks import fits_dtype
from zephon_collate.core.text import shown

__all__ = ["check_ignore_fits", "check_leading", "check_present", "check_rank"]


def check_present(owner: str, in_keys: Any, data: Mapping[str, Any]) -> None:
    """``ValueError`` naming the first of ``in_keys`` that ``data`` lacks."""
    missing = [key for key in in_keys if key not in data]
    if missing:
        raise ValueError(
            f"{owner} needs {shown(missing[0])}, which the TensorDict lacks (it holds {sorted(data.keys())})"
        )


def check_rank(
    owner: str, key: str, tensor: torch.Tensor, layout: str, min_dim: int, max_dim: int = 64
) -> None:
    """``ValueError`` unless ``tensor`` has ``min_dim`` to ``max_dim`` dimensions (``layout`` names them)."""
    if not min_dim <= tensor.dim() <= max_dim:
        raise ValueError(f"{owner}: {shown(key)} must be {layout}, got shape {tuple(tensor.shape)}")


def check_ignore_fits(owner: str, ignore_index: int, key: str, labels: torch.Tensor) -> None:
    """``ValueError`` if integer ``labels`` cannot hold ``ignore_index`` (it would wrap around)."""
    if not fits_dtype(ignore_index, labels.dtype):
        raise ValueError(
            f"{owner}: ignore_index {ignore_index} does not fit {shown(key)} of dtype {labels.dtype}"
        )


def check_leading(
    owner: str, key: str, tensor: torch.Tensor, like_key: str, like: torch.Tensor, dims: int
) -> None:
    """``ValueError`` unless the first ``dims`` sizes of ``tensor`` equal those of ``like``."""
    if tensor.shape[:dims] != like.shape[:dims]:
        raise ValueError(
            f"{owner}: {shown(key)} has shape {tuple(tensor.shape)}, which does not match {shown(like_key)} "
            f"{tuple(like.shape)} in its first {dims} dims; per-token fields must align one to one"
        )
