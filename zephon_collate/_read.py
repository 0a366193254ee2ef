"""The one payload reader: payloads to checked fields, for every entry point.

Records (:class:`~zephon_collate.SampleRecord`), plain payload dicts, Hugging
Face examples and packer documents are all read here, field by field:
:func:`read_field` takes one field from every payload, through the mapping
interface (:func:`payload_get`), as a row per payload (a NumPy array or a torch
tensor, a view of the payload wherever one is possible); :func:`concat` lays a
per-token field's rows end to end as a :class:`Ragged` (values and offsets), the
layout every later step works on; the ``check_*`` functions check a field's
values once, vectorised over the whole batch, and name the payload, the field,
the token and the fix. Nothing here writes into a payload.

Payloads are dicts of fields, or arrays (a list, tuple, NumPy array or torch
tensor that is the token row itself, with no other field).
"""

from __future__ import annotations

import array
import difflib
import functools
import itertools
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeAlias, cast

import numpy as np
import torch

from zephon_collate._text import shown, shown_fields
from zephon_collate.keys import INT64_MAX, TOKEN_FIELD_CANDIDATES
from zephon_collate.records import FLUSH_TAG, TOMBSTONE_TAG, SampleMeta, SampleRecord

__all__ = [
    "MISSING",
    "Kind",
    "Names",
    "Ragged",
    "Row",
    "Values",
    "as_numpy",
    "as_record",
    "as_record_tuple",
    "as_tensor",
    "check_fits",
    "check_flat",
    "check_ids",
    "check_payloads",
    "check_zero_one",
    "concat",
    "describe",
    "describe_record",
    "first_token_field",
    "gather_spans",
    "host_view",
    "is_array_payload",
    "misaligned",
    "misspelled",
    "numpy_dtype",
    "payload_get",
    "payload_items",
    "places",
    "read_field",
    "read_ragged",
    "record_names",
    "resolve_tokens_field",
    "row_any",
    "row_of",
    "sequence_of",
    "to_row",
]

Row: TypeAlias = "np.ndarray | torch.Tensor"
Kind = Literal["ids", "values"]
"""``"ids"``: integers only (token ids, positions); ``"values"``: bool, integer or float."""
Names: TypeAlias = Callable[[int], str]
"""How errors name the payload at a batch index: ``record 3 (sample_id (0, 0, 7))``, ``example 3``."""
MISSING: Any = object()
"""What :func:`payload_get` returns for an absent field when asked to (compare with ``is``)."""


def misspelled(fields: Iterable[object], known: Sequence[str]) -> tuple[str, str] | None:
    """``(field, meant)``: the first of ``fields`` that is a near miss of a supervision mask in ``known``
    (``loss_masks``, ``completion_masks``: a mask under a name nothing reads, so every token would be
    trained), or ``None``. Only names holding ``mask`` count, and only close ones (``attention_mask``,
    ``action_mask`` are other fields)."""
    for name in fields:
        if not isinstance(name, str) or name in known or "mask" not in name.lower():
            continue
        close = difflib.get_close_matches(name.lower(), known, n=1, cutoff=0.85)
        if close:
            return name, close[0]
    return None


def describe_record(index: int, record: SampleRecord) -> str:
    """``record 3 (sample_id (0, 0, 7))``: how errors name a record known by its place."""
    return f"record {index} (sample_id {record.meta.sample_id})"


def describe(records: Sequence[SampleRecord], index: int) -> str:
    """:func:`describe_record` of ``records[index]``."""
    return describe_record(index, records[index])


def record_names(records: Sequence[SampleRecord]) -> Names:
    """The :data:`Names` of a batch of records (formatted only when a message uses them)."""
    return lambda index: describe(records, index)


def is_array_payload(payload: object) -> bool:
    """True for a payload that is the token row itself (a list, tuple, NumPy array or tensor)."""
    return isinstance(payload, (list, tuple, np.ndarray, torch.Tensor))


