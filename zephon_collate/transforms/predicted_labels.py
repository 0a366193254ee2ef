"""PredictedLabels: each place's own target, for a loss that reads one label row aligned with the logits."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from zephon_collate.core.checks import check_ignore_index, check_key
from zephon_collate.core.keys import IGNORE_INDEX, LABELS, LOGITS_INDEX, SHIFT_LABELS
from zephon_collate.functional import host, predicted_labels
from zephon_collate.transforms.base import Transform

__all__ = ["PredictedLabels"]


class PredictedLabels(Transform):
    """``shift_labels`` ``[B, L]``: at each place, the label of the token its logits predict
    (``logits_index``), ``ignore_index`` where none, as ``transformers``' loss takes them.

    Parameters:
        labels_key: the token-aligned labels (default ``"labels"``).
        logits_index_key: each token's predictor place (default ``"logits_index"``).
        out_key: where to write them (default ``"shift_labels"``).
        ignore_index: the label of a place that predicts nothing.

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict(labels=torch.tensor([[-100, 2, 3, 4, 3, 5]]),
        ...                 logits_index=torch.tensor([[-1, 0, 1, 2, 1, 4]]), batch_size=[1])
        >>> PredictedLabels()(td)["shift_labels"].tolist()
        [[2, 3, 4, -100, 5, -100]]
    """

    def __init__(
        self,
        labels_key: str = LABELS,
        logits_index_key: str = LOGITS_INDEX,
        out_key: str = SHIFT_LABELS,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        super().__init__()
        self.labels_key = check_key("PredictedLabels", "labels_key", labels_key)
        self.logits_index_key = check_key("PredictedLabels", "logits_index_key", logits_index_key)
        self.out_key = check_key("PredictedLabels", "out_key", out_key)
        self.ignore_index = check_ignore_index(ignore_index, owner="PredictedLabels")
        self.in_keys, self.out_keys = [labels_key, logits_index_key], [out_key]

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        labels, index = data[self.labels_key], data[self.logits_index_key]
        return {self.out_key: predicted_labels(labels, index, self.ignore_index)}

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        labels, index = data[self.labels_key], data[self.logits_index_key]
        return {self.out_key: host.predicted_labels(labels, index, self.ignore_index)}
