"""TokenShift: next-token inputs and labels."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from zephon_collate.core.checks import check_key, check_keys
from zephon_collate.core.keys import INPUT_IDS, LABELS
from zephon_collate.core.text import shown
from zephon_collate.transforms._shapes import check_leading, check_rank
from zephon_collate.transforms.base import Transform

__all__ = ["TokenShift"]


class TokenShift(Transform):
    """Cut ``[B, S]`` tokens into ``[B, S-1]`` inputs and next-token labels (views).

    Parameters:
        tokens_key: the token field, cut ``[:, :-1]`` (default ``"input_ids"``).
        labels_key: where to write labels, ``tokens[:, 1:]`` (default ``"labels"``).
        input_keys: per-token fields cut like the inputs (positions, padding mask, extra fields).
        label_keys: per-token fields cut like the labels (a supervision mask).

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict(input_ids=torch.tensor([[1, 10, 2]]), positions=torch.tensor([[0, 1, 2]]),
        ...                 batch_size=[1])
        >>> out = TokenShift(input_keys=("positions",))(td)
        >>> out["input_ids"].tolist(), out["labels"].tolist(), out["positions"].tolist()
        ([[1, 10]], [[10, 2]], [[0, 1]])
    """

    runs_before = ("EosMask", "LossMask", "CuSeqlens", "SegmentIds", "Positions", "Total", "PredictedLabels")

    def __init__(
        self,
        tokens_key: str = INPUT_IDS,
        labels_key: str = LABELS,
        input_keys: Sequence[str] = (),
        label_keys: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.tokens_key = check_key("TokenShift", "tokens_key", tokens_key)
        self.labels_key = check_key("TokenShift", "labels_key", labels_key)
        self.input_keys = check_keys("TokenShift", "input_keys", input_keys)
        self.label_keys = check_keys("TokenShift", "label_keys", label_keys)
        aligned = (*self.input_keys, *self.label_keys)
        if len({tokens_key, labels_key, *aligned}) != 2 + len(aligned):
            raise ValueError(
                f"TokenShift: keys must be distinct, got tokens_key={shown(tokens_key)}, "
                f"labels_key={shown(labels_key)}, input_keys={self.input_keys}, label_keys={self.label_keys}"
            )
        self.in_keys, self.out_keys = [tokens_key, *aligned], [tokens_key, labels_key, *aligned]

    def check(self, data: Mapping[str, torch.Tensor]) -> None:
        tokens = data[self.tokens_key]
        check_rank("TokenShift", self.tokens_key, tokens, "[B, S] or [B, S, ...] tokens", 2)
        for key in (*self.input_keys, *self.label_keys):
            check_leading("TokenShift", key, data[key], self.tokens_key, tokens, 2)

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tokens = data[self.tokens_key]
        updates = {self.tokens_key: tokens[:, :-1], self.labels_key: tokens[:, 1:]}
        for key in self.input_keys:
            updates[key] = data[key][:, :-1]
        for key in self.label_keys:
            updates[key] = data[key][:, 1:]
        return updates

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.compute(data)  # type: ignore[arg-type,return-value]  # views: the same slicing on arrays
