"""Payloads to rows: read each record's fields and check them, before stacking.

Payloads are dicts of fields, or arrays (a list, tuple, NumPy array or torch
tensor that is the token row itself, with no other field). :func:`read_columns`
reads a batch's fields into :class:`Columns`, one row per record, which
:mod:`zephon_collate.collate.stack` stacks. Nothing here writes into a payload.
"""

from __future__ import annotations

import array
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import numpy as np
import torch

from zephon_collate.keys import INPUT_IDS, INT64_MAX, LOSS_MASK, POSITIONS, TOKEN_FIELD_CANDIDATES
from zephon_collate.records import FLUSH_TAG, TOMBSTONE_TAG, SampleRecord
from zephon_collate.text import shown, shown_fields

__all__ = [
    "Columns",
    "as_numpy",
    "as_record_tuple",
    "payload_get",
    "payload_items",
    "read_columns",
]


Row: TypeAlias = "np.ndarray | torch.Tensor"
Kind = Literal["ids", "values"]  # ids: integer only; values: bool, integer or float


def describe(records: Sequence[SampleRecord], index: int) -> str:
    """``record 3 (sample_id (0, 0, 7))``: how errors name a record."""
    return describe_record(index, records[index])


def describe_record(index: int, record: SampleRecord) -> str:
    """:func:`describe` of a record known by its place in the batch or stream."""
    return f"record {index} (sample_id {record.meta.sample_id})"


class RecordName:
    """:func:`describe` of one record, formatted only when an error message uses it."""

    __slots__ = ("index", "records")

    def __init__(self, records: Sequence[SampleRecord], index: int) -> None:
        self.records, self.index = records, index

    def __str__(self) -> str:
        return describe(self.records, self.index)


def is_array_payload(payload: object) -> bool:
    return isinstance(payload, (list, tuple, np.ndarray, torch.Tensor))


def as_record_tuple(batch: object, owner: str) -> tuple[SampleRecord, ...]:
    """The records of a :class:`~zephon_collate.SampleBatch` or of a sequence of :class:`SampleRecord`.

    A batch is recognised by its ``records`` tuple (this layer sits below ``SampleBatch``).

    Raises:
        TypeError: for anything else (plain payload dicts included: the Collator wraps those).
    """
    records = getattr(batch, "records", None)
    if isinstance(records, tuple) and not isinstance(batch, Sequence):
        batch = records
    if isinstance(batch, (str, bytes, Mapping)) or not isinstance(batch, Iterable):
        raise TypeError(
            f"{owner}: expected a SampleBatch or a list of SampleRecord, got {type(batch).__name__}"
        )
    records = tuple(batch)
    for index, record in enumerate(records):
        if not isinstance(record, SampleRecord):
            raise TypeError(
                f"{owner}: item {index} must be a SampleRecord, got {type(record).__name__}; wrap plain "
                "payloads in SampleRecord(meta, payload), or use Collator, which accepts them"
            )
    return records


def check_payloads(records: Sequence[SampleRecord]) -> None:
    """Raise for the first sentinel record (``ValueError``) or non-dict, non-array payload (``TypeError``)."""
    for index, record in enumerate(records):
        tags = record.meta.tags
        if tags and (tags.get(TOMBSTONE_TAG) or tags.get(FLUSH_TAG)):
            tag = "tombstone" if record.meta.tombstone else "flush sentinel"
            raise ValueError(
                f"{describe(records, index)}: is a {tag}, a control record that carries no training data; "
                "drop sentinels before collating (pack_flat and FlatPacker consume them), e.g. "
                "[r for r in records if not r.meta.is_sentinel]"
            )
        payload = record.payload
        if type(payload) is not dict and not isinstance(payload, Mapping) and not is_array_payload(payload):
            raise TypeError(
                f"{describe(records, index)}: payload must be a dict of fields or a token array "
                f"(list, tuple, NumPy array or torch tensor), got {type(payload).__name__}"
            )


def first_token_field(payload: Mapping[Any, Any]) -> str | None:
    """The first of ``TOKEN_FIELD_CANDIDATES`` that ``payload`` has, or ``None``."""
    return next((c for c in TOKEN_FIELD_CANDIDATES if c in payload), None)


