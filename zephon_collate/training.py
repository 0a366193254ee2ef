"""to_training: a batch of tokenized records to training tensors.

The steps: check the arguments (:class:`TrainingOptions`), read and check the
payloads (:mod:`zephon_collate.payloads`), stack them once into a TensorDict
(:mod:`zephon_collate.batch`), run the transform chain the options build, then
rename, exclude, flatten and convert to the containers asked for
(:mod:`zephon_collate.output`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from tensordict import TensorDictBase

from zephon_collate import numpy_kernels
from zephon_collate.batch import check_padding_lengths, stack_columns
from zephon_collate.options import TrainingOptions
from zephon_collate.output import (
    assemble_outputs,
    empty_outputs,
    ids_and_texts,
    merge_row_outputs,
    output_keys,
)
from zephon_collate.payloads import TOKENS, Columns, as_record_tuple, describe, read_columns
from zephon_collate.types import SampleBatch, SampleRecord

__all__ = ["run_chain", "to_training"]

INT32_MAX = 2**31 - 1


def _first_bad_row(bad: torch.Tensor) -> int:
    return int(bad.reshape(bad.shape[0], -1).any(dim=1).nonzero()[0, 0])


def _smallest(values: torch.Tensor) -> float:
    """The smallest value of a non-empty tensor (read back to the host)."""
    if numpy_kernels.applies(values):
        return values.numpy().min().item()
    return values.min().item()


def _outside_zero_one(mask: torch.Tensor) -> bool:
    """True if a non-empty, non-bool mask holds a value other than 0 and 1."""
    if mask.is_floating_point():
        return bool(((mask != 0) & (mask != 1)).any())
    if numpy_kernels.applies(mask):  # one pass: as unsigned, 0 and 1 are the only values <= 1
        array = mask.numpy()
        return bool(array.view(array.dtype.str.replace("i", "u")).max() > 1)
    low, high = torch.aminmax(mask)
    return bool(low < 0) or bool(high > 1)


def check_values(td: TensorDictBase, columns: Columns, options: TrainingOptions) -> None:
    """Data errors that need the values: negative ids, non-0/1 supervision masks, cu_seqlens positions."""
    records = columns.records
    tokens = td[TOKENS]
    if tokens.numel() and _smallest(tokens) < 0:
        index = _first_bad_row(tokens < 0)
        raise ValueError(f"{describe(records, index)}: token ids must be >= 0, found a negative id")
    if options.return_labels and "loss_mask" in td:
        mask = td["loss_mask"]
        if mask.dtype != torch.bool and mask.numel() and _outside_zero_one(mask):
            bad = (mask != 0) & (mask != 1)
            raise ValueError(
                f"{describe(records, _first_bad_row(bad))}: field 'loss_mask' must hold only 0 and 1 "
                "(or booleans): 1 for supervised tokens, 0 for the rest"
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
        _check_boundary_positions(td, columns, options)


def _check_boundary_positions(td: TensorDictBase, columns: Columns, options: TrainingOptions) -> None:
    positions = td["positions"]
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
    first = positions[:, 0].numpy() if numpy_kernels.applies(positions) else positions[:, 0]
    if bool((first != 0).any()):
        index = int((positions[:, 0] != 0).nonzero()[0, 0])
        raise ValueError(
            f"{describe(columns.records, index)}: positions must start at zero in every row to derive "
            f"cu_seqlens, but this row starts at {int(positions[index, 0])}"
        )


def read_batch(records: Sequence[SampleRecord], options: TrainingOptions) -> Columns:
    """Read the fields ``options`` uses from the payloads, with the checks that need no stacking."""
    optional = ["loss_mask"]
    if options.reads_positions:
        optional.append("positions")
    required = list(options.data_fields)
    required += [name for name in ("positions", "loss_mask") if name in options.extra_fields]
    if options.return_cu_seqlens and "positions" not in required:
        required.append("positions")
    must_align = options.return_labels or options.flatten
    aligned = ["positions", "loss_mask", *(options.data_fields if must_align else ())]
    columns = read_columns(
        records,
        tokens_field=options.tokens_field,
        optional=optional,
        required=required,
        aligned=aligned,
    )
    if not options.needs_padding_lengths:
        columns.padding_lengths = [None] * len(records)
    return columns


def stack(columns: Columns, options: TrainingOptions) -> TensorDictBase:
    """The stacked TensorDict the chain runs on, value-checked."""
    padding = check_padding_lengths(columns) if options.needs_padding_lengths else None
    keep = ("loss_mask",) if options.return_labels else ()
    td = stack_columns(columns, options.output.torch_dtype, padding_lengths=padding, keep_dtype=keep)
    check_values(td, columns, options)
    return td


def run_chain(td: TensorDictBase, options: TrainingOptions) -> TensorDictBase:
    """Run the chain ``options`` build on a stacked TensorDict."""
    return options.build_chain(list(td.keys()))(td)


def _stackable(columns: Columns) -> bool:
    return all(len({tuple(row.shape) for row in rows}) <= 1 for rows in columns.rows.values())


def to_training(
    batch: SampleBatch | Sequence[SampleRecord],
    *,
    tokens_field: str = "auto",
    return_labels: bool = False,
    dtype: Any = "auto",
    extra_fields: Sequence[str] = (),
    ignore_index: int = -100,
    rename_fields: Mapping[str, str] | None = None,
    flatten: bool = False,
    exclude_fields: Sequence[str] = (),
    return_num_valid_tokens: bool = False,
    return_loss_mask: bool = False,
    return_cu_seqlens: bool = False,
    return_padding_mask: bool = False,
    eos_mask_loss: bool = False,
    eos_token_id: int | None = None,
    position_mode: Literal["preserve", "sequence"] = "preserve",
) -> dict[str, Any]:
    """Convert a batch to training-ready format; the reference is :meth:`SampleBatch.to_training`."""
    options = TrainingOptions.create(
        tokens_field=tokens_field,
        return_labels=return_labels,
        dtype=dtype,
        extra_fields=extra_fields,
        ignore_index=ignore_index,
        rename_fields=rename_fields,
        flatten=flatten,
        exclude_fields=exclude_fields,
        return_num_valid_tokens=return_num_valid_tokens,
        return_loss_mask=return_loss_mask,
        return_cu_seqlens=return_cu_seqlens,
        return_padding_mask=return_padding_mask,
        eos_mask_loss=eos_mask_loss,
        eos_token_id=eos_token_id,
        position_mode=position_mode,
    )
    return training_outputs(as_record_tuple(batch, "to_training"), options)


def training_outputs(records: Sequence[SampleRecord], options: TrainingOptions) -> dict[str, Any]:
    """to_training for already-validated options (the collator's entry point)."""
    if not records:
        return empty_outputs(options)
    columns = read_batch(records, options)
    if options.output.kind == "list" and not _stackable(columns):
        per_row = []
        for index in range(len(records)):
            row = Columns(columns.records[index : index + 1], columns.tokens_field)
            row.rows = {name: rows[index : index + 1] for name, rows in columns.rows.items()}
            row.padding_lengths = columns.padding_lengths[index : index + 1]
            per_row.append(stack(row, options))
        keys = output_keys(options, list(per_row[0].keys()))
        tds = [run_chain(td, options) for td in per_row]
        return merge_row_outputs(ids_and_texts(records), options, tds, keys)
    td = stack(columns, options)
    keys = output_keys(options, list(td.keys()))
    return assemble_outputs(ids_and_texts(records), options, run_chain(td, options), keys)