def as_record(sample: object, index: int, owner: str) -> SampleRecord:
    """``sample`` as a record: a record as given, a plain payload (a dict or a token array) wrapped.

    A plain payload gets ``SampleMeta(sample_id=(0, 0, i), lane_id=0, chunk_id=0,
    chunk_offset=i)``, ``i`` being its place in the batch or stream, and no tags (so
    no padding): what Hugging Face datasets and ``transformers.Trainer`` hand over.

    Example:
        >>> as_record({"input_ids": [5, 6]}, 3, "Collator").meta.sample_id
        (0, 0, 3)

    Raises:
        TypeError: for an item that is neither a record, a dict nor a token array.
    """
    if isinstance(sample, SampleRecord):
        return sample
    if isinstance(sample, Mapping) or is_array_payload(sample):
        return SampleRecord(SampleMeta((0, 0, index), 0, 0, index), sample)
    raise TypeError(
        f"{owner}: item {index} must be a SampleRecord, a payload dict or a token array, "
        f"got {type(sample).__name__}"
    )


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
    found = tuple(batch)
    for index, record in enumerate(found):
        if not isinstance(record, SampleRecord):
            raise TypeError(
                f"{owner}: item {index} must be a SampleRecord, got {type(record).__name__}; wrap plain "
                "payloads in SampleRecord(meta, payload), or use Collator, which accepts them"
            )
    return found


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


def payload_get(payload: Mapping[Any, Any], name: str, default: Any = None) -> Any:
    """``payload[name]`` if ``name in payload``, else ``default``: read through the mapping interface.

    A plain ``dict`` takes the fast ``dict.get``; any other mapping (a ``dict``
    subclass overriding ``__getitem__`` included) answers through its own
    ``__contains__`` and ``__getitem__``.

    Example:
        >>> class Doubled(dict):
        ...     def __getitem__(self, key):
        ...         return 2 * super().__getitem__(key)
        >>> payload_get(Doubled(x=1), "x"), payload_get({"x": 1}, "y", 0)
        (2, 0)
    """
    if type(payload) is dict:
        return payload.get(name, default)
    return payload[name] if name in payload else default  # noqa: SIM401 (a subclass may not route .get)


def payload_items(payload: Mapping[Any, Any]) -> list[tuple[Any, Any]]:
    """The ``(name, value)`` pairs of a payload, each value read through ``payload[name]``."""
    if type(payload) is dict:
        return list(payload.items())
    return [(name, payload[name]) for name in payload]


def first_token_field(payload: Mapping[Any, Any]) -> str | None:
    """The first of ``TOKEN_FIELD_CANDIDATES`` that ``payload`` has, or ``None``."""
    return next((c for c in TOKEN_FIELD_CANDIDATES if c in payload), None)


def resolve_tokens_field(payloads: Sequence[Any], tokens_field: str, names: Names) -> str:
    """The payload field holding token ids: ``tokens_field``, or the first candidate all dict payloads have.

    Raises:
        ValueError: if an explicit field is missing from a payload, or no candidate is in every payload.
    """
    dicts = [(i, p) for i, p in enumerate(payloads) if type(p) is dict or isinstance(p, Mapping)]
    if tokens_field != "auto":
        for index, payload in dicts:
            if tokens_field not in payload:
                raise ValueError(
                    f"{names(index)}: payload has no tokens field {shown(tokens_field)} "
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
            f"{names(index)} has fields {shown_fields(payload)}; pass tokens_field='<name>'"
        )
    first_index, first = dicts[0]
    field = first_token_field(first)
    index, payload = next((i, p) for i, p in dicts if field not in p)
    raise ValueError(
        f"tokens_field='auto' found no token field that every payload has: {names(first_index)} "
        f"has {shown(field)}, {names(index)} has fields {shown_fields(payload)}; "
        "give every payload the same token field, or pass tokens_field='<name>'"
    )