def resolve_tokens_field(records: Sequence[SampleRecord], tokens_field: str) -> str:
    """The payload field holding token ids: ``tokens_field``, or the first candidate all dicts have.

    Sentinel records (which the packer consumes) are not consulted.
    """
    dicts = [
        (i, r.payload)
        for i, r in enumerate(records)
        if isinstance(r.payload, Mapping) and not r.meta.is_sentinel
    ]
    if tokens_field != "auto":
        for index, payload in dicts:
            if tokens_field not in payload:
                raise ValueError(
                    f"{describe(records, index)}: payload has no tokens field {shown(tokens_field)} "
                    f"(its fields: {shown_fields(payload)}); pass the right tokens_field"
                )
        return tokens_field
    for candidate in TOKEN_FIELD_CANDIDATES:
        if all(candidate in payload for _, payload in dicts):
            return candidate
    bare = next(((i, p) for i, p in dicts if first_token_field(p) is None), None)
    if bare is not None:
        index, payload = bare
        raise ValueError(
            f"tokens_field='auto' found none of {', '.join(TOKEN_FIELD_CANDIDATES)} in every payload; "
            f"{describe(records, index)} has fields {shown_fields(payload)}; pass tokens_field='<name>'"
        )
    # Each payload has a candidate, but no one candidate is in all of them.
    first_index, first = dicts[0]
    field = first_token_field(first)
    index, payload = next((i, p) for i, p in dicts if field not in p)
    raise ValueError(
        f"tokens_field='auto' found no token field that every payload has: {describe(records, first_index)} "
        f"has {shown(field)}, {describe(records, index)} has fields {shown_fields(payload)}; "
        "give every payload the same token field, or pass tokens_field='<name>'"
    )


def sequence_array(value: Any, where: object, name: str, *, fix: str) -> np.ndarray:
    """``np.array(value)``, with a ragged or unreadable sequence as a ``ValueError`` / ``TypeError``.

    ``fix`` says what to do about a ragged one (e.g. "give equal-length rows").
    """
    try:
        return np.array(value)
    except ValueError:
        raise ValueError(f"{where}: field {shown(name)} is a ragged nested sequence; {fix}") from None
    except (TypeError, RuntimeError, NotImplementedError):  # e.g. a list of tensors on a device
        raise TypeError(
            f"{where}: field {shown(name)} holds items that cannot be read as plain numbers; give a list of "
            "numbers, or one array or tensor"
        ) from None


def _beyond_int64(where: object, name: str) -> ValueError:
    message = (
        f"{where}: field {shown(name)} holds values beyond int64; give integers from -2**63 to 2**63 - 1"
    )
    return ValueError(message)


def _numpy_row(value: Any, where: object, name: str) -> np.ndarray:
    """A NumPy array of ``value``; a list or tuple gets the dtype NumPy infers for it (all bools: bool)."""
    if isinstance(value, (list, tuple)) and (not value or type(value[0]) is int):
        try:  # the fast, exact path for a flat sequence of Python ints
            return np.frombuffer(array.array("q", value), dtype=np.int64)
        except OverflowError:
            if all(type(item) is int for item in value):
                raise _beyond_int64(where, name) from None
        except (TypeError, RuntimeError, NotImplementedError):
            pass  # floats, bools, nested rows, tensors: let NumPy tell which
    if isinstance(value, np.ndarray):  # no copy, unless strided (torch takes no negative strides)
        row = value if value.flags.c_contiguous else np.array(value)
    else:
        row = sequence_array(value, where, name, fix="give equal-length rows")
    if row.dtype.kind == "O":
        if not isinstance(value, np.ndarray) and all(
            isinstance(item, numbers.Integral) and not isinstance(item, bool) for item in row.flat
        ):
            raise _beyond_int64(where, name)
        raise TypeError(
            f"{where}: field {shown(name)} holds Python objects that are not numbers (dtype object); "
            "give numbers only"
        )
    if not row.dtype.isnative:  # e.g. '>i4' on a little-endian machine: torch reads native order only
        row = row.astype(row.dtype.newbyteorder("="))
    if row.dtype.kind == "f" and row.dtype.itemsize > 8:
        raise TypeError(
            f"{where}: field {shown(name)} has dtype {row.dtype}, which torch cannot hold; cast it with "
            ".astype(np.float64)"
        )
    if row.dtype.kind == "u" and row.dtype.itemsize > 1:  # uint16/32/64: torch supports little on them
        if row.dtype.itemsize == 8 and row.size and row.max() > INT64_MAX:
            raise ValueError(
                f"{where}: field {shown(name)} holds values beyond int64 (dtype {row.dtype}); "
                "give values up to 2**63 - 1"
            )
        row = row.astype(np.int64)
    return row


