"""The output stage of to_training: key order, renaming, exclusion, flattening, containers."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch

from zephon_collate._read import payload_get
from zephon_collate._text import shown
from zephon_collate.collate.options import TrainingOptions
from zephon_collate.keys import (
    CU_SEQLENS,
    IDS,
    INPUT_IDS,
    LABELS,
    LOSS_MASK,
    MAX_SEQLEN,
    NUM_VALID_TOKENS,
    PADDING_LENGTH,
    PADDING_MASK,
    POSITIONS,
    TEXT,
    TEXTS,
)
from zephon_collate.records import SampleRecord

__all__ = [
    "PAGE_ORDER",
    "assemble_outputs",
    "convert",
    "emitted_keys",
    "empty_outputs",
    "ids_and_texts",
    "merge_row_outputs",
    "output_names",
    "per_record_outputs",
    "rename_and_exclude",
]

_NOT_PER_TOKEN = (IDS, TEXTS, NUM_VALID_TOKENS, CU_SEQLENS, MAX_SEQLEN)


PAGE_ORDER: tuple[str | None, ...] = (IDS, TEXTS, INPUT_IDS, LABELS, POSITIONS, None, NUM_VALID_TOKENS)
PAGE_ORDER += (LOSS_MASK, CU_SEQLENS, MAX_SEQLEN, PADDING_MASK)
"""The reference page's order of the outputs; ``None`` is where the extra fields go."""
_INTERNAL = (PADDING_LENGTH,)
"""Keys of the stacked batch that no output carries."""


def emitted_keys(options: TrainingOptions, keys: Sequence[str]) -> list[str]:
    """The fields a call emits, from the chain's final ``keys``: in the reference page's order, then
    any key a transform of yours adds, in the chain's order.

    Example:
        >>> emitted_keys(TrainingOptions(return_labels=True), ["input_ids", "padding_length", "labels"])
        ['ids', 'texts', 'input_ids', 'labels']
    """
    extras = PAGE_ORDER.index(None)
    ranks = {key: rank for rank, key in enumerate(PAGE_ORDER) if key is not None}
    found = [key for key in keys if key not in _INTERNAL]

    def rank(item: tuple[int, str]) -> tuple[int, int]:
        index, key = item
        if key in ranks:
            return ranks[key], 0
        if key in options.extra_fields:
            return extras, options.extra_fields.index(key)
        return len(PAGE_ORDER), index

    ordered = sorted(enumerate(dict.fromkeys([IDS, TEXTS, *found])), key=rank)
    return [key for _, key in ordered]


def rename_and_exclude(
    keys: Sequence[str], options: TrainingOptions, *, empty: bool
) -> list[tuple[str, str]]:
    """``(emitted_key, final_name)`` pairs after renaming then exclusion.

    Raises:
        ValueError: if a rename source is not emitted (nonempty batches only), or
            two fields end with the same name.
    """
    renames = dict(cast(Sequence[tuple[str, str]], options.rename_fields))  # normalised to pairs
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


def output_names(options: TrainingOptions, keys: Sequence[str]) -> list[tuple[str, str]]:
    """``(key, final name)`` of every output of a nonempty batch, from the chain's final ``keys``."""
    return rename_and_exclude(emitted_keys(options, keys), options, empty=False)


def empty_outputs(options: TrainingOptions, keys: Sequence[str]) -> dict[str, Any]:
    """What to_training returns for an empty batch whose chain would end with ``keys``.

    Every emitted field is an empty list, except ``num_valid_tokens`` (0) and
    flattened ``cu_seqlens``/``max_seqlen`` (``[0]``/0). Positions are emitted
    when generated (``position_mode="sequence"``) or listed in ``extra_fields``.
    """
    values: dict[str, Any] = {NUM_VALID_TOKENS: 0}
    if options.return_cu_seqlens and options.flatten:
        values.update(cu_seqlens=[0], max_seqlen=0)
    shown = [
        key
        for key in keys
        if key != POSITIONS or options.position_mode == "sequence" or POSITIONS in options.extra_fields
    ]
    pairs = rename_and_exclude(emitted_keys(options, shown), options, empty=True)
    return {name: values.get(key, []) for key, name in pairs}


def ids_and_texts(records: Sequence[SampleRecord]) -> dict[str, list[Any]]:
    """The per-record outputs: ``"ids"`` (sample ids), ``"texts"`` (a dict payload's ``"text"`` or None).

    A ``"text"`` that is not a str (e.g. a list of chat messages) is copied, so
    changing the output never changes the record.
    """
    texts = [
        r.payload.get(TEXT)
        if type(r.payload) is dict
        else payload_get(r.payload, TEXT)
        if isinstance(r.payload, Mapping)
        else None
        for r in records
    ]
    return per_record_outputs([r.meta.sample_id for r in records], texts)


def per_record_outputs(ids: list[Any], texts: Sequence[Any]) -> dict[str, list[Any]]:
    """``{"ids": ids, "texts": texts}``, each text that is not a str copied (the output never shares an
    object with the input)."""
    return {
        IDS: ids,
        TEXTS: [
            t if t is None or type(t) is str or isinstance(t, (str, bytes)) else copy.deepcopy(t)
            for t in texts
        ],
    }


def convert(value: torch.Tensor | np.ndarray, kind: str) -> Any:
    """A chain output (a tensor, or an array from the CPU plan) in the container ``kind`` asks for."""
    if isinstance(value, np.ndarray):
        if kind == "list":
            return value.tolist()
        array = np.ascontiguousarray(value)
        return torch.from_numpy(array) if kind == "torch" else array
    if kind == "torch":
        return value.contiguous()
    if kind == "numpy":  # contiguous first: a view of the stacked batch would keep all of it alive
        return value.detach().cpu().contiguous().numpy()
    return value.tolist()


def assemble_outputs(
    per_record: Mapping[str, list[Any]],
    options: TrainingOptions,
    result: Mapping[str, Any],
    pairs: Sequence[tuple[str, str]],
    *,
    python_scalars: bool = True,
) -> dict[str, Any]:
    """The output dict of a stacked batch, from the plan's result and the per-record lists.

    Per-token fields (leading dims those of ``input_ids``) are flattened with
    ``flatten``; every field is converted to the container ``dtype`` asks for.
    ``python_scalars=False`` keeps ``num_valid_tokens`` and a flattened
    ``max_seqlen`` as 0-d tensors (no device sync).
    """
    scalar = int if python_scalars else torch.as_tensor
    kind = options.output.kind
    tokens = tuple(result[INPUT_IDS].shape[:2])
    out: dict[str, Any] = {}
    for key, name in pairs:
        if key in per_record:
            out[name] = per_record[key]
            continue
        value = result[key]
        if key == NUM_VALID_TOKENS:
            out[name] = scalar(value.sum())
        elif key == MAX_SEQLEN and options.flatten:
            out[name] = scalar(value)
        elif options.flatten and key not in _NOT_PER_TOKEN and tuple(value.shape[:2]) == tokens:
            out[name] = convert(value.reshape(-1, *value.shape[2:]), kind)
        else:
            out[name] = convert(value, kind)
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
    per_record: Mapping[str, list[Any]],
    options: TrainingOptions,
    tds: Sequence[Mapping[str, Any]],
    pairs: Sequence[tuple[str, str]],
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
        elif any(not isinstance(row, list) for row in rows):  # one value per row (a 0-d output of yours)
            out[name] = rows
        elif options.flatten:
            out[name] = [item for row in rows for item in row[0]]
        else:
            out[name] = [row[0] for row in rows]
    return out
