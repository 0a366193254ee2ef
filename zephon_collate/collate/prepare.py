"""Records to checked, stacked tensors: read the fields the options use, stack them once, check values.

:func:`read_batch` then :func:`stack` are the first half of every collate
call (``to_training``, ``Collator.__call__`` and ``Collator.stack``): they
raise every data error, naming the record and the field, before any output
is built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import torch

from zephon_collate.checks import warn_user
from zephon_collate.collate.options import TrainingOptions
from zephon_collate.collate.padding import RowPadding
from zephon_collate.collate.stack import check_padding_lengths, stack_columns
from zephon_collate.functional.segments import segment_starts
from zephon_collate.functional.values import any_outside_zero_one, first_nonzero, first_true_row, smallest
from zephon_collate.keys import (
    ASSISTANT_MASK,
    ASSISTANT_MASKS,
    ATTENTION_MASK,
    COMPLETION_MASK,
    INPUT_IDS,
    INT32_MAX,
    LABELS,
    LOSS_MASK,
    POSITIONS,
)
from zephon_collate.read import Columns, RecordName, as_numpy, describe, read_columns, to_row
from zephon_collate.records import SampleRecord
from zephon_collate.text import shown

__all__ = ["check_values", "read_batch", "segment_counts", "stack"]


def read_batch(
    records: Sequence[SampleRecord],
    options: TrainingOptions,
    padding: RowPadding | None = None,
    boundary_safe: bool = False,
    *,
    unused: Literal["raise", "warn"] = "warn",
) -> Columns:
    """Read the fields ``options`` uses from the payloads, with the checks that need no stacking.

    With ``padding`` (the Collator's ``pad_token_id``), ragged rows are padded on the right;
    ``boundary_safe`` (its ``boundary_safe_labels``) reads the positions whenever labels are made.
    A supervising field the call does not apply (:func:`unused_supervision`) is refused
    (``unused="raise"``, the Collator) or, when labels are made, warned about once
    (``"warn"``, ``to_training``, which returns the reference page's result).
    """
    optional = [LOSS_MASK]
    if options.reads_positions or (boundary_safe and options.return_labels):
        optional.append(POSITIONS)
    required = list(options.data_fields)
    required += [name for name in (POSITIONS, LOSS_MASK) if name in options.extra_fields]
    if options.return_cu_seqlens and POSITIONS not in required:
        required.append(POSITIONS)
    must_align = options.return_labels or options.flatten
    aligned = [POSITIONS, LOSS_MASK, *(options.data_fields if must_align else ())]
    columns = read_columns(
        records, tokens_field=options.tokens_field, optional=optional, required=required, aligned=aligned
    )
    if unused == "raise" or options.return_labels:
        problem = unused_supervision(columns)
        if problem is not None and unused == "raise":
            raise ValueError(problem)
        if problem is not None:
            warn_user(
                f"to_training: {problem}; the labels are made from the tokens as the reference page says"
            )
    if padding is not None:
        padding.apply(columns)
    if not options.needs_padding_lengths:
        columns.padding_lengths = [None] * len(records)
    return columns


SUPERVISING_FIELDS = (ATTENTION_MASK, LABELS, ASSISTANT_MASKS, ASSISTANT_MASK, COMPLETION_MASK)
"""Payload fields that say what is trained (Hugging Face and TRL names); the native path reads none."""


def unused_supervision(columns: Columns) -> str | None:
    """What is wrong with the first payload field that would change what gets supervised but is not read.

    An ``attention_mask`` with zeros (Hugging Face's padding), ``labels`` that
    differ from the tokens (``-100`` on a prompt), or ``assistant_masks`` /
    ``assistant_mask`` / ``completion_mask`` with zeros (a chat template's, TRL's)
    would be silently dropped: the padding or the prompt trained on. Harmless
    copies (an all-ones mask, labels equal to the tokens, a mask equal to the
    ``loss_mask``) pass; a field listed in ``extra_fields`` is read, so used.
    Returns ``None`` when nothing is wrong, else the message (naming the record,
    the field and the fix).
    """
    for index, record in enumerate(columns.records):
        payload = record.payload
        if not isinstance(payload, Mapping):
            continue
        for name in SUPERVISING_FIELDS:
            if name not in payload or name in columns.rows or name == columns.tokens_field:
                continue
            where = RecordName(columns.records, index)
            values = as_numpy(to_row(payload[name], where, name, "values"))
            tokens = as_numpy(columns.rows[INPUT_IDS][index])
            if name == ATTENTION_MASK and not (values == 1).all():
                return (
                    f"{where}: payload has an 'attention_mask' with zeros, which is not applied here: those "
                    "tokens would be trained on as real ones. For Hugging Face examples use "
                    "Collator.for_transformers(...); else give padding as meta.padding_length (pack_flat "
                    "writes it) or pad with Collator(pad_token_id=...) and drop the mask"
                )
            if name in (ASSISTANT_MASKS, ASSISTANT_MASK, COMPLETION_MASK) and not (values == 1).all():
                loss_mask = columns.rows.get(LOSS_MASK)
                if loss_mask is None or not np.array_equal(as_numpy(loss_mask[index]), values):
                    return (
                        f"{where}: payload has {shown(name)} with zeros, which are not read here: the "
                        "prompt would be trained on. For Hugging Face examples use "
                        "Collator.for_transformers(...); else give them as the loss_mask "
                        f"(loss_mask = {name})"
                    )
            if name == LABELS and (values.shape != tokens.shape or not (values == tokens).all()):
                return (
                    f"{where}: payload has 'labels' that differ from its tokens (e.g. -100 on a prompt), "
                    "which are not read here: labels are made from the tokens. For Hugging Face examples "
                    "use Collator.for_transformers(...); else give the supervision as a loss_mask "
                    "(loss_mask = labels != -100) and drop 'labels'"
                )
    return None


def check_values(data: Mapping[str, torch.Tensor], columns: Columns, options: TrainingOptions) -> None:
    """Data errors that need the values: negative ids, non-0/1 supervision masks, cu_seqlens positions."""
    records = columns.records
    tokens = data[INPUT_IDS]
    if tokens.numel() and smallest(tokens) < 0:
        index = first_true_row(tokens < 0)
        raise ValueError(f"{describe(records, index)}: token ids must be >= 0, found a negative id")
    if options.return_labels and LOSS_MASK in data:
        mask = data[LOSS_MASK]
        if mask.dtype != torch.bool and mask.numel() and any_outside_zero_one(mask):
            raise ValueError(
                f"{describe(records, first_true_row((mask != 0) & (mask != 1)))}: field 'loss_mask' must "
                "hold only 0 and 1 (or booleans): 1 for supervised tokens, 0 for the rest"
            )
    if options.return_padding_mask and options.output.kind != "list" and tokens.dim() != 2:
        raise ValueError(
            f"to_training: return_padding_mask needs 2-D scalar token rows for tensor/array output, "
            f"got tokens of shape {tuple(tokens.shape)}"
        )
    if options.eos_mask_loss and tokens.dim() != 2:
        raise ValueError(
            f"to_training: eos_mask_loss needs scalar token rows ([B, S]), got shape {tuple(tokens.shape)}"
        )
    if options.return_cu_seqlens:
        _check_boundary_positions(data[POSITIONS], columns, options)


def _check_boundary_positions(positions: torch.Tensor, columns: Columns, options: TrainingOptions) -> None:
    if positions.dim() != 2:
        raise ValueError(
            f"to_training: return_cu_seqlens needs one position per token ([B, S]), got shape "
            f"{tuple(positions.shape)}"
        )
    rows, length = positions.shape
    input_length = length - 1 if options.return_labels and length else length
    if rows * input_length > INT32_MAX:
        raise ValueError(
            f"to_training: {rows} x {input_length} input tokens overflow the int32 cu_seqlens; "
            "use smaller batches"
        )
    if not input_length:
        return
    index = first_nonzero(positions[:, 0])
    if index is not None:
        raise ValueError(
            f"{describe(columns.records, index)}: positions must start at zero in every row to derive "
            f"cu_seqlens, but this row starts at {int(positions[index, 0])}"
        )


def stack(columns: Columns, options: TrainingOptions) -> dict[str, torch.Tensor]:
    """The stacked tensors the plan runs on, value-checked."""
    padding = check_padding_lengths(columns) if options.needs_padding_lengths else None
    keep = (LOSS_MASK,) if options.return_labels else ()
    data = stack_columns(columns, options.output.torch_dtype, padding_lengths=padding, keep_dtype=keep)
    check_values(data, columns, options)
    return data


def segment_counts(positions: torch.Tensor) -> torch.Tensor:
    """Boundaries each ``[B, S]`` row needs: its segment starts, then its end."""
    return segment_starts(positions).sum(dim=1) + 1
