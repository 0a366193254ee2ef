"""LossMask: supervision and padding masking of labels, the final loss mask and counts."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from zephon_collate.core.checks import check_ignore_index, check_key
from zephon_collate.core.keys import LABELS, LOSS_MASK, NUM_VALID_TOKENS, PADDING_LENGTH
from zephon_collate.functional import apply_loss_mask, host
from zephon_collate.transforms._shapes import check_ignore_fits, check_leading, check_rank
from zephon_collate.transforms.base import Transform

__all__ = ["LossMask"]


def _optional_key(name: str, value: str | None) -> str | None:
    return None if value is None else check_key("LossMask", name, value)


class LossMask(Transform):
    """Mask unsupervised and padding labels, then emit the label-aligned loss mask and per-row counts. Run it
    after :class:`EosMask`; the supervision mask is consumed. A key set to ``None`` skips its part.

    Parameters:
        ignore_index: the loss-ignore sentinel (default -100).
        supervision_key: label-aligned 0/1 mask to apply (default ``"loss_mask"``).
        padding_length_key: ``[B]`` trailing pad counts (default ``"padding_length"``).
        labels_key: the labels (default ``"labels"``).
        out_key: where to write the float32 loss mask (default ``"loss_mask"``).
        count_key: where to write per-row valid-label counts, ``[B]`` int64 (default ``"num_valid_tokens"``).

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict(labels=torch.tensor([[11, 12, 13, 0]]), loss_mask=torch.tensor([[0, 1, 1, 1]]),
        ...                 padding_length=torch.tensor([1]), batch_size=[1])
        >>> out = LossMask()(td)
        >>> out["labels"].tolist(), out["loss_mask"].tolist(), out["num_valid_tokens"].tolist()
        ([[-100, 12, 13, -100]], [[0.0, 1.0, 1.0, 0.0]], [2])
    """

    runs_before = ("Total", "PredictedLabels")

    def __init__(
        self,
        ignore_index: int = -100,
        supervision_key: str | None = LOSS_MASK,
        padding_length_key: str | None = PADDING_LENGTH,
        labels_key: str = LABELS,
        out_key: str | None = LOSS_MASK,
        count_key: str | None = NUM_VALID_TOKENS,
    ) -> None:
        super().__init__()
        self.ignore_index = check_ignore_index(ignore_index, owner="LossMask")
        self.supervision_key = _optional_key("supervision_key", supervision_key)
        self.padding_length_key = _optional_key("padding_length_key", padding_length_key)
        self.labels_key = check_key("LossMask", "labels_key", labels_key)
        self.out_key = _optional_key("out_key", out_key)
        self.count_key = _optional_key("count_key", count_key)
        reads = [labels_key, supervision_key, padding_length_key]
        self.in_keys = [key for key in reads if key is not None]
        self.out_keys = [key for key in (labels_key, out_key, count_key) if key is not None]
        if supervision_key is not None and supervision_key not in self.out_keys:
            self.dropped_keys = (supervision_key,)

    def check(self, data: Mapping[str, torch.Tensor]) -> None:
        labels = data[self.labels_key]
        check_rank("LossMask", self.labels_key, labels, "[B, S] or [B, S, ...] labels", 2)
        check_ignore_fits("LossMask", self.ignore_index, self.labels_key, labels)
        if self.supervision_key is not None:
            supervision = data[self.supervision_key]
            check_rank("LossMask", self.supervision_key, supervision, "a [B, S, ...] mask", 2, labels.dim())
            check_leading(
                "LossMask", self.supervision_key, supervision, self.labels_key, labels, supervision.dim()
            )
        if self.padding_length_key is not None:
            padding = data[self.padding_length_key]
            check_rank("LossMask", self.padding_length_key, padding, "[B] pad counts", 1, 1)
            check_leading("LossMask", self.padding_length_key, padding, self.labels_key, labels, 1)

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        supervision = None if self.supervision_key is None else data[self.supervision_key]
        padding = None if self.padding_length_key is None else data[self.padding_length_key]
        labels, loss_mask, counts = apply_loss_mask(
            data[self.labels_key], supervision, padding, self.ignore_index
        )
        updates = {self.labels_key: labels}
        if self.out_key is not None:
            updates[self.out_key] = loss_mask
        if self.count_key is not None:
            updates[self.count_key] = counts
        return updates

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        # New labels, never a view of the tokens they were shifted from: one copy, then masked in place
        # (a masked copyto runs faster than np.where, which also allocates its result).
        labels = data[self.labels_key].copy()
        ignore = labels.dtype.type(self.ignore_index)
        if self.supervision_key is not None:
            supervision = data[self.supervision_key]
            drop = ~supervision if supervision.dtype == np.bool_ else supervision == 0  # ~ on bytes: faster
            np.copyto(labels, ignore, where=drop.reshape(*drop.shape, *([1] * (labels.ndim - drop.ndim))))
        if self.padding_length_key is not None:
            # Padding sits at the end of each row: only the last ``widest`` columns are touched.
            counts = data[self.padding_length_key]
            largest = int(np.maximum.reduce(counts)) if counts.size else 0  # the ufunc: .max is Python
            widest = min(largest, labels.shape[1])
            if widest > 0:
                pad = host.trailing(counts, widest)
                tail = labels[:, labels.shape[1] - widest :]
                np.copyto(tail, ignore, where=pad.reshape(*pad.shape, *([1] * (labels.ndim - 2))))
        updates = {self.labels_key: labels}
        if self.out_key is None and self.count_key is None:
            return updates
        valid = labels != self.ignore_index
        if self.out_key is not None:
            updates[self.out_key] = valid.view(np.uint8).astype(np.float32)
        if self.count_key is not None:
            updates[self.count_key] = np.add.reduce(valid.reshape(len(valid), -1), axis=1, dtype=np.int64)
        return updates