def _tensor_row(value: torch.Tensor, where: object, name: str) -> torch.Tensor:
    """``value`` itself, or an exact int64 copy of a uint16/32/64 tensor."""
    if value.layout != torch.strided or value.is_nested or value.is_quantized:
        kind = "nested" if value.is_nested else "quantized" if value.is_quantized else str(value.layout)
        raise TypeError(
            f"{where}: field {shown(name)} is a {kind} tensor; give a plain dense tensor "
            "(.to_dense(), .dequantize())"
        )
    if value.dtype in (torch.uint16, torch.uint32, torch.uint64):
        if value.dtype == torch.uint64:
            as_signed = value.view(torch.int64)  # values beyond int64 read as negative
            if as_signed.device.type != "meta" and bool((as_signed < 0).any()):
                raise ValueError(
                    f"{where}: field {shown(name)} holds values beyond int64 (dtype {value.dtype}); "
                    "give values up to 2**63 - 1"
                )
            return as_signed
        return value.to(torch.int64)
    return value


_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_PLAIN_DTYPES: dict[str, frozenset[torch.dtype]] = {
    "ids": frozenset(_INTEGER_DTYPES),
    "values": frozenset((*_INTEGER_DTYPES, torch.bool, torch.float16, torch.float32, torch.float64)),
}


def to_row(value: Any, where: object, name: str, kind: Kind) -> Row:
    """Check one payload value and return it as an array or tensor, without copying tensors.

    ``where`` names the value's record in error messages (a str, or a :class:`RecordName`).
    """
    if isinstance(value, torch.Tensor):
        row: Row = _tensor_row(value, where, name)
        if value.dtype.is_floating_point and value.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"{where}: field {shown(name)} has dtype {value.dtype}, which collating cannot compute with; "
                "cast it with .float()"
            )
        bad = value.dtype.is_complex or (
            kind == "ids" and (value.dtype.is_floating_point or value.dtype == torch.bool)
        )
        dtype: object = value.dtype
        empty_float = value.dtype.is_floating_point and value.numel() == 0
    elif isinstance(value, (np.ndarray, list, tuple, int, float, np.generic)) and not isinstance(
        value, (str, bytes)
    ):
        row = _numpy_row(value, where, name)
        allowed = "iu" if kind == "ids" else "biuf"
        bad = row.dtype.kind not in allowed
        dtype = row.dtype
        empty_float = row.dtype.kind == "f" and row.size == 0
    else:
        raise TypeError(
            f"{where}: field {shown(name)} must be a list, tuple, NumPy array or torch tensor of numbers, "
            f"got {type(value).__name__}"
        )
    if bad and empty_float:  # torch.tensor([]) and np.array([]) are float: an empty row holds no float
        row = row.astype(np.int64) if isinstance(row, np.ndarray) else row.to(torch.int64)
    elif bad:
        expected = "integer token ids" if kind == "ids" else "bool, integer or float values"
        raise TypeError(f"{where}: field {shown(name)} has dtype {dtype}; it must hold {expected}")
    if kind == "ids" and row.ndim == 0:
        raise ValueError(f"{where}: field {shown(name)} must be a sequence, got a scalar")
    if kind == "ids" and row.ndim == 2 and row.shape[0] == 1:
        raise ValueError(
            f"{where}: field {shown(name)} has shape {tuple(row.shape)}: a batch of one row, as "
            "tokenizer(..., return_tensors='pt') returns; pass the row itself (value[0] or value.squeeze(0))"
        )
    return row


def as_numpy(row: Row) -> np.ndarray:
    """A row as a NumPy array: a tensor detached and on the CPU (bfloat16 read as float32), no copy else."""
    if not isinstance(row, torch.Tensor):
        return np.asarray(row)
    tensor = row.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


@dataclass
class Columns:
    """Per-record rows of each field read from a batch, before stacking.

    ``rows[name][i]`` is record ``i``'s value (array or tensor) for ``name``;
    the token field is stored under ``"input_ids"``. ``padding_lengths`` holds
    ``meta.padding_length`` per record (``None`` where unset).
    """

    records: tuple[SampleRecord, ...]
    tokens_field: str
    rows: dict[str, list[Row]] = field(default_factory=dict)
    padding_lengths: list[int | None] = field(default_factory=list)

    def lengths(self) -> list[int]:
        return [int(row.shape[0]) for row in self.rows[INPUT_IDS]]


_MISSING = object()


