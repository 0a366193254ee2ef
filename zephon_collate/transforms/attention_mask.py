"""AttentionMask: Hugging Face's ``attention_mask``, 1 on real tokens and 0 on padding."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from zephon_collate.core.checks import check_key
from zephon_collate.core.keys import ATTENTION_MASK, PADDING_MASK
from zephon_collate.transforms._shapes import check_rank
from zephon_collate.transforms.base import Transform

__all__ = ["AttentionMask"]


class AttentionMask(Transform):
    """Write ``attention_mask`` (int64, 1 on real tokens, 0 on padding) from the padding mask (consumed).

    Parameters:
        padding_key, out_key: the keys (defaults ``"padding_mask"``, ``"attention_mask"``).

    Example:
        >>> from tensordict import TensorDict
        >>> out = AttentionMask()(TensorDict(padding_mask=torch.tensor([[False, True]]), batch_size=[1]))
        >>> out["attention_mask"].tolist(), "padding_mask" in out
        ([[1, 0]], False)
    """

    def __init__(self, padding_key: str = PADDING_MASK, out_key: str = ATTENTION_MASK) -> None:
        super().__init__()
        self.padding_key = check_key("AttentionMask", "padding_key", padding_key)
        self.out_key = check_key("AttentionMask", "out_key", out_key)
        self.in_keys, self.out_keys = [padding_key], [out_key]
        if padding_key != out_key:
            self.dropped_keys = (padding_key,)

    def check(self, data: Mapping[str, torch.Tensor]) -> None:
        mask = data[self.padding_key]
        check_rank("AttentionMask", self.padding_key, mask, "a [B, S] boolean mask", 1)
        if mask.dtype != torch.bool:
            raise TypeError(f"AttentionMask: {self.padding_key!r} must be a bool mask, got {mask.dtype}")

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.out_key: data[self.padding_key].logical_not().to(torch.int64)}

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {self.out_key: (~data[self.padding_key]).view(np.uint8).astype(np.int64)}
