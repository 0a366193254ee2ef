"""Records to TensorDict: read each payload's fields, check them, stack them once.

Payloads are dicts of fields, or arrays (a list, tuple, NumPy array or torch
tensor that is the token row itself, with no other field). Nothing here writes
into a payload: stacking copies.
"""

from __future__ import annotations

import array
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import numpy as np
import torch
from tensordict import TensorDict

from zephon_collate.types import SampleBatch, SampleRecord
from zephon_collate.validation import check_field_names

__all__ = [
    "TOKEN_FIELD_CANDIDATES",
    "Columns",
    "as_record_tuple",
    "read_columns",
    "stack_batch",
    "stack_columns",
]

TOKEN_FIELD_CANDIDATES = ("input_ids", "tokens", "token_ids", "ids")
TOKENS = "input_ids"
PADDING_LENGTH = "padding_length"

INT64_MAX = 2**63 - 1

Row: TypeAlias = "np.ndarray | torch.Tensor"
Kind = Literal["ids", "values"]  # ids: integer only; values: bool, integer or float


def describe(records: Sequence[SampleRecord], index: int) -> str:
    """``record 3 (sample_id (0, 0, 7))``: how errors name a record."""
    return f"record {index} (sample_id {records[index].meta.sample_id})"


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
    """The records of a :class:`SampleBatch` or of a sequence of :class:`SampleRecord`.

    Raises:
        TypeError: for anything else (plain payload dicts included: the Collator wraps those).
    """
    if isinstance(batch, SampleBatch):
        return batch.records
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
        if record.meta.is_sentinel:
            tag = "tombstone" if record.meta.tombstone else "flush sentinel"
            raise ValueError(
                f"{describe(records, index)}: is a {tag}, a control record that carries no training data; "
                "drop sentinels before collating (pack_flat and FlatPacker consume them), e.g. "
                "[r for r in records if not r.meta.is_sentinel]"
            )
        payload = record.payload
        if not isinstance(payload, Mapping) and not is_array_payload(payload):
            raise TypeError(
                f"{describe(records, index)}: payload must be a dict of fields or a token array "
                f"(list, tuple, NumPy array or torch tensor), got {type(payload).__name__}"
            )


def resolve_tokens_field(records: Sequence[SampleRecord], tokens_field: str) -> str:
    """The payload field holding token ids: ``tokens_field``, or the first candidate all dicts have."""
    dicts = [(i, r.payload) for i, r in enumerate(records) if isinstance(r.payload, Mapping)]
    if tokens_field != "auto":
        for index, payload in dicts:
            if tokens_field not in payload:
                raise ValueError(
                    f"{describe(records, index)}: payload has no tokens field {tokens_field!r} "
                    f"(its fields: {sorted(map(str, payload))}); pass the right tokens_field"
                )
        return tokens_field
    for candidate in TOKEN_FIELD_CANDIDATES:
        if all(candidate in payload for _, payload in dicts):
            return candidate
    index, payload = next((i, p) for i, p in dicts if not any(c in p for c in TOKEN_FIELD_CANDIDATES))
    raise ValueError(
        f"tokens_field='auto' found none of {', '.join(TOKEN_FIELD_CANDIDATES)} in every payload; "
        f"{describe(records, index)} has fields {sorted(map(str, payload))}; pass tokens_field='<name>'"
    )