def payload_get(payload: Mapping[Any, Any], name: str, default: Any = None) -> Any:
    """``payload[name]`` if ``name in payload``, else ``default``: read through the mapping interface.

    A plain ``dict`` takes the fast ``dict.get``; any other mapping (a ``dict``
    subclass overriding ``__getitem__`` included) answers through its own
    ``__contains__`` and ``__getitem__``.
    """
    if type(payload) is dict:
        return payload.get(name, default)
    return payload[name] if name in payload else default  # noqa: SIM401 (a subclass may not route .get)


def payload_items(payload: Mapping[Any, Any]) -> list[tuple[Any, Any]]:
    """The ``(name, value)`` pairs of a payload, each value read through ``payload[name]``."""
    if type(payload) is dict:
        return list(payload.items())
    return [(name, payload[name]) for name in payload]


def _value(payload: Any, name: str, tokens_field: str) -> Any:
    """``payload[name]``, the array payload itself for the token field, or ``_MISSING``."""
    if isinstance(payload, Mapping):
        return payload_get(payload, name, _MISSING)
    return payload if name == tokens_field else _MISSING


def read_field(
    records: Sequence[SampleRecord], name: str, tokens_field: str, kind: Kind, *, required: bool
) -> list[Row] | None:
    """Read ``name`` from every payload, or ``None`` if no payload has it.

    Raises:
        ValueError: if some payloads have the field and others lack it, or it is
            required and missing.
    """
    values = [_value(record.payload, name, tokens_field) for record in records]
    lacking = [index for index, value in enumerate(values) if value is _MISSING]  # `is`: no tensor ==
    if len(lacking) == len(values) and not required:
        return None
    if lacking:
        index = lacking[0]
        payload = records[index].payload
        holds = (
            f"its fields: {shown_fields(payload)}"
            if isinstance(payload, Mapping)
            else "an array payload holds only its token row"
        )
        reason = (
            "some payloads have it and others lack it" if len(lacking) < len(values) else "it is required"
        )
        raise ValueError(f"{describe(records, index)}: payload lacks field {shown(name)} ({holds}); {reason}")
    plain = _PLAIN_DTYPES[kind]
    return [
        value
        if type(value) is torch.Tensor
        and value.dtype in plain
        and (value.ndim == 1 or (value.ndim > 1 and kind == "values"))
        and value.layout == torch.strided
        and not value.is_nested
        else to_row(value, RecordName(records, index), name, kind)
        for index, value in enumerate(values)
    ]


def check_aligned(columns: Columns, name: str, lengths: list[int]) -> None:
    """Raise ``ValueError`` if a field's rows do not have one entry per token (``lengths``)."""
    rows = columns.rows[name]
    if all(row.ndim and row.shape[0] == length for row, length in zip(rows, lengths, strict=True)):
        return
    for index, (row, length) in enumerate(zip(rows, lengths, strict=True)):
        if row.ndim == 0 or row.shape[0] != length:
            got = "a scalar" if row.ndim == 0 else f"{row.shape[0]} entries"
            raise ValueError(
                f"{describe(columns.records, index)}: field {shown(name)} has {got} but the token row has "
                f"{length}; per-token fields must match the tokens one to one"
            )


def read_columns(
    records: Sequence[SampleRecord],
    *,
    tokens_field: str = "auto",
    optional: Sequence[str] = (POSITIONS, LOSS_MASK),
    required: Sequence[str] = (),
    aligned: Sequence[str] = (POSITIONS, LOSS_MASK),
) -> Columns:
    """Read the token field, the ``optional`` fields present in every payload and the ``required`` ones.

    Fields in ``aligned`` must have one entry per token. ``positions`` reads as
    integers, other fields as bool, integer or float values.

    Raises:
        TypeError: if a payload is neither a dict nor an array, or a value has a wrong type.
        ValueError: if the tokens field is missing, a field is present in only some
            payloads, or an aligned field does not match the tokens.
    """
    records = tuple(records)
    check_payloads(records)
    field_name = resolve_tokens_field(records, tokens_field) if records else tokens_field
    columns = Columns(records, field_name)
    columns.rows[INPUT_IDS] = read_field(records, field_name, field_name, "ids", required=True) or []
    lengths = columns.lengths()
    for name in dict.fromkeys((*optional, *required)):
        kind: Kind = "ids" if name == POSITIONS else "values"
        rows = read_field(records, name, field_name, kind, required=name in required)
        if rows is not None:
            columns.rows[name] = rows
            if name in aligned:
                check_aligned(columns, name, lengths)
    columns.padding_lengths = [r.meta.padding_length for r in records]
    return columns
