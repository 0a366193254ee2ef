"""EosMask: drop the predictions made from EOS tokens."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from zephon_collate.core.checks import check_eos_token_id, check_ignore_index, check_key
from zephon_collate.core.keys import INPUT_IDS, LABELS
from zephon_collate.functional import eos_label_mask, mask_labels
from zephon_collate.transforms._shapes import check_ignore_fits, check_leading
from zephon_collate.transforms.base import Transform

__all__ = ["EosMask"]


class EosMask(Transform):
    """Set ``labels`` to ``ignore_index`` wherever the input token equals ``eos_token_id`` (after TokenShift).

    Parameters:
        eos_token_id: the EOS id, a nonnegative int (else ``ValueError``).
        ignore_index: the loss-ignore sentinel (default -100).
        inputs_key, labels_key: the keys read (defaults ``"input_ids"``, ``"labels"``).

    Example:
        >>> from tensordict import TensorDict
        >>> BOS, A, EOS, B = 1, 10, 2, 11
        >>> td = TensorDict(input_ids=torch.tensor([[BOS, A, EOS, BOS, B]]),
        ...                 labels=torch.tensor([[A, EOS, BOS, B, EOS]]), batch_size=[1])
        >>> EosMask(eos_token_id=EOS)(td)["labels"].tolist()
        [[10, 2, -100, 11, 2]]
    """

    runs_before = ("LossMask",)

    def __init__(
        self,
        eos_token_id: int,
        ignore_index: int = -100,
        inputs_key: str = INPUT_IDS,
        labels_key: str = LABELS,
    ) -> None:
        super().__init__()
        self.eos_token_id = check_eos_token_id(eos_token_id, owner="EosMask")
        self.ignore_index = check_ignore_index(ignore_index, owner="EosMask")
        self.inputs_key = check_key("EosMask", "inputs_key", inputs_key)
        self.labels_key = check_key("EosMask", "labels_key", labels_key)
        self.in_keys, self.out_keys = [inputs_key, labels_key], [labels_key]

    def check(self, data: Mapping[str, torch.Tensor]) -> None:
        inputs, labels = data[self.inputs_key], data[self.labels_key]
        check_leading(
            "EosMask", self.labels_key, labels, self.inputs_key, inputs, max(inputs.dim(), labels.dim())
        )
        check_ignore_fits("EosMask", self.ignore_index, self.labels_key, labels)

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from_eos = eos_label_mask(data[self.inputs_key], self.eos_token_id)
        return {self.labels_key: mask_labels(data[self.labels_key], from_eos, self.ignore_index)}

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        labels = data[self.labels_key]
        from_eos = data[self.inputs_key] == self.eos_token_id  # an id beyond the dtype matches nothing
        from_eos = from_eos.reshape(*from_eos.shape, *([1] * (labels.ndim - from_eos.ndim)))
        return {self.labels_key: np.where(from_eos, labels.dtype.type(self.ignore_index), labels)}