def _sequence_array(value: Any, where: str, name: str) -> np.ndarray:
    """``np.array(value)``, with a ragged or unreadable sequence as a ``ValueError`` / ``TypeError``."""
    try:
        return np.array(value)
    except ValueError:
        raise ValueError(
            f"{where}: field {shown(name)} is a ragged nested sequence; give equal-length rows"
        ) from None
    except (TypeError, RuntimeError, NotImplementedError):  # e.g. a list of tensors on a device
        raise TypeError(
            f"{where}: field {shown(name)} holds items that cannot be read as plain numbers; give a list of "
            "numbers, or one array or tensor"
        ) from None


def _beyond_int64(where: str, name: str) -> ValueError:
    return ValueError(
        f"{where}: field {shown(name)} holds values beyond int64; give integers from -2**63 to 2**63 - 1"
    )


def _numpy_row(value: Any, where: str, name: str) -> np.ndarray:
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
        if type(value) is not np.ndarray:  # a subclass (np.memmap, ...): read as a plain view of its data
            if isinstance(value, np.ma.MaskedArray) and np.ma.is_masked(value):
                raise ValueError(
                    f"{where}: field {shown(name)} is a masked array with masked entries, whose data would "
                    "be read as if unmasked; fill them (.filled(value)) or drop them"
                )
            value = value.view(np.ndarray)
        row = value if value.flags.c_contiguous else np.array(value)
    else:
        row = _sequence_array(value, where, name)
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


def _tensor_row(value: torch.Tensor, where: str, name: str) -> torch.Tensor:
    """``value`` itself, or an exact int64 copy of a uint16/32/64 tensor."""
    if value.layout != torch.strided or value.is_nested or value.is_quantized:
        kind = "nested" if value.is_nested else "quantized" if value.is_quantized else str(value.layout)
        raise TypeError(
            f"{where}: field {shown(name)} is a {kind} tensor; give a plain dense tensor "
            "(.to_dense(), .dequantize())"
        )
    if value.device.type == "meta":
        raise ValueError(
            f"{where}: field {shown(name)} is a tensor on the 'meta' device, which holds no data; give "
            "tensors with data (on the CPU or an accelerator)"
        )
    if value.dtype in (torch.uint16, torch.uint32, torch.uint64):
        if value.dtype == torch.uint64:
            as_signed = value.view(torch.int64)  # values beyond int64 read as negative
            if bool((as_signed < 0).any()):
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
    "values": frozenset((*_INTEGER_DTYPES, torch.bool, *_FLOAT_DTYPES)),
}


