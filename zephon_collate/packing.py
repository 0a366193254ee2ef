"""pack_flat: pack tokenized records into flat rows of exactly ``seq_len`` tokens.

Documents are laid end to end in rows; each document (or piece of one) is a
segment whose ``positions`` restart at 0, and the trailing padding is a segment
of its own, so ``to_training(return_cu_seqlens=True)`` finds every document
boundary and padding never joins a document. :func:`pack_flat` packs a list;
:class:`zephon_collate.packing_stream.FlatPacker` packs an endless stream with a
bounded buffer and a resumable state. Both give the same rows for the same
input and options, and neither changes its input records. Tokens are handled
with NumPy slicing and concatenation: Python loops run over documents only.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from zephon_collate.payloads import TOKEN_FIELD_CANDIDATES, is_array_payload
from zephon_collate.types import SampleBatch, SampleRecord

__all__ = ["OVERFLOWS", "STRATEGIES", "pack_flat"]

STRATEGIES = ("greedy", "best_fit")
OVERFLOWS = ("split", "truncate")
LOSS_MASK = "loss_mask"
POSITIONS = "positions"
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def _where(index: int, record: SampleRecord) -> str:
    return f"record {index} (sample_id {record.meta.sample_id})"


def _check_int(owner: str, name: str, value: object, minimum: int, maximum: int = INT64_MAX) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"{owner}: {name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})"
        )
    if value < minimum:
        raise ValueError(f"{owner}: {name} must be an int >= {minimum}, got {value!r}")
    if value > maximum:
        raise ValueError(f"{owner}: {name} must be an int <= {maximum}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class PackOptions:
    """The options of :func:`pack_flat` and ``FlatPacker``, checked by :meth:`create`."""

    seq_len: int
    pad_token_id: int
    emit_positions: bool
    tokens_field: str
    strategy: str
    overflow: str
    buffer_size: int | None
    fields: tuple[str, ...] | None

    @classmethod
    def create(cls, owner: str, **options: Any) -> PackOptions:
        """Check every option, raising ``TypeError``/``ValueError`` that names it and says what to pass."""
        checked = dict(options)
        checked["seq_len"] = _check_int(owner, "seq_len", options["seq_len"], 1, INT32_MAX)  # int32 offsets
        checked["pad_token_id"] = _check_int(owner, "pad_token_id", options["pad_token_id"], 0)
        if options["buffer_size"] is not None or owner != "pack_flat":
            checked["buffer_size"] = _check_int(owner, "buffer_size", options["buffer_size"], 1)
        if not isinstance(options["emit_positions"], bool):
            raise TypeError(f"{owner}: emit_positions must be a bool, got {options['emit_positions']!r}")
        tokens_field = options["tokens_field"]
        if not isinstance(tokens_field, str) or not tokens_field:
            raise TypeError(f"{owner}: tokens_field must be 'auto' or a field name, got {tokens_field!r}")
        for name, allowed in (("strategy", STRATEGIES), ("overflow", OVERFLOWS)):
            if not isinstance(options[name], str) or options[name] not in allowed:
                choices = " or ".join(map(repr, allowed))
                raise ValueError(f"{owner}: {name} must be {choices}, got {options[name]!r}")
        fields = options["fields"]
        if fields is not None:
            if isinstance(fields, (str, bytes)) or not isinstance(fields, Iterable):
                raise TypeError(f"{owner}: fields must be None or a sequence of field names, got {fields!r}")
            checked["fields"] = fields = tuple(fields)
            for name in fields:
                if not isinstance(name, str):
                    raise TypeError(f"{owner}: fields must hold str field names, got {name!r}")
                if name == tokens_field or (name == POSITIONS and options["emit_positions"]):
                    hint = "; pass emit_positions=False to pack input positions" if name == POSITIONS else ""
                    raise ValueError(f"{owner}: fields may not list {name!r}, which the packer writes{hint}")
            if len(set(fields)) != len(fields):
                raise ValueError(f"{owner}: fields lists a name twice: {fields!r}")
        return cls(**checked)


def _as_array(value: object, where: str, name: str, *, ids: bool) -> np.ndarray:
    """A 1-D NumPy view of a payload value (token ids: int64, >= 0); never copies an int64 ndarray."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_nested or value.is_quantized or value.is_meta:
            kinds = {"meta": value.is_meta, "nested": value.is_nested, "quantized": value.is_quantized}
            kind = next((k for k, hit in kinds.items() if hit), str(value.layout))
            raise TypeError(f"{where}: field {name!r} is a {kind} tensor; give a dense tensor with data")
        tensor = value.detach().cpu()
        array = (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
    elif isinstance(value, np.ndarray):
        array = value
    elif isinstance(value, (list, tuple)):
        try:
            array = np.asarray(value)
        except ValueError:
            raise ValueError(
                f"{where}: field {name!r} is a ragged nested sequence; give a flat sequence"
            ) from None
        except (TypeError, RuntimeError, NotImplementedError):  # e.g. a list of tensors on a device
            raise TypeError(
                f"{where}: field {name!r} holds items that cannot be read as plain numbers; give a list "
                "of numbers, or one array or tensor"
            ) from None
        if array.size == 0:
            array = array.astype(np.int64)  # [] reads as float64
    else:
        raise TypeError(
            f"{where}: field {name!r} must be a list, tuple, NumPy array or torch tensor, "
            f"got {type(value).__name__}"
        )
    if array.ndim != 1:
        raise ValueError(
            f"{where}: field {name!r} must be 1-D (one entry per token), got shape {array.shape}"
        )
    if ids and array.dtype.kind == "O" and all(isinstance(v, numbers.Integral) for v in array):
        raise ValueError(f"{where}: field {name!r} holds token ids beyond int64; give ids up to 2**63 - 1")
    if ids and array.dtype.kind == "f" and array.size == 0:  # torch.tensor([]), np.array([]): no float in it
        array = array.astype(np.int64)
    if ids and array.dtype.kind not in "iu":
        raise TypeError(
            f"{where}: field {name!r} has dtype {array.dtype}; token ids must be integers "
            "(cast whole-number floats with .astype(np.int64))"
        )
    if array.dtype.kind not in "biuf":
        raise TypeError(
            f"{where}: field {name!r} has dtype {array.dtype}; it must hold bool, integer or float values"
        )
    if not ids:
        return array
    if array.size and array.dtype == np.uint64 and array.max() > INT64_MAX:
        raise ValueError(f"{where}: field {name!r} holds token ids beyond int64; give ids up to 2**63 - 1")
    array = array.astype(np.int64, copy=False)
    if array.size and array.min() < 0:
        raise ValueError(
            f"{where}: field {name!r} holds a negative token id ({array.min()}); ids must be >= 0"
        )
    return array


def _check_loss_mask(values: np.ndarray, where: str) -> None:
    """``ValueError`` unless a packed ``loss_mask`` holds only 0 and 1 (NaN included)."""
    if values.dtype.kind != "b" and values.size and not np.isin(values, (0, 1)).all():
        raise ValueError(
            f"{where}: field 'loss_mask' must hold only 0 and 1 (or booleans): 1 for supervised tokens, "
            "0 for the rest"
        )


def candidate_fields(payload: Mapping[Any, Any], tokens_name: str, length: int, where: str) -> list[str]:
    """The per-token fields of one dict payload: ``loss_mask`` (checked strictly), then numeric 1-D
    fields with ``length`` entries, in payload order. Input ``positions`` are never candidates."""
    found = []
    if LOSS_MASK in payload:
        if len(_as_array(payload[LOSS_MASK], where, LOSS_MASK, ids=False)) != length:
            raise ValueError(f"{where}: field 'loss_mask' does not have one entry per token ({length})")
        found.append(LOSS_MASK)
    for name, value in payload.items():
        if isinstance(name, str) and name not in (tokens_name, POSITIONS, LOSS_MASK):
            try:
                if len(_as_array(value, where, name, ids=False)) == length:
                    found.append(name)
            except (TypeError, ValueError):
                continue
    return found


class Reader:
    """Reads documents: the token field and the packed fields of each record.

    ``tokens_name``/``fields`` set to ``None`` are fixed by the first record
    with tokens (``strict``: later records must then agree on ``loss_mask``).
    """

    def __init__(self, tokens_name: str | None, fields: tuple[str, ...] | None, *, strict: bool) -> None:
        self.tokens_name = tokens_name
        self.fields = fields
        self.strict = strict

    def read(self, record: SampleRecord, index: int) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
        """``(tokens, {field: values})`` of a record, or ``None`` for a document without tokens."""
        payload, where = record.payload, _where(index, record)
        if not isinstance(payload, Mapping):
            if not is_array_payload(payload):
                raise TypeError(
                    f"{where}: payload must be a dict of fields or a token array (list, tuple, NumPy array "
                    f"or torch tensor), got {type(payload).__name__}"
                )
            tokens = _as_array(payload, where, self.tokens_name or "input_ids", ids=True)
            if not tokens.size:
                return None
            self.tokens_name = self.tokens_name or "input_ids"
            self.fields = () if self.fields is None else self.fields
            if self.fields:
                raise ValueError(
                    f"{where}: an array payload holds only its token row, but fields {self.fields} are "
                    "packed beside the tokens; give it a dict payload with them, or pass fields=()"
                )
            return tokens, {}
        name = self.tokens_name or next((c for c in TOKEN_FIELD_CANDIDATES if c in payload), None)
        if name is None or name not in payload:
            wanted = repr(name) if name else f"any of {', '.join(TOKEN_FIELD_CANDIDATES)}"
            raise ValueError(
                f"{where}: payload has no tokens field {wanted} (its fields: {sorted(map(str, payload))}); "
                "pass the right tokens_field"
            )
        tokens = _as_array(payload[name], where, name, ids=True)
        if not tokens.size:
            return None
        self.tokens_name = name
        if self.fields and name in self.fields:
            raise ValueError(
                f"{where}: the tokens field {name!r} is also listed in fields; drop it from fields"
            )
        if self.fields is None:
            self.fields = tuple(candidate_fields(payload, name, tokens.size, where))
        elif self.strict and LOSS_MASK in payload and LOSS_MASK not in self.fields:
            raise ValueError(
                f"{where}: payload has a 'loss_mask' but earlier records have none; give every record a "
                "loss_mask (1 = supervised), or pass fields=(...) to choose the packed fields"
            )
        values = {}
        for field_name in self.fields:
            if field_name not in payload:
                raise ValueError(
                    f"{where}: payload lacks field {field_name!r}, which is packed beside the tokens "
                    f"(fields {self.fields}); give every record this field, or pass fields=(...) without it"
                )
            values[field_name] = _as_array(payload[field_name], where, field_name, ids=False)
            if field_name == LOSS_MASK:
                _check_loss_mask(values[field_name], where)
            if len(values[field_name]) != tokens.size:
                raise ValueError(
                    f"{where}: field {field_name!r} has {len(values[field_name])} entries but the token row "
                    f"has {tokens.size}; per-token fields must match the tokens one to one"
                )
        return tokens, values


def _shared_fields(records: Sequence[SampleRecord], tokens_name: str) -> tuple[str, ...]:
    """The per-token fields every document with tokens shares; ``loss_mask`` in only some: ``ValueError``."""
    shared: list[str] | None = None
    with_mask: int | None = None
    without_mask: int | None = None
    for index, record in enumerate(records):
        payload, where = record.payload, _where(index, record)
        if record.meta.is_sentinel:
            continue
        if isinstance(payload, Mapping) and tokens_name in payload:
            length = _as_array(payload[tokens_name], where, tokens_name, ids=True).size
            found = candidate_fields(payload, tokens_name, length, where) if length else []
        elif is_array_payload(payload):
            length, found = _as_array(payload, where, tokens_name, ids=True).size, []
        else:
            continue  # Reader.read raises for it
        if not length:
            continue
        if LOSS_MASK in found:
            with_mask = index if with_mask is None else with_mask
        else:
            without_mask = index if without_mask is None else without_mask
        shared = found if shared is None else [name for name in shared if name in found]
    if with_mask is not None and without_mask is not None:
        raise ValueError(
            f"{_where(with_mask, records[with_mask])} has a 'loss_mask' but "
            f"{_where(without_mask, records[without_mask])} has none; give every record a loss_mask "
            "(1 = supervised), or pass fields=(...) to choose the packed fields"
        )
    return tuple(shared or ())


def _resolve_tokens_field(records: Sequence[SampleRecord], tokens_field: str) -> str:
    if tokens_field != "auto":
        return tokens_field
    dicts = [
        (i, r) for i, r in enumerate(records) if not r.meta.is_sentinel and isinstance(r.payload, Mapping)
    ]
    for candidate in TOKEN_FIELD_CANDIDATES:
        if all(candidate in record.payload for _, record in dicts):
            return candidate
    first = next((c for c in TOKEN_FIELD_CANDIDATES if c in dicts[0][1].payload), TOKEN_FIELD_CANDIDATES[0])
    index, record = next((i, r) for i, r in dicts if first not in r.payload)
    raise ValueError(
        f"pack_flat: tokens_field='auto' found no field among {', '.join(TOKEN_FIELD_CANDIDATES)} that every "
        f"payload has; {_where(index, record)} has fields {sorted(map(str, record.payload))}; "
        "pass tokens_field='<name>'"
    )


def pack_flat(
    records: Iterable[SampleRecord] | SampleBatch,
    seq_len: int,
    *,
    pad_token_id: int,
    emit_positions: bool = True,
    tokens_field: str = "auto",
    strategy: str = "greedy",
    overflow: str = "split",
    buffer_size: int | None = None,
    fields: Sequence[str] | None = None,
) -> list[SampleRecord]:
    """Pack tokenized records into flat rows of exactly ``seq_len`` tokens.

    Each row's payload is a dict of NumPy arrays of length ``seq_len``: the
    tokens (int64, under the input's token field name; ``"input_ids"`` for
    array payloads), every packed per-token field (``loss_mask`` and the
    fields with one entry per token in every document, in NumPy's common dtype
    of the row's pieces) and, with ``emit_positions``, int64 ``"positions"``
    restarting at 0 on every segment. The trailing padding (``pad_token_id``,
    0 in other fields) is a segment of its own, so its positions restart too;
    ``meta.padding_length`` (the ``"_padding_length"`` tag) is its length, 0
    when the row is full. Input ``positions`` are never packed unless listed
    in ``fields`` with ``emit_positions=False``.

    Layout: ``strategy="greedy"`` keeps arrival order and starts a new row when
    the next document does not fit. ``"best_fit"`` collects ``buffer_size``
    pieces (``None``: the whole list), sorts them by length, longest first
    (ties in arrival order), puts each in the row with the least space left
    that fits it (ties: the earliest row) or in a new row, and emits those rows
    in the order they were opened. A document longer than ``seq_len`` is cut
    into ``seq_len`` pieces and a shorter last piece (``overflow="split"``,
    each piece a segment) or keeps its first ``seq_len`` tokens
    (``"truncate"``). Documents without tokens and tombstones are skipped and
    appear in no row; a flush sentinel closes every pending row (padded) and is
    not emitted.

    Metadata of a row: ``sample_id``, ``lane_id``, ``chunk_id``,
    ``chunk_offset`` and ``lineage`` are those of its first contributor, one
    ``ContributorRef`` per piece with cursor ``base.cursor.child(piece_index)``
    (pieces count from 0, an unsplit document is piece 0) and
    ``is_last_child=True`` on the piece that closes its document.
    ``component_sample_counts`` adds each document's counts on its closing
    piece (other components in the row appear with 0);
    ``component_token_counts`` gives a document's tokens to its only
    component, or splits them in proportion to its sample counts (largest
    remainder). A record with no components counts in neither.

    Parameters:
        records: the records (dict payloads or token arrays; sentinels allowed), or a SampleBatch.
        seq_len: tokens per row, an int >= 1.
        pad_token_id: the padding token, an int >= 0.
        emit_positions: write segment-restarting ``"positions"``.
        tokens_field: the token field, or ``"auto"``: the first of input_ids, tokens,
            token_ids, ids that every dict payload has.
        strategy: ``"greedy"`` or ``"best_fit"``.
        overflow: ``"split"`` or ``"truncate"`` documents longer than ``seq_len``.
        buffer_size: pieces per best-fit round (int >= 1), or ``None`` for all.
        fields: the per-token fields to pack, or ``None`` for those all documents share
            (``loss_mask`` in only some documents is then an error).

    Returns:
        The rows, a list of :class:`SampleRecord`.

    Raises:
        TypeError: for an option of the wrong type, an item that is not a SampleRecord, a
            payload that is neither a dict nor an array, or non-integer token ids.
        ValueError: for an option out of range, a missing tokens field, per-token fields
            of the wrong length or shape, or ``loss_mask`` in only some documents.

    Example:
        >>> from zephon_collate.types import SampleMeta
        >>> metas = [SampleMeta((0, 0, i), 0, 0, i, component_sample_counts={0: 1}) for i in range(3)]
        >>> docs = [SampleRecord(m, {"input_ids": list(range(10 * i, 10 * i + n))})
        ...         for i, (m, n) in enumerate(zip(metas, [3, 2, 4]))]
        >>> rows = pack_flat(docs, 5, pad_token_id=0)
        >>> [row.payload["input_ids"].tolist() for row in rows]
        [[0, 1, 2, 10, 11], [20, 21, 22, 23, 0]]
        >>> rows[1].payload["positions"].tolist(), rows[1].meta.padding_length
        ([0, 1, 2, 3, 0], 1)
        >>> [(ref.cursor.sample_id, ref.cursor.lineage) for ref in rows[0].meta.contributors]
        [((0, 0, 0), (0,)), ((0, 0, 1), (0,))]
        >>> rows[0].meta.component_sample_counts, rows[0].meta.component_token_counts
        ({0: 2}, {0: 5})
    """
    options = PackOptions.create(
        "pack_flat",
        seq_len=seq_len,
        pad_token_id=pad_token_id,
        emit_positions=emit_positions,
        tokens_field=tokens_field,
        strategy=strategy,
        overflow=overflow,
        buffer_size=buffer_size,
        fields=fields,
    )
    if isinstance(records, (str, bytes, Mapping)) or not isinstance(records, (Iterable, SampleBatch)):
        raise TypeError(f"pack_flat: records must be a list of SampleRecord, got {type(records).__name__}")
    records = list(records.records if isinstance(records, SampleBatch) else records)
    bad = next((i for i, record in enumerate(records) if not isinstance(record, SampleRecord)), None)
    if bad is not None:
        raise TypeError(
            f"pack_flat: records[{bad}] must be a SampleRecord, got {type(records[bad]).__name__}"
        )
    from zephon_collate.packing_stream import FlatPacker  # packing_stream builds on this module

    tokens_name = _resolve_tokens_field(records, options.tokens_field)
    if tokens_name in (options.fields or ()):
        raise ValueError(
            f"pack_flat: the tokens field {tokens_name!r} is also listed in fields; drop it from fields"
        )
    shared = _shared_fields(records, tokens_name) if options.fields is None else options.fields
    size = options.buffer_size or max(1, len(records))
    settings = {**vars(options), "tokens_field": tokens_name, "buffer_size": size, "fields": shared}
    return list(FlatPacker(**settings).pack(records))
