"""SegmentIds: which packed document each token belongs to, from segment-restarting positions."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from zephon_collate.core.checks import check_key
from zephon_collate.core.keys import PADDING_LENGTH, POSITIONS, SEGMENT_IDS
from zephon_collate.core.text import shown
from zephon_collate.functional import host
from zephon_collate.functional.labels import padding_from_length
from zephon_collate.functional.segments import (
    PADDING_SEGMENT,
    flatten_segment_ids,
    segment_ids_from_positions,
)
from zephon_collate.transforms.base import Transform

__all__ = ["SegmentIds"]


class SegmentIds(Transform):
    """Per-token segment ids, int32: ``cumsum(positions == 0) - 1`` in each row, or numbered across the batch.

    Parameters:
        positions_key: the ``[B, S]`` segment-restarting positions (default ``"positions"``).
        flatten: number the segments across the batch, ``[B * S]`` (Mamba's ``seq_idx``).
        mark_padding: give trailing padding the id -1 (reads ``padding_length_key``).
        padding_length_key: the ``[B]`` trailing pad counts (default ``"padding_length"``).
        shifted: the positions were cut ``[:, :-1]`` by :class:`TokenShift` (one padding token less).
        out_key: where to write the ids (default ``"segment_ids"``).

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict(positions=torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]),
        ...                 padding_length=torch.tensor([1, 0]), batch_size=[2])
        >>> SegmentIds(flatten=True, mark_padding=True)(td)["segment_ids"].tolist()
        [0, 0, 0, 1, 1, -1, 2, 2, 2, 2, 3, 3]
    """

    runs_before = ("Positions",)

    def __init__(
        self,
        positions_key: str = POSITIONS,
        flatten: bool = False,
        mark_padding: bool = False,
        padding_length_key: str = PADDING_LENGTH,
        shifted: bool = False,
        out_key: str = SEGMENT_IDS,
    ) -> None:
        super().__init__()
        for name, value in (("flatten", flatten), ("mark_padding", mark_padding), ("shifted", shifted)):
            if not isinstance(value, bool):
                raise TypeError(f"SegmentIds: {name} must be a bool, got {shown(value)}")
        self.positions_key = check_key("SegmentIds", "positions_key", positions_key)
        self.padding_length_key = check_key("SegmentIds", "padding_length_key", padding_length_key)
        self.out_key = check_key("SegmentIds", "out_key", out_key)
        self.flatten, self.mark_padding, self.shifted = flatten, mark_padding, shifted
        self.in_keys = [positions_key, padding_length_key] if mark_padding else [positions_key]
        self.out_keys = [out_key]

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        positions = data[self.positions_key]
        padding = None
        if self.mark_padding:
            padding = padding_from_length(data[self.padding_length_key], positions.shape[1], self.shifted)
        ids = segment_ids_from_positions(positions, padding)
        return {self.out_key: flatten_segment_ids(ids) if self.flatten else ids}

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        positions = data[self.positions_key]
        starts = host.segment_starts(positions)
        if self.mark_padding:
            counts = data[self.padding_length_key].astype(np.int64)
            padding = host.trailing(np.maximum(counts - 1, 0) if self.shifted else counts, positions.shape[1])
            ids = np.where(padding, np.int32(PADDING_SEGMENT), host.segment_ids(starts & ~padding))
        else:
            ids = host.segment_ids(starts)
        if not self.flatten:
            return {self.out_key: ids}
        counts = np.maximum(ids.max(axis=1, initial=-1), -1).astype(np.int64) + 1
        offsets = np.cumsum(counts) - counts
        flat = np.where(ids >= 0, ids + offsets[:, None], ids)
        return {self.out_key: flat.reshape(-1).astype(np.int32)}

    def output_batch_size(self, batch_size: torch.Size) -> torch.Size:
        return torch.Size([]) if self.flatten else batch_size