def _numpy_row(value: Any, where: object, name: str) -> np.ndarray:
    """A NumPy array of ``value``; a list or tuple gets the dtype NumPy infers for it (all bools: bool)."""
    if isinstance(value, (list, tuple)) and not (value and isinstance(value[0], bool)):
        try:  # the fast, exact path for a flat sequence of ints
            return np.frombuffer(array.array("q", value), dtype=np.int64)
        except (TypeError, OverflowError, RuntimeError, NotImplementedError):
            pass  # floats, bools, nested rows, ids beyond int64, device tensors: let NumPy tell which
    try:
        row = np.array(value)
    except ValueError:
        raise ValueError(
            f"{where}: field {name!r} is a ragged nested sequence; give equal-length rows"
        ) from None
    except (TypeError, RuntimeError, NotImplementedError):  # e.g. a list of tensors on a device
        raise TypeError(
            f"{where}: field {name!r} holds items that cannot be read as plain numbers; give a list of "
            "numbers, or one array or tensor"
        ) from None
    if row.dtype.kind == "O":
        if not isinstance(value, np.ndarray) and all(
            isinstance(item, numbers.Integral) and not isinstance(item, bool) for item in row.flat
        ):
            raise ValueError(
                f"{where}: field {name!r} holds integers that do not fit in int64; "
                "give integers from -2**63 to 2**63 - 1"
            )
        raise TypeError(
            f"{where}: field {name!r} holds Python objects that are not numbers (dtype object); "
            "give numbers only"
        )
    if row.dtype.kind == "u" and row.dtype.itemsize > 1:  # uint16/32/64: torch supports little on them
        if row.dtype.itemsize == 8 and row.size and row.max() > INT64_MAX:
            raise ValueError(
                f"{where}: field {name!r} holds values beyond int64 (dtype {row.dtype}); "
                "give values up to 2**63 - 1"
            )
        row = row.astype(np.int64)
    return row


def _tensor_row(value: torch.Tensor, where: object, name: str) -> torch.Tensor:
    """``value`` itself, or an exact int64 copy of a uint16/32/64 tensor."""
    if value.layout != torch.strided or value.is_nested or value.is_quantized:
        kind = "nested" if value.is_nested else "quantized" if value.is_quantized else str(value.layout)
        raise TypeError(
            f"{where}: field {name!r} is a {kind} tensor; give a plain dense tensor "
            "(.to_dense(), .dequantize())"
        )
    if value.dtype in (torch.uint16, torch.uint32, torch.uint64):
        if value.dtype == torch.uint64:
            as_signed = value.view(torch.int64)  # values beyond int64 read as negative
            if as_signed.device.type != "meta" and bool((as_signed < 0).any()):
                raise ValueError(
                    f"{where}: field {name!r} holds values beyond int64 (dtype {value.dtype}); "
                    "give values up to 2**63 - 1"
                )
            return as_signed
        return value.to(torch.int64)
    return value


def to_row(value: Any, where: object, name: str, kind: Kind) -> Row:
    """Check one payload value and return it as an array or tensor, without copying tensors.

    ``where`` names the value's record in error messages (a str, or a :class:`RecordName`).
    """
    if isinstance(value, torch.Tensor):
        row: Row = _tensor_row(value, where, name)
        bad = value.dtype.is_complex or (
            kind == "ids" and (value.dtype.is_floating_point or value.dtype == torch.bool)
        )
        dtype_name = str(value.dtype)
        empty_float = value.dtype.is_floating_point and value.numel() == 0
    elif isinstance(value, (np.ndarray, list, tuple, int, float, np.generic)) and not isinstance(
        value, (str, bytes)
    ):
        row = _numpy_row(value, where, name)
        allowed = "iu" if kind == "ids" else "biuf"
        bad = row.dtype.kind not in allowed
        dtype_name = str(row.dtype)
        empty_float = row.dtype.kind == "f" and row.size == 0
    else:
        raise TypeError(
            f"{where}: field {name!r} must be a list, tuple, NumPy array or torch tensor of numbers, "
            f"got {type(value).__name__}"
        )
    if bad and empty_float:  # torch.tensor([]) and np.array([]) are float: an empty row holds no float
        row = row.astype(np.int64) if isinstance(row, np.ndarray) else row.to(torch.int64)
    elif bad:
        expected = "integer token ids" if kind == "ids" else "bool, integer or float values"
        raise TypeError(f"{where}: field {name!r} has dtype {dtype_name}; it must hold {expected}")
    if kind == "ids" and row.ndim == 0:
        raise ValueError(f"{where}: field {name!r} must be a sequence, got a scalar")
    return row


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
        return [int(row.shape[0]) for row in self.rows[TOKENS]]


