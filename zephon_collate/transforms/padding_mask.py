"""PaddingMask: where each row's trailing padding lies."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from zephon_collate.core.checks import check_key
from zephon_collate.core.keys import INPUT_IDS, PADDING_LENGTH, PADDING_MASK
from zephon_collate.functional import host, trailing_mask
from zephon_collate.transforms._shapes import check_leading, check_rank
from zephon_collate.transforms.base import Transform

__all__ = ["PaddingMask"]


class PaddingMask(Transform):
    """Boolean ``[B, S]`` mask, True on the last ``padding_length[b]`` tokens of row ``b``.

    Parameters:
        padding_length_key: the ``[B]`` pad counts (default ``"padding_length"``).
        like_key: the token field giving ``S`` (default ``"input_ids"``).
        out_key: where to write the mask (default ``"padding_mask"``).

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict(input_ids=torch.zeros(1, 4), padding_length=torch.tensor([1]), batch_size=[1])
        >>> PaddingMask()(td)["padding_mask"].tolist()
        [[False, False, False, True]]
    """

    runs_before = ("TokenShift",)
    shifted_as = "inputs"

    def __init__(
        self, padding_length_key: str = PADDING_LENGTH, like_key: str = INPUT_IDS, out_key: str = PADDING_MASK
    ) -> None:
        super().__init__()
        self.padding_length_key = check_key("PaddingMask", "padding_length_key", padding_length_key)
        self.like_key = check_key("PaddingMask", "like_key", like_key)
        self.out_key = check_key("PaddingMask", "out_key", out_key)
        self.in_keys, self.out_keys = [padding_length_key, like_key], [out_key]

    def check(self, data: Mapping[str, torch.Tensor]) -> None:
        like, padding = data[self.like_key], data[self.padding_length_key]
        check_rank("PaddingMask", self.like_key, like, "[B, S] or [B, S, ...]", 2)
        check_rank("PaddingMask", self.padding_length_key, padding, "[B] pad counts", 1, 1)
        check_leading("PaddingMask", self.padding_length_key, padding, self.like_key, like, 1)

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        length = data[self.like_key].shape[1]
        return {self.out_key: trailing_mask(data[self.padding_length_key], length)}

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {self.out_key: host.trailing(data[self.padding_length_key], data[self.like_key].shape[1])}
