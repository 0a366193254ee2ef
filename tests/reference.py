"""A simple, obviously correct, per-row pure-Python to_training for comparisons.

It follows the reference page sentence by sentence, one record at a time, on
Python lists, and returns list output (as ``dtype=None`` does). It covers dict
and array payloads with scalar tokens; it does not validate (tests feed it
valid batches only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

TOKEN_FIELD_CANDIDATES = ("input_ids", "tokens", "token_ids", "ids")


def _as_list(value: Any) -> list:
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _tokens_field(records: Sequence[Any], tokens_field: str) -> str:
    if tokens_field != "auto":
        return tokens_field
    dicts = [r.payload for r in records if isinstance(r.payload, Mapping)]
    for name in TOKEN_FIELD_CANDIDATES:
        if all(name in p for p in dicts):
            return name
    raise AssertionError("reference: no tokens field")


def _field(record: Any, name: str, tokens_field: str) -> list | None:
    payload = record.payload
    if isinstance(payload, Mapping):
        return _as_list(payload[name]) if name in payload else None
    return _as_list(payload) if name == tokens_field else None


def reference_row(record: Any, tokens_field: str, opts: dict[str, Any]) -> dict[str, Any]:
    """All per-row outputs of one record, as lists."""
    tokens = _field(record, tokens_field, tokens_field)
    assert tokens is not None
    length = len(tokens)
    pad = record.meta.padding_length or 0
    positions = _field(record, "positions", tokens_field)
    mask = _field(record, "loss_mask", tokens_field)
    padding_full = [i >= length - pad for i in range(length)]
    extras = {name: _field(record, name, tokens_field) for name in opts.get("extra_fields", ())}
    ignore = opts.get("ignore_index", -100)
    row: dict[str, Any] = {}
    if opts.get("return_labels"):
        inputs = tokens[:-1]
        labels = tokens[1:]
        for j in range(len(labels)):
            supervised = mask is None or mask[j + 1] != 0
            is_padding = j >= len(labels) - pad
            from_eos = opts.get("eos_mask_loss") and inputs[j] == opts["eos_token_id"]
            if not supervised or is_padding or from_eos:
                labels[j] = ignore
        row["labels"] = labels
        row["loss_mask"] = [1.0 if label != ignore else 0.0 for label in labels]
        row["num_valid_tokens"] = sum(label != ignore for label in labels)
        cut = slice(0, max(length - 1, 0))
    else:
        inputs = tokens
        row["raw_loss_mask"] = mask
        cut = slice(0, length)
    row["input_ids"] = inputs
    row["payload_positions"] = None if positions is None else positions[cut]
    row["padding_mask"] = padding_full[cut]
    row["extras"] = {
        name: value[cut] if opts.get("return_labels") else value for name, value in extras.items()
    }
    if opts.get("position_mode", "preserve") == "sequence":
        row["positions"] = list(range(len(inputs)))
    else:
        row["positions"] = row["payload_positions"]
    if opts.get("return_cu_seqlens"):
        bounds = [i for i, p in enumerate(row["payload_positions"]) if p == 0] + [len(inputs)]
        row["cu_seqlens"] = bounds
        row["max_seqlen"] = max((b - a for a, b in pairwise(bounds)), default=0)
    return row


def reference_to_training(records: Sequence[Any], **opts: Any) -> dict[str, Any]:
    """List-valued to_training output of the reference page, before renaming and exclusion."""
    tokens_field = _tokens_field(records, opts.get("tokens_field", "auto"))
    rows = [reference_row(r, tokens_field, opts) for r in records]
    flatten = opts.get("flatten", False)

    def per_token(values: list[list]) -> list:
        return [item for value in values for item in value] if flatten else values

    out: dict[str, Any] = {
        "ids": [r.meta.sample_id for r in records],
        "texts": [r.payload.get("text") if isinstance(r.payload, Mapping) else None for r in records],
        "input_ids": per_token([row["input_ids"] for row in rows]),
    }
    if opts.get("return_labels"):
        out["labels"] = per_token([row["labels"] for row in rows])
    if rows and rows[0]["positions"] is not None:
        out["positions"] = per_token([row["positions"] for row in rows])
    for name in opts.get("extra_fields", ()):
        if name not in ("positions", "loss_mask"):
            out[name] = per_token([row["extras"][name] for row in rows])
    if opts.get("return_num_valid_tokens"):
        out["num_valid_tokens"] = sum(row["num_valid_tokens"] for row in rows)
    if opts.get("return_loss_mask"):
        out["loss_mask"] = per_token([row["loss_mask"] for row in rows])
    elif not opts.get("return_labels") and rows and rows[0]["raw_loss_mask"] is not None:
        out["loss_mask"] = per_token([row["raw_loss_mask"] for row in rows])
    if opts.get("return_cu_seqlens"):
        bounds = [row["cu_seqlens"] for row in rows]
        if flatten:
            joined, total = [], 0
            for row_bounds in bounds:
                joined += [b + total for b in row_bounds[:-1]]
                total += row_bounds[-1]
            out["cu_seqlens"] = [*joined, total]
            out["max_seqlen"] = max((row["max_seqlen"] for row in rows), default=0)
        else:
            width = max(len(b) for b in bounds)
            out["cu_seqlens"] = [b + [b[-1]] * (width - len(b)) for b in bounds]
            out["max_seqlen"] = [row["max_seqlen"] for row in rows]
    if opts.get("return_padding_mask"):
        out["padding_mask"] = per_token([row["padding_mask"] for row in rows])
    return out
