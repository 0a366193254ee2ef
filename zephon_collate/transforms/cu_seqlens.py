"""CuSeqlens: varlen-attention segment boundaries from segment-restarting positions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from zephon_collate.core.checks import check_key, check_num_boundaries
from zephon_collate.core.keys import CU_SEQLENS, INT32_MAX, MAX_SEQLEN, POSITIONS
from zephon_collate.core.text import shown
from zephon_collate.functional import cu_seqlens_flat, cu_seqlens_rows, host
from zephon_collate.transforms._shapes import check_rank
from zephon_collate.transforms.base import Transform

__all__ = ["CuSeqlens"]


class CuSeqlens(Transform):
    """Boundaries ``cu_seqlens`` and maxima ``max_seqlen``, int32: per row ``[B, K]`` (padded with the row
    length) and ``[B]``, or flattened ``[N]`` and ``[]``; without ``num_boundaries`` the size is read back.

    Parameters:
        positions_key: the ``[B, S]`` segment-restarting positions (default ``"positions"``).
        flatten: one sequence across the batch instead of one per row.
        num_boundaries: a fixed boundary count (filler: the row or total length), or ``None``.
        out_key, max_key: where to write them (defaults ``"cu_seqlens"``, ``"max_seqlen"``).

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict(positions=torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]), batch_size=[2])
        >>> out = CuSeqlens()(td)
        >>> out["cu_seqlens"].tolist(), out["max_seqlen"].tolist()
        ([[0, 3, 5], [0, 5, 5]], [3, 5])
    """

    runs_before = ("Positions",)

    def __init__(
        self,
        positions_key: str = POSITIONS,
        flatten: bool = False,
        num_boundaries: int | None = None,
        out_key: str = CU_SEQLENS,
        max_key: str = MAX_SEQLEN,
    ) -> None:
        super().__init__()
        num_boundaries = check_num_boundaries("CuSeqlens", num_boundaries)
        if not isinstance(flatten, bool):
            raise TypeError(f"CuSeqlens: flatten must be a bool, got {shown(flatten)}")
        self.positions_key = check_key("CuSeqlens", "positions_key", positions_key)
        self.out_key = check_key("CuSeqlens", "out_key", out_key)
        self.max_key = check_key("CuSeqlens", "max_key", max_key)
        self.flatten, self.num_boundaries = flatten, num_boundaries
        self.data_dependent_shape = num_boundaries is None  # else the boundary count is read back
        self.in_keys, self.out_keys = [positions_key], [out_key, max_key]

    def check(self, data: Mapping[str, torch.Tensor]) -> None:
        positions = data[self.positions_key]
        check_rank("CuSeqlens", self.positions_key, positions, "[B, S] positions", 2, 2)
        if (positions.numel() if self.flatten else positions.shape[-1]) > INT32_MAX:  # per row, unflattened
            raise ValueError(
                f"CuSeqlens: {tuple(positions.shape)} positions overflow the int32 boundaries; "
                "use smaller batches"
            )

    def empty_outputs(self, earlier: Mapping[str, Any]) -> dict[str, Any]:
        return {self.out_key: [0], self.max_key: 0} if self.flatten else {}

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        kernel = cu_seqlens_flat if self.flatten else cu_seqlens_rows
        boundaries, longest = kernel(data[self.positions_key], self.num_boundaries)
        return {self.out_key: boundaries, self.max_key: longest}

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        kernel = host.cu_seqlens_flat if self.flatten else host.cu_seqlens_rows
        boundaries, longest = kernel(data[self.positions_key], self.num_boundaries)
        return {self.out_key: boundaries, self.max_key: longest}

    def output_batch_size(self, batch_size: torch.Size) -> torch.Size:
        return torch.Size([]) if self.flatten else batch_size

    def join(self, key: str, rows: list[Any]) -> Any:
        """Rows run alone: flattened, boundaries continued; per row, padded with its length to the widest."""
        if key == self.max_key:
            return max(rows) if self.flatten else [row[0] for row in rows]
        if key != self.out_key:
            return super().join(key, rows)
        if not self.flatten:
            width = max(len(row[0]) for row in rows)
            return [row[0] + [row[0][-1]] * (width - len(row[0])) for row in rows]
        joined: list[int] = []
        total = 0
        for row in rows:
            joined += [start + total for start in row[:-1]]
            total += row[-1]
        return [*joined, total]
