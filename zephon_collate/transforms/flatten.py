"""Flatten: per-token fields from ``[B, S, ...]`` to ``[B * S, ...]``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from zephon_collate.core.checks import check_key, check_keys
from zephon_collate.core.keys import INPUT_IDS
from zephon_collate.transforms.base import Transform

__all__ = ["Flatten"]


class Flatten(Transform):
    """Flatten each of ``keys`` whose first two dims are ``like_key``'s: ``[B, S, ...]`` to ``[B * S, ...]``.

    Parameters:
        keys: the fields that may be per token (others are left as they are).
        like_key: the field whose ``[B, S]`` marks a field per token (default ``"input_ids"``).

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict(input_ids=torch.tensor([[1, 2], [3, 4]]), row=torch.tensor([7, 8]), batch_size=2)
        >>> out = Flatten(["input_ids", "row"])(td)
        >>> out["input_ids"].tolist(), out["row"].tolist()
        ([1, 2, 3, 4], [7, 8])
    """

    runs_last = True

    def __init__(self, keys: Sequence[str], like_key: str = INPUT_IDS) -> None:
        super().__init__()
        self.keys = check_keys("Flatten", "keys", keys)
        self.like_key = check_key("Flatten", "like_key", like_key)
        self.in_keys = list(dict.fromkeys((like_key, *self.keys)))
        self.out_keys = list(self.in_keys)

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self._flat(data)  # type: ignore[return-value]  # tensors in, tensors out

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._flat(data)  # type: ignore[return-value]  # arrays in, arrays out

    def _flat(self, data: Mapping[str, torch.Tensor | np.ndarray]) -> dict[str, torch.Tensor | np.ndarray]:
        tokens = tuple(data[self.like_key].shape[:2])
        return {
            key: value.reshape(-1, *value.shape[2:])
            for key, value in ((key, data[key]) for key in self.in_keys)
            if tuple(value.shape[:2]) == tokens and value.ndim >= 2
        }

    def output_batch_size(self, batch_size: torch.Size) -> torch.Size:
        return torch.Size([])
