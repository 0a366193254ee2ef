"""SegmentIds: which packed document each token belongs to, from segment-restarting positions."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from zephon_collate.core.checks import check_key
from zephon_collate.core.keys import PADDING_LENGTH, POSITIONS, SEGMENT_IDS
from zephon_collate.core.text import shown
from zephon_collate.functional import host
from zephon_collate.functional.labels import padding_from_length
from zephon_collate.functional.segments import (
    PADDING_SEGMENT,
    flatten_segment_ids,
    segment_ids_from_positions,
)
from zephon_collate.transforms.base import Transform

__all__ = ["SegmentIds"]


class SegmentIds(Transform):
    """Per-token segment ids: ``cumsum(positions == 0) - 1`` in each row, int32.

    A segment starts wherever ``positions`` is zero (and at the first token of
    a row); each row numbers its segments ``0, 1, ...`` (``[B, S]``). With
    ``flatten=True`` the ids are numbered across the batch instead, ``[B * S]``
    (row ``b``'s ids offset by the segments of the rows before it): the
    ``seq_idx`` that Mamba-style kernels take (as ``[1, B * S]``), and what
    :func:`~zephon_collate.functional.attention.document_block_mask` needs for a
    flattened ``[1, B * S]`` layout; the output TensorDict then has
    ``batch_size=[]``, as :class:`CuSeqlens` does when flattening.

    **Padding.** With ``mark_padding=True`` the last ``padding_length[b]``
    tokens of row ``b`` get segment id **-1**, so no kernel treats padding as a
    document (the masks of :mod:`zephon_collate.functional.attention` let a -1 token
    attend to itself only, and no token attend to it). Unmarked, the padding
    written by ``pack_flat`` is a segment of its own, which also keeps it out
    of every document. ``padding_length`` counts the row as packed: after
    :class:`TokenShift` has cut the positions to the inputs, pass
    ``shifted=True`` (the cut removed one padding token). Flattened with marked
    padding, the real documents are numbered ``0 .. D-1`` across the batch.

    Positions must be those of the payload (segment-restarting); place this
    before ``Positions("sequence")``. The segments are those of
    :class:`CuSeqlens` (see :func:`~zephon_collate.functional.attention.check_consistent`).

    Parameters:
        positions_key: the ``[B, S]`` positions (default ``"positions"``).
        flatten: number the segments across the batch, ``[B * S]``.
        mark_padding: give trailing padding the id -1 (reads ``padding_length_key``).
        padding_length_key: the ``[B]`` trailing pad counts (default ``"padding_length"``).
        shifted: the positions were cut ``[:, :-1]`` after ``padding_length`` was counted.
        out_key: where to write the ids (default ``"segment_ids"``).

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict(
        ...     positions=torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]),
        ...     padding_length=torch.tensor([1, 0]),
        ...     batch_size=[2],
        ... )
        >>> SegmentIds()(td)["segment_ids"].tolist()
        [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 1, 1]]
        >>> SegmentIds(mark_padding=True)(td)["segment_ids"].tolist()
        [[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, 1, 1]]
        >>> SegmentIds(flatten=True, mark_padding=True)(td)["segment_ids"].tolist()
        [0, 0, 0, 1, 1, -1, 2, 2, 2, 2, 3, 3]
    """

    def __init__(
        self,
        positions_key: str = POSITIONS,
        flatten: bool = False,
        mark_padding: bool = False,
        padding_length_key: str = PADDING_LENGTH,
        shifted: bool = False,
        out_key: str = SEGMENT_IDS,
    ) -> None:
        super().__init__()
        for name, value in (("flatten", flatten), ("mark_padding", mark_padding), ("shifted", shifted)):
            if not isinstance(value, bool):
                raise TypeError(f"SegmentIds: {name} must be a bool, got {shown(value)}")
        self.positions_key = check_key("SegmentIds", "positions_key", positions_key)
        self.padding_length_key = check_key("SegmentIds", "padding_length_key", padding_length_key)
        self.out_key = check_key("SegmentIds", "out_key", out_key)
        self.flatten = flatten
        self.mark_padding = mark_padding
        self.shifted = shifted
        self.in_keys = [positions_key, padding_length_key] if mark_padding else [positions_key]
        self.out_keys = [out_key]

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        positions = data[self.positions_key]
        padding = None
        if self.mark_padding:
            padding = padding_from_length(data[self.padding_length_key], positions.shape[1], self.shifted)
        ids = segment_ids_from_positions(positions, padding)
        return {self.out_key: flatten_segment_ids(ids) if self.flatten else ids}

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        positions = data[self.positions_key]
        starts = host.segment_starts(positions)
        if self.mark_padding:
            counts = data[self.padding_length_key].astype(np.int64)
            padding = host.trailing(np.maximum(counts - 1, 0) if self.shifted else counts, positions.shape[1])
            ids = np.where(padding, np.int32(PADDING_SEGMENT), host.segment_ids(starts & ~padding))
        else:
            ids = host.segment_ids(starts)
        if not self.flatten:
            return {self.out_key: ids}
        counts = np.maximum(ids.max(axis=1, initial=-1), -1).astype(np.int64) + 1
        offsets = np.cumsum(counts) - counts
        flat = np.where(ids >= 0, ids + offsets[:, None], ids)
        return {self.out_key: flat.reshape(-1).astype(np.int32)}

    def output_batch_size(self, batch_size: torch.Size) -> torch.Size:
        return torch.Size([]) if self.flatten else batch_size
