"""Rows to TensorDict: stack a batch's checked rows once.

:func:`stack_batch` reads and checks the payloads (:mod:`zephon_collate.read`),
checks each ``meta.padding_length``, and stacks every field into one tensor on
the payloads' device. Nothing here writes into a payload: stacking copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from zephon_collate.checks import check_field_names
from zephon_collate.keys import INPUT_IDS, PADDING_LENGTH
from zephon_collate.read import Columns, as_record_tuple, describe, read_columns
from zephon_collate.text import shown

__all__ = ["stack_batch", "stack_columns"]

CPU = torch.device("cpu")


def check_padding_lengths(columns: Columns) -> list[int]:
    """Each record's trailing pad count (0 where unset), checked against its token row."""
    counts = []
    for index, (count, length) in enumerate(zip(columns.padding_lengths, columns.lengths(), strict=True)):
        if count is None:
            count = 0
        if not isinstance(count, (int, np.integer)) or isinstance(count, bool) or not 0 <= count <= length:
            raise ValueError(
                f"{describe(columns.records, index)}: meta.padding_length is {shown(count)} but must be an "
                "int "
                f"from 0 to the token row's length {length}"
            )
        counts.append(int(count))
    return counts


def _common_device(columns: Columns) -> torch.device:
    """The device of the token rows; any row elsewhere raises ``ValueError``."""
    if all(not isinstance(row, torch.Tensor) or row.is_cpu for rows in columns.rows.values() for row in rows):
        return CPU
    device = None
    for name, rows in columns.rows.items():
        for index, row in enumerate(rows):
            here = row.device if isinstance(row, torch.Tensor) else torch.device("cpu")
            if device is None:
                device = here
            elif here != device:
                raise ValueError(
                    f"{describe(columns.records, index)}: field {shown(name)} is on {here} while record 0's "
                    f"tokens are on {device}; put all payload data on one device"
                )
    if device is not None and device.type == "meta":
        raise ValueError(
            "the payload tensors are on the 'meta' device, which holds no data; give tensors with data "
            "(on the CPU or an accelerator)"
        )
    return device or CPU


def _check_cast(stacked: torch.Tensor, dtype: torch.dtype, name: str, columns: Columns) -> None:
    """``ValueError`` naming the first record whose values ``dtype`` cannot represent exactly."""
    source = stacked.dtype
    if source == dtype or source == torch.bool or stacked.numel() == 0:
        return
    info = torch.iinfo(dtype)  # -2**(n-1) and 2**(n-1) are exact in every float dtype
    if source.is_floating_point:
        for bad, problem in (
            (~torch.isfinite(stacked) | (stacked != stacked.round()), "non-integral or non-finite values"),
            ((stacked < info.min) | (stacked >= info.max + 1), f"values outside the {dtype} range"),
        ):
            _raise_for_first_bad_row(bad, problem, dtype, name, columns)
        return
    if torch.iinfo(source).bits < info.bits and torch.iinfo(source).min < 0:
        return
    if source == torch.uint8 and info.bits > 8:
        return
    outside = (stacked < info.min) | (stacked > info.max)
    _raise_for_first_bad_row(outside, f"values outside the {dtype} range", dtype, name, columns)


def _raise_for_first_bad_row(
    bad: torch.Tensor, problem: str, dtype: torch.dtype, name: str, columns: Columns
) -> None:
    bad_rows = bad.reshape(len(bad), -1).any(1)
    if bool(bad_rows.any()):
        index = int(bad_rows.nonzero()[0, 0])
        raise ValueError(
            f"{describe(columns.records, index)}: field {shown(name)} holds {problem}, which {dtype} cannot "
            "represent exactly; fix the data or pick a wider dtype"
        )