def to_row(value: Any, where: str, name: str, kind: Kind) -> Row:
    """Check one payload value and return it as an array or tensor, without copying tensors.

    Raises:
        TypeError: for a value that is not numbers (a str, objects, a sparse tensor, ...) or of
            the wrong kind (floats as token ids).
        ValueError: for values beyond int64, a tensor without data, or token ids given as a
            scalar or as a batch of one row.
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
    elif isinstance(value, (np.ndarray, list, tuple, int, float, np.generic)):
        row = _numpy_row(value, where, name)
        bad = row.dtype.kind not in ("iu" if kind == "ids" else "biuf")
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
    if row.is_cpu and not row.requires_grad and row.dtype != torch.bfloat16:
        return row.numpy()  # the common case, a view
    tensor = row.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def host_view(values: Values) -> Values:
    """What the checks compute on: host values as they are, a CPU tensor as a NumPy view, a device
    tensor where it is.

    NumPy's comparisons run several times faster than torch's on the CPU; on a device
    the tensor stays where it is. The checks below use operations both share.
    """
    if isinstance(values, np.ndarray) or values.device.type != "cpu":
        return values
    return as_numpy(values)


def read_field(
    payloads: Sequence[Any],
    name: str,
    tokens_field: str,
    kind: Kind,
    names: Names,
    *,
    required: bool,
    fill: Callable[[int], Row] | None = None,
) -> list[Row] | None:
    """``name`` of every payload, one checked row each (:func:`to_row`), or ``None`` if no payload has it.

    An array payload is its token row (``tokens_field``) and has no other field.
    With ``fill``, a payload lacking the field gets ``fill(index)`` instead
    (Hugging Face examples may carry ``labels`` or a mask in some rows only).

    Raises:
        ValueError: if some payloads have the field and others lack it (without ``fill``), or
            it is required and missing.
    """
    values = _values(payloads, name, tokens_field, names, required=required, fill=fill)
    return None if values is None else _rows(values, name, kind, names)


def read_ragged(
    payloads: Sequence[Any],
    name: str,
    tokens_field: str,
    kind: Kind,
    names: Names,
    *,
    required: bool,
    fill: Callable[[int], Row] | None = None,
) -> Ragged | None:
    """:func:`read_field`'s rows end to end (:func:`concat`), or ``None`` if no payload has ``name``.

    Rows given as lists of Python ints, the common case of tokenized datasets,
    are read in one pass into one fresh int64 buffer, without a copy per row.

    Example:
        >>> field = read_ragged([{"ids": [5, 6, 7]}, {"ids": [8]}], "ids", "ids", "ids", str, required=True)
        >>> field.values.tolist(), field.offsets.tolist()
        ([5, 6, 7, 8], [0, 3, 4])

    Raises:
        the errors of :func:`read_field` and :func:`concat`.
    """
    values = _values(payloads, name, tokens_field, names, required=required, fill=fill)
    if values is None:
        return None
    joined = _joined_ints(values)
    return joined if joined is not None else concat(_rows(values, name, kind, names), name, names)


def _joined_ints(values: list[Any]) -> Ragged | None:
    """Lists of Python ints end to end in one int64 buffer, or ``None`` for anything else (read row
    by row, where the errors are named)."""
    buffer = array.array("q")
    lengths = []
    try:
        for value in values:
            if type(value) is not list or (value and type(value[0]) is not int):
                return None
            buffer.fromlist(value)
            lengths.append(len(value))
    except (OverflowError, TypeError):
        return None  # beyond int64, or not ints after the first: the row-by-row read names it
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    offsets[1:] = lengths
    offsets.cumsum(out=offsets)  # in place, on the array: np.cumsum of a list converts it again
    return Ragged(np.frombuffer(buffer, dtype=np.int64) if buffer else np.empty(0, np.int64), offsets)


def _values(
    payloads: Sequence[Any],
    name: str,
    tokens_field: str,
    names: Names,
    *,
    required: bool,
    fill: Callable[[int], Row] | None,
) -> list[Any] | None:
    """``name`` of every payload (``fill(index)`` where one lacks it), unchecked; ``None`` if none has it."""
    values = [
        p.get(name, MISSING)
        if type(p) is dict  # the common case first: isinstance against Mapping is an ABC check, slower
        else payload_get(p, name, MISSING)
        if isinstance(p, Mapping)
        else (p if name == tokens_field else MISSING)
        for p in payloads
    ]
    lacking = [index for index, value in enumerate(values) if value is MISSING]  # `is`: no tensor ==
    if len(lacking) == len(values) and not required:
        return None
    if lacking and fill is not None and len(lacking) < len(values):
        for index in lacking:
            values[index] = fill(index)
        lacking = []
    if lacking:
        index = lacking[0]
        payload = payloads[index]
        holds = (
            f"its fields: {shown_fields(payload)}"
            if isinstance(payload, Mapping)
            else "an array payload holds only its token row"
        )
        reason = (
            "some payloads have it and others lack it" if len(lacking) < len(values) else "it is required"
        )
        raise ValueError(f"{names(index)}: payload lacks field {shown(name)} ({holds}); {reason}")
    return values


def _rows(values: list[Any], name: str, kind: Kind, names: Names) -> list[Row]:
    """Every value checked (:func:`to_row`); plain tensors pass as they are."""
    plain = _PLAIN_DTYPES[kind]
    return [
        value
        if type(value) is torch.Tensor
        and value.dtype in plain
        and (value.ndim == 1 or (value.ndim > 1 and kind == "values"))
        and value.layout is torch.strided
        and not value.is_meta
        else to_row(value, names(index), name, kind)
        for index, value in enumerate(values)
    ]


Values: TypeAlias = "np.ndarray | torch.Tensor"
"""A field's values: a NumPy array on the host (CPU data, viewed without a copy), a tensor on a device."""


