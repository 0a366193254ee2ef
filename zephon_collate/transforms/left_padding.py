"""LeftPadding: move each row's trailing padding to its front."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from zephon_collate.core.checks import check_key, check_keys
from zephon_collate.core.keys import PADDING_LENGTH
from zephon_collate.transforms._shapes import check_leading, check_rank
from zephon_collate.transforms.base import Transform

__all__ = ["LeftPadding"]


class LeftPadding(Transform):
    """Rotate each row of the ``keys`` fields right by its pad count: trailing padding becomes leading. Run it
    last; ``padding_length`` then counts each row's *first* tokens.

    Parameters:
        keys: the ``[B, S, ...]`` per-token fields to move.
        padding_length_key: the ``[B]`` trailing pad counts (default ``"padding_length"``).

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict(input_ids=torch.tensor([[5, 6, 0, 0], [7, 8, 9, 0]]),
        ...                 padding_length=torch.tensor([2, 1]), batch_size=[2])
        >>> LeftPadding(["input_ids"])(td)["input_ids"].tolist()
        [[0, 0, 5, 6], [0, 7, 8, 9]]
    """

    def __init__(self, keys: Sequence[str], padding_length_key: str = PADDING_LENGTH) -> None:
        super().__init__()
        self.keys = check_keys("LeftPadding", "keys", keys)
        self.padding_length_key = check_key("LeftPadding", "padding_length_key", padding_length_key)
        self.in_keys, self.out_keys = [*self.keys, padding_length_key], list(self.keys)

    def check(self, data: Mapping[str, torch.Tensor]) -> None:
        counts = data[self.padding_length_key]
        check_rank("LeftPadding", self.padding_length_key, counts, "[B] pad counts", 1, 1)
        for key in self.keys:
            check_rank("LeftPadding", key, data[key], "[B, S] or [B, S, ...]", 2)
            check_leading("LeftPadding", key, data[key], self.padding_length_key, counts, 1)

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        counts = data[self.padding_length_key].to(torch.int64)
        updates = {}
        for key in self.keys:
            value = data[key]
            length = value.shape[1]
            source = (torch.arange(length, device=value.device) - counts.unsqueeze(1)) % max(length, 1)
            source = source.reshape(*source.shape, *([1] * (value.dim() - 2))).expand_as(value)
            updates[key] = value.gather(1, source)
        return updates

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        counts = data[self.padding_length_key].astype(np.int64)
        updates = {}
        for key in self.keys:
            value = data[key]
            source = (np.arange(value.shape[1]) - counts[:, None]) % max(value.shape[1], 1)
            source = source.reshape(*source.shape, *([1] * (value.ndim - 2)))
            updates[key] = np.take_along_axis(value, np.broadcast_to(source, value.shape), axis=1)
        return updates
