"""Total: a per-row count summed into the batch's own, as a step of the chain."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from zephon_collate.core.checks import check_key
from zephon_collate.core.keys import NUM_VALID_TOKENS
from zephon_collate.transforms._shapes import check_rank
from zephon_collate.transforms.base import Transform

__all__ = ["Total"]


class Total(Transform):
    """Sum a per-row count ``[B]`` into the batch's total, 0-d int64 (later steps see what the output holds).

    Parameters:
        key: the count, replaced by its total (default ``"num_valid_tokens"``).

    Example:
        >>> from tensordict import TensorDict
        >>> out = Total()(TensorDict(num_valid_tokens=torch.tensor([4, 4]), batch_size=[2]))
        >>> out["num_valid_tokens"].tolist(), out["num_valid_tokens"].dtype, out.batch_size
        (8, torch.int64, torch.Size([]))
    """

    def __init__(self, key: str = NUM_VALID_TOKENS) -> None:
        super().__init__()
        self.key = check_key("Total", "key", key)
        self.in_keys, self.out_keys = [self.key], [self.key]

    def check(self, data: Mapping[str, torch.Tensor]) -> None:
        check_rank("Total", self.key, data[self.key], "[B] per-row counts", 1, 1)

    def output_batch_size(self, batch_size: torch.Size) -> torch.Size:
        return torch.Size([])  # a 0-d entry has no batch dimension

    def join(self, key: str, rows: list[Any]) -> Any:
        return sum(rows) if key == self.key else super().join(key, rows)

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.key: data[self.key].sum(dtype=torch.int64)}

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {self.key: np.asarray(np.add.reduce(data[self.key], dtype=np.int64))}
