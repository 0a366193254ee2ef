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
    """Write ``labels`` equal to the tokens, unshifted: the model shifts them in its ``forward``.

    A ``transformers`` causal LM computes its loss as ``logits[:, :-1]`` against
    ``labels[:, 1:]``, so it takes labels aligned with ``input_ids`` (token ``t``'s
    label is token ``t`` itself) and drops each row's first label. Nothing is
    cut: a supervision mask and the pad counts are already aligned with these
    labels, so :class:`LossMask` applies them as they are, and
    :class:`BoundaryMask` placed before it makes each segment's first label
    ``ignore_index`` (the first label of a packed example, which would be
    predicted from the previous example).

    Parameters:
        tokens_key: the token field (default ``"input_ids"``).
        labels_key: where to write the labels (default ``"labels"``).

    Example:
        >>> from tensordict import TensorDict
        >>> from zephon_collate.transforms import Chain, LossMask
        >>> td = TensorDict(
        ...     input_ids=torch.tensor([[5, 6, 7, 0]]),
        ...     loss_mask=torch.tensor([[0, 1, 1, 1]]),
        ...     padding_length=torch.tensor([1]),
        ...     batch_size=[1],
        ... )
        >>> Chain(UnshiftedLabels(), LossMask(out_key=None, count_key=None))(td)["labels"].tolist()
        [[-100, 6, 7, -100]]
    """

    def __init__(self, tokens_key: str = INPUT_IDS, labels_key: str = LABELS) -> None:
        super().__init__()
        self.tokens_key = check_key("UnshiftedLabels", "tokens_key", tokens_key)
        self.labels_key = check_key("UnshiftedLabels", "labels_key", labels_key)
        self.in_keys = [tokens_key]
        self.out_keys = [labels_key]

    def check(self, data: Mapping[str, torch.Tensor]) -> None:
        check_rank("UnshiftedLabels", self.tokens_key, data[self.tokens_key], "[B, S] or [B, S, ...]", 2)

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.labels_key: data[self.tokens_key]}

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {self.labels_key: data[self.tokens_key]}
