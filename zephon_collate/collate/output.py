"""The output stage of to_training: key order, renaming, exclusion, flattening, containers."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from zephon_collate.collate.options import TrainingOptions
from zephon_collate.functional.labels import contiguous
from zephon_collate.keys import (
    CU_SEQLENS,
    IDS,
    INPUT_IDS,
    LABELS,
    LOSS_MASK,
    MAX_SEQLEN,
    NUM_VALID_TOKENS,
    PADDING_MASK,
    POSITIONS,
    TEXT,
    TEXTS,
)
from zephon_collate.read import payload_get
from zephon_collate.records import SampleRecord
from zephon_collate.text import shown

__all__ = ["assemble_outputs", "empty_outputs", "ids_and_texts", "merge_row_outputs", "output_keys"]

NOT_PER_TOKEN = (IDS, TEXTS, NUM_VALID_TOKENS, CU_SEQLENS, MAX_SEQLEN)


def emitted_keys(options: TrainingOptions, stacked_keys: Sequence[str] | None) -> list[str]:
    """The fields a call emits, in the reference page's order (``None``: an empty batch)."""
    empty = stacked_keys is None
    has = set(stacked_keys or ())
    keys = [IDS, TEXTS, INPUT_IDS]
    keys += [LABELS] if options.return_labels else []
    if options.position_mode == "sequence" or (not empty and POSITIONS in has):
        keys.append(POSITIONS)
    keys += list(options.data_fields)
    if empty and POSITIONS in options.extra_fields and POSITIONS not in keys:
        keys.append(POSITIONS)
    keys += [NUM_VALID_TOKENS] if options.return_num_valid_tokens else []
    raw_mask = not options.return_labels and (
        LOSS_MASK in has or (empty and LOSS_MASK in options.extra_fields)
    )
    keys += [LOSS_MASK] if options.return_loss_mask or raw_mask else []
    keys += [CU_SEQLENS, MAX_SEQLEN] if options.return_cu_seqlens else []
    keys += [PADDING_MASK] if options.return_padding_mask else []
    return keys


def rename_and_exclude(
    keys: Sequence[str], options: TrainingOptions, *, empty: bool
) -> list[tuple[str, str]]:
    """``(emitted_key, final_name)`` pairs after renaming then exclusion.

    Raises:
        ValueError: if a rename source is not emitted (nonempty batches only), or
            two fields end with the same name.
    """
    renames = dict(options.rename_fields)
    if not empty:
        for source in renames:
            if source not in keys:
                raise ValueError(
                    f"to_training: rename_fields names {shown(source)}, which this call does not emit "
                    f"(it emits {list(keys)})"
                )
    finals = [(key, renames.get(key, key)) for key in keys]
    seen: dict[str, str] = {}
    for key, name in finals:
        if name in seen:
            raise ValueError(
                f"to_training: rename_fields gives {shown(seen[name])} and {shown(key)} the same name "
                f"{shown(name)}; "
                "final names must be unique"
            )
        seen[name] = key
    excluded = set(options.exclude_fields)
    return [(key, name) for key, name in finals if name not in excluded]


def output_keys(options: TrainingOptions, stacked_keys: Sequence[str]) -> list[tuple[str, str]]:
    """Emitted keys of a nonempty batch with their final names."""
    return rename_and_exclude(emitted_keys(options, stacked_keys), options, empty=False)


def empty_outputs(options: TrainingOptions) -> dict[str, Any]:
    """What to_training returns for an empty batch."""
    values: dict[str, Any] = {NUM_VALID_TOKENS: 0}
    if options.return_cu_seqlens and options.flatten:
        values.update(cu_seqlens=[0], max_seqlen=0)
    pairs = rename_and_exclude(emitted_keys(options, None), options, empty=True)
    return {name: values.get(key, []) for key, name in pairs}


def ids_and_texts(records: Sequence[SampleRecord]) -> dict[str, list[Any]]:
    """The per-record outputs: ``"ids"`` (sample ids), ``"texts"`` (a dict payload's ``"text"`` or None).

    A ``"text"`` that is not a str (e.g. a list of chat messages) is copied, so
    changing the output never changes the record.
    """
    texts = [payload_get(r.payload, TEXT) if isinstance(r.payload, Mapping) else None for r in records]
    return {
        IDS: [r.meta.sample_id for r in records],
        TEXTS: [t if t is None or isinstance(t, (str, bytes)) else copy.deepcopy(t) for t in texts],
    }


def _convert(value: torch.Tensor | np.ndarray, kind: str) -> Any:
    """A chain output (a tensor, or an array from the CPU plan) in the container ``kind`` asks for."""
    if type(value) is np.ndarray:
        if kind == "list":
            return value.tolist()
        array = np.ascontiguousarray(value)
        return torch.from_numpy(array) if kind == "torch" else array
    if kind == "torch":
        return contiguous(value)
    if kind == "numpy":  # contiguous first: a view of the stacked batch would keep all of it alive
        return value.detach().cpu().contiguous().numpy()
    return value.tolist()


def _flat(value: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    return value.reshape(-1, *value.shape[2:]) if value.ndim >= 2 else value


def assemble_outputs(
    per_record: dict[str, list[Any]],
    options: TrainingOptions,
    td: Mapping[str, Any],
    pairs: list[tuple[str, str]],
    *,
    python_scalars: bool = True,
) -> dict[str, Any]:
    """Build the output dict of a stacked batch from the plan's outputs and :func:`ids_and_texts`.

    ``python_scalars=False`` keeps ``num_valid_tokens`` and a flattened
    ``max_seqlen`` as 0-d tensors (no device sync).
    """
    scalar = int if python_scalars else torch.as_tensor
    kind = options.output.kind
    out: dict[str, Any] = {}
    for key, name in pairs:
        if key in per_record:
            out[name] = per_record[key]
        elif key == NUM_VALID_TOKENS:
            out[name] = scalar(td[key].sum())
        elif key == MAX_SEQLEN and options.flatten:
            out[name] = scalar(td[key])
        elif key in NOT_PER_TOKEN or not options.flatten:
            out[name] = _convert(td[key], kind)
        else:
            out[name] = _convert(_flat(td[key]), kind)
    return out


def _pad_rows(rows: list[list[int]]) -> list[list[int]]:
    width = max(len(row) for row in rows)
    return [row + [row[-1]] * (width - len(row)) for row in rows]


def _join_boundaries(rows: list[list[int]]) -> list[int]:
    joined: list[int] = []
    total = 0
    for row in rows:
        joined += [start + total for start in row[:-1]]
        total += row[-1]
    return [*joined, total]


def merge_row_outputs(
    per_record: dict[str, list[Any]],
    options: TrainingOptions,
    tds: list[Mapping[str, Any]],
    pairs: list[tuple[str, str]],
) -> dict[str, Any]:
    """List output for rows of unequal length, each run through the chain as a batch of one."""
    out: dict[str, Any] = {}
    for key, name in pairs:
        if key in per_record:
            out[name] = per_record[key]
            continue
        rows = [td[key].tolist() for td in tds]
        if key == NUM_VALID_TOKENS:
            out[name] = sum(sum(row) for row in rows)
        elif key == CU_SEQLENS:
            out[name] = _join_boundaries(rows) if options.flatten else _pad_rows([row[0] for row in rows])
        elif key == MAX_SEQLEN:
            out[name] = max(rows) if options.flatten else [row[0] for row in rows]
        elif options.flatten:
            out[name] = [item for row in rows for item in row[0]]
        else:
            out[name] = [row[0] for row in rows]
    return out
