"""BoundaryMask: no label may predict the first token of the next document."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from zephon_collate.core.checks import check_key
from zephon_collate.core.keys import LOSS_MASK, POSITIONS
from zephon_collate.functional.labels import align_mask
from zephon_collate.functional.segments import segment_starts
from zephon_collate.transforms._shapes import check_leading, check_rank
from zephon_collate.transforms.base import Transform

__all__ = ["BoundaryMask"]


class BoundaryMask(Transform):
    """Zero the supervision mask on every token that starts a segment, so no label predicts it.

    Parameters:
        positions_key: the ``[B, S]`` segment-restarting positions (default ``"positions"``); ``None``:
            each row is one document padded on the right (before ``LeftPadding``): column 0 starts it.
        mask_key: the token-aligned supervision mask (default ``"loss_mask"``; created, int64, if absent;
            required with ``positions_key=None``).

    Example:
        >>> from tensordict import TensorDict
        >>> from zephon_collate.transforms import Chain, LossMask, TokenShift
        >>> td = TensorDict(input_ids=torch.tensor([[1, 10, 11, 1, 12]]), batch_size=[1],
        ...                 positions=torch.tensor([[0, 1, 2, 0, 1]]))
        >>> steps = BoundaryMask(), TokenShift(label_keys=["loss_mask"]), LossMask(padding_length_key=None)
        >>> Chain(*steps)(td)["labels"].tolist()  # 11 -> 1 (the next document's first token) is not trained
        [[10, 11, -100, 12]]
    """

    runs_before: tuple[str, ...] = ("TokenShift",)
    shifted_as = "labels"

    def __init__(self, positions_key: str | None = POSITIONS, mask_key: str = LOSS_MASK) -> None:
        super().__init__()
        checked = None if positions_key is None else check_key("BoundaryMask", "positions_key", positions_key)
        self.positions_key = checked
        self.mask_key = check_key("BoundaryMask", "mask_key", mask_key)
        if self.positions_key is None:  # rows of one document: the mask's own first column
            self.in_keys = [mask_key]
            self.runs_before = ("TokenShift", "LeftPadding")  # after it, column 0 is padding
        else:
            self.in_keys = [self.positions_key]
            self.optional_keys = (mask_key,)  # combined with when given, else created
        self.out_keys = [mask_key]

    def check(self, data: Mapping[str, torch.Tensor]) -> None:
        if self.positions_key is None:
            check_rank("BoundaryMask", self.mask_key, data[self.mask_key], "[B, S, ...] mask", 2)
            return
        positions = data[self.positions_key]
        check_rank("BoundaryMask", self.positions_key, positions, "[B, S] positions", 2, 2)
        if self.mask_key in data:
            check_leading(
                "BoundaryMask", self.mask_key, data[self.mask_key], self.positions_key, positions, 2
            )

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        mask = data.get(self.mask_key)
        if self.positions_key is None:
            given = data[self.mask_key]
            keep = torch.arange(given.shape[1], device=given.device).expand(given.shape[:2]) > 0
        else:
            keep = segment_starts(data[self.positions_key]).logical_not()
        if mask is None:
            return {self.mask_key: keep.long()}
        keep = align_mask(keep, mask)
        return {self.mask_key: mask & keep if mask.dtype == torch.bool else mask * keep}

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        mask = data.get(self.mask_key)
        if self.positions_key is None:
            out = data[self.mask_key].copy()
            out[:, :1] = 0  # each row's one document starts there
            return {self.mask_key: out}
        positions = data[self.positions_key]
        keep = positions != 0
        if mask is None:
            out = keep.astype(np.int64)
        else:
            keep = keep.reshape(*positions.shape, *([1] * (mask.ndim - positions.ndim)))
            # One pass: the mask, 0 at each segment start.
            out = mask & keep if mask.dtype == np.bool_ else np.where(keep, mask, mask.dtype.type(0))
        out[:, :1] = 0  # a row's first token starts a segment too
        return {self.mask_key: out}
