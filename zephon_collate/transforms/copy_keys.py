"""CopyKeys: outputs that hold the same values as others, in tensors of their own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from zephon_collate.core.checks import check_key
from zephon_collate.transforms.base import Transform

__all__ = ["CopyKeys"]


class CopyKeys(Transform):
    """Write each ``source`` again under ``target``, as a copy (never the same storage).

    Parameters:
        copies: ``{source: target}``.

    Example:
        >>> from tensordict import TensorDict
        >>> out = CopyKeys({"q": "k"})(TensorDict(q=torch.tensor([0, 3, 5]), batch_size=[]))
        >>> out["k"].tolist(), out["k"].data_ptr() != out["q"].data_ptr()
        ([0, 3, 5], True)
    """

    def __init__(self, copies: Mapping[str, str]) -> None:
        super().__init__()
        self.copies = {
            check_key("CopyKeys", "source", s): check_key("CopyKeys", "target", t) for s, t in copies.items()
        }
        self.in_keys, self.out_keys = list(self.copies), list(self.copies.values())

    def empty_outputs(self, earlier: Mapping[str, Any]) -> dict[str, Any]:
        return {target: earlier[source] for source, target in self.copies.items() if source in earlier}

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {target: data[source].clone() for source, target in self.copies.items()}

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {target: data[source].copy() for source, target in self.copies.items()}
