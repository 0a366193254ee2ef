"""to_training: a batch of tokenized records to training tensors.

The steps: check the arguments (:class:`TrainingOptions`), read, stack and
check the payloads (:mod:`zephon_collate.collate.prepare`), run the plan for
the options and the stacked keys (:mod:`zephon_collate.collate.plan`), then
rename, exclude, flatten and convert to the containers asked for
(:mod:`zephon_collate.collate.output`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from zephon_collate.collate.options import TrainingOptions
from zephon_collate.collate.output import assemble_outputs, empty_outputs, ids_and_texts, merge_row_outputs
from zephon_collate.collate.padding import RowPadding
from zephon_collate.collate.plan import plan_for
from zephon_collate.collate.prepare import read_batch, stack
from zephon_collate.read import Columns
from zephon_collate.records import SampleRecord

__all__ = ["stackable", "training_outputs"]


def stackable(columns: Columns) -> bool:
    """True if every field's rows have one shape (so the batch stacks into tensors)."""
    return all(len({tuple(row.shape) for row in rows}) <= 1 for rows in columns.rows.values())


def training_outputs(
    records: Sequence[SampleRecord],
    options: TrainingOptions,
    padding: RowPadding | None = None,
    boundary_safe: bool = False,
    unused: Literal["raise", "warn"] = "warn",
) -> dict[str, Any]:
    """to_training for already-checked options: the one-step path of ``to_training`` and the Collator
    (which may pad ragged rows, ``padding``, mask labels across documents, ``boundary_safe``, and
    refuses supervising fields it does not read, ``unused="raise"``)."""
    if not records:
        return empty_outputs(options)
    columns = read_batch(records, options, padding, boundary_safe, unused=unused)
    if options.output.kind == "list" and not stackable(columns):
        return _ragged_outputs(records, columns, options, boundary_safe)
    data = stack(columns, options)
    plan = plan_for(options, tuple(data), None, boundary_safe)
    return assemble_outputs(ids_and_texts(records), options, plan.outputs(data), plan.pairs)


def _ragged_outputs(
    records: Sequence[SampleRecord], columns: Columns, options: TrainingOptions, boundary_safe: bool
) -> dict[str, Any]:
    """List output for rows of unequal length: each row runs the plan as a batch of one."""
    per_row = []
    for index in range(len(records)):
        row = Columns(columns.records[index : index + 1], columns.tokens_field)
        row.rows = {name: rows[index : index + 1] for name, rows in columns.rows.items()}
        row.padding_lengths = columns.padding_lengths[index : index + 1]
        per_row.append(stack(row, options))
    plan = plan_for(options, tuple(per_row[0]), None, boundary_safe)
    return merge_row_outputs(ids_and_texts(records), options, [plan.outputs(d) for d in per_row], plan.pairs)
