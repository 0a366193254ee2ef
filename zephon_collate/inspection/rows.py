"""Read a collated batch row by row (:func:`batch_rows`) and put what looks wrong into words."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from zephon_collate.core.keys import (
    ATTENTION_MASK,
    CU_SEQ_LENS_Q,
    CU_SEQLENS,
    INPUT_IDS,
    LABELS,
    LOSS_MASK,
    PADDING_MASK,
    POSITION_IDS,
    POSITIONS,
)
from zephon_collate.functional.segments import segment_starts
from zephon_collate.inspection.trees import is_tree_batch, tree_warnings
from zephon_collate.inspection.values import as_lists, as_rows, percent

__all__ = ["RowView", "batch_rows", "batch_warnings", "is_transformers_batch"]

_PADDING_WARN_FRACTION = 0.5


@dataclass(frozen=True)
class RowView:
    """One row of a batch, as plain Python lists (``None`` where the batch lacks the field).

    ``supervised[t]``: the label is not ``ignore_index`` (without labels: ``loss_mask`` is not 0);
    ``starts``: the segment starts, from ``cu_seqlens``, else where ``positions`` are 0.
    """

    index: int
    sample_id: Any
    input_ids: list[int]
    labels: list[int] | None
    supervised: list[bool] | None
    padding: list[bool]
    positions: list[int] | None
    position_starts: list[int] | None
    cu_starts: list[int] | None
    loss_mask: list[float] | None

    @property
    def starts(self) -> list[int]:
        """The segment starts drawn: ``cu_starts``, else ``position_starts``, else ``[0]``."""
        found = self.cu_starts if self.cu_starts is not None else self.position_starts
        return found if found is not None else ([0] if self.input_ids else [])

    @property
    def num_padding(self) -> int:
        return sum(self.padding)

    @property
    def num_supervised(self) -> int:
        return sum(self.supervised) if self.supervised is not None else 0


def _starts(positions: list[int]) -> list[int]:
    """Where segments start: the package's one rule (:func:`~zephon_collate.functional.segment_starts`)."""
    if not positions:
        return []
    starts = segment_starts(torch.tensor(positions, dtype=torch.int64))
    return [int(t) for t in starts.nonzero().reshape(-1)]


def _trailing_pad(tokens: list[int], pad_token_id: int) -> list[bool]:
    count = 0
    while count < len(tokens) and tokens[len(tokens) - 1 - count] == pad_token_id:
        count += 1
    return [False] * (len(tokens) - count) + [True] * count


def is_transformers_batch(batch: Mapping[str, Any]) -> bool:
    """True for a batch in Hugging Face's names (``attention_mask``, ``position_ids`` or
    ``cu_seq_lens_q``, and none of ``positions``, ``cu_seqlens``, ``padding_mask``)."""
    return any(key in batch for key in (ATTENTION_MASK, POSITION_IDS, CU_SEQ_LENS_Q)) and not any(
        key in batch for key in (POSITIONS, CU_SEQLENS, PADDING_MASK)
    )


def _page_view(batch: Mapping[str, Any], ignore_index: int) -> dict[str, Any]:
    """A Hugging Face batch in the page's names, each row's unshifted labels moved one to the left."""
    view = {key: value for key, value in batch.items() if key not in (LABELS, ATTENTION_MASK)}
    if POSITION_IDS in batch:  # a padding-free mRoPE batch's [4, 1, N]: plane 0 holds the text positions
        positions = batch[POSITION_IDS]
        view[POSITIONS] = positions[0] if np.ndim(positions) == 3 else positions
    if batch.get(CU_SEQ_LENS_Q) is not None:
        view[CU_SEQLENS] = batch[CU_SEQ_LENS_Q]
    if batch.get(ATTENTION_MASK) is not None:
        view[PADDING_MASK] = [
            [not value for value in row] for row in as_rows(batch[ATTENTION_MASK], ATTENTION_MASK)
        ]
    if batch.get(LABELS) is not None:
        view[LABELS] = [[*row[1:], ignore_index] if row else [] for row in as_rows(batch[LABELS], LABELS)]
    return view


