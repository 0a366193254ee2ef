"""SequenceMap: a padding-free row's sequence map, for the loss helpers that score sequence by sequence."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from zephon_collate.core.checks import check_key
from zephon_collate.core.keys import (
    EXAMPLE_LENGTHS,
    LOGITS_INDEX,
    NUM_SEQUENCES,
    PADDING_LENGTH,
    POSITIONS,
    SEQUENCE_INDEX,
)
from zephon_collate.functional import host, sequence_map
from zephon_collate.transforms._shapes import check_rank
from zephon_collate.transforms.base import Transform

__all__ = ["SequenceMap"]


class SequenceMap(Transform):
    """One padding-free row's ``logits_index``, ``sequence_index`` (``[1, S]``, -1 on padding) and
    ``num_sequences`` (0-d), from its positions and example lengths (consumed).

    Parameters:
        positions_key: the ``[1, S]`` segment-restarting positions (default ``"positions"``).
        padding_length_key: the row's trailing padding ``[1]`` (default ``"padding_length"``).
        lengths_key: the ``[1, E]`` examples' token counts (default ``"example_lengths"``).

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict(positions=torch.tensor([[0, 1, 0, 1]]), padding_length=torch.tensor([0]),
        ...                 example_lengths=torch.tensor([[2, 0, 2]]), batch_size=[1])
        >>> out = SequenceMap()(td)
        >>> out["logits_index"].tolist(), out["sequence_index"].tolist(), int(out["num_sequences"])
        ([[-1, 0, -1, 2]], [[0, 0, 2, 2]], 3)
    """

    runs_before = ("PositionOffset",)

    def __init__(
        self,
        positions_key: str = POSITIONS,
        padding_length_key: str = PADDING_LENGTH,
        lengths_key: str = EXAMPLE_LENGTHS,
    ) -> None:
        super().__init__()
        self.positions_key = check_key("SequenceMap", "positions_key", positions_key)
        self.padding_length_key = check_key("SequenceMap", "padding_length_key", padding_length_key)
        self.lengths_key = check_key("SequenceMap", "lengths_key", lengths_key)
        self.in_keys = [positions_key, padding_length_key, lengths_key]
        self.out_keys = [LOGITS_INDEX, SEQUENCE_INDEX, NUM_SEQUENCES]
        self.dropped_keys = (lengths_key,)

    def check(self, data: Mapping[str, torch.Tensor]) -> None:
        check_rank("SequenceMap", self.positions_key, data[self.positions_key], "[1, S] positions", 2, 2)
        check_rank("SequenceMap", self.lengths_key, data[self.lengths_key], "[1, E] example lengths", 2, 2)
        if data[self.positions_key].shape[0] != 1:
            raise ValueError(
                f"SequenceMap: {self.positions_key!r} has {data[self.positions_key].shape[0]} rows; the "
                "sequence map describes one padding-free row"
            )

    def output_batch_size(self, batch_size: torch.Size) -> torch.Size:
        return torch.Size([])  # num_sequences is 0-d

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        args = (data[self.positions_key], data[self.padding_length_key], data[self.lengths_key])
        return dict(zip(self.out_keys, sequence_map(*args), strict=True))

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        args = (data[self.positions_key], data[self.padding_length_key], data[self.lengths_key])
        return dict(zip(self.out_keys, host.sequence_map(*args), strict=True))
