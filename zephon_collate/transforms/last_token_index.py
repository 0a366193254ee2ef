"""LastTokenIndex: the place of each sequence's last token, where a reward model reads its score."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from zephon_collate.core.checks import check_int, check_key
from zephon_collate.core.keys import INPUT_IDS, LAST_TOKEN_INDEX, SEQUENCE_INDEX
from zephon_collate.functional import host, last_token_index
from zephon_collate.transforms._shapes import check_rank
from zephon_collate.transforms.base import Transform

__all__ = ["LastTokenIndex"]


class LastTokenIndex(Transform):
    """``[S]`` int64: each sequence's last token, as a place in the flattened ``input_ids`` (read back).

    Parameters:
        skip_id: an id not to read as a sequence's last token (a model's ``pad_token_id``), or ``None``.
        sequence_key: the ``[B, L]`` sequence numbers, -1 on padding (default ``"sequence_index"``).
        out_key: where to write the places (default ``"last_token_index"``).

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict(sequence_index=torch.tensor([[0, 0, 0], [1, 1, -1]]), batch_size=[2])
        >>> LastTokenIndex()(td)["last_token_index"].tolist()
        [2, 4]
    """

    data_dependent_shape = True

    def __init__(
        self, skip_id: int | None = None, sequence_key: str = SEQUENCE_INDEX, out_key: str = LAST_TOKEN_INDEX
    ) -> None:
        super().__init__()
        self.skip_id = None if skip_id is None else check_int("LastTokenIndex", "skip_id", skip_id, 0)
        self.sequence_key = check_key("LastTokenIndex", "sequence_key", sequence_key)
        self.out_key = check_key("LastTokenIndex", "out_key", out_key)
        self.in_keys = [sequence_key] if self.skip_id is None else [sequence_key, INPUT_IDS]
        self.out_keys = [out_key]

    def check(self, data: Mapping[str, torch.Tensor]) -> None:
        check_rank(
            "LastTokenIndex", self.sequence_key, data[self.sequence_key], "[B, L] sequence numbers", 2, 2
        )

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = data[INPUT_IDS] if self.skip_id is not None else None
        return {self.out_key: last_token_index(data[self.sequence_key], ids, self.skip_id)}

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = data[INPUT_IDS] if self.skip_id is not None else None
        return {self.out_key: host.last_token_index(data[self.sequence_key], ids, self.skip_id)}

    def output_batch_size(self, batch_size: torch.Size) -> torch.Size:
        return torch.Size([])  # one entry per sequence, not per row