def batch_rows(
    batch: Mapping[str, Any], *, ignore_index: int = -100, pad_token_id: int | None = None
) -> list[RowView]:
    """The rows of a collated ``batch`` as :class:`RowView` (a Hugging Face batch in its own names).

    Example:
        >>> hf = {"input_ids": [[5, 6, 7, 8, 9]], "labels": [[-100, 6, 7, -100, 9]],
        ...       "position_ids": [[0, 1, 2, 0, 1]]}
        >>> row = batch_rows(hf)[0]
        >>> row.labels, row.starts
        ([6, 7, -100, 9, -100], [0, 3])
    """
    if INPUT_IDS not in batch:
        raise KeyError(f"inspect_batch: the batch has no 'input_ids' (its keys: {sorted(batch)})")
    if is_transformers_batch(batch):
        batch = _page_view(batch, ignore_index)
    tokens = as_rows(batch[INPUT_IDS], INPUT_IDS)
    fields: dict[str, list[list[Any]]] = {}
    for name in (LABELS, LOSS_MASK, POSITIONS, PADDING_MASK):
        if name in batch and batch[name] is not None:
            fields[name] = as_rows(batch[name], name, tokens)
    cu_rows = as_rows(batch[CU_SEQLENS], CU_SEQLENS) if batch.get(CU_SEQLENS) is not None else None
    if cu_rows is not None and any(isinstance(value, list) for row in cu_rows for value in row):
        raise ValueError(
            f"inspect_batch: field 'cu_seqlens' must hold [B, K] or [K] boundaries, got rows of lists "
            f"({str(cu_rows[0])[:60]}); give the batch as the collator returned it"
        )
    ids = list(batch.get("ids") or [])
    rows = []
    for index, row in enumerate(tokens):
        labels = fields.get(LABELS, [None] * len(tokens))[index]
        loss_mask = fields.get(LOSS_MASK, [None] * len(tokens))[index]
        if labels is not None:
            supervised = [label != ignore_index for label in labels]
        elif loss_mask is not None:
            supervised = [bool(value) for value in loss_mask]
        else:
            supervised = None
        if PADDING_MASK in fields:
            padding = [bool(value) for value in fields[PADDING_MASK][index]]
        elif pad_token_id is not None:
            padding = _trailing_pad(row, pad_token_id)
        else:
            padding = [False] * len(row)
        positions = fields.get(POSITIONS, [None] * len(tokens))[index]
        position_starts = None if positions is None else _starts(positions)
        cu_starts = None
        if cu_rows is not None and index < len(cu_rows):
            cu_starts = sorted({int(v) for v in cu_rows[index] if int(v) < len(row)})
        rows.append(
            RowView(
                index,
                tuple(ids[index]) if index < len(ids) and ids[index] is not None else None,
                [int(t) for t in row],
                None if labels is None else [int(label) for label in labels],
                supervised,
                padding,
                None if positions is None else [int(p) for p in positions],
                position_starts,
                cu_starts,
                None if loss_mask is None else [float(v) for v in loss_mask],
            )
        )
    return rows


def _flat_row_ends(batch: Mapping[str, Any]) -> frozenset[int]:
    """Where a flattened batch's records meet (``[B * S]`` tokens of ``B`` records), else nothing."""
    tokens, ids = batch.get(INPUT_IDS), batch.get("ids")
    if tokens is None or not isinstance(ids, (list, tuple)) or len(ids) < 2:
        return frozenset()
    flat = as_lists(tokens)
    if not isinstance(flat, list) or not flat or isinstance(flat[0], list) or len(flat) % len(ids):
        return frozenset()
    width = len(flat) // len(ids)
    return frozenset(range(width, len(flat), width))