class Ragged:
    """One per-token field of a batch: every row's values end to end, and where each row starts.

    ``values`` is ``[N, ...]``: a NumPy array for data on the host (where the
    checks and the stacking run in NumPy, several times faster than torch
    there), a torch tensor for data on an accelerator. ``offsets`` is ``[B + 1]``
    int64 (NumPy, from 0 to ``N``): row ``b`` is ``values[offsets[b]:offsets[b + 1]]``.
    This is the layout of a padding-free batch, and of an Arrow list column.

    Example:
        >>> field = concat([np.array([5, 6, 7]), np.array([8])], "input_ids", str)
        >>> field.values.tolist(), field.offsets.tolist(), field.lengths.tolist()
        ([5, 6, 7, 8], [0, 3, 4], [3, 1])
    """

    __slots__ = ("lengths", "offsets", "values")  # a plain class: several are made per field and call

    def __init__(self, values: Values, offsets: np.ndarray) -> None:
        self.values = values
        self.offsets = offsets
        self.lengths: np.ndarray = (
            offsets[1:] - offsets[:-1]
        )  # [B] row lengths (np.diff costs more on short arrays)

    def __repr__(self) -> str:
        return f"Ragged(values={self.values!r}, offsets={self.offsets!r})"

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1

    @property
    def on_host(self) -> bool:
        return isinstance(self.values, np.ndarray)

    def row(self, index: int) -> Values:
        """Row ``index``'s values (a view)."""
        return self.values[int(self.offsets[index]) : int(self.offsets[index + 1])]

    def take(self, index: int) -> Ragged:
        """Row ``index`` alone, as a one-row :class:`Ragged` (a view)."""
        row = self.row(index)
        return Ragged(row, np.array([0, row.shape[0]], dtype=np.int64))

    def select(self, keep: np.ndarray) -> Ragged:
        """The tokens where the ``[N]`` boolean ``keep`` is True, each row keeping its own."""
        kept = np.zeros(len(keep) + 1, dtype=np.int64)
        np.cumsum(keep, out=kept[1:])
        mask = keep if self.on_host else torch.from_numpy(keep).to(self.values.device)
        return Ragged(self.values[mask], kept[self.offsets])

    def cast(self, dtype: torch.dtype) -> Ragged:
        """The values in ``dtype``: no copy when they are in it already, unless they are read-only (a
        view of columnar input), which the batch never hands out."""
        if isinstance(self.values, np.ndarray):
            copy = not self.values.flags.writeable
            return Ragged(self.values.astype(numpy_dtype(dtype), copy=copy), self.offsets)
        return Ragged(self.values.to(dtype), self.offsets)

    @property
    def host(self) -> np.ndarray:
        """The values, read on the host (a tensor on a device is copied back)."""
        return as_numpy(self.values)


_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {}


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype of a torch dtype that has one (every integer, bool and float dtype but bfloat16)."""
    found = _NUMPY_DTYPES.get(dtype)
    if found is None:
        found = _NUMPY_DTYPES[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
    return found


def as_tensor(values: Values) -> torch.Tensor:
    """``values`` as a tensor: a host array wrapped without a copy."""
    return torch.from_numpy(values) if isinstance(values, np.ndarray) else values


def _device_of(rows: Sequence[Row], name: str, names: Names) -> torch.device:
    """The one device of a field's rows (NumPy rows count as the CPU); two devices raise ``ValueError``."""
    device = torch.device("cpu")
    for index, row in enumerate(rows):
        here = row.device if isinstance(row, torch.Tensor) else torch.device("cpu")
        if index == 0:
            device = here
        elif here != device:
            raise ValueError(
                f"{names(index)}: field {shown(name)} is on {here} while the first payload's is on "
                f"{device}; put all payload data on one device"
            )
    return device