def read_field(
    records: Sequence[SampleRecord], name: str, tokens_field: str, kind: Kind, *, required: bool
) -> list[Row] | None:
    """Read ``name`` from every payload, or ``None`` if no payload has it.

    Raises:
        ValueError: if some payloads have the field and others lack it, or it is
            required and missing.
    """
    present = [
        (name in p) if isinstance(p, Mapping) else (name == tokens_field)
        for p in (r.payload for r in records)
    ]
    if not any(present) and not required:
        return None
    if not all(present):
        index = present.index(False)
        payload = records[index].payload
        holds = (
            f"its fields: {sorted(map(str, payload))}"
            if isinstance(payload, Mapping)
            else "an array payload holds only its token row"
        )
        reason = "some payloads have it and others lack it" if any(present) else "it is required"
        raise ValueError(f"{describe(records, index)}: payload lacks field {name!r} ({holds}); {reason}")
    rows = []
    for index, record in enumerate(records):
        payload = record.payload
        value = payload[name] if isinstance(payload, Mapping) else payload
        rows.append(to_row(value, RecordName(records, index), name, kind))
    return rows


def check_aligned(columns: Columns, name: str) -> None:
    """Raise ``ValueError`` if a field's rows do not have one entry per token."""
    for index, (row, length) in enumerate(zip(columns.rows[name], columns.lengths(), strict=True)):
        if row.ndim == 0 or row.shape[0] != length:
            got = "a scalar" if row.ndim == 0 else f"{row.shape[0]} entries"
            raise ValueError(
                f"{describe(columns.records, index)}: field {name!r} has {got} but the token row has "
                f"{length}; per-token fields must match the tokens one to one"
            )