def _row_warnings(row: RowView, padding_fraction: float, row_ends: frozenset[int] = frozenset()) -> list[str]:
    where = f"row {row.index}"
    found = []
    length = len(row.input_ids)
    if row.supervised is not None and length and not any(row.supervised):
        found.append(
            f"{where}: no supervised token: its loss mask is all zero (every label is ignored), "
            "so it adds nothing to the loss; check the chat template's assistant mask"
        )
    if length and row.num_padding / length > padding_fraction:
        found.append(
            f"{where}: {row.num_padding} of {length} tokens ({percent(row.num_padding, length)}) are "
            "padding: pack more documents per row, or shorten seq_len"
        )
    if row.position_starts is not None and row.cu_starts is not None and row.position_starts != row.cu_starts:
        found.append(
            f"{where}: positions restart at 0 at tokens {row.position_starts} but cu_seqlens starts segments "
            f"at {row.cu_starts}: the model's positions and its attention boundaries disagree "
            "(position_mode='sequence' does this on purpose)"
        )
    if row.positions is not None:
        jumps = [t for t in range(1, length) if row.positions[t] not in (0, row.positions[t - 1] + 1)]
        if jumps:
            t = jumps[0]
            found.append(
                f"{where}: positions do not count up by one inside a segment at {len(jumps)} tokens "
                f"(first: token {t}, {row.positions[t - 1]} -> {row.positions[t]})"
            )
    if row.supervised is not None:
        # A label on padding, or one predicting padding (the next token is padding), trains on padding.
        targets = [*row.padding[1:], False]
        padded = sum(s and (p or q) for s, p, q in zip(row.supervised, row.padding, targets, strict=True))
        if padded:
            found.append(f"{where}: {padded} padding tokens have supervised labels; they train on padding")
        if row.labels is not None:
            # A label that is the next segment's first token; where a flattened batch's records meet,
            # the label is the record's own next token, cut off: no crossing.
            labels, tokens, supervised = row.labels, row.input_ids, row.supervised
            crossing = [
                t
                for t in row.starts
                if t > 0 and t not in row_ends and supervised[t - 1] and labels[t - 1] == tokens[t]
            ]
            if crossing:
                t = crossing[0]
                found.append(
                    f"{where}: {len(crossing)} supervised labels cross a segment boundary (first: token "
                    f"{t - 1} -> {t}): a segment's last token is trained to predict the next segment's "
                    "first token, which document-restricted attention cannot see; mask these labels "
                    "with Collator(boundary_safe_labels=True) (the default; the BoundaryMask transform), "
                    "or eos_mask_loss=True with documents that end in EOS"
                )
    if row.labels is not None and row.loss_mask is not None and row.supervised is not None:
        disagree = sum(bool(m) != s for m, s in zip(row.loss_mask, row.supervised, strict=True))
        if disagree:
            found.append(
                f"{where}: loss_mask and labels disagree at {disagree} tokens "
                "(loss_mask should be 1 exactly where the label is not ignore_index)"
            )
    return found


def batch_warnings(
    batch: Mapping[str, Any] | Sequence[RowView],
    *,
    ignore_index: int = -100,
    pad_token_id: int | None = None,
    padding_fraction: float = _PADDING_WARN_FRACTION,
) -> list[str]:
    """What looks wrong in a collated batch (or its rows), in words; a tree batch gets ``tree_warnings``.

    Example:
        >>> batch = {"input_ids": [[5, 0, 0, 0]], "labels": [[-100, -100, -100, -100]],
        ...          "padding_mask": [[False, True, True, True]]}
        >>> for warning in batch_warnings(batch):
        ...     print(warning)
        batch: no supervised token in any row: the loss is empty (NaN or 0); check the loss mask
        row 0: 3 of 4 tokens (75%) are padding: pack more documents per row, or shorten seq_len
    """
    if isinstance(batch, Mapping) and is_tree_batch(batch):
        return tree_warnings(batch, ignore_index=ignore_index, padding_fraction=padding_fraction)
    rows = (
        list(batch)
        if isinstance(batch, Sequence) and not isinstance(batch, Mapping)
        else batch_rows(batch, ignore_index=ignore_index, pad_token_id=pad_token_id)
    )
    found = []
    none_supervised = bool(rows) and all(r.supervised is not None and not any(r.supervised) for r in rows)
    if none_supervised:
        found.append(
            "batch: no supervised token in any row: the loss is empty (NaN or 0); check the loss mask"
        )
    row_ends = _flat_row_ends(batch) if isinstance(batch, Mapping) else frozenset()
    for row in rows:
        for warning in _row_warnings(row, padding_fraction, row_ends):
            if none_supervised and "no supervised token" in warning:
                continue
            found.append(warning)
    return found