def concat(rows: Sequence[Row], name: str, names: Names) -> Ragged:
    """A field's rows end to end (one copy, never a view of a payload), as a :class:`Ragged`.

    Rows may be NumPy arrays or tensors of any dtypes (the widest wins, as
    NumPy and torch promote); they must share their trailing dims and device.
    Rows on the CPU give host values, rows on an accelerator a tensor there.

    Raises:
        ValueError: if a row is one value (0-d), if rows differ beyond their first dim, or lie on
            different devices.
    """
    if not rows:
        return Ragged(np.empty(0, dtype=np.int64), np.zeros(1, dtype=np.int64))
    try:
        lengths = [row.shape[0] for row in rows]
    except IndexError:  # a 0-d row: named here, off the common path
        index = next(i for i, row in enumerate(rows) if row.ndim == 0)
        raise ValueError(
            f"{names(index)}: field {shown(name)} is one value ({rows[index].item()!r}), but it is read as "
            "a row of values, one per token; give it one value per token, or drop it (a per-example "
            "label, as for sequence classification, is not a token field)"
        ) from None
    if len(set(lengths)) == 1:  # rows of one length (packed rows): no running sum to take
        offsets = np.arange(len(rows) + 1, dtype=np.int64) * lengths[0]
    else:
        offsets = np.array(list(itertools.accumulate(lengths, initial=0)), dtype=np.int64)
    # Always a copy, even of one row: what the batch holds never shares memory with a payload.
    first = type(rows[0])
    if all(type(row) is first for row in rows):  # one kind of row: one concatenation, which checks shapes
        try:
            if first is np.ndarray:
                arrays = cast(Sequence[np.ndarray], rows)
                return Ragged(np.concatenate(arrays) if len(arrays) > 1 else arrays[0].copy(), offsets)
            joined = torch.cat(list(cast(Sequence[torch.Tensor], rows)))
            if joined.is_cpu and not joined.requires_grad and joined.dtype != torch.bfloat16:
                return Ragged(joined.numpy(), offsets)  # the common case, a view of the fresh copy
            return Ragged(as_numpy(joined) if joined.is_cpu else joined, offsets)
        except (ValueError, RuntimeError):
            pass  # shapes or devices differ: the loop below names the row
    trailing = rows[0].shape[1:]
    for index, row in enumerate(rows):
        if row.shape[1:] != trailing:
            raise ValueError(
                f"{names(index)}: field {shown(name)} has shape {tuple(row.shape)}, the first payload's "
                f"{tuple(rows[0].shape)}; rows may differ in length only"
            )
    if all(isinstance(row, np.ndarray) or row.is_cpu for row in rows):
        return Ragged(np.concatenate([as_numpy(row) for row in rows]), offsets)
    _device_of(rows, name, names)  # raises, naming the row on another device
    return Ragged(torch.cat([torch.as_tensor(row) for row in rows]), offsets)


