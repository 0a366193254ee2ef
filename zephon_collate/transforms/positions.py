"""Positions: the model's position ids."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import numpy as np
import torch

from zephon_collate.core.checks import check_key, check_position_mode
from zephon_collate.core.keys import INPUT_IDS, POSITIONS
from zephon_collate.functional import sequence_positions
from zephon_collate.transforms._shapes import check_rank
from zephon_collate.transforms.base import Transform

__all__ = ["Positions"]


class Positions(Transform):
    """Model positions: keep the payload's (``"preserve"``), or number each row ``0 .. S-1`` (``"sequence"``).

    Parameters:
        mode: ``"preserve"`` or ``"sequence"`` (else ``ValueError``).
        like_key: the token field giving shape, dtype and device (default ``"input_ids"``).
        out_key: the positions key (default ``"positions"``).

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict(input_ids=torch.tensor([[1, 10, 2, 1, 11, 2]]), batch_size=[1])
        >>> Positions("sequence")(td)["positions"].tolist()
        [[0, 1, 2, 3, 4, 5]]
    """

    def __init__(
        self,
        mode: Literal["preserve", "sequence"] = "sequence",
        like_key: str = INPUT_IDS,
        out_key: str = POSITIONS,
    ) -> None:
        super().__init__()
        self.mode = check_position_mode(mode)
        self.like_key = check_key("Positions", "like_key", like_key)
        self.out_key = check_key("Positions", "out_key", out_key)
        self.in_keys = [out_key] if self.mode == "preserve" else [like_key]
        self.out_keys = [out_key]

    def check(self, data: Mapping[str, torch.Tensor]) -> None:
        if self.mode == "sequence":
            check_rank("Positions", self.like_key, data[self.like_key], "[B, S] or [B, S, ...]", 2)

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.mode == "preserve":
            return {}
        return {self.out_key: sequence_positions(data[self.like_key])}

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.mode == "preserve":
            return {}
        like = data[self.like_key]
        if like.dtype.kind in "iu" and like.shape[1] - 1 > np.iinfo(like.dtype).max:
            self.compute({self.like_key: torch.from_numpy(like)})  # raises, naming the dtype
        return {
            self.out_key: np.broadcast_to(np.arange(like.shape[1], dtype=like.dtype), like.shape[:2]).copy()
        }
