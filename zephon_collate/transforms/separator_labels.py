"""SeparatorLabels: a label of its own on each packed document's first token."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from zephon_collate.core.checks import check_ignore_index, check_key
from zephon_collate.core.keys import LABELS, MM_TOKEN_TYPE_IDS, PADDING_LENGTH, POSITION_IDS
from zephon_collate.functional import host, trailing_mask
from zephon_collate.functional.segments import segment_starts
from zephon_collate.transforms._shapes import check_ignore_fits
from zephon_collate.transforms.base import Transform

__all__ = ["SeparatorLabels"]


class SeparatorLabels(Transform):
    """Set the label of each document's first token to ``separator_id``; the row's padding keeps its own,
    and so does an image placeholder (``media_key`` nonzero, when the batch has it), which is never a
    label. ``DataCollatorWithFlattening(separator_id=...)``. Place it before :class:`PositionOffset`.

    Parameters:
        separator_id: the label of each document's first token.
        positions_key, labels_key, padding_length_key, media_key: the keys read (``position_ids``,
            ``labels``, ``padding_length``, ``mm_token_type_ids`` where present).

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict(labels=torch.tensor([[-100, 6, 7, -100, 9, -100]]), batch_size=[1],
        ...                 position_ids=torch.tensor([[0, 1, 2, 0, 1, 0]]), padding_length=torch.tensor([1]))
        >>> SeparatorLabels(-7)(td)["labels"].tolist()
        [[-7, 6, 7, -7, 9, -100]]
    """

    runs_before = ("PositionOffset",)

    def __init__(
        self,
        separator_id: int,
        positions_key: str = POSITION_IDS,
        labels_key: str = LABELS,
        padding_length_key: str = PADDING_LENGTH,
        media_key: str = MM_TOKEN_TYPE_IDS,
    ) -> None:
        super().__init__()
        self.separator_id = check_ignore_index(separator_id, owner="SeparatorLabels", name="separator_id")
        self.positions_key = check_key("SeparatorLabels", "positions_key", positions_key)
        self.labels_key = check_key("SeparatorLabels", "labels_key", labels_key)
        self.padding_length_key = check_key("SeparatorLabels", "padding_length_key", padding_length_key)
        self.media_key = check_key("SeparatorLabels", "media_key", media_key)
        self.in_keys = [positions_key, labels_key, padding_length_key]
        self.optional_keys = (media_key,)
        self.out_keys = [labels_key]

    def check(self, data: Mapping[str, torch.Tensor]) -> None:
        check_ignore_fits("SeparatorLabels", self.separator_id, self.labels_key, data[self.labels_key])

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        labels = data[self.labels_key]
        padding = trailing_mask(data[self.padding_length_key], labels.shape[1])
        starts = segment_starts(data[self.positions_key]) & padding.logical_not()
        media = data.get(self.media_key)
        if media is not None:
            starts = starts & (media == 0)
        return {self.labels_key: labels.masked_fill(starts, self.separator_id)}

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        labels = data[self.labels_key]
        padding = host.trailing(data[self.padding_length_key], labels.shape[1])
        starts = host.segment_starts(data[self.positions_key]) & ~padding
        media = data.get(self.media_key)
        if media is not None:
            starts &= media == 0
        return {self.labels_key: np.where(starts, labels.dtype.type(self.separator_id), labels)}