def row_any(flags: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``[B]`` booleans: does row ``b`` (``flags[offsets[b]:offsets[b + 1]]``) hold a True? Empty rows: no.

    Example:
        >>> row_any(np.array([False, True, False, False]), np.array([0, 2, 2, 4])).tolist()
        [True, False, False]
    """
    counts = np.zeros(len(offsets) - 1, dtype=np.int64)
    nonempty = offsets[1:] > offsets[:-1]
    if flags.size:
        counts[nonempty] = np.add.reduceat(flags, offsets[:-1][nonempty])
    return counts > 0


def sequence_of(offsets: np.ndarray) -> np.ndarray:
    """``[N]``: the row of every value of a :class:`Ragged` with these offsets."""
    return np.repeat(np.arange(len(offsets) - 1, dtype=np.int64), np.diff(offsets))


def places(offsets: np.ndarray) -> np.ndarray:
    """``[N]``: every value's place in its row."""
    lengths = np.diff(offsets)
    return np.asarray(np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(offsets[:-1], lengths))


def gather_spans(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices ``starts[i] .. starts[i] + lengths[i] - 1`` of every span, end to end.

    Example:
        >>> gather_spans(np.array([5, 0, 9]), np.array([2, 0, 3])).tolist()
        [5, 6, 9, 10, 11]
    """
    total = int(lengths.sum())
    ends = np.cumsum(lengths)
    return np.asarray(np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths))


def check_flat(field: Ragged, name: str, where: str) -> None:
    """``ValueError`` unless ``field`` holds one value per token (1-D values), naming ``where``."""
    if field.values.ndim != 1:
        raise ValueError(
            f"{where}: field {shown(name)} must be 1-D (one entry per token), got rows of shape "
            f"{tuple(field.values.shape[1:])} per token"
        )


def misaligned(where: str, name: str, entries: int | None, length: int) -> ValueError:
    """The refusal of a per-token field whose row does not hold one entry per token (``entries=None``:
    one value, not a row)."""
    got = "a scalar" if entries is None else f"{entries} entries"
    return ValueError(
        f"{where}: field {shown(name)} has {got} but the token row has {length}; per-token fields must "
        "match the tokens one to one"
    )


def row_of(offsets: np.ndarray, flat_index: int) -> int:
    """The row holding flat token ``flat_index`` (empty rows hold none)."""
    return int(np.searchsorted(offsets, flat_index, side="right")) - 1


def _first_true(mask: np.ndarray | torch.Tensor) -> int | None:
    """The flat index of the first True of a boolean array or tensor, or ``None``."""
    if isinstance(mask, torch.Tensor):
        found = mask.reshape(-1).nonzero()
        return int(found[0, 0]) if found.numel() else None
    flat = np.flatnonzero(mask)
    return int(flat[0]) if flat.size else None


def _token(field: Ragged, flat: int, name: str) -> str:
    """``name[t]`` of the token at flat index ``flat`` (per-token fields of ``[N, ...]`` count whole rows)."""
    per_token = max(1, int(np.prod(field.values.shape[1:])))
    token = flat // per_token
    return f"{name}[{token - int(field.offsets[row_of(field.offsets, token)])}]"


def _bad_at(field: Ragged, bad: np.ndarray | torch.Tensor) -> tuple[int, int] | None:
    """``(row, flat index)`` of the first True in ``bad`` (shaped like ``field.values``), or ``None``."""
    flat = _first_true(bad)
    if flat is None:
        return None
    per_token = max(1, int(np.prod(field.values.shape[1:])))
    return row_of(field.offsets, flat // per_token), flat


def _kind(values: Values) -> str:
    """NumPy's dtype kind of host values or a tensor: ``"b"``, ``"i"``, ``"u"``, ``"f"``."""
    if isinstance(values, np.ndarray):
        return str(values.dtype.kind)
    dtype = values.dtype
    if dtype == torch.bool:
        return "b"
    return "f" if dtype.is_floating_point else "u" if dtype == torch.uint8 else "i"


def _size(values: Values) -> int:
    return int(values.size) if isinstance(values, np.ndarray) else int(values.numel())


@functools.lru_cache(maxsize=64)
def _range_of(dtype: np.dtype | torch.dtype) -> tuple[int, int]:
    info = torch.iinfo(dtype) if isinstance(dtype, torch.dtype) else np.iinfo(dtype)
    return int(info.min), int(info.max)


def _integer_range(values: Values) -> tuple[int, int]:
    return _range_of(values.dtype)


def check_ids(field: Ragged, name: str, names: Names) -> None:
    """``ValueError`` naming the first payload with a negative id in ``field`` (an embedding would fail).

    Example:
        >>> check_ids(concat([np.array([1, 2]), np.array([3, -4])], "input_ids", str), "input_ids",
        ...           lambda i: f"example {i}")
        Traceback (most recent call last):
        ...
        ValueError: example 1: field 'input_ids' token ids must be >= 0, found -4 at input_ids[1]
    """
    values = host_view(field.values)
    if not _size(values) or _kind(values) in "bu" or values.min() >= 0:  # one reduction on the common path
        return
    found = _bad_at(field, values < 0)
    assert found is not None
    row, flat = found
    value = int(values.reshape(-1)[flat])
    raise ValueError(
        f"{names(row)}: field {shown(name)} token ids must be >= 0, found {value} at "
        f"{_token(field, flat, name)}"
    )


def check_zero_one(field: Ragged, name: str, names: Names, meaning: str) -> None:
    """``ValueError`` naming the first payload whose ``field`` holds a value other than 0 and 1.

    ``meaning`` says what 1 means (e.g. "1 for supervised tokens, 0 for the rest").
    NaN counts as neither. Booleans always pass.
    """
    values = host_view(field.values)
    kind = _kind(values)
    if kind == "b" or not _size(values):
        return
    # As unsigned, 0 and 1 are the only values <= 1: one reduction on the common path.
    if (
        kind in "iu"
        and isinstance(values, np.ndarray)
        and values.view(values.dtype.str.replace("i", "u")).max() <= 1
    ):
        return
    bad = (values != 0) & (values != 1)
    found = _bad_at(field, bad)
    if found is None:
        return
    row, flat = found
    value = values.reshape(-1)[flat].item()
    raise ValueError(
        f"{names(row)}: field {shown(name)} must hold only 0 and 1 (or booleans), {meaning}; found "
        f"{shown(value)} at {_token(field, flat, name)}"
    )


def check_fits(field: Ragged, dtype: torch.dtype, name: str, names: Names) -> None:
    """``ValueError`` naming the first payload whose ``field`` values the integer ``dtype`` cannot hold.

    Floats must be integral and finite; integers must lie in ``dtype``'s range.
    """
    values = host_view(field.values)
    kind = _kind(values)
    if kind == "b" or not _size(values):
        return
    smallest, largest = _range_of(dtype)
    if kind in "iu":
        low, high = _integer_range(values)
        if smallest <= low and high <= largest:
            return  # every value of the source dtype fits
        if smallest <= values.min() and values.max() <= largest:
            return
        problems = [((values < smallest) | (values > largest), f"values outside the {dtype} range")]
    else:  # compared in float64, where -2**63 and 2**63 are exact (in float16 they overflow)
        values = values.astype(np.float64) if isinstance(values, np.ndarray) else values.double()
        finite = np.isfinite(values) if isinstance(values, np.ndarray) else torch.isfinite(values)
        rounded = np.round(values) if isinstance(values, np.ndarray) else values.round()
        problems = [
            (~finite | (values != rounded), "non-integral or non-finite values"),
            (
                (values < float(smallest)) | (values >= float(largest) + 1),
                f"values outside the {dtype} range",
            ),
        ]
    for bad, problem in problems:
        found = _bad_at(field, bad)
        if found is not None:
            row, flat = found
            floats = (
                "; float data (log-probs, advantages) keeps a float dtype of its own in "
                f"Collator(float_fields=[{shown(name)}])"
                if problem.startswith("non-integral")
                else ""
            )
            raise ValueError(
                f"{names(row)}: field {shown(name)} holds {problem} (e.g. "
                f"{shown(values.reshape(-1)[flat].item())} at {_token(field, flat, name)}), which {dtype} "
                f"cannot represent exactly; fix the data or pick a wider dtype{floats}"
            )
