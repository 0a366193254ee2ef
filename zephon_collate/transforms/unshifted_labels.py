"""UnshiftedLabels: labels as Hugging Face ``transformers`` models take them, a copy of the tokens."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from zephon_collate.core.checks import check_key
from zephon_collate.core.keys import INPUT_IDS, LABELS
from zephon_collate.transforms._shapes import check_rank
from zephon_collate.transforms.base import Transform

__all__ = ["UnshiftedLabels"]


class UnshiftedLabels(Transform):
    """Write ``labels`` equal to the tokens, unshifted: a ``transformers`` model shifts them itself.

    Parameters:
        tokens_key, labels_key: the token field and the labels (defaults ``"input_ids"``, ``"labels"``).

    Example:
        >>> from tensordict import TensorDict
        >>> from zephon_collate.transforms import Chain, LossMask
        >>> td = TensorDict(input_ids=torch.tensor([[5, 6, 7, 0]]), loss_mask=torch.tensor([[0, 1, 1, 1]]),
        ...                 padding_length=torch.tensor([1]), batch_size=[1])
        >>> Chain(UnshiftedLabels(), LossMask(out_key=None, count_key=None))(td)["labels"].tolist()
        [[-100, 6, 7, -100]]
    """

    runs_before = ("EosMask", "LossMask", "Total", "PredictedLabels")

    def __init__(self, tokens_key: str = INPUT_IDS, labels_key: str = LABELS) -> None:
        super().__init__()
        self.tokens_key = check_key("UnshiftedLabels", "tokens_key", tokens_key)
        self.labels_key = check_key("UnshiftedLabels", "labels_key", labels_key)
        self.in_keys, self.out_keys = [tokens_key], [labels_key]

    def check(self, data: Mapping[str, torch.Tensor]) -> None:
        check_rank("UnshiftedLabels", self.tokens_key, data[self.tokens_key], "[B, S] or [B, S, ...]", 2)

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.labels_key: data[self.tokens_key]}

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {self.labels_key: data[self.tokens_key]}
