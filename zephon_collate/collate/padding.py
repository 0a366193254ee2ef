"""RowPadding: ragged rows padded on the right to one length, recorded as each record's trailing padding.

Unpacked SFT examples come in different lengths. The Collator (``pad_token_id=``)
pads each row's fields on the right to the longest row, rounded up to
``pad_to_multiple_of``, and adds the pad count to the record's padding length:
``labels``, ``padding_mask``, ``cu_seqlens`` and ``num_valid_tokens`` then treat it
exactly as the reference page's trailing padding. Token ids are padded with
``pad_token_id``, positions restart at 0 (the padding is a segment of its own,
as :func:`~zephon_collate.pack_flat` writes it), every other field with 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from zephon_collate.checks import check_int
from zephon_collate.keys import INPUT_IDS, POSITIONS
from zephon_collate.read import Columns, Row

__all__ = ["RowPadding"]


def _pad(row: Row, count: int, fill: int, restart: bool) -> Row:
    """``row`` with ``count`` entries appended along its first dim: ``fill``, or 0, 1, ... (``restart``)."""
    if isinstance(row, torch.Tensor):
        tail = (
            torch.arange(count, dtype=row.dtype, device=row.device)
            if restart
            else torch.full((count, *row.shape[1:]), fill, dtype=row.dtype, device=row.device)
        )
        return torch.cat([row, tail])
    tail = np.arange(count, dtype=row.dtype) if restart else np.full((count, *row.shape[1:]), fill, row.dtype)
    return np.concatenate([row, tail])


@dataclass(frozen=True)
class RowPadding:
    """Pad ragged rows on the right; see the module doc.

    Parameters:
        pad_token_id: the token id of padding (an int >= 0).
        multiple: round the padded length up to a multiple of this (an int >= 1), or ``None``.

    Example:
        >>> from zephon_collate import Collator
        >>> collate = Collator(pad_token_id=0, pad_to_multiple_of=4, return_labels=True)
        >>> out = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
        >>> out["input_ids"].tolist(), out["labels"].tolist()
        ([[5, 6, 7], [8, 9, 0]], [[6, 7, -100], [9, -100, -100]])
    """

    pad_token_id: int
    multiple: int | None = None

    @classmethod
    def create(cls, pad_token_id: object, multiple: object, owner: str = "Collator") -> RowPadding | None:
        """The padding ``owner``'s ``pad_token_id`` / ``pad_to_multiple_of`` ask for, checked."""
        if pad_token_id is None:
            if multiple is not None:
                raise ValueError(f"{owner}: pad_to_multiple_of needs pad_token_id, the id to pad with")
            return None
        token = check_int(owner, "pad_token_id", pad_token_id, 0)
        step = None if multiple is None else check_int(owner, "pad_to_multiple_of", multiple, 1)
        return cls(token, step)

    def length(self, longest: int) -> int:
        """The padded row length: ``longest``, rounded up to a multiple of ``multiple``."""
        return longest if self.multiple is None else -(-longest // self.multiple) * self.multiple

    def apply(self, columns: Columns) -> None:
        """Pad every field of ``columns`` in place (its rows are this call's own) and count the padding."""
        lengths = columns.lengths()
        if not lengths:
            return
        target = self.length(max(lengths))
        added = [target - length for length in lengths]
        for name, rows in columns.rows.items():
            fill = self.pad_token_id if name == INPUT_IDS else 0
            columns.rows[name] = [
                _pad(row, count, fill, restart=name == POSITIONS) if count and row.ndim else row
                for row, count in zip(rows, added, strict=True)
            ]
        columns.padding_lengths = [
            (0 if before is None else before) + count if count or before is not None else None
            for before, count in zip(columns.padding_lengths, added, strict=True)
        ]
