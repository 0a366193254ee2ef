"""MRopePositions: the text row and the 3 mRoPE planes, as packed Qwen-VL input takes them."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from zephon_collate.core.checks import check_key
from zephon_collate.core.keys import POSITION_IDS
from zephon_collate.transforms.base import Transform

__all__ = ["MRopePositions"]


class MRopePositions(Transform):
    """Join the text positions ``[B, S]`` and the mRoPE planes ``[B, S, 3]`` (consumed) into ``[4, B, S]``.

    Parameters:
        positions_key: the text positions, replaced by the joined ``[4, B, S]`` (default ``"position_ids"``).
        planes_key: the ``[B, S, 3]`` planes (default ``"mrope_positions"``).

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict(position_ids=torch.tensor([[0, 1, 0]]),
        ...                 mrope_positions=torch.tensor([[[0, 0, 0], [1, 1, 2], [0, 0, 0]]]), batch_size=[1])
        >>> MRopePositions()(td)["position_ids"].tolist()
        [[[0, 1, 0]], [[0, 1, 0]], [[0, 1, 0]], [[0, 2, 0]]]
    """

    def __init__(self, positions_key: str = POSITION_IDS, planes_key: str = "mrope_positions") -> None:
        super().__init__()
        self.positions_key = check_key("MRopePositions", "positions_key", positions_key)
        self.planes_key = check_key("MRopePositions", "planes_key", planes_key)
        self.in_keys, self.out_keys = [positions_key, planes_key], [positions_key]
        self.dropped_keys = (planes_key,)

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        text, planes = data[self.positions_key], data[self.planes_key]
        return {self.positions_key: torch.cat([text[None], planes.movedim(-1, 0).to(text.dtype)])}

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        text, planes = data[self.positions_key], data[self.planes_key]
        return {
            self.positions_key: np.concatenate([text[None], np.moveaxis(planes, -1, 0).astype(text.dtype)])
        }

    def output_batch_size(self, batch_size: torch.Size) -> torch.Size:
        return torch.Size([])  # [4, B, S]: the planes lead