def stack_rows(columns: Columns, name: str, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """Stack one field's rows into a ``[B, ...]`` tensor of ``dtype`` (``None``: keep the rows' dtype)."""
    rows = columns.rows[name]
    if not rows:  # an empty batch
        return torch.empty((0, 0), dtype=dtype or torch.long, device=device)
    first = tuple(rows[0].shape)
    for index, row in enumerate(rows):
        if row.shape != first:
            what = "token rows" if name == INPUT_IDS else f"rows of field {shown(name)}"
            raise ValueError(
                f"cannot stack {what} of unequal shape into a tensor: record 0 has shape {first}, "
                f"{describe(columns.records, index)} has {tuple(row.shape)}; pad them "
                "(Collator(pad_token_id=...)) or pack them (pack_flat), or pass dtype=None for lists"
            )
    if all(type(row) is torch.Tensor for row in rows):  # already on `device` (_common_device)
        stacked = torch.stack(rows)  # type: ignore[arg-type]
    elif all(isinstance(row, np.ndarray) for row in rows):
        stacked = torch.from_numpy(np.stack(rows)).to(device)  # type: ignore[arg-type]
    else:
        tensors = [row if isinstance(row, torch.Tensor) else torch.tensor(row) for row in rows]
        stacked = torch.stack([t.to(device) for t in tensors])
    if dtype is None:
        return stacked
    if stacked.dtype == dtype:
        return stacked
    _check_cast(stacked, dtype, name, columns)
    return stacked.to(dtype)


def stack_columns(
    columns: Columns,
    dtype: torch.dtype,
    *,
    padding_lengths: list[int] | None = None,
    keep_dtype: Sequence[str] = (),
) -> dict[str, torch.Tensor]:
    """Stack every field of ``columns`` into ``[B, ...]`` tensors on the payloads' device.

    Fields are cast to ``dtype`` except those in ``keep_dtype``; ``padding_lengths``,
    when given, becomes a ``[B]`` int64 ``"padding_length"`` entry.
    """
    device = _common_device(columns)
    data = {
        name: stack_rows(columns, name, None if name in keep_dtype else dtype, device)
        for name in columns.rows
    }
    if padding_lengths is not None:
        counts = torch.from_numpy(np.array(padding_lengths, dtype=np.int64))  # 6x faster than torch.tensor
        data[PADDING_LENGTH] = counts if device.type == "cpu" else counts.to(device)
    return data


def stack_batch(
    batch: Any,
    *,
    tokens_field: str = "auto",
    extra_fields: Sequence[str] = (),
    dtype: torch.dtype = torch.long,
    pin_memory: bool = False,
) -> TensorDict:
    """Stack a batch's payloads into a ``TensorDict`` with ``batch_size=[B]``.

    The token field is stored as ``"input_ids"`` (``[B, S]``, or ``[B, S, ...]``
    for non-scalar tokens); ``"positions"`` and ``"loss_mask"`` are included when
    every payload has them, each listed extra field always; all in ``dtype``.
    ``"padding_length"`` (``[B]`` int64) holds each record's ``meta.padding_length``,
    0 where unset. This is the input of the transform chain.

    Parameters:
        batch: a :class:`~zephon_collate.SampleBatch` or a sequence of records.
        tokens_field: the token field, or ``"auto"`` (input_ids, tokens, token_ids, ids).
        extra_fields: further per-record fields to stack.
        dtype: integer dtype for every stacked field.
        pin_memory: pin the stacked CPU tensors (for ``non_blocking`` copies to CUDA).

    An empty batch gives ``batch_size=[0]``, ``"input_ids"`` and each listed
    extra field of shape ``[0, 0]``.

    Raises:
        TypeError: for an argument of the wrong type, a batch that is not records, a
            payload that is neither a dict nor an array, or values of a wrong type.
        ValueError: for a ``dtype`` that is not a signed integer dtype, ``pin_memory``
            without an accelerator, a sentinel record, a missing or partial field,
            unequal row lengths, a bad ``meta.padding_length``, or values ``dtype``
            cannot hold.

    Example:
        >>> from zephon_collate import SampleBatch, SampleMeta, SampleRecord
        >>> meta = SampleMeta((0, 0, 0), 0, 0, tags={"_padding_length": 1})
        >>> batch = SampleBatch([SampleRecord(meta, {"input_ids": [5, 6, 0], "positions": [0, 1, 0]})])
        >>> td = batch.to_tensordict()
        >>> sorted(td.keys()), td["input_ids"].tolist(), td["padding_length"].tolist()
        (['input_ids', 'padding_length', 'positions'], [[5, 6, 0]], [1])
    """
    owner = "stack_batch"
    if not isinstance(tokens_field, str) or not tokens_field:
        raise TypeError(f"{owner}: tokens_field must be a field name or 'auto', got {shown(tokens_field)}")
    extras = check_field_names("extra_fields", extra_fields, owner=owner)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{owner}: dtype must be a torch dtype such as torch.long, got {shown(dtype)}")
    if dtype not in (torch.int8, torch.int16, torch.int32, torch.int64):
        raise ValueError(f"{owner}: dtype must be a signed integer dtype such as torch.long, got {dtype}")
    if not isinstance(pin_memory, (bool, np.bool_)):
        raise TypeError(f"{owner}: pin_memory must be a bool, got {shown(pin_memory)}")
    if pin_memory and not torch.accelerator.is_available():
        raise ValueError(f"{owner}: pin_memory=True needs an accelerator, and none is available here")
    records = as_record_tuple(batch, owner)
    columns = read_columns(records, tokens_field=tokens_field, required=extras)
    data = stack_columns(columns, dtype, padding_lengths=check_padding_lengths(columns))
    td = TensorDict(data, batch_size=[len(records)], device=_common_device(columns))
    return td.pin_memory() if pin_memory else td
