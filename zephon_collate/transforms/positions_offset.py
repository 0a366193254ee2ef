"""PositionOffset: positions counted from another start than 0."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from zephon_collate.core.checks import check_int, check_key
from zephon_collate.core.keys import POSITION_IDS
from zephon_collate.transforms.base import Transform

__all__ = ["PositionOffset"]


class PositionOffset(Transform):
    """Add ``offset`` to every position (``DataCollatorWithFlattening(position_ids_start=...)``).

    Parameters:
        offset: the first position, an int >= 0.
        positions_key: the positions (default ``"position_ids"``).

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict(position_ids=torch.tensor([[0, 1, 2, 0, 1]]), batch_size=[1])
        >>> PositionOffset(2)(td)["position_ids"].tolist()
        [[2, 3, 4, 2, 3]]
    """

    def __init__(self, offset: int, positions_key: str = POSITION_IDS) -> None:
        super().__init__()
        self.offset = check_int("PositionOffset", "offset", offset, 0)
        self.positions_key = check_key("PositionOffset", "positions_key", positions_key)
        self.in_keys = self.out_keys = [positions_key]

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.positions_key: data[self.positions_key] + self.offset}

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        positions = data[self.positions_key]
        return {self.positions_key: positions + positions.dtype.type(self.offset)}