def read_columns(
    records: Sequence[SampleRecord],
    *,
    tokens_field: str = "auto",
    optional: Sequence[str] = ("positions", "loss_mask"),
    required: Sequence[str] = (),
    aligned: Sequence[str] = ("positions", "loss_mask"),
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
    columns.rows[TOKENS] = read_field(records, field_name, field_name, "ids", required=True) or []
    for name in dict.fromkeys((*optional, *required)):
        kind: Kind = "ids" if name == "positions" else "values"
        rows = read_field(records, name, field_name, kind, required=name in required)
        if rows is not None:
            columns.rows[name] = rows
            if name in aligned:
                check_aligned(columns, name)
    columns.padding_lengths = [r.meta.padding_length for r in records]
    return columns


def check_padding_lengths(columns: Columns) -> list[int]:
    """Each record's trailing pad count (0 where unset), checked against its token row."""
    counts = []
    for index, (count, length) in enumerate(zip(columns.padding_lengths, columns.lengths(), strict=True)):
        if count is None:
            count = 0
        if not isinstance(count, (int, np.integer)) or isinstance(count, bool) or not 0 <= count <= length:
            raise ValueError(
                f"{describe(columns.records, index)}: meta.padding_length is {count!r} but must be an int "
                f"from 0 to the token row's length {length}"
            )
        counts.append(int(count))
    return counts


def _common_device(columns: Columns) -> torch.device:
    """The device of the token rows; any row elsewhere raises ``ValueError``."""
    device = None
    for name, rows in columns.rows.items():
        for index, row in enumerate(rows):
            here = row.device if isinstance(row, torch.Tensor) else torch.device("cpu")
            if device is None:
                device = here
            elif here != device:
                raise ValueError(
                    f"{describe(columns.records, index)}: field {name!r} is on {here} while record 0's "
                    f"tokens are on {device}; put all payload data on one device"
                )
    if device is not None and device.type == "meta":
        raise ValueError(
            "the payload tensors are on the 'meta' device, which holds no data; give tensors with data "
            "(on the CPU or an accelerator)"
        )
    return device or torch.device("cpu")


def _check_cast(stacked: torch.Tensor, dtype: torch.dtype, name: str, columns: Columns) -> None:
    source = stacked.dtype
    if source == dtype or source == torch.bool or stacked.numel() == 0:
        return
    if source.is_floating_point:
        bad_rows = (~torch.isfinite(stacked) | (stacked != stacked.round())).reshape(len(stacked), -1).any(1)
        problem = "non-integral or non-finite values"
    else:
        info = torch.iinfo(dtype)
        if torch.iinfo(source).bits < info.bits and torch.iinfo(source).min < 0:
            return
        if source == torch.uint8 and info.bits > 8:
            return
        bad_rows = ((stacked < info.min) | (stacked > info.max)).reshape(len(stacked), -1).any(1)
        problem = f"values outside the {dtype} range"
    if bool(bad_rows.any()):
        index = int(bad_rows.nonzero()[0, 0])
        raise ValueError(
            f"{describe(columns.records, index)}: field {name!r} holds {problem}, which {dtype} cannot "
            "represent exactly; fix the data or pick a wider dtype"
        )


def stack_rows(columns: Columns, name: str, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """Stack one field's rows into a ``[B, ...]`` tensor of ``dtype`` (``None``: keep the rows' dtype)."""
    rows = columns.rows[name]
    if not rows:  # an empty batch
        return torch.empty((0, 0), dtype=dtype or torch.long, device=device)
    first = tuple(rows[0].shape)
    for index, row in enumerate(rows):
        if tuple(row.shape) != first:
            what = "token rows" if name == TOKENS else f"rows of field {name!r}"
            raise ValueError(
                f"cannot stack {what} of unequal shape into a tensor: record 0 has shape {first}, "
                f"{describe(columns.records, index)} has {tuple(row.shape)}; pad or pack them "
                "(pack_flat), or pass dtype=None for lists"
            )
    if all(isinstance(row, np.ndarray) for row in rows):
        stacked = torch.from_numpy(np.stack(rows)).to(device)  # type: ignore[arg-type]
    else:
        tensors = [row if isinstance(row, torch.Tensor) else torch.tensor(row) for row in rows]
        stacked = torch.stack([t.to(device) for t in tensors])
    if dtype is None:
        return stacked
    _check_cast(stacked, dtype, name, columns)
    return stacked.to(dtype)


def stack_columns(
    columns: Columns,
    dtype: torch.dtype,
    *,
    padding_lengths: list[int] | None = None,
    keep_dtype: Sequence[str] = (),
) -> TensorDict:
    """Stack every field of ``columns`` into a ``TensorDict`` with ``batch_size=[B]``.

    Fields are cast to ``dtype`` except those in ``keep_dtype``; ``padding_lengths``,
    when given, becomes a ``[B]`` int64 ``"padding_length"`` entry.
    """
    device = _common_device(columns)
    data = {
        name: stack_rows(columns, name, None if name in keep_dtype else dtype, device)
        for name in columns.rows
    }
    if padding_lengths is not None:
        data[PADDING_LENGTH] = torch.tensor(padding_lengths, dtype=torch.int64, device=device)
    return TensorDict(data, batch_size=[len(columns.records)], device=device)


def stack_batch(
    batch: SampleBatch | Sequence[SampleRecord],
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
        batch: a :class:`SampleBatch` or a sequence of records.
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
        raise TypeError(f"{owner}: tokens_field must be a field name or 'auto', got {tokens_field!r}")
    extras = check_field_names("extra_fields", extra_fields, owner=owner)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{owner}: dtype must be a torch dtype such as torch.long, got {dtype!r}")
    if dtype not in (torch.int8, torch.int16, torch.int32, torch.int64):
        raise ValueError(f"{owner}: dtype must be a signed integer dtype such as torch.long, got {dtype}")
    if not isinstance(pin_memory, (bool, np.bool_)):
        raise TypeError(f"{owner}: pin_memory must be a bool, got {pin_memory!r}")
    if pin_memory and not torch.accelerator.is_available():
        raise ValueError(f"{owner}: pin_memory=True needs an accelerator, and none is available here")
    records = as_record_tuple(batch, owner)
    columns = read_columns(records, tokens_field=tokens_field, required=extras)
    td = stack_columns(columns, dtype, padding_lengths=check_padding_lengths(columns))
    return td.pin_memory() if pin_memory else td
