"""Packer input: check the packing options and read each document's tokens and per-token fields.

:class:`PackOptions` checks the options of :func:`zephon_collate.packing.pack_flat`
and :class:`zephon_collate.packing.packer.FlatPacker`. :class:`Reader` reads one
record at a time (a :class:`Document`): its token row as int64 ids >= 0, the
per-token fields packed beside it (``loss_mask`` holding only 0 and 1), each a
1-D NumPy view of the payload, its float fields (:mod:`zephon_collate.fields`),
its own segment structure (payload ``positions``, restarting at 0 where a
segment starts) and its group key, with a ``TypeError``/``ValueError`` that
names the record, the field and the fix. Nothing here writes into a payload.

Supervision is read as ``loss_mask`` only. The fields that spell it otherwise
(:data:`SUPERVISING_FIELDS`: ``labels`` with -100 on a prompt, ``assistant_masks``,
``assistant_mask``, ``completion_mask``, a padding ``attention_mask``) follow the
native Collator's rule, written once here for records and columns
(:func:`unread_supervision`): one that would change what is trained is refused
unless ``fields`` lists it (then it is a data field, whose prompt
``overflow="auto"`` still keeps whole: :func:`prompt_entries`); a harmless copy
is accepted and never packed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass
from typing import Any, Literal, NamedTuple, cast

import numpy as np
import torch

from zephon_collate._checks import Keywords, check_int, check_option_names
from zephon_collate._columns import Columns, example_names, read_by_rows
from zephon_collate._read import (
    Names,
    Ragged,
    as_numpy,
    check_flat,
    check_ids,
    check_zero_one,
    describe_record,
    first_token_field,
    is_array_payload,
    misaligned,
    payload_items,
    places,
    row_any,
    to_row,
)
from zephon_collate._text import shown, shown_fields
from zephon_collate.fields import FloatField, check_float_fields, read_floats
from zephon_collate.keys import (
    ATTENTION_MASK,
    IGNORE_INDEX,
    INPUT_IDS,
    INT32_MAX,
    LABELS,
    LOSS_MASK,
    POSITIONS,
    SUPERVISION_MASKS,
    TOKEN_FIELD_CANDIDATES,
)
from zephon_collate.records import SampleRecord

__all__ = [
    "OVERFLOWS",
    "PACK_OPTION_NAMES",
    "PROMPT_FIELDS",
    "REQUIRED",
    "STRATEGIES",
    "STREAM_BUFFER_SIZE",
    "SUPERVISING_FIELDS",
    "Document",
    "PackOptions",
    "Reader",
    "as_array",
    "candidate_columns",
    "candidate_fields",
    "check_loss_mask",
    "check_supervision",
    "check_supervision_columns",
    "prompt_entries",
    "supervision_rows",
    "unread_supervision",
]

STRATEGIES = ("greedy", "best_fit")
OVERFLOWS = ("auto", "split", "truncate")


STREAM_BUFFER_SIZE = 1024
"""``FlatPacker``'s default ``buffer_size`` (``pack_flat``'s is the whole list)."""

PROMPT_FIELDS = (LABELS, *SUPERVISION_MASKS[1:])
"""Supervising fields that mark a prompt (``labels`` -100, a mask's 0s), as a ``loss_mask``'s 0s do."""
SUPERVISING_FIELDS = (ATTENTION_MASK, *PROMPT_FIELDS)
"""Payload fields that say what is trained under another name than ``loss_mask`` (Hugging Face's and
TRL's): the native Collator's, in its order. Never packed unless ``fields`` lists them."""


@dataclass(frozen=True, kw_only=True)
class PackOptions(Keywords):
    """The packing options: the one home of the keywords (and defaults) of :func:`pack_flat`,
    ``FlatPacker`` and ``PackedStream``, checked by :meth:`create`."""

    seq_len: int
    pad_token_id: int
    emit_positions: bool = True
    tokens_field: str = "auto"
    strategy: Literal["greedy", "best_fit"] = "greedy"
    overflow: Literal["auto", "split", "truncate"] = "auto"
    buffer_size: int | None = None
    fields: Sequence[str] | None = None
    float_fields: Sequence[str | FloatField] = ()
    group_key: str | None = None

    @classmethod
    def create(cls, owner: str, **given: Any) -> PackOptions:
        """Check every option, raising ``TypeError``/``ValueError`` that names it and says what to pass."""
        check_option_names(owner, given, PACK_OPTION_NAMES)
        if "pad_token_id" not in given:
            raise TypeError(f"{owner}: pad_token_id is required: the token id of the padding, an int >= 0")
        options = {**_DEFAULTS, **given}
        checked = dict(options)
        checked["seq_len"] = check_int(owner, "seq_len", options["seq_len"], 1, INT32_MAX)  # int32 offsets
        checked["pad_token_id"] = check_int(owner, "pad_token_id", options["pad_token_id"], 0)
        if options["buffer_size"] is not None or owner not in ("pack_flat", "pack_columns"):  # None: all
            checked["buffer_size"] = check_int(owner, "buffer_size", options["buffer_size"], 1)
        if not isinstance(options["emit_positions"], bool):
            raise TypeError(f"{owner}: emit_positions must be a bool, got {shown(options['emit_positions'])}")
        tokens_field = options["tokens_field"]
        if not isinstance(tokens_field, str) or not tokens_field:
            raise TypeError(
                f"{owner}: tokens_field must be 'auto' or a field name, got {shown(tokens_field)}"
            )
        for name, allowed in (("strategy", STRATEGIES), ("overflow", OVERFLOWS)):
            if not isinstance(options[name], str) or options[name] not in allowed:
                choices = ", ".join(map(repr, allowed[:-1])) + f" or {allowed[-1]!r}"
                raise ValueError(f"{owner}: {name} must be {choices}, got {shown(options[name])}")
        fields = options["fields"]
        if fields is not None:
            if isinstance(fields, (str, bytes)) or not isinstance(fields, Iterable):
                raise TypeError(
                    f"{owner}: fields must be None or a sequence of field names, got {shown(fields)}"
                )
            checked["fields"] = fields = tuple(fields)
            for name in fields:
                if not isinstance(name, str):
                    raise TypeError(f"{owner}: fields must hold str field names, got {shown(name)}")
                if name == tokens_field or (name == POSITIONS and options["emit_positions"]):
                    hint = "; pass emit_positions=False to pack input positions" if name == POSITIONS else ""
                    raise ValueError(
                        f"{owner}: fields may not list {shown(name)}, which the packer writes{hint}"
                    )
            if len(set(fields)) != len(fields):
                raise ValueError(f"{owner}: fields lists a name twice: {shown(fields)}")
        reserved = (
            *(fields or ()),
            POSITIONS,
            LOSS_MASK,
            *([tokens_field] if tokens_field != "auto" else []),
        )
        specs = check_float_fields(owner, options["float_fields"], reserved)
        for spec in specs:
            if not spec.per_token:
                raise ValueError(
                    f"{owner}: float field {shown(spec.name)} holds one value per document, but a packed row "
                    "holds several documents: declare FloatField(name, align='sequence', broadcast=True) to "
                    "repeat each document's value over its tokens"
                )
        checked["float_fields"] = specs
        group = options["group_key"]
        if group is not None:
            if not isinstance(group, str) or not group:
                raise TypeError(
                    f"{owner}: group_key must be None or a payload field name, got {shown(group)}"
                )
            if group in (*reserved, *(spec.name for spec in specs)):
                raise ValueError(
                    f"{owner}: group_key {shown(group)} names a field that is packed beside the tokens; name "
                    "the payload field that holds each record's group id"
                )
        return cls(**checked)

    def check_columnar(self, owner: str) -> None:
        """Refuse the options a columnar batch cannot serve: groups and float fields are read record by
        record (their values are Python lists per record, which the columns do not carry)."""
        if self.float_fields:
            raise read_by_rows(owner, "float_fields")
        if self.group_key is not None:
            raise read_by_rows(owner, "group_key groups")

    @property
    def floats(self) -> tuple[FloatField, ...]:
        """The float fields, as specs (checked by :meth:`create`)."""
        return cast(tuple[FloatField, ...], self.float_fields)

    def plain(self) -> dict[str, Any]:
        """The options as plain data (float fields as tuples), for a state that ``torch.load`` reads back."""
        values = dict(vars(self))
        values["float_fields"] = [
            [spec.name, spec.align, str(spec.dtype), spec.broadcast] for spec in self.floats
        ]
        if values["fields"] is not None:
            values["fields"] = list(values["fields"])
        return values


PACK_OPTION_NAMES = PackOptions.names()
"""The packing keywords, in the order ``pack_flat``, ``FlatPacker`` and ``PackedStream`` spell them."""
REQUIRED = {"pad_token_id": "the token id of the padding, an int >= 0"}
"""The packing keyword without a default, and what it is (for the error naming it)."""
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PackOptions) if f.default is not MISSING}


def as_array(value: object, where: str, name: str, *, ids: bool) -> np.ndarray:
    """A 1-D NumPy array of a payload value, read by the one payload reader.

    :func:`~zephon_collate._read.to_row` checks the value; token ids come back
    as int64 and ``>= 0``; an int64 ndarray is not copied.
    """
    if not isinstance(value, (torch.Tensor, np.ndarray, list, tuple)):
        raise TypeError(
            f"{where}: field {shown(name)} must be a list, tuple, NumPy array or torch tensor of numbers, "
            f"got {type(value).__name__}"
        )
    row = as_numpy(to_row(value, where, name, "ids" if ids else "values"))
    if row.ndim != 1:
        raise ValueError(
            f"{where}: field {shown(name)} must be 1-D (one entry per token), got shape {row.shape}"
        )
    if not ids:
        return row
    row = row.astype(np.int64, copy=False)
    check_ids(Ragged(row, np.array([0, row.size], dtype=np.int64)), name, lambda _: where)
    return row


def check_loss_mask(values: np.ndarray, where: str) -> None:
    """``ValueError`` unless a packed ``loss_mask`` holds only 0 and 1 (NaN included)."""
    field = Ragged(values, np.array([0, values.shape[0]], dtype=np.int64))
    check_zero_one(field, LOSS_MASK, lambda _: where, "1 for supervised tokens, 0 for the rest")


def prompt_entries(name: str, values: np.ndarray) -> np.ndarray:
    """Entry-wise booleans: does a packed supervising field (one of :data:`PROMPT_FIELDS`, listed in
    ``fields``) mark a prompt token here, as a ``loss_mask``'s 0 does? ``labels``: -100; a mask: 0.
    ``overflow="auto"`` never cuts a document holding one.

    Example:
        >>> prompt_entries("labels", np.array([-100, 5, 6])).tolist()
        [True, False, False]
    """
    flags: np.ndarray = values == IGNORE_INDEX if name == LABELS else values == 0
    return flags


def unread_supervision(where: str, name: str) -> ValueError:
    """The refusal of a supervising field that would change what is trained but is not packed, naming
    the document, the field and the fix (see :func:`supervision_rows`)."""
    unread = (
        "the packer reads supervision as 'loss_mask' only: packed as data, a cut (overflow='auto') "
        "would not keep the prompt with its answer, and the Collator refuses it"
    )
    hf = (
        "or pack Hugging Face examples with trl.pack_dataset and collate them with "
        "Collator.for_transformers(...)"
    )
    if name == LABELS:
        return ValueError(
            f"{where}: payload has 'labels' that differ from its tokens (e.g. -100 on a prompt), but "
            f"{unread}. Give the supervision as a loss_mask (loss_mask = [int(l != -100) for l in "
            f"labels]) and drop 'labels', {hf}"
        )
    if name == ATTENTION_MASK:
        return ValueError(
            f"{where}: payload has an 'attention_mask' with zeros (padding inside the document), which the "
            "packer would pack as real tokens, and the Collator refuses it. Give the documents without "
            f"their padding (drop the padded tokens and the mask: each row is padded when packed), {hf}"
        )
    return ValueError(
        f"{where}: payload has {shown(name)} with zeros, but {unread}. Give it as the loss_mask "
        f"(loss_mask = {name}) and drop {shown(name)}, {hf}"
    )


def supervision_rows(name: str, field: Ragged, tokens: Ragged, loss_mask: Ragged | None) -> np.ndarray:
    """``[B]`` booleans: would row ``b`` of supervising field ``name`` change what is trained?

    The native Collator's rule: ``labels`` must equal the tokens; a mask must be
    all ones, or (``assistant_masks``, ``assistant_mask``, ``completion_mask``) equal
    the ``loss_mask``; a row of another length or shape differs. Records are read as
    batches of one row, so records and columns follow this one rule.

    Example:
        >>> one = np.array([0, 3])
        >>> tokens = Ragged(np.array([5, 6, 7]), one)
        >>> [bool(supervision_rows("labels", Ragged(np.array(row), one), tokens, None)[0])
        ...  for row in ([5, 6, 7], [-100, 6, 7])]
        [False, True]
    """
    if name == LABELS:
        return _rows_differing(field, tokens)
    bad = row_any(_any_entry(field.host != 1), field.offsets)
    if name != ATTENTION_MASK and loss_mask is not None:
        bad &= _rows_differing(field, loss_mask)  # a copy of the loss_mask is harmless
    return bad


def _rows_differing(field: Ragged, like: Ragged) -> np.ndarray:
    """``[B]`` booleans: does row ``b`` of ``field`` differ from row ``b`` of ``like`` (in length, shape
    or a value)?"""
    values, other = field.host, like.host
    if values.shape[1:] != other.shape[1:]:
        return np.ones(field.rows, dtype=bool)
    aligned = field.lengths == like.lengths
    differs: np.ndarray = ~aligned
    offsets = np.zeros(int(aligned.sum()) + 1, dtype=np.int64)
    np.cumsum(field.lengths[aligned], out=offsets[1:])
    mine = values[np.repeat(aligned, field.lengths)]
    theirs = other[np.repeat(aligned, like.lengths)]
    differs[aligned] = row_any(_any_entry(mine != theirs), offsets)
    return differs


def _any_entry(flags: np.ndarray) -> np.ndarray:
    """``[N]`` booleans from ``[N, ...]`` ones: is any entry of token ``n`` True?"""
    return flags if flags.ndim == 1 else np.asarray(flags.reshape(len(flags), -1).any(axis=1))


def _per_document(where: str, name: str) -> ValueError:
    """The refusal of a supervising field given as one value per document."""
    return ValueError(
        f"{where}: field {shown(name)} holds one value per document, not one per token, so what it "
        "supervises cannot be checked; give it one value per token (as a loss_mask: 1 = supervised), or "
        "drop it (a per-example label, as for sequence classification, is not a token field)"
    )


def _payload_row(payload: Mapping[Any, Any], name: str, where: str) -> Ragged:
    """A payload field as a batch of one row; one value for the document: ``ValueError``."""
    values = as_numpy(to_row(payload[name], where, name, "values"))
    if values.ndim == 0:
        raise _per_document(where, name)
    return Ragged(values, np.array([0, len(values)], dtype=np.int64))


def check_supervision(
    payload: Mapping[Any, Any], tokens: np.ndarray, where: str, packed: Container[str]
) -> None:
    """Refuse a record's first supervising field that is not ``packed`` and would change what is
    trained (:func:`supervision_rows`).

    Raises:
        TypeError: for a supervising field that is not numbers (the payload reader's error).
        ValueError: :func:`unread_supervision`'s; for one given as one value per document.
    """
    found = [name for name in SUPERVISING_FIELDS if name in payload and name not in packed]
    if not found:
        return
    row = Ragged(tokens, np.array([0, tokens.size], dtype=np.int64))
    loss_mask = _payload_row(payload, LOSS_MASK, where) if LOSS_MASK in payload else None
    for name in found:
        if supervision_rows(name, _payload_row(payload, name, where), row, loss_mask)[0]:
            raise unread_supervision(where, name)


def check_supervision_columns(columns: Columns, tokens: Ragged, packed: Container[str], names: Names) -> None:
    """:func:`check_supervision` over a columnar batch, each field in one pass: the first document with
    tokens that a supervising column (not ``packed``) would train otherwise is named, as the Collator
    names it (the earliest document, then the field in :data:`SUPERVISING_FIELDS` order).

    Raises:
        TypeError: for a supervising field that is not numbers (as the columnar reader refuses it).
        ValueError: :func:`unread_supervision`'s; for one given as one value per document.
    """
    found = [name for name in SUPERVISING_FIELDS if name in columns and name not in packed]
    if not found:
        return
    loss_mask = columns.ragged(LOSS_MASK, "values", names) if columns.is_list(LOSS_MASK) else None
    first = []
    for rank, name in enumerate(found):
        if not columns.is_list(name) and columns.example().get(name) == 0:
            raise _per_document(names(0), name)
        field = columns.ragged(name, "values", names)  # a field that is no column of numbers: TypeError
        bad = np.flatnonzero(supervision_rows(name, field, tokens, loss_mask) & (tokens.lengths > 0))
        if bad.size:
            first.append((int(bad[0]), rank, name))
    if first:
        row, _, name = min(first)
        raise unread_supervision(names(row), name)


def candidate_fields(
    payload: Mapping[Any, Any], tokens_name: str, length: int, where: str, skipped: Sequence[str] = ()
) -> list[str]:
    """The per-token fields of one dict payload: ``loss_mask`` (checked strictly), then numeric 1-D
    fields with ``length`` entries, in payload order. Input ``positions`` (the document's segments), the
    ``skipped`` names (float fields, read by their specs) and the :data:`SUPERVISING_FIELDS` (refused or
    harmless: :func:`unread_supervision`) are never candidates."""
    found = []
    if LOSS_MASK in payload:
        if len(as_array(payload[LOSS_MASK], where, LOSS_MASK, ids=False)) != length:
            raise ValueError(f"{where}: field 'loss_mask' does not have one entry per token ({length})")
        found.append(LOSS_MASK)
    for name, value in payload_items(payload):
        if isinstance(name, str) and name not in (
            tokens_name,
            POSITIONS,
            LOSS_MASK,
            *SUPERVISING_FIELDS,
            *skipped,
        ):
            try:
                if len(as_array(value, where, name, ids=False)) == length:
                    found.append(name)
            except (TypeError, ValueError):
                continue
    return found


class Document(NamedTuple):
    """One record as the packer reads it: tokens, packed fields, its own segments, its group."""

    tokens: np.ndarray
    fields: dict[str, np.ndarray]
    positions: np.ndarray | None  # the payload's segment-restarting positions, or None (one segment)
    group: Any  # the group key's value (an int or a str), or None without group_key


_NO_GROUP: Any = None


def _aligned_rows(field: Ragged, tokens: Ragged) -> np.ndarray:
    """``[B]`` booleans: does each document with tokens hold one entry of ``field`` per token?"""
    aligned: np.ndarray = (field.lengths == tokens.lengths) | (tokens.lengths == 0)
    return aligned


def candidate_columns(columns: Columns, tokens_name: str, tokens: Ragged, names: Names) -> list[str]:
    """:func:`candidate_fields` of a columnar batch: ``loss_mask`` (one entry per token in every document
    with tokens, else ``ValueError``), then each list column of numbers with one entry per token in every
    such document, in the batch's order. Input ``positions`` and the :data:`SUPERVISING_FIELDS` are never
    candidates."""
    found = []
    if LOSS_MASK in columns:
        bad = np.flatnonzero(~_aligned_rows(columns.ragged(LOSS_MASK, "values", names), tokens))
        if bad.size:
            row = int(bad[0])
            raise ValueError(
                f"{names(row)}: field 'loss_mask' does not have one entry per token "
                f"({int(tokens.lengths[row])})"
            )
        found.append(LOSS_MASK)
    for name in columns.names:
        if name in (tokens_name, POSITIONS, LOSS_MASK, *SUPERVISING_FIELDS) or not columns.is_list(name):
            continue
        try:
            field = columns.ragged(name, "values", names)
        except (TypeError, ValueError):
            continue
        if field.values.ndim == 1 and bool(_aligned_rows(field, tokens).all()):
            found.append(name)
    return found


def _check_one_segment(positions: Ragged, tokens: Ragged, names: Names) -> None:
    """A ``positions`` column beside columnar documents: each must count 0, 1, ... over its tokens (one
    segment), for columns carry no per-document segments into the packer (records do)."""
    aligned = _aligned_rows(positions, tokens)
    if positions.values.ndim != 1 or not aligned.all():
        bad = ~aligned | (positions.values.ndim != 1)
    else:
        if not np.array_equal(positions.offsets, tokens.offsets):  # entries of documents without tokens
            positions = positions.select(np.repeat(tokens.lengths > 0, positions.lengths))
        bad = row_any(positions.host != places(tokens.offsets), tokens.offsets)
    found = np.flatnonzero(bad)
    if found.size:
        raise ValueError(
            f"{names(int(found[0]))}: field 'positions' does not count 0, 1, ... over the document's tokens "
            "(it restarts: segments, or is misaligned); packing keeps a document's segments for records "
            "only: give these documents as records or payload dicts (pack_flat), drop the column for one "
            "segment per document, or pass emit_positions=False with fields=(..., 'positions') to pack it "
            "as data"
        )


class Reader:
    """Reads documents: the token field and the packed fields of each record.

    ``tokens_name``/``fields`` set to ``None`` are fixed by the first record
    with tokens (``strict``: later records must then agree on ``loss_mask``).
    ``floats`` are read by their specs, ``positions`` (with ``segments``, the
    packer's ``emit_positions``) as the document's segment structure, and
    ``group_key`` as its group.
    """

    def __init__(
        self,
        tokens_name: str | None,
        fields: tuple[str, ...] | None,
        *,
        strict: bool,
        floats: tuple[FloatField, ...] = (),
        segments: bool = False,
        group_key: str | None = None,
    ) -> None:
        self.tokens_name = tokens_name
        self.fields = fields
        self.strict = strict
        self.floats = floats
        self.segments = segments
        self.group_key = group_key

    @property
    def packed(self) -> tuple[str, ...]:
        """Every field packed beside the tokens: the per-token fields, then the float fields."""
        return (*(self.fields or ()), *(spec.name for spec in self.floats))

    def read(self, record: SampleRecord, index: int) -> Document | None:
        """The :class:`Document` of a record, or ``None`` for a document without tokens."""
        payload, where = record.payload, describe_record(index, record)
        if not isinstance(payload, Mapping):
            if not is_array_payload(payload):
                raise TypeError(
                    f"{where}: payload must be a dict of fields or a token array (list, tuple, NumPy array "
                    f"or torch tensor), got {type(payload).__name__}"
                )
            tokens = as_array(payload, where, self.tokens_name or INPUT_IDS, ids=True)
            if not tokens.size:
                return None
            self.tokens_name = self.tokens_name or INPUT_IDS
            self.fields = () if self.fields is None else self.fields
            if self.packed or self.group_key is not None:
                read = list(self.packed) or [str(self.group_key)]
                raise ValueError(
                    f"{where}: an array payload holds only its token row, but fields {read} are "
                    "read beside the tokens; give it a dict payload with them, or pass fields=()"
                )
            return Document(tokens, {}, None, _NO_GROUP)
        name = self.tokens_name or first_token_field(payload)
        if name is None or name not in payload:
            wanted = repr(name) if name else f"any of {', '.join(TOKEN_FIELD_CANDIDATES)}"
            raise ValueError(
                f"{where}: payload has no tokens field {wanted} (its fields: {shown_fields(payload)}); "
                "pass the right tokens_field"
            )
        tokens = as_array(payload[name], where, name, ids=True)
        if not tokens.size:
            return None
        self.tokens_name = name
        if self.fields and name in self.fields:
            raise ValueError(
                f"{where}: the tokens field {shown(name)} is also listed in fields; drop it from fields"
            )
        if self.fields is None:
            skipped = [spec.name for spec in self.floats] + ([self.group_key] if self.group_key else [])
            self.fields = tuple(candidate_fields(payload, name, tokens.size, where, skipped))
        else:
            self._check_present(payload, where)
        check_supervision(payload, tokens, where, self._listed)
        values = {}
        for field_name in self.fields:
            values[field_name] = as_array(payload[field_name], where, field_name, ids=False)
            if field_name == LOSS_MASK:
                check_loss_mask(values[field_name], where)
            if len(values[field_name]) != tokens.size:
                raise misaligned(where, field_name, len(values[field_name]), tokens.size)
        lengths = np.array([tokens.size], dtype=np.int64)
        for spec in self.floats:
            if spec.name not in payload:
                raise ValueError(
                    f"{where}: payload lacks float field {shown(spec.name)} (its fields: "
                    f"{shown_fields(payload)}); give every record this field, or drop it from float_fields"
                )
            row = to_row(payload[spec.name], where, spec.name, "values")
            floats = read_floats([row], lengths, spec, lambda _: where)
            values[spec.name] = np.asarray(cast(Ragged, floats).values)
        positions = self._positions(payload, tokens.size, where) if self.segments else None
        group = self._group(payload, where) if self.group_key is not None else _NO_GROUP
        return Document(tokens, values, positions, group)

    @property
    def _listed(self) -> tuple[str, ...]:
        """The fields read as the user listed them: packed ones and the group key (never supervision)."""
        return (*self.packed, *([self.group_key] if self.group_key is not None else []))

    def _check_present(self, given: Container[str], where: str) -> None:
        """A record (or the first row of columns) after the first: it has every packed field, and no
        ``loss_mask`` the earlier ones lacked (found fields, ``strict``), which would go unpacked."""
        assert self.fields is not None
        if self.strict and LOSS_MASK in given and LOSS_MASK not in self.fields:
            raise ValueError(
                f"{where}: payload has a 'loss_mask' but earlier records have none; give every record a "
                "loss_mask (1 = supervised), or pass fields=(...) to choose the packed fields"
            )
        for field_name in self.fields:
            if field_name not in given:
                raise ValueError(
                    f"{where}: payload lacks field {shown(field_name)}, which is packed beside the tokens "
                    f"(fields {self.fields}); give every record this field, or pass fields=(...) without it"
                )

    def _positions(self, payload: Mapping[Any, Any], length: int, where: str) -> np.ndarray | None:
        """The payload's ``positions``: the document's segments (a segment starts wherever they are 0)."""
        if POSITIONS not in payload:
            return None
        positions = as_array(payload[POSITIONS], where, POSITIONS, ids=True)
        if positions.size != length or positions[0] != 0:
            problem = (
                f"has {positions.size} entries for {length} tokens"
                if positions.size != length
                else f"starts at {int(positions[0])}"
            )
            raise ValueError(
                f"{where}: field 'positions' {problem}; the packer keeps a document's segments (a segment "
                "starts wherever positions are 0), so they must start at 0 and give one per token. Drop "
                "them for one segment per document, or pass emit_positions=False to pack them as data"
            )
        if not (positions[1:] == 0).any():
            return None  # one segment: what the packer writes anyway
        return positions

    def _group(self, payload: Mapping[Any, Any], where: str) -> Any:
        """The group key's value: an int or a str (a 0-d integer array or tensor reads as an int)."""
        key = cast(str, self.group_key)
        if key not in payload:
            raise ValueError(
                f"{where}: payload lacks the group key {shown(key)} (its fields: {shown_fields(payload)}); "
                "give every record its group id (e.g. the index of its prompt)"
            )
        value = payload[key]
        if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iu":
            value = int(value)
        elif isinstance(value, torch.Tensor) and value.ndim == 0 and not value.dtype.is_floating_point:
            value = int(value) if value.dtype != torch.bool else value
        elif isinstance(value, np.integer):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise TypeError(
                f"{where}: group key {shown(key)} must be an int or a str (records with equal keys in a row "
                f"form a group), got {shown(value)}"
            )
        return value

    def read_columns(self, columns: Columns, first: int) -> tuple[Ragged, dict[str, Ragged]]:
        """:meth:`read` of every document of a columnar batch at once: ``(tokens, {field: values})``, the
        tokens ids >= 0 (in their stored dtype) and each field holding one entry per token of its
        document (documents without tokens hold none). Row ``b`` is named ``example {first + b}``.
        """
        names: Names = lambda row: example_names(first + row)  # noqa: E731 (a Names, by its place)
        example = columns.example()
        name = self.tokens_name or first_token_field(example)
        if name is None or name not in columns:
            wanted = repr(name) if name else f"any of {', '.join(TOKEN_FIELD_CANDIDATES)}"
            raise ValueError(
                f"{names(0)}: payload has no tokens field {wanted} (its fields: {shown_fields(example)}); "
                "pass the right tokens_field"
            )
        read = columns.ragged(name, "ids", names)
        tokens = Ragged(read.host, read.offsets)  # the packer works on the host
        check_flat(tokens, name, names(0))
        check_ids(tokens, name, names)
        if self.fields and name in self.fields:
            raise ValueError(
                f"{names(0)}: the tokens field {shown(name)} is also listed in fields; drop it from fields"
            )
        if self.segments and POSITIONS in columns:
            _check_one_segment(columns.ragged(POSITIONS, "ids", names), tokens, names)
        has_tokens = tokens.lengths > 0
        if not has_tokens.any():
            return tokens, {}
        self.tokens_name = name
        if self.fields is None:
            self.fields = tuple(candidate_columns(columns, name, tokens, names))
        else:
            self._check_present(columns, names(0))
        check_supervision_columns(columns, tokens, self._listed, names)
        values = {}
        for field_name in self.fields:
            read = columns.ragged(field_name, "values", names)
            field = Ragged(read.host, read.offsets)
            check_flat(field, field_name, names(0))
            bad = np.flatnonzero(~_aligned_rows(field, tokens))
            if bad.size:
                row = int(bad[0])
                raise misaligned(names(row), field_name, int(field.lengths[row]), int(tokens.lengths[row]))
            if not np.array_equal(field.offsets, tokens.offsets):  # entries of documents without tokens
                field = field.select(np.repeat(has_tokens, field.lengths))
            if field_name == LOSS_MASK:
                check_zero_one(field, LOSS_MASK, names, "1 for supervised tokens, 0 for the rest")
            values[field_name] = field
        return tokens, values
